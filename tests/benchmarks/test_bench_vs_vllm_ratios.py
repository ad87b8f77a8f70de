"""benchmarks/bench_vs_vllm.py's ratios: taken within a round, their median over the rounds, and
a run in which requests failed left out (its tokens/s describe another workload: a server that
drops requests under load must not look faster for it)."""

from __future__ import annotations

import importlib.util
import os

import pytest

PATH = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "bench_vs_vllm.py")


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_vs_vllm", PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def row(server: str, round_: int, concurrency: int, tok_s: float, failed: int = 0) -> dict:
    return {"server": server, "round": round_, "concurrency": concurrency, "completed": 96 - failed,
            "failed": failed, "output_tok_s": tok_s, "itl_p50_ms": 10.0, "ttft_p50_ms": 50.0,
            "itl_p99_ms": 20.0, "ttft_p99_ms": 90.0, "e2el_p50_ms": 700.0}


def test_a_round_with_failed_requests_is_left_out_of_the_ratio(bench, capsys):
    rows = [row(bench.VLLM, 0, 32, 1000.0), row("raymoe 1x1", 0, 32, 900.0),
            row(bench.VLLM, 1, 32, 500.0, failed=4), row("raymoe 1x1", 1, 32, 950.0),
            row(bench.VLLM, 2, 32, 1100.0), row("raymoe 1x1", 2, 32, 1210.0)]
    ratio = next(r for r in bench.ratios(rows) if r["name"] == "raymoe 1x1 / vLLM output tok/s at C=32")
    assert ratio["per_round"] == pytest.approx([0.9, 1.1])  # round 1 (1.9 with the failures) left out
    assert ratio["value"] == pytest.approx(1.0) and ratio["met"]
    bench.print_table(rows, bench.ratios(rows))
    assert "4 failed: left out of the ratios" in capsys.readouterr().out


def test_with_every_round_failed_the_ratio_is_not_measured(bench):
    rows = [row(bench.VLLM, 0, 32, 500.0, failed=1), row("raymoe 1x1", 0, 32, 900.0)]
    ratio = next(r for r in bench.ratios(rows) if r["name"] == "raymoe 1x1 / vLLM output tok/s at C=32")
    assert ratio["value"] is None and ratio["met"] is None and ratio["per_round"] == []


def test_peak_memory_sums_a_process_tree(bench):
    """The sampler sees memory a server's child holds (a server's actors and daemons are its descendants)."""
    import subprocess
    import sys
    import time

    parent = subprocess.Popen([sys.executable, "-c",
                               "import subprocess, sys; subprocess.run([sys.executable, '-c', "
                               "'import time; x = bytearray(300 << 20); time.sleep(4)'])"])
    sampler = bench.PeakMemory(parent.pid, interval_s=0.1)
    sampler.start()
    try:
        deadline = time.monotonic() + 20
        # (PSS and the process tree are read every PeakMemory.EVERY-th sample: wait for both peaks)
        while min(sampler.peak_rss, sampler.peak_pss) < 300 << 20 and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        memory = sampler.stop()
        parent.wait(20)
    assert memory["peak_rss_gb"] >= 0.3 and memory["peak_pss_gb"] >= 0.3, memory
