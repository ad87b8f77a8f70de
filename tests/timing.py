"""Margins for "fails within its deadline" asserts, scaled to how busy this machine is.

A deadline test asserts a lower bound exactly (the error must not come before the deadline)
and an upper bound with a margin: the waiting thread must still get a core to notice the
deadline and raise. On a few shared cores that takes longer the more runnable processes
there are, so the margin grows with the load per core and with the measured lateness of a
short sleep, instead of being a constant tuned on one machine.
"""

from __future__ import annotations

import os
import time


def busy_factor() -> float:
    """Runnable processes per core over the last minute (at least 1)."""
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):  # no load average on this platform
        return 1.0
    return max(1.0, load / (os.cpu_count() or 1))


def scheduling_delay_s(samples: int = 20) -> float:
    """The worst lateness of a 1 ms sleep: how long a runnable thread waits for a core now."""
    worst = 0.0
    for _ in range(samples):
        started = time.perf_counter()
        time.sleep(0.001)
        worst = max(worst, time.perf_counter() - started - 0.001)
    return worst


def deadline_margin_s(base_s: float) -> float:
    """``base_s`` (the margin on an idle machine) scaled by the load, plus 10 measured
    scheduling delays. Call it when asserting, so it sees the load the test ran under."""
    return base_s * busy_factor() + 10 * scheduling_delay_s()
