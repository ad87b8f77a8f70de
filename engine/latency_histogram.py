"""A cumulative histogram of durations in Prometheus' bucket layout, as plain Python.

The engine counts here (no prometheus_client in the engine); the ingress reads a snapshot at
each scrape and exposes it as a histogram family. Cumulative since start, so any number of
scrapers (ingress replicas) see the same series, and the routers' snapshots add up.
"""

from __future__ import annotations

from bisect import bisect_left
from typing import Any

# Upper bounds (seconds) shared by every latency histogram of /metrics.
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class LatencyHistogram:
    def __init__(self, bounds: tuple[float, ...] = LATENCY_BUCKETS):
        if list(bounds) != sorted(set(bounds)):
            raise ValueError(f"histogram bounds must be strictly increasing, got {bounds}")
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)  # counts[i]: bounds[i-1] < value <= bounds[i]; last: +Inf
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value

    def snapshot(self) -> dict[str, Any]:
        """``{"bounds", "counts", "sum"}``: per-bucket (not cumulative) counts, copied."""
        return {"bounds": list(self.bounds), "counts": list(self.counts), "sum": self.sum}
