"""A router killed under load: its requests start over on another router; it comes back."""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from raymoe.engine.engine import EngineConfig, LLMEngine
from raymoe.engine.sampling_params import SamplingParams
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


def generation_tokens(url: str) -> float:
    """The ingress's count of output tokens received from routers (a re-run request's tokens
    count twice: once from the router that died, once from the one that re-ran it)."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=60) as response:
        families = {f.name: f for f in text_string_to_metric_families(response.read().decode())}
    return sum(s.value for s in families["raymoe:generation_tokens"].samples if s.name.endswith("_total"))


MAX_TOKENS = 48


def test_router_killed_under_load_loses_no_request(server, tiny_mixtral_dir):
    prompts = [[10 + i, 20 + i, 30 + i] for i in range(16)]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    reference = LLMEngine.from_pretrained(tiny_mixtral_dir, EngineConfig(dtype="float32"))
    expected = [o.output_token_ids for o in reference.generate(prompts, params)]
    routers = call(server.url, "/admin/placement")["routers"]
    victim = routers[0]["pid"]
    before = generation_tokens(server.url)

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
    # Proof that requests were re-run, not merely finished before the kill: the ingress
    # received more tokens than the requests hold, the dead router's partial outputs included.
    received = generation_tokens(server.url) - before
    assert received > len(prompts) * MAX_TOKENS, received
    # The router comes back (restarted by Ray, rejoined by the controller) and serves again.
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        status = call(server.url, "/admin/placement")
        back = status["routers"][0]
        if back.get("alive") and back["pid"] != victim and any(
                0 in r.get("restarted_routers", []) for r in status["recoveries"]):
            break
        time.sleep(1)
    else:
        raise AssertionError(f"router 0 did not come back: {status['routers']} {status['recoveries']}")
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        bodies = list(pool.map(complete, prompts[:8]))
    assert [b["choices"][0]["token_ids"] for b in bodies] == expected[:8]
    with urllib.request.urlopen(f"{server.url}/health", timeout=30) as response:
        assert response.status == 200


def test_a_stream_whose_router_dies_after_sending_tokens_ends_with_an_error_event(server):
    # With nothing else in flight the ingress picks router 0 (fewest requests, lowest index).
    deadline = time.monotonic() + 120
    while not all(r.get("alive") for r in call(server.url, "/admin/placement")["routers"]):
        assert time.monotonic() < deadline
        time.sleep(0.5)
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
    assert "lost after" in payloads[-1]["error"]["message"]
