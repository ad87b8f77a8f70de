"""A router killed under load: its requests move to another router and continue there after the
tokens they had produced (stream migration); the client sees one stream with no token repeated
or missing, equal to a run without the failure; the router comes back. Past
``serve.max_migrations`` a request ends with an error event."""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import threading
import time
import urllib.request

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from raymoe.engine.engine import EngineConfig, LLMEngine
from raymoe.engine.sampling_params import SamplingParams
from raymoe.engine.tokenizer import Tokenizer
from server_process import served

TOKEN = "router-failure-token"


@pytest.fixture(scope="module")
def server(tiny_mixtral_dir, tmp_path_factory):
    yield from served(tmp_path_factory.mktemp("router-failure"), tiny_mixtral_dir,
                      "routers: 2\nexpert_workers: 2\ncomm:\n  backend: gloo\n  timeout_s: 3.0\n"
                      "balancer:\n  enabled: false\n  poll_interval_s: 0.2\n", env={"RAYMOE_ADMIN_TOKEN": TOKEN})


def call(url: str, path: str, body: dict | None = None) -> dict:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url + path, data=data, headers={
        "Content-Type": "application/json", "Authorization": f"Bearer {TOKEN}"})
    with urllib.request.urlopen(request, timeout=300) as response:
        return json.loads(response.read())


def counter(url: str, family: str, **labels: str) -> float:
    with urllib.request.urlopen(f"{url}/metrics", timeout=60) as response:
        families = {f.name: f for f in text_string_to_metric_families(response.read().decode())}
    if family not in families:
        return 0.0
    return sum(s.value for s in families[family].samples
               if s.name.endswith("_total") and all(s.labels.get(k) == v for k, v in labels.items()))


def generation_tokens(url: str) -> float:
    """The ingress's count of output tokens received from routers."""
    return counter(url, "raymoe:generation_tokens")


def resumed_migrations(url: str) -> float:
    """Requests moved to another router after they had produced tokens."""
    return counter(url, "raymoe:request_migrations", resumed="true")


def wait_until_routers_alive(url: str) -> None:
    deadline = time.monotonic() + 180
    while not all(r.get("alive") for r in call(url, "/admin/placement")["routers"]):
        assert time.monotonic() < deadline, "the routers did not come back"
        time.sleep(0.5)


MAX_TOKENS = 48


def test_router_killed_under_load_loses_no_request(server, tiny_mixtral_dir):
    wait_until_routers_alive(server.url)
    prompts = [[10 + i, 20 + i, 30 + i] for i in range(16)]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    reference = LLMEngine.from_pretrained(tiny_mixtral_dir, EngineConfig(dtype="float32"))
    expected = [o.output_token_ids for o in reference.generate(prompts, params)]
    routers = call(server.url, "/admin/placement")["routers"]
    victim = routers[0]["pid"]
    before, moved_before = generation_tokens(server.url), resumed_migrations(server.url)

    def complete(prompt):
        return call(server.url, "/v1/completions", {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
                                                    "ignore_eos": True, "return_token_ids": True})

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        futures = [pool.submit(complete, p) for p in prompts]
        # Kill once tokens flow (2 per request on average: both routers, which step together,
        # are mid-way through requests 24x longer), not after a lucky sleep.
        deadline = time.monotonic() + 120
        while generation_tokens(server.url) - before < 2 * len(prompts):
            assert time.monotonic() < deadline and not any(f.done() for f in futures), "no tokens flowed"
            time.sleep(0.05)
        os.kill(victim, signal.SIGKILL)
        bodies = [f.result(timeout=300) for f in futures]
    assert [b["choices"][0]["token_ids"] for b in bodies] == expected
    assert all(b["usage"]["completion_tokens"] == MAX_TOKENS for b in bodies)
    # Proof that requests moved after producing tokens (not merely finished before the kill):
    # the ingress counted resumed migrations, and it received no token twice.
    assert resumed_migrations(server.url) - moved_before >= 1
    assert generation_tokens(server.url) - before == len(prompts) * MAX_TOKENS
    # The router comes back (restarted by Ray, rejoined by the controller) and serves again. (It
    # was left out of the group meanwhile, router 1 serving on: actors/recovery.py.)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        status = call(server.url, "/admin/placement")
        back = status["routers"][0]
        if back.get("alive") and back["pid"] != victim and any(  # rejoined in a recovery, or re-included
                0 in r.get("restarted_routers", []) + r.get("reincluded_routers", []) for r in status["recoveries"]):
            break
        time.sleep(1)
    else:
        raise AssertionError(f"router 0 did not come back: {status['routers']} {status['recoveries']}")
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        bodies = list(pool.map(complete, prompts[:8]))
    assert [b["choices"][0]["token_ids"] for b in bodies] == expected[:8]
    # Both routers serve this replica over its delta channel (actors/delta_channel.py), router 0's
    # made anew after the kill (the default; tests/serve/test_delta_channel_off.py runs Ray's path).
    assert [r["delta_channels"] for r in call(server.url, "/admin/placement")["routers"]] == [1, 1]
    with urllib.request.urlopen(f"{server.url}/health", timeout=30) as response:
        assert response.status == 200


