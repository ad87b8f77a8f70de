"""Every cyclic-garbage-collector pause inside Ray actor processes, for benchmarks/bench_gc_freeze.py.

Installed as Ray's ``worker_process_setup_hook`` (it runs in every worker process before any
actor is built), it records each collection's generation, duration and wall-clock end through
``gc.callbacks`` and writes them to ``$RAYMOE_GC_PAUSES_DIR/<pid>.json`` every second. Nothing
here is imported by raymoe itself.
"""

from __future__ import annotations

import gc
import json
import os
import threading
import time

_pauses: list[tuple[int, float, float]] = []  # (generation, seconds, time.time() at its end)
_started: list[float] = [0.0]


def _callback(phase: str, info: dict) -> None:
    if phase == "start":
        _started[0] = time.perf_counter()
    else:
        _pauses.append((info["generation"], time.perf_counter() - _started[0], time.time()))


def _dump_every_second(directory: str) -> None:
    path = os.path.join(directory, f"{os.getpid()}.json")
    while True:
        time.sleep(1.0)
        with open(path + ".tmp", "w") as f:
            json.dump({"pid": os.getpid(), "pauses": list(_pauses)}, f)
        os.replace(path + ".tmp", path)


def install() -> None:
    directory = os.environ.get("RAYMOE_GC_PAUSES_DIR")
    if directory:
        gc.callbacks.append(_callback)
        threading.Thread(target=_dump_every_second, args=(directory,), daemon=True).start()
