"""Overload gets 503 with Retry-After; random bodies never get a 5xx (hypothesis fuzz); the
defaults are safe: loopback only, admin routes off without a token, bodies never unpickled."""

from __future__ import annotations

import concurrent.futures
import json
import os
import pickle
import signal
import time
import urllib.error
import urllib.request

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from raymoe.cluster.procfs import TCP_LISTEN, tcp_sockets
from server_process import served


@pytest.fixture(scope="module")
def small_server(tiny_mixtral_dir, tmp_path_factory):
    # No serve.host (the default must be loopback) and no admin token (admin routes disabled).
    # A KV cache smaller than the context (256): a request can ask for more than it holds.
    yield from served(tmp_path_factory.mktemp("overload"), tiny_mixtral_dir,
                      "routers: 1\nexpert_workers: 1\nengine:\n  max_num_seqs: 2\n  kv_cache_bytes: 160000\n"
                      "serve:\n  max_queued_per_router: 2\n",
                      env={"RAYMOE_ADMIN_TOKEN": None})


def post(url: str, data: bytes, content_type: str = "application/json", timeout_s: float = 120) -> tuple[int, dict, dict]:
    request = urllib.request.Request(url, data=data, headers={"Content-Type": content_type})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            raw = response.read()
            streamed = response.headers.get("content-type", "").startswith("text/event-stream")
            return response.status, {k.lower(): v for k, v in response.headers.items()}, {"stream": raw.decode()} if streamed else json.loads(raw)
    except urllib.error.HTTPError as error:
        return error.code, {k.lower(): v for k, v in error.headers.items()}, json.loads(error.read())


