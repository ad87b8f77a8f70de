"""Pinning a CPU actor's compute thread to one core, so that a router and a worker share one.

A router and the workers of its group compute one after the other (dense part, then
experts, then dense part again, four times a step here), so a core can host a router's step
thread and a worker's serving thread without taking any parallelism away. What sharing buys
is the hand-off: waking a thread that sleeps on the same core costs a few microseconds,
waking one on another core costs an inter-processor interrupt, which on a virtual machine
is far dearer, and dearer still when the host is busy (measured on this 2-vCPU guest, a
round trip between two processes: 6 us on one core vs 65-76 us across two at a quiet moment,
38 us vs 1,549 us at a busy one; benchmarks/bench_cpu_floor.py (5)). Router ``r`` takes the
``r``-th core its process may use, worker ``w`` the ``w``-th (modulo their number), so one
router and one worker share core 0, and with more routers and workers both kinds spread over
the cores alike.

Only the calling thread is pinned: Ray's own threads, a router's token streams and the HTTP
ingress keep every core. Used only where the actor computes on one thread (a second
intra-op thread created by a pinned thread would inherit its single core).
"""

from __future__ import annotations

import os


def pin_current_thread(index: int | None) -> int | None:
    """Pin the calling thread to the ``index``-th (modulo) core this process may run on;
    returns that core, or None where ``index`` is None (the actor is not pinned) or the
    platform cannot pin threads (then nothing changes)."""
    if index is None or not hasattr(os, "sched_setaffinity"):
        return None
    cores = sorted(os.sched_getaffinity(0))
    core = cores[index % len(cores)]
    try:
        os.sched_setaffinity(0, {core})  # 0: the calling thread on Linux
    except OSError:
        return None
    return core