STREAMS = 32
STREAM_TOKENS = 240  # long enough that streams are still in flight when every one has text (prompt + 240 < 256)


def test_32_streams_survive_a_router_sigkill_byte_equal_to_the_reference(server, tiny_mixtral_dir):
    """Half greedy, half seeded at temperature 0.9: every stream completes, its text is the
    in-process engine's, and it carries each token once (the usage count and the text agree)."""
    wait_until_routers_alive(server.url)
    tokenizer = Tokenizer(tiny_mixtral_dir)
    prompts = [[50 + i, 60 + i, 70 + i, 80 + i] for i in range(STREAMS)]
    params = [SamplingParams(max_tokens=STREAM_TOKENS, ignore_eos=True, temperature=0.0) if i % 2 == 0 else
              SamplingParams(max_tokens=STREAM_TOKENS, ignore_eos=True, temperature=0.9, seed=1000 + i)
              for i in range(STREAMS)]
    reference = LLMEngine.from_pretrained(tiny_mixtral_dir, EngineConfig(dtype="float32"))
    expected = [tokenizer.decode(o.output_token_ids) for o in reference.generate(prompts, params)]
    victim = call(server.url, "/admin/placement")["routers"][0]["pid"]
    before, moved_before = generation_tokens(server.url), resumed_migrations(server.url)
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)
    model = client.models.list().data[0].id

    started = [threading.Event() for _ in range(STREAMS)]  # set at each stream's first text

    def stream(i: int) -> tuple[str, str | None, int]:
        extra = {} if params[i].seed is None else {"seed": params[i].seed}
        chunks = client.completions.create(model=model, prompt=prompts[i],
                                           max_tokens=STREAM_TOKENS, temperature=params[i].temperature, stream=True,
                                           stream_options={"include_usage": True},
                                           extra_body={"ignore_eos": True}, **extra)
        text, reason, usage = "", None, -1
        for chunk in chunks:
            for choice in chunk.choices:
                text += choice.text
                reason = choice.finish_reason or reason
                if text:
                    started[i].set()
            if chunk.usage is not None:
                usage = chunk.usage.completion_tokens
        return text, reason, usage

    with concurrent.futures.ThreadPoolExecutor(STREAMS) as pool:
        futures = [pool.submit(stream, i) for i in range(STREAMS)]
        # Kill once every stream has text (so the victim's streams move with tokens behind them).
        deadline = time.monotonic() + 120
        while not all(e.is_set() for e in started):
            failed = [f.exception() for f in futures if f.done() and f.exception() is not None]
            assert not failed, f"a stream failed before every stream had text: {failed[0]!r}"
            assert time.monotonic() < deadline, \
                f"{sum(e.is_set() for e in started)} of {STREAMS} streams had text after 120 s"
            time.sleep(0.01)
        os.kill(victim, signal.SIGKILL)
        results = [f.result(timeout=300) for f in futures]
    assert [r[0] for r in results] == expected
    assert [(r[1], r[2]) for r in results] == [("length", STREAM_TOKENS)] * STREAMS
    assert resumed_migrations(server.url) - moved_before >= 1
    assert generation_tokens(server.url) - before == STREAMS * STREAM_TOKENS  # no token received twice


@pytest.fixture(scope="module")
def server_without_migration(tiny_mixtral_dir, tmp_path_factory):
    yield from served(tmp_path_factory.mktemp("router-failure-no-migration"), tiny_mixtral_dir,
                      "routers: 2\nexpert_workers: 1\ncomm:\n  backend: gloo\n  timeout_s: 3.0\n"
                      "balancer:\n  enabled: false\n  poll_interval_s: 0.2\nserve:\n  max_migrations: 0\n",
                      env={"RAYMOE_ADMIN_TOKEN": TOKEN})


def test_past_max_migrations_a_stream_ends_with_an_error_event(server_without_migration):
    server = server_without_migration
    # With nothing else in flight the ingress picks router 0 (fewest requests, lowest index).
    wait_until_routers_alive(server.url)
    victim = call(server.url, "/admin/placement")["routers"][0]["pid"]
    body = json.dumps({"prompt": [7, 8, 9], "max_tokens": 200, "temperature": 0, "ignore_eos": True,
                       "stream": True}).encode()
    request = urllib.request.Request(server.url + "/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    events = []
    with urllib.request.urlopen(request, timeout=300) as response:
        for raw in response:
            line = raw.decode().strip()
            if not line.startswith("data: "):
                continue
            events.append(line[len("data: "):])
            if len(events) == 2:
                os.kill(victim, signal.SIGKILL)  # tokens have reached the client
    assert events[-1] == "[DONE]"
    payloads = [json.loads(e) for e in events[:-1]]
    assert "choices" in payloads[0]  # tokens were streamed first
    assert "error" in payloads[-1] and payloads[-1]["error"]["code"] == "step_failed"
    assert "already been moved 0 times" in payloads[-1]["error"]["message"]
