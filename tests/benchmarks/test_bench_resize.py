"""benchmarks/bench_resize.py's pure parts, from synthetic timelines: the longest pause of any
stream while a resize ran, the whole load's longest gap, a row's lost/differing counts and
its --help. The full run (a server, resizes) is not run here."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

PATH = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "bench_resize.py")


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, os.path.dirname(PATH))
    spec = importlib.util.spec_from_file_location("bench_resize", PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def stream(times, first_token=0):
    return {"events": [(t, [first_token + k]) for k, t in enumerate(times)], "error": None, "end": times[-1]}


def test_the_pause_counts_gaps_overlapping_the_resize_only(bench):
    streams = [stream([0.0, 0.1, 0.2, 1.5, 1.6]), stream([0.0, 3.0])]
    assert bench.pause_during(streams[:1], 1.0, 1.2) == pytest.approx(1.3)  # 0.2 -> 1.5 spans the call
    assert bench.pause_during(streams[:1], 1.55, 1.58) == pytest.approx(0.1)
    assert bench.pause_during(streams[:1], 5.0, 6.0) == 0.0
    assert bench.longest_gap(streams) == pytest.approx(3.0)


def test_a_row_counts_lost_and_differing_streams_and_reads_the_report(bench):
    result = {"workers": 3, "code": 200, "call_s": 1.234, "pause_s": 0.05, "longest_gap_s": 0.2, "lost": 1,
              "tokens": [[1, 2], [3, 4]], "spanned": 2,
              "report": {"workers_before": 2, "seconds": 1.2, "pause_s": 0.04, "copies": 16, "bytes_copied": 10,
                         "bytes_all_experts": 20}}
    row = bench.row(result, [[1, 2], [3, 5]])
    assert row["from"] == 2 and row["to"] == 3 and row["differing"] == 1 and row["lost"] == 1
    assert row["call_s"] == 1.23 and row["copies"] == 16 and row["refused"] is None and row["streams_past_answer"] == 2
    refused = bench.row({"workers": 1, "code": 400, "call_s": 0.01, "pause_s": 0.0, "longest_gap_s": 0.1, "lost": 0,
                         "tokens": [], "report": {"error": {"message": "at least 2 workers"}}}, [])
    assert refused["refused"] == "at least 2 workers"


def test_help_runs():
    done = subprocess.run([sys.executable, PATH, "--help"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "--sizes" in done.stdout
