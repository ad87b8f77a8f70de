"""benchmarks/gpu_check.py and gpu_check_2gpu.py on a machine without a GPU (issue 34, item 9).

Both must import, answer --help, and write a JSON that says the run was skipped and why
(exit status 0) where there is no GPU; their --cpu-smoke modes run the checks' own code on
the CPU: the bounded abort of gpu_check's NCCL check (a stand-in abort that never returns),
and gpu_check_2gpu's whole end-to-end path (deploy, one router and one worker, tokens against
the CPU engine) over the sockets transport. What needs a GPU is not run here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = {"gpu_check": ROOT / "benchmarks" / "gpu_check.py", "gpu_check_2gpu": ROOT / "benchmarks" / "gpu_check_2gpu.py"}
no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU answer; this machine has a GPU")


def run(script: str, *arguments: str, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {key: value for key, value in os.environ.items() if key != "OUT"}
    return subprocess.run([sys.executable, str(SCRIPTS[script]), *arguments], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT, env={**env, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"})


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_help(script):
    finished = run(script, "--help", timeout=120)
    assert finished.returncode == 0, finished.stderr
    assert "--out" in finished.stdout


@no_gpu
def test_gpu_check_says_it_skipped_and_why(tmp_path):
    out = tmp_path / "gpu_check.json"
    finished = run("gpu_check", "--out", str(out))
    assert finished.returncode == 0, finished.stdout[-3000:] + finished.stderr[-3000:]
    summary = json.loads(out.read_text())
    assert summary["skipped"] is True and summary["reason"].startswith("no GPU here: ")
    assert summary["exit_status"] == 0 and summary["budget_s"] <= 360
    statuses = {check["key"]: check["status"] for check in summary["checks"]}
    assert statuses.pop("a") == "INFO"  # versions run anywhere
    assert set(statuses) == set("bcdefghi") and set(statuses.values()) == {"SKIP"}
    assert all(check["summary"] for check in summary["checks"])


@no_gpu
def test_gpu_check_2gpu_says_it_skipped_and_why(tmp_path):
    out = tmp_path / "gpu_check_2gpu.json"
    finished = run("gpu_check_2gpu", "--out", str(out), timeout=120)
    assert finished.returncode == 0, finished.stdout[-3000:] + finished.stderr[-3000:]
    summary = json.loads(out.read_text())
    assert summary["skipped"] is True and summary["status"] == "SKIP"
    assert summary["reason"].startswith("no GPU here: ") and summary["exit_status"] == 0


def test_the_budgets_fit_six_minutes():
    sys.path.insert(0, str(SCRIPTS["gpu_check"].parent))
    try:
        import gpu_check
    finally:
        sys.path.pop(0)
    assert gpu_check.TOTAL_BUDGET_S <= 360
    assert sum(check.budget_s for check in gpu_check.CHECKS) + gpu_check.RESERVE_S <= gpu_check.TOTAL_BUDGET_S
    assert {check.key for check in gpu_check.CHECKS} == set(gpu_check.CHECK_FUNCTIONS)


def test_the_nccl_checks_bounded_abort_runs_on_cpu(tmp_path):
    out = tmp_path / "smoke.json"
    finished = run("gpu_check", "--cpu-smoke", "--only", "g", "--out", str(out))
    assert finished.returncode == 0, finished.stdout[-3000:] + finished.stderr[-3000:]
    (check,) = json.loads(out.read_text())["checks"]
    assert check["status"] == "PASS", check
    assert check["details"]["stand_in_abort_s"] < 2.5
    assert "ncclCommAbort did not return within 0.5 s" in finished.stdout


def test_the_two_gpu_path_runs_end_to_end_on_cpu_actors(tmp_path):
    out = tmp_path / "smoke2.json"
    finished = run("gpu_check_2gpu", "--cpu-smoke", "--out", str(out), timeout=600)
    summary = json.loads(out.read_text())
    assert finished.returncode == 0 and summary["status"] == "PASS", finished.stdout[-4000:]
    assert summary["details"]["tokens"] == summary["details"]["expected"]
    assert summary["details"]["router"]["warm_up"]["attention"]["backend"] == "sdpa"
    # the ping-pong micro-batches ran (issue 29) and gave the CPU engine's tokens
    ping_pong = summary["details"]["ping_pong"]
    assert ping_pong["tokens_equal"] and ping_pong["ping_pong_steps"] > 0, ping_pong
