"""Issue 32, items 2-4: the first hour of a user and an operator.

- Item 2: every CPU example under configs/examples serves as written (its demo checkpoint
  written on first use) and answers the README's request (model "demo-mixtral"); a GPU
  example on a machine without its checkpoint says which command writes one.
- Item 3: `raymoe status` prints routers and workers (pid, node, alive, in flight, last
  failure) in text, and says how to start a server when there is none; /health names a
  frozen router; `raymoe plan memory` sizes a small model in sensible units.
- Item 4: a normal start and a clean stop log no error-level or deprecation lines.

One server per CPU example (a start is ~30 s on 2 cores); the demo checkpoint is written once.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from doc_examples import curl_body
from raymoe.kernels.comm.ports import free_port
from server_process import ServerProcess

EXAMPLES = Path(__file__).resolve().parents[2] / "configs" / "examples"
# The README's curl body, as written there.
README_BODY = curl_body("README.md", "/v1/completions")
# What a normal start or clean stop must not log: glog error lines ("[... E 123 123] ..."),
# Python's ERROR records, tracebacks, deprecation warnings and failed tasks.
NOISE = re.compile(r"\] E |\bE \d+ \d+\]|\bERROR\b|Traceback|[Dd]eprecat|\bfailed\b")


def post(url: str, body: dict, timeout: float = 120) -> dict:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


def get(url: str, timeout: float = 60) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def cli(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "raymoe.cluster.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"})


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("raymoe-cache")


@pytest.fixture(scope="module")
def cpu_2x3(cache, tmp_path_factory):
    """configs/examples/cpu-2x3.yaml as written (only the port is a free one); the demo
    checkpoint is not there yet: the server writes it."""
    assert not (cache / "demo-mixtral").exists()
    server = ServerProcess(str(EXAMPLES / "cpu-2x3.yaml"), str(tmp_path_factory.mktemp("cpu-2x3") / "serve.log"),
                           env={"RAYMOE_CACHE": str(cache)})
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


# ---- item 2 ------------------------------------------------------------------------------
def test_cpu_2x3_example_writes_the_demo_and_answers_the_readme_request(cpu_2x3, cache):
    assert (cache / "demo-mixtral" / "config.json").is_file()
    assert "writing the demo checkpoint" in cpu_2x3.tail(10**6)
    body = post(f"{cpu_2x3.url}/v1/completions", README_BODY)
    assert body["model"] == "demo-mixtral" and body["usage"]["completion_tokens"] == 16
    assert get(f"{cpu_2x3.url}/v1/models")[1]["data"][0]["id"] == "demo-mixtral"


def test_gpu_example_without_its_checkpoint_names_the_command_that_writes_one(tmp_path):
    done = cli("serve", str(EXAMPLES / "1node-8gpu.yaml"), "--port", str(free_port(below_ephemeral=True)), timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "checkpoint /mnt/models/Mixtral-8x7B-Instruct-v0.1 does not exist" in done.stderr
    assert "raymoe demo-model /mnt/models/Mixtral-8x7B-Instruct-v0.1" in done.stderr
    assert "Ray cluster" not in done.stderr  # refused before any Ray started


# ---- item 3 ------------------------------------------------------------------------------
def test_status_prints_routers_and_workers_in_text(cpu_2x3):
    done = cli("status", "--address", cpu_2x3.ray_address())
    assert done.returncode == 0, done.stderr[-2000:]
    rows = {line.split()[0] + " " + line.split()[1]: line.split() for line in done.stdout.splitlines()
            if re.match(r"(router|worker) \d", line)}
    assert sorted(rows) == ["router 0", "router 1", "worker 0", "worker 1", "worker 2"], done.stdout
    router_pids = {int(rows[f"router {r}"][2]) for r in range(2)}
    worker_pids = {int(rows[f"worker {w}"][2]) for w in range(3)}
    assert router_pids == set(cpu_2x3.actor_pids("Router")), done.stdout
    assert worker_pids == set(cpu_2x3.actor_pids("ExpertWorker")), done.stdout
    for name, fields in rows.items():  # actor pid node alive in-flight state progress last-failure
        assert fields[3] == "127.0.0.1" and fields[4] == "yes" and fields[8] == "-", done.stdout
        assert fields[5] == ("0" if name.startswith("router") else "-"), done.stdout
        assert fields[6] in ("alive", "serving"), done.stdout  # the controller's rank watch
    assert "in-flight" in done.stdout and "last failure" in done.stdout


def test_status_without_a_cluster_says_how_to_start_one():
    done = cli("status", "--address", f"127.0.0.1:{free_port(below_ephemeral=True)}", timeout=120)
    assert done.returncode == 1
    assert "no Ray cluster at 127.0.0.1:" in done.stderr and "raymoe serve" in done.stderr, done.stderr


def test_plan_memory_sizes_a_small_model_in_small_units(tiny_mixtral_dir):
    done = cli("plan", "memory", "--model", tiny_mixtral_dir, "--gpus", "2")
    assert done.returncode == 0, done.stderr
    assert "0.0B params" not in done.stdout and "0.0 GB" not in done.stdout, done.stdout
    assert re.search(r": [\d.]+[KM] params", done.stdout) and re.search(r"[\d.]+ [KM]B/GPU", done.stdout), done.stdout


# ---- item 4 (last on this server: it stops it) ---------------------------------------------
def test_a_normal_start_and_a_clean_stop_log_no_errors_or_deprecations(cpu_2x3):
    assert cpu_2x3.stop() == 0, cpu_2x3.tail()
    log = cpu_2x3.tail(10**7)
    assert "raymoe serve: ready at" in log and "raymoe serve: shutting down" in log
    noise = [line for line in log.splitlines() if NOISE.search(line)]
    assert not noise, "\n".join(noise)


# ---- item 2 and 3 on the other CPU example -------------------------------------------------
def test_explicit_example_answers_and_health_names_a_frozen_router(cache, tmp_path):
    """configs/examples/explicit-per-layer.yaml as written (the demo already written above,
    or written now when this test runs alone); then its one router frozen (SIGSTOP): /health
    is 503 with a reason that names it."""
    server = ServerProcess(str(EXAMPLES / "explicit-per-layer.yaml"), str(tmp_path / "serve.log"),
                           env={"RAYMOE_CACHE": str(cache)})
    try:
        server.wait_ready()
        body = post(f"{server.url}/v1/completions", README_BODY)
        assert body["model"] == "demo-mixtral" and body["usage"]["completion_tokens"] == 16
        status, answer = get(f"{server.url}/health")
        assert (status, answer["status"], answer["routers"], answer["expert_workers"]) == (200, "ok", 1, 2), answer
        assert [row["rank"] for row in answer["ranks"]] == ["router 0", "worker 0", "worker 1"], answer
        assert all(row["state"] in ("serving", "alive") for row in answer["ranks"]), answer
        (router,) = server.actor_pids("Router")
        os.kill(router, signal.SIGSTOP)
        try:
            status, answer = get(f"{server.url}/health")
        finally:
            os.kill(router, signal.SIGCONT)
        assert status == 503 and answer["status"] == "unhealthy"
        # silent for 5 s, short of the rank watch's limit (comm.wedge_after_s: 10 s at the default timeout_s 30 s): unresponsive, not yet wedged
        assert answer["reason"] == "router 0: unresponsive (no answer within 5 s)", answer
        deadline = time.monotonic() + 60
        while get(f"{server.url}/health")[0] != 200:  # thawed: healthy again
            assert time.monotonic() < deadline
            time.sleep(0.5)
    finally:
        assert server.stop() == 0, server.tail()
