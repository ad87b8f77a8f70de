"""Overload gets 503 with Retry-After; random bodies never get a 5xx (hypothesis fuzz)."""

from __future__ import annotations

import concurrent.futures
import json
import urllib.error
import urllib.request

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from server_process import served


@pytest.fixture(scope="module")
def small_server(tiny_mixtral_dir, tmp_path_factory):
    yield from served(tmp_path_factory.mktemp("overload"), tiny_mixtral_dir,
                      "routers: 1\nexpert_workers: 1\nengine:\n  max_num_seqs: 2\nserve:\n  max_queued_per_router: 2\n")


def post(url: str, data: bytes) -> tuple[int, dict, dict]:
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            raw = response.read()
            streamed = response.headers.get("content-type", "").startswith("text/event-stream")
            return response.status, {k.lower(): v for k, v in response.headers.items()}, {"stream": raw.decode()} if streamed else json.loads(raw)
    except urllib.error.HTTPError as error:
        return error.code, {k.lower(): v for k, v in error.headers.items()}, json.loads(error.read())


def test_overload_is_refused_with_retry_after_and_the_server_recovers(small_server):
    body = json.dumps({"prompt": [5, 6, 7], "max_tokens": 48, "temperature": 0, "ignore_eos": True}).encode()
    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        results = list(pool.map(lambda _: post(f"{small_server.url}/v1/completions", body), range(12)))
    codes = [code for code, _, _ in results]
    assert set(codes) <= {200, 503}
    assert codes.count(200) >= 4  # the 2 batched + 2 queued always get in
    refused = [(headers, payload) for code, headers, payload in results if code == 503]
    assert refused, codes
    for headers, payload in refused:
        assert headers.get("retry-after") == "1" and payload["error"]["code"] == "overloaded"
    assert post(f"{small_server.url}/v1/completions", body)[0] == 200


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
