"""benchmarks/bench_autoscale.py's pure parts: the ramp's phases, the concurrency at a time,
the resizes read from status samples, and its --help. The full run (a server, a ramp) is not
run here."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

PATH = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "bench_autoscale.py")


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, os.path.dirname(PATH))
    spec = importlib.util.spec_from_file_location("bench_autoscale", PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_phases_and_the_concurrency_at_a_time(bench):
    phases = bench.parse_phases("1:10,16:20,1:5")
    assert phases == [(1, 10.0), (16, 20.0), (1, 5.0)]
    assert [bench.concurrency_at(phases, t) for t in (0, 9.9, 10, 29.9, 30, 34.9, 35)] == [1, 1, 16, 16, 1, 1, 0]
    for bad in ("0:10", "4:0", "x"):
        with pytest.raises(ValueError):
            bench.parse_phases(bad)


def test_each_resize_is_counted_once_from_the_samples(bench):
    grow = {"resized": True, "time": 5.0, "workers_before": 1, "workers": 3}
    shrink = {"resized": True, "time": 9.0, "workers_before": 3, "workers": 1}
    samples = [{"last_resize": None}, {"last_resize": grow}, {"last_resize": grow},
               {"last_resize": {"resized": False, "time": 7.0}}, {"last_resize": shrink}]
    assert bench.resizes_seen(samples) == [grow, shrink]


def test_help_runs():
    root = os.path.join(os.path.dirname(PATH), "..")  # raymoe importable without an install
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    result = subprocess.run([sys.executable, PATH, "--help"], capture_output=True, text=True, timeout=60, env=env)
    assert result.returncode == 0 and "--phases" in result.stdout


def test_itl_series_bins_each_gap_where_it_ends(bench):
    # origin 100, 5 s bins. a: gaps of 10 ms (ends in bin 0), 5990 ms and 40 ms (bin 1);
    # b: 20 ms (bin 1); b's last event carries no token, so it makes no gap
    a = {"events": [(100.0, [1]), (100.01, [2]), (106.0, [3]), (106.04, [4])]}
    b = {"events": [(105.5, [1]), (105.52, [2]), (105.6, [])]}
    times, p50, p90 = bench.itl_series([a, b], origin=100.0)
    assert times == [2.5, 7.5]
    assert p50 == pytest.approx([10.0, 40.0])  # bin 1: [20, 40, 5990]
    assert p90 == pytest.approx([10.0, 40.0])  # the element at 0.9 * (n - 1), rounded down


def test_resizes_are_read_per_pool(bench):
    router = {"resized": True, "time": 6.0, "routers_before": 1, "routers": 2}
    samples = [{"last_resize": None, "last_router_resize": router}, {"last_router_resize": router}]
    assert bench.resizes_seen(samples, "last_router_resize") == [router]
    assert bench.resizes_seen(samples) == []
