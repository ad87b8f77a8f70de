"""What an actor built while loading is frozen out of Python's cyclic garbage collector.

A full collection walks every object the collector tracks. A serving process holds ~335,000
of them once torch, transformers and Ray are imported, and a full collection took 170 ms on
the 2-vCPU guest of docs/BENCHMARKS.md: a pause of the router's step loop (every stream it
serves) or of the ingress' event loop, about every 8 s of serving at 32 streams there, for
objects that live as long as the process. ``gc.freeze()`` moves every object alive at that
moment into a permanent generation no collection visits; what serving allocates afterwards is
collected as before (benchmarks/bench_gc_freeze.py measures both).

Frozen objects are still freed by reference counting; only a reference cycle among them
would never be reclaimed, so each actor freezes once, after loading (what loading left
as cyclic garbage is collected first). ``RAYMOE_GC_FREEZE=0`` leaves the collector as Python
set it (for A/B runs).
"""

from __future__ import annotations

import gc
import os

ENV = "RAYMOE_GC_FREEZE"


def enabled() -> bool:
    return os.environ.get(ENV, "1") != "0"


def freeze_loaded_heap() -> int:
    """Collect what loading left as garbage, then freeze everything alive (unless ``ENV`` is 0).
    Returns how many objects are frozen now (0 when switched off)."""
    if not enabled():
        return 0
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
