"""benchmarks/bench_recovery_nodes.py's pure parts, from synthetic records: requests lost and
differing per slot's reference, the longest pause of a stream across its requests (a slow first
token counts), the p99 ITL after the fault, the table; and its --help. The namespace cluster
itself (root, minutes) is not started here."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

PATH = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "bench_recovery_nodes.py")


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_recovery_nodes", PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def record(slot, times, first_token=0, error=None, finished=True):
    return {"slot": slot, "events": [(t, [first_token + k]) for k, t in enumerate(times)], "error": error,
            "finished": finished}


def test_lost_differing_and_a_pause_between_two_requests_of_a_slot(bench):
    reference = [[0, 1, 2], [10, 11, 12]]
    records = [
        record(0, [0.0, 0.1, 0.2]),
        record(0, [2.7, 2.8, 2.9]),  # slot 0's next request: first token 2.5 s after the last one
        record(1, [0.0, 0.1, 0.2], first_token=10),
        record(1, [0.3, 0.4, 0.5], first_token=20),  # other tokens: differs
        record(1, [0.6], first_token=10, error="recovery failed", finished=False),  # lost
    ]
    row = bench.summarize_case("g", records, reference, 3, fault_t=0.25, after_s=30, full_size_s=21.7,
                               full_size_since_action_s=6.7)
    assert (row["requests"], row["streams"], row["lost"], row["differing"]) == (5, 2, 1, 1)
    assert row["longest_pause_all_s"] == pytest.approx(2.5)
    assert row["longest_pause_surviving_s"] == pytest.approx(2.5)  # slot 1 lost a request: not surviving
    assert row["full_size_s"] == 21.7 and row["full_size_since_action_s"] == 6.7
    # per-request gaps ending after 0.25: slot 0's second request (0.1, 0.1), slot 1's second (0.1, 0.1)
    assert row["itl_tokens_after"] == 4 and row["p99_itl_after_ms"] == pytest.approx(100.0)
    text = bench.table([row])
    assert "a whole node killed" in text and "1/5" in text and "21.70/6.70" in text


def test_slot_streams_orders_each_slots_events_and_params_alternate(bench):
    streams = bench.slot_streams([record(1, [0.5]), record(0, [0.2]), record(1, [0.1])])
    assert [[t for t, _ in s["events"]] for s in streams] == [[0.2], [0.1, 0.5]]
    assert bench.request_params(0, 300) == {"max_tokens": 300, "temperature": 0.0, "ignore_eos": True}
    assert bench.request_params(3, 300)["seed"] == 1003 and bench.request_params(3, 300)["temperature"] == 0.9
    row = bench.summarize_case("none", [record(0, [0.0, 1.0])], [[0, 1]], 2, None, 30, None)
    assert row["full_size_s"] is None and "n/a" in bench.table([row])


def test_help_and_unknown_cases(bench, capsys):
    done = subprocess.run([sys.executable, PATH, "--help"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "--cases" in done.stdout and "--partition-s" in done.stdout
    with pytest.raises(SystemExit) as refused:
        bench.main(["--cases", "g,z"])
    assert refused.value.code == 2 and "unknown cases ['z']" in capsys.readouterr().err
