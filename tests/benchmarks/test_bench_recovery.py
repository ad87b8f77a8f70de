"""benchmarks/bench_recovery.py's pure parts, from synthetic timelines: lost and differing
streams, the longest pause (surviving streams and all), the p99 inter-token latency after the
fault, tokens/s bins, the table; and its --help. The full run (servers, faults) is not run here."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

PATH = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "bench_recovery.py")


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_recovery", PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def stream(times, first_token=0, error=None, per_event=1):
    """Events at ``times``, each carrying ``per_event`` consecutive token ids."""
    events = [(t, list(range(first_token + k * per_event, first_token + (k + 1) * per_event)))
              for k, t in enumerate(times)]
    return {"events": events, "error": error, "end": times[-1] if times else None}


def test_pauses_and_itl_from_a_synthetic_timeline(bench):
    steady = [0.1 * k for k in range(20)]  # 20 tokens, 0.1 s apart
    paused = [0.1 * k for k in range(10)] + [0.9 + 3.0 + 0.1 * k for k in range(10)]  # a 3 s hole after t=0.9
    streams = [stream(steady), stream(paused), stream(steady[:5], error="step_failed")]
    reference = [list(range(20)), list(range(20)), list(range(20))]
    row = bench.summarize("c", streams, reference, 20, fault_t=0.95, surviving=[0], after_s=30,
                          full_size_s=4.2)
    assert row["lost"] == 1 and row["lost_streams"] == [2]
    assert row["differing"] == 0
    assert row["longest_pause_surviving_s"] == pytest.approx(0.1)
    assert row["longest_pause_all_s"] == pytest.approx(3.0)
    # Tokens after t=0.95: stream 0's 10 gaps of 0.1 s, stream 1's 3 s gap and 9 of 0.1 s,
    # stream 2's none (it ended at 0.4): p99 of 20 values lands between 0.1 and 3.0.
    itl = bench.itl_after(streams, 0.95, 30)
    assert len(itl) == 20 and max(itl) == pytest.approx(3.0)
    assert 100 < row["p99_itl_after_ms"] <= 3000
    assert row["full_size_s"] == 4.2


def test_a_stream_with_other_tokens_differs_and_one_cut_short_is_lost(bench):
    good = stream([0, 1, 2, 3])
    other = stream([0, 1, 2, 3], first_token=7)
    short = stream([0, 1, 2])
    row = bench.summarize("a", [good, other, short], [[0, 1, 2, 3]] * 3, 4, fault_t=1.5, surviving=None,
                          after_s=30, full_size_s=None)
    assert (row["lost"], row["differing"], row["differing_streams"]) == (1, 1, [1])
    assert row["full_size_s"] is None


def test_an_event_with_several_tokens_counts_each(bench):
    two = stream([0.0, 1.0, 2.0], per_event=2)  # 2 tokens per event, 1 s apart: ITL 0.5 s each
    assert bench.itl_after([two], 0.5, 30) == [0.5, 0.5, 0.5, 0.5]
    assert bench.longest_pause([two]) == pytest.approx(1.0)
    assert bench.percentile([1.0, 2.0, 3.0, 4.0], 50) == pytest.approx(2.5)


def test_rate_series_bins_tokens_around_the_fault(bench):
    times, rates = bench.rate_series([stream([-0.9, -0.2, 0.1, 0.2, 1.3])], origin=0.0, bin_s=0.5)
    assert sum(r * 0.5 for r in rates) == 5  # every token counted once
    assert times[0] < -0.5 and times[-1] > 1.0
    zero = [t for t, r in zip(times, rates) if r == 0]
    assert times[0] == pytest.approx(-0.75) and zero == [pytest.approx(0.75)]  # bins [-1, -0.5) ... [1, 1.5)


def test_table_and_copies_per_expert(bench):
    row = bench.summarize("none", [stream([0, 1])], None, 2, None, None, 30, None)
    text = bench.table([row])
    assert "no fault" in text and "n/a" in text
    # 2 workers x 2 slots: experts 0 and 1 on both workers, expert 2 on worker 0 only.
    assert bench.copies_per_expert({"slots_per_worker": 2, "placement": [[0, 1, 1, 0]]}) == 2
    assert bench.copies_per_expert({"slots_per_worker": 2, "placement": [[0, 2, 1, 0]]}) == 1


def test_help_and_unknown_cases(bench, capsys):
    done = subprocess.run([sys.executable, PATH, "--help"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "--cases" in done.stdout and "--streams" in done.stdout
    with pytest.raises(SystemExit) as refused:
        bench.main(["--cases", "a,z"])
    assert refused.value.code == 2 and "unknown cases ['z']" in capsys.readouterr().err
