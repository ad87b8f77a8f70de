"""Two stateless HTTP ingress replicas share one cluster; killing one under load fails only
the requests it held, and every request on the other completes."""

from __future__ import annotations

import concurrent.futures
import http.client
import json
import os
import signal
import time
import urllib.request

import pytest

from server_process import served

REPLICA = "x-raymoe-replica"


@pytest.fixture(scope="module")
def server(tiny_mixtral_dir, tmp_path_factory):
    yield from served(tmp_path_factory.mktemp("replicas"), tiny_mixtral_dir,
                      "routers: 1\nexpert_workers: 1\nserve:\n  served_model_name: tiny\n  replicas: 2\n")


def replicas(url: str, calls: int = 60) -> dict[str, int]:
    """Replica id -> pid, as the replicas answer /health through Serve's proxy."""
    seen = {}
    for _ in range(calls):
        with urllib.request.urlopen(f"{url}/health", timeout=30) as response:
            seen[response.headers[REPLICA]] = int(response.headers[f"{REPLICA}-pid"])
        if len(seen) == 2:
            break
    return seen


def stream(port: int, started: list) -> tuple[str, str]:
    """One streamed completion: (replica that served it, how it ended)."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    body = json.dumps({"prompt": [7, 8, 9], "max_tokens": 48, "stream": True, "ignore_eos": True, "temperature": 0})
    try:
        connection.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        response = connection.getresponse()
        replica = response.headers.get(REPLICA, "?")
        started.append(replica)
        text = response.read().decode()
        events = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
        if events and events[-1] == "[DONE]" and json.loads(events[-2])["choices"][0]["finish_reason"] == "length":
            return replica, "completed"
        return replica, "incomplete"
    except (OSError, http.client.HTTPException):
        return "?", "connection lost"
    finally:
        connection.close()


def test_two_replicas_serve_and_one_can_die_under_load(server):
    ids = replicas(server.url)
    assert len(ids) == 2, ids  # both replicas answer, one cluster behind them
    started: list = []
    with concurrent.futures.ThreadPoolExecutor(24) as pool:
        futures = [pool.submit(stream, server.port, started) for _ in range(24)]
        deadline = time.monotonic() + 60
        while len(started) < 24 and time.monotonic() < deadline:  # every stream has its replica
            time.sleep(0.05)
        victim, survivor = sorted(ids)
        if started.count(victim) == 0:
            victim, survivor = survivor, victim
        os.kill(ids[victim], signal.SIGKILL)
        results = [f.result(timeout=180) for f in futures]
    on_survivor = [how for replica, how in results if replica == survivor]
    print(f"replica streams: {started.count(victim)} on the killed one, {len(on_survivor)} on the survivor; "
          f"outcomes {sorted(how for _, how in results)}")
    assert on_survivor and all(how == "completed" for how in on_survivor)
    # The service goes on: new requests complete (on the survivor, or a replica Serve restarted).
    with urllib.request.urlopen(urllib.request.Request(
            f"{server.url}/v1/completions", data=json.dumps({"prompt": [5], "max_tokens": 4, "temperature": 0,
                                                                 "ignore_eos": True}).encode(),
            headers={"Content-Type": "application/json"}), timeout=120) as response:
        assert json.loads(response.read())["usage"]["completion_tokens"] == 4
