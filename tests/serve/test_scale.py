"""Resizing a served deployment (issue 31 item 1): the authenticated admin route
``POST /admin/scale``, ``raymoe scale`` and ``raymoe status --json``'s live size; answers stay
equal to the in-process engine's at every size."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.error
import urllib.request

import pytest

from raymoe.engine.engine import EngineConfig, LLMEngine
from raymoe.engine.sampling_params import SamplingParams
from server_process import served

ADMIN_TOKEN = "scale-admin-token"
AUTH = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
PROMPTS = [[4, 5, 6, 7], [100, 42, 9], [17, 250, 3, 3, 8]]


@pytest.fixture(scope="module")
def server(tiny_mixtral_dir, tmp_path_factory):
    yield from served(tmp_path_factory.mktemp("scale"), tiny_mixtral_dir,
                      "routers: 1\nexpert_workers: 1\nbalancer:\n  interval_steps: 1000000000\n"
                      "serve:\n  served_model_name: tiny\n", env={"RAYMOE_ADMIN_TOKEN": ADMIN_TOKEN})


@pytest.fixture(scope="module")
def expected(tiny_mixtral_dir):
    engine = LLMEngine.from_pretrained(tiny_mixtral_dir, EngineConfig(dtype="float32"))
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    return [o.output_token_ids for o in engine.generate(PROMPTS, params)]


def call(url: str, body=None, headers: dict | None = None) -> tuple[int, dict]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=600) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def completions(server) -> list[list[int]]:
    outputs = []
    for prompt in PROMPTS:
        code, body = call(f"{server.url}/v1/completions", {"model": "tiny", "prompt": prompt, "max_tokens": 8,
                                                           "temperature": 0, "ignore_eos": True, "return_token_ids": True})
        assert code == 200, body
        outputs.append(body["choices"][0]["token_ids"])
    return outputs


def raymoe(server, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "raymoe.cluster.cli", *args, "--address", server.ray_address()],
                          capture_output=True, text=True, timeout=600)


def test_admin_scale_and_the_cli_resize_the_workers_live(server, expected):
    before = completions(server)
    assert before == expected  # the in-process engine's tokens at every size
    assert call(f"{server.url}/admin/scale", {"workers": 2})[0] == 401  # same token as the other admin routes
    assert call(f"{server.url}/admin/scale", {"workers": 2}, {"Authorization": "Bearer wrong"})[0] == 401
    code, body = call(f"{server.url}/admin/scale", {"routers": 0}, AUTH)
    assert code == 400 and body["error"]["code"] == "resize_refused" and ">= 1" in body["error"]["message"], body
    code, body = call(f"{server.url}/admin/scale", {}, AUTH)
    assert code == 400 and body["error"]["code"] == "invalid_body", body
    code, body = call(f"{server.url}/admin/scale", {"workers": 0}, AUTH)
    assert code == 400 and body["error"]["code"] == "resize_refused" and ">= 1" in body["error"]["message"], body
    code, body = call(f"{server.url}/admin/scale", {"workers": "two"}, AUTH)
    assert code == 400 and body["error"]["param"] == "workers"

    code, report = call(f"{server.url}/admin/scale", {"workers": 2}, AUTH)
    assert code == 200 and report["resized"] and report["workers"] == 2, report
    assert completions(server) == before  # the same tokens at the new size
    status = raymoe(server, "status", "--json")
    assert status.returncode == 0, status.stderr[-2000:]
    live = json.loads(status.stdout)
    assert live["workers"] == 2 and live["num_routers"] == 1 and len(live["routers"]) == 1
    assert [row["actor"] for row in live["actors"]] == ["router 0", "worker 0", "worker 1"]
    assert all(row["alive"] for row in live["actors"]), live["actors"]
    with urllib.request.urlopen(f"{server.url}/health", timeout=30) as response:
        assert json.loads(response.read())["expert_workers"] == 2

    refused = raymoe(server, "scale", "--workers", "2", "--routers", "0")
    assert refused.returncode == 2 and "--routers must be >= 1" in refused.stderr
    done = raymoe(server, "scale", "--workers", "1")
    assert done.returncode == 0 and done.stdout.startswith("scaled: 2 -> 1 expert workers"), done.stderr[-2000:]
    text = raymoe(server, "status")
    assert text.returncode == 0 and "live size: 1 expert workers, 1 routers" in text.stdout, text.stderr[-2000:]
    assert "last resize: 2 -> 1 workers" in text.stdout
    assert completions(server) == before


def test_the_routers_grow_and_shrink_live_over_http_with_streams_running(server, expected):
    """A router added through the admin route takes requests from the ingress within a second;
    one removed finishes its streams first (or they move): every answer stays the reference's."""
    import concurrent.futures
    import time

    def stream(prompt) -> list[int]:
        body = json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0,
                           "ignore_eos": True, "stream": True, "return_token_ids": True}).encode()
        request = urllib.request.Request(f"{server.url}/v1/completions", data=body,
                                         headers={"Content-Type": "application/json"})
        tokens = []
        with urllib.request.urlopen(request, timeout=600) as response:
            for line in response:
                line = line.decode().strip()
                if line.startswith("data: {"):
                    chunk = json.loads(line[6:])
                    assert "error" not in chunk, chunk
                    tokens += chunk["choices"][0].get("token_ids") or []
        return tokens

    def round_of_streams() -> list[list[int]]:
        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            return list(pool.map(stream, PROMPTS * 2))

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        running = pool.submit(lambda: [round_of_streams() for _ in range(3)])
        code, grown = call(f"{server.url}/admin/scale", {"routers": 2}, AUTH)
        rounds = running.result(timeout=600)
    assert code == 200 and grown["resized"] and (grown["routers_before"], grown["routers"]) == (1, 2), grown
    assert all(got == expected * 2 for got in rounds)
    # Within a couple of refreshes the ingress sends requests to router 1 as well.
    done = raymoe(server, "status", "--json")
    assert done.returncode == 0 and json.loads(done.stdout)["num_routers"] == 2, done.stderr[-2000:]
    deadline = time.monotonic() + 30
    while True:
        assert round_of_streams() == expected * 2
        code, placement = call(f"{server.url}/admin/placement", headers=AUTH)
        if placement["routers"][1].get("generated_tokens", 0) > 0:
            break
        assert time.monotonic() < deadline, placement["routers"]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        running = pool.submit(lambda: [round_of_streams() for _ in range(3)])
        shrunk = raymoe(server, "scale", "--routers", "1")
        rounds = running.result(timeout=600)
    assert shrunk.returncode == 0 and shrunk.stdout.startswith("scaled: 2 -> 1 routers"), shrunk.stderr[-2000:]
    assert all(got == expected * 2 for got in rounds)
    assert completions(server) == expected
    text = raymoe(server, "status")
    assert "live size: 1 expert workers, 1 routers" in text.stdout and "last resize: 2 -> 1 routers" in text.stdout
