"""The launch check (cluster/ray-up/try-local.py): `ray up` with cluster/ray-up/local.yaml over
loopback SSH, `raymoe serve --address`, a completion, `raymoe status`, `ray down`, and every
process of that cluster gone. A separate Ray cluster, started here first, must be alive and
running tasks afterwards. Needs sshd, ssh-keygen, ssh and rsync (.ci/run installs Debian's
openssh-server and rsync) and root (sshd's privilege separation); about 2-5 minutes."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from raymoe.cluster import procfs
from raymoe.kernels.comm.ports import free_port

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "cluster" / "ray-up" / "try-local.py"


def _missing() -> str | None:
    if not sys.platform.startswith("linux"):
        return "Linux only (reads /proc)"
    if os.getuid() != 0:
        return "needs root: sshd's privilege separation"
    tools = {"sshd": shutil.which("sshd") or (Path("/usr/sbin/sshd").exists() and "/usr/sbin/sshd"),
             "ssh": shutil.which("ssh"), "ssh-keygen": shutil.which("ssh-keygen"), "rsync": shutil.which("rsync")}
    lacking = [name for name, path in tools.items() if not path]
    if lacking:
        return f"needs {', '.join(lacking)} (Debian: apt-get install openssh-server rsync)"
    return None


pytestmark = [pytest.mark.slow, pytest.mark.skipif(_missing() is not None, reason=_missing() or "")]


def process_table() -> dict[int, procfs.Process]:
    """Every process but the zombies."""
    return {pid: process for pid, process in procfs.processes().items() if process.state != "Z"}


def processes_of(temp_dir: str) -> dict[int, int]:
    """pid -> start time of the processes naming ``temp_dir``, and their descendants."""
    table = process_table()
    found = procfs.descendants({pid for pid, process in table.items() if temp_dir in process.command}, table)
    return {pid: table[pid].start_time for pid in found}


@pytest.fixture
def bystander():
    """An ordinary Ray cluster on this machine that is none of the launch's business."""
    temp = tempfile.mkdtemp(prefix="rb-", dir="/tmp")
    port = free_port()
    env = dict(os.environ, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", RAY_USAGE_STATS_ENABLED="0")
    ray = [sys.executable, "-m", "ray.scripts.scripts"]
    done = subprocess.run(ray + ["start", "--head", f"--port={port}", f"--temp-dir={temp}", "--num-cpus=1",
                                 "--include-dashboard=false"], env=env, capture_output=True, text=True, timeout=180)
    try:
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
        time.sleep(3)  # the raylet's agents
        yield {"address": f"127.0.0.1:{port}", "processes": processes_of(temp), "env": env}
    finally:
        processes = processes_of(temp)
        table = process_table()
        raylets = [p for p in processes if p in table and table[p].command.split(" ")[0].endswith("raylet")]
        for group in (raylets, [p for p in processes if p not in raylets]):
            for pid in group:
                try:
                    os.kill(pid, 15)
                except ProcessLookupError:
                    pass
            time.sleep(2)
        for pid in processes_of(temp):
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass
        shutil.rmtree(temp, ignore_errors=True)


@pytest.mark.timeout(900)
def test_ray_up_serve_status_ray_down_over_loopback_ssh(bystander):
    before = bystander["processes"]
    assert len(before) >= 5, before  # gcs_server, raylet, monitor, log monitor, agents
    pids = " ".join(str(p) for p in before)
    started = time.monotonic()
    launch = subprocess.Popen([sys.executable, str(SCRIPT), "--bystander-pids", pids], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=dict(os.environ, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0"))
    try:
        stdout, stderr = launch.communicate(timeout=780)
    finally:
        if launch.poll() is None:  # timed out (or this test was interrupted): let it clean up after itself
            launch.send_signal(15)
            try:
                launch.communicate(timeout=120)
            except subprocess.TimeoutExpired:
                launch.kill()
    done = subprocess.CompletedProcess(launch.args, launch.returncode, stdout, stderr)
    print(done.stderr[-6000:], file=sys.stderr)
    assert done.returncode == 0, done.stderr[-8000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    seconds = result["seconds"]
    print(f"launch timings (s): {seconds}; test total {time.monotonic() - started:.0f} s", file=sys.stderr)
    assert result["launch"] == "ok" and {"ray_up", "ready", "first_completion", "ray_down"} <= set(seconds)
    assert "ray down: every process of the cluster is gone" in done.stderr
    # nothing of the launch is left: no sshd of its own, no ssh relays, no cluster processes
    table = process_table()
    leftovers = [c for c in (process.command for process in table.values())
                 if any(mark in c for mark in ("/sshd_config", "/relay.py", "/tmp/ray-raymoe-try-")) and "raymoe-try-" in c]
    assert not leftovers, f"processes of the launch are still running: {leftovers}"
    # the separate cluster was not touched: every process alive, and it still runs tasks
    alive = {pid for pid, start in before.items() if pid in table and table[pid].start_time == start}
    assert alive == set(before), f"the separate Ray cluster lost {sorted(set(before) - alive)}"
    probe = ("import ray; from raymoe.cluster.ray_connect import connect; "
             f"connect({bystander['address']!r}, logging_level='ERROR', log_to_driver=False); "
             "print('answer', ray.get(ray.remote(lambda: 6 * 7).remote()))")
    answer = subprocess.run([sys.executable, "-c", probe], env=bystander["env"], capture_output=True, text=True,
                            timeout=120)
    assert "answer 42" in answer.stdout, answer.stderr[-3000:]
