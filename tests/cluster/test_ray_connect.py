"""How raymoe's commands reach a Ray cluster (cluster/ray_connect.py, ``ensure_ray``): an
explicit address reaches a token-authenticated cluster, a refused token says "authentication
failed", and a command without an address never attaches to a cluster it finds on the
machine. One token-authenticated Ray (`ray start --head`, loopback, its own temp dir and
token) serves the module; it is stopped by its marker, so nothing else on the machine is."""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

import pytest

from raymoe.kernels.comm.ports import free_port

CLI = [sys.executable, "-m", "raymoe.cluster.cli"]


@pytest.fixture(scope="module")
def cluster():
    yield from ray_head("token")


@pytest.fixture(scope="module")
def open_cluster():
    """A Ray head without authentication (RAY_AUTH_MODE=disabled), as Ray's AutoscalingCluster runs."""
    yield from ray_head("disabled")


def ray_head(auth_mode: str):
    from raymoe.cluster.ray_up_node import MARKER, stop

    folder = Path(tempfile.mkdtemp(prefix="rc-", dir="/tmp"))  # short: Ray's socket paths live under it
    token = folder / "token"
    token.write_text(secrets.token_hex(32))
    name = f"raymoe-connect-test-{uuid.uuid4().hex[:8]}"
    port = free_port()
    # RAY_TMPDIR: this cluster's ray_current_cluster is the one `ray.init()` would find,
    # without touching the machine's /tmp/ray.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_AUTH", "RAY_ADDRESS"))}
    env.update(RAY_TMPDIR=str(folder), RAY_AUTH_TOKEN_PATH=str(token), RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0",
               RAY_USAGE_STATS_ENABLED="0")
    start = subprocess.run([sys.executable, "-m", "ray.scripts.scripts", "start", "--head", f"--port={port}",
                            "--num-cpus=1", "--include-dashboard=false"],
                           env=dict(env, RAY_AUTH_MODE=auth_mode, **{MARKER: name}), capture_output=True, text=True,
                           timeout=180)
    try:
        assert start.returncode == 0, start.stdout[-2000:] + start.stderr[-2000:]
        yield {"address": f"127.0.0.1:{port}", "env": env, "folder": folder}
    finally:
        stop(name, grace_s=10)
        shutil.rmtree(folder, ignore_errors=True)


def run(command: list[str], env: dict, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)


def test_an_explicit_address_reaches_a_token_cluster(cluster):
    # RAY_AUTH_MODE unset: Ray itself would send no token to an explicit address
    done = run(CLI + ["status", "--address", cluster["address"]], cluster["env"])
    assert done.returncode == 1
    assert "no running raymoe deployment found at " + cluster["address"] in done.stderr, done.stderr[-2000:]
    assert "authentication failed" not in done.stderr


def test_a_wrong_token_says_authentication_failed(cluster):
    wrong = cluster["folder"] / "wrong"
    wrong.write_text(secrets.token_hex(32))
    env = dict(cluster["env"], RAY_AUTH_TOKEN_PATH=str(wrong))
    for command in ("status", "rebalance"):
        done = run(CLI + [command, "--address", cluster["address"]], env)
        assert done.returncode == 1
        assert f"raymoe {command}: authentication failed: the Ray cluster at {cluster['address']}" in done.stderr
        assert "no running raymoe deployment" not in done.stderr
    no_token = dict(cluster["env"], RAY_AUTH_MODE="disabled")
    done = run(CLI + ["status", "--address", cluster["address"]], no_token)
    assert "authentication failed" in done.stderr and "sends none (RAY_AUTH_MODE=disabled)" in done.stderr
    # serve stops there too, without starting or joining any Ray (no serve.shutdown -> ray.init())
    done = run(CLI + ["serve", "--address", cluster["address"], "--port", str(free_port())],
               dict(env, RAYMOE_CACHE=str(cluster["folder"] / "cache")), timeout=300)
    assert done.returncode == 1 and "raymoe serve: authentication failed" in done.stderr, done.stderr[-3000:]


PROBE = """
import ray
from raymoe.cluster.deploy import ensure_ray
ensure_ray({address!r})
print("GCS", ray.get_runtime_context().gcs_address)
print("NICE", ray.get(ray.remote(lambda: __import__("os").nice(0)).remote()))
"""


def test_no_address_starts_a_ray_of_its_own_and_an_explicit_one_is_used_as_given(cluster):
    # what plain ray.init() does here: it joins the cluster it finds (the hazard)
    plain = run([sys.executable, "-c", "import ray; ray.init(); print('GCS', ray.get_runtime_context().gcs_address)"],
                cluster["env"])
    assert f"GCS {cluster['address']}" in plain.stdout, plain.stderr[-2000:]
    own = run([sys.executable, "-c", PROBE.format(address=None)], cluster["env"], timeout=300)
    assert own.returncode == 0, own.stderr[-3000:]
    gcs = own.stdout.split("GCS ")[1].strip()
    gcs = gcs.split()[0]
    assert gcs.startswith("127.0.0.1:") and gcs != cluster["address"]
    assert "NICE 0" in own.stdout  # its actors serve at normal priority, not Ray's niceness 15
    given = run([sys.executable, "-c", PROBE.format(address=cluster["address"])], cluster["env"])
    assert given.returncode == 0 and f"GCS {cluster['address']}" in given.stdout, given.stderr[-3000:]


ACTOR = """
import ray
from raymoe.cluster.ray_connect import connect
connect({address!r})
@ray.remote(num_cpus=0)
class Answer:
    def get(self):
        return 42
print("ACTOR", ray.get(Answer.options(name="answer", lifetime="detached").remote().get.remote(), timeout=120))
"""


def test_a_token_on_this_machine_does_not_stop_it_reaching_a_cluster_without_authentication(open_cluster):
    # This machine has a token (RAY_AUTH_TOKEN_PATH) and the cluster wants none: connect turns token
    # mode on all the same, and a detached actor is still created and answers. (Checked because
    # the Ray-autoscaler test's "Actor creation cancelled" was suspected to come from this.)
    done = run([sys.executable, "-c", ACTOR.format(address=open_cluster["address"])], open_cluster["env"], timeout=300)
    assert done.returncode == 0 and "ACTOR 42" in done.stdout, (done.stdout[-2000:], done.stderr[-3000:])