def prompt_tokens(url: str) -> float:
    """The ingress's count of prompt tokens admitted (a refused request adds none)."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=60) as response:
        families = {f.name: f for f in text_string_to_metric_families(response.read().decode())}
    return sum(s.value for s in families["raymoe:prompt_tokens"].samples if s.name.endswith("_total"))


def resume(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGCONT)
    except ProcessLookupError:  # past the step deadline the controller replaced the frozen worker
        pass


def test_overload_is_refused_with_retry_after_and_the_server_recovers(small_server):
    """No luck needed: with the only expert worker stopped no request can finish, so the
    router's 2 batch seats and 2 queue seats fill and stay full; the next request must get
    503. Resumed well within the step deadline (30 s), the worker lets all 4 complete."""
    url = small_server.url
    workers = small_server.actor_pids("ExpertWorker")
    assert len(workers) == 1, workers
    body = json.dumps({"prompt": [5, 6, 7], "max_tokens": 6, "temperature": 0, "ignore_eos": True}).encode()
    before = prompt_tokens(url)
    os.kill(workers[0], signal.SIGSTOP)
    try:
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            held = [pool.submit(post, f"{url}/v1/completions", body) for _ in range(4)]
            deadline = time.monotonic() + 60
            while prompt_tokens(url) - before < 4 * 3:  # all 4 admitted (and none can finish)
                assert time.monotonic() < deadline and not any(f.done() for f in held), [f.done() for f in held]
                time.sleep(0.05)
            try:  # admitted, it could not finish either: it would wait until the worker resumes
                code, headers, payload = post(f"{url}/v1/completions", body, timeout_s=20)
            except OSError as error:
                raise AssertionError(f"a fifth request was admitted with every seat taken ({error})") from None
            assert code == 503, payload
            assert headers.get("retry-after") == "1" and payload["error"]["code"] == "overloaded"
            resume(workers[0])
            codes = [f.result(timeout=300)[0] for f in held]
        assert codes == [200] * 4  # the admitted ones were served, not dropped
    finally:
        resume(workers[0])
    assert post(f"{url}/v1/completions", body)[0] == 200


def metric(url: str, name: str) -> float:
    with urllib.request.urlopen(f"{url}/metrics", timeout=60) as response:
        families = {f.name: f for f in text_string_to_metric_families(response.read().decode())}
    return sum(s.value for s in families[name].samples)


def test_a_request_whose_kv_can_never_fit_is_a_400_streamed_or_not(small_server):
    # The router refuses it (validate_prompt) before queueing; a stream hears so as an HTTP
    # 400 too, not as a 200 whose first event is an error.
    url = small_server.url
    capacity = int(metric(url, "raymoe:kv_cache_capacity_tokens"))
    assert 0 < capacity < 250, capacity  # the fixture's kv_cache_bytes: below the 256-token context
    for stream in (False, True):
        body = {"prompt": [5, 6, 7], "max_tokens": capacity, "temperature": 0, "stream": stream}
        code, headers, payload = post(f"{url}/v1/completions", json.dumps(body).encode())
        assert code == 400, (stream, code, payload)
        assert not headers.get("content-type", "").startswith("text/event-stream")
        assert "KV cache" in payload["error"]["message"] and "kv_cache_bytes" in payload["error"]["message"], payload
    # A request that fits streams as ever.
    body = {"prompt": [5, 6, 7], "max_tokens": 3, "temperature": 0, "ignore_eos": True, "stream": True}
    code, headers, payload = post(f"{url}/v1/completions", json.dumps(body).encode())
    assert code == 200 and payload["stream"].rstrip().endswith("data: [DONE]"), payload


def test_admin_routes_are_disabled_without_a_token(small_server):
    for method, path in (("GET", "/admin/placement"), ("POST", "/admin/rebalance")):
        request = urllib.request.Request(small_server.url + path, method=method, data=b"{}" if method == "POST" else None,
                                         headers={"Authorization": "Bearer anything"})
        with pytest.raises(urllib.error.HTTPError) as caught:
            urllib.request.urlopen(request, timeout=60)
        assert caught.value.code == 403
        assert json.loads(caught.value.read())["error"]["code"] == "admin_disabled"


def listening_addresses(port: int) -> list[str]:
    """Local addresses of the sockets listening on ``port``."""
    return [address for address, listening, _ in tcp_sockets(TCP_LISTEN) if listening == port]


@pytest.mark.skipif(not os.path.exists("/proc/net/tcp"), reason="reads Linux's /proc/net/tcp")
def test_the_endpoint_listens_on_loopback_only_by_default(small_server):
    addresses = listening_addresses(small_server.port)
    assert addresses and set(addresses) == {"127.0.0.1"}, addresses


class Payload:
    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.mkdir, (self.marker,))  # runs only if someone unpickles this


def test_a_pickled_body_is_refused_and_never_unpickled(small_server, tmp_path):
    marker = str(tmp_path / "unpickled")
    data = pickle.dumps(Payload(marker))
    for path in ("/v1/completions", "/v1/chat/completions"):
        for content_type in ("application/json", "application/octet-stream", "application/python-pickle"):
            code, _, payload = post(small_server.url + path, data, content_type)
            expected = 400 if content_type == "application/json" else 415  # not JSON: refused unread
            assert code == expected and payload["error"]["message"], (path, content_type, payload)
    assert not os.path.exists(marker)


FIELDS = ["model", "prompt", "messages", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop",
          "stop_token_ids", "ignore_eos", "return_token_ids", "logprobs", "stream", "n", "echo", "user"]
scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**40, 2**40), st.floats(allow_nan=False),
                    st.text(max_size=20))
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                       st.dictionaries(st.text(max_size=8), inner, max_size=3)),
                      max_leaves=8)
bodies = st.one_of(
    st.dictionaries(st.sampled_from(FIELDS), values, max_size=8).map(lambda d: json.dumps(d).encode()),
    st.binary(max_size=64),
)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=bodies, path=st.sampled_from(["/v1/completions", "/v1/chat/completions"]))
def test_random_bodies_never_get_a_server_error(small_server, body, path):
    code, _, payload = post(small_server.url + path, body)
    assert code < 500 or (code == 503 and payload["error"]["code"] == "overloaded"), payload
    if code >= 400:
        assert set(payload["error"]) == {"message", "type", "param", "code"}
