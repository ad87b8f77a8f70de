"""Per-phase CPU accounting inside Ray actor processes, for benchmarks/bench_served_phases.py.

Installed as Ray's ``worker_process_setup_hook`` (it runs in every worker process before any
actor is built), it wraps a few raymoe functions with thread-CPU timers and writes the running
totals to ``$RAYMOE_PHASES_DIR/<pid>.json`` every ``DUMP_EVERY`` router steps. Nothing here is
imported by raymoe itself: the serving code carries no timers of its own beyond its telemetry.

Phases (each inclusive of what it calls; the benchmark derives the exclusive parts):
- router: ``group_step`` (Router._group_step: one step of the step thread, engine and
  exchange), ``engine_step`` (LLMEngine.step), ``forward`` (MoEModel.forward inside it),
  ``sample`` and ``postprocess`` (sampling, and each sequence's bookkeeping after it), ``plan`` (the exchange plan; with the native kernels it packs the rows too), ``exchange``
  (RouterExchange.exchange: pack, send, receive, combine), ``record`` (telemetry per layer),
  ``loop`` (the step thread's CPU between two group steps: delivery, inbox).
- worker: ``headers`` (WorkerExchange.receive_headers), ``serve`` (WorkerExchange.serve_layer),
  ``experts`` (run_rows inside it, or the native kernels' one call for it; where the whole layer
  is one native call (kernels/csrc/cpu_exchange.c), the experts' wall time it reports).
"""

from __future__ import annotations

import functools
import json
import os
import threading
import time

DUMP_EVERY = 8
_totals: dict[str, float] = {}
_lock = threading.Lock()
_state = {"steps": 0, "last_exit": None}


def _add(name: str, seconds: float) -> None:
    with _lock:
        _totals[name] = _totals.get(name, 0.0) + seconds


def thread_timed(function, record):
    """``function`` wrapped: after each call, ``record(seconds)`` with the thread-CPU time it took
    (what it calls included). Also benchmarks/step_functions_hook.py's."""
    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        started = time.thread_time()
        try:
            return function(*args, **kwargs)
        finally:
            record(time.thread_time() - started)
    return wrapper


def write_totals(directory: str, steps: int, seconds: dict[str, float]) -> None:
    """``<directory>/<pid>.json``: this process's step count and totals, replaced whole (a reader
    never sees half a file; bench_served_phases.py::read_phases reads them)."""
    path = os.path.join(directory, f"{os.getpid()}.json")
    with open(path + ".tmp", "w") as f:
        json.dump({"pid": os.getpid(), "steps": steps, "seconds": seconds}, f)
    os.replace(path + ".tmp", path)


def _timed(name: str, function):
    return thread_timed(function, lambda seconds: _add(name, seconds))


def _dump() -> None:
    directory = os.environ.get("RAYMOE_PHASES_DIR")
    if not directory:
        return
    with _lock:
        steps, seconds = _state["steps"], dict(_totals)
    write_totals(directory, steps, seconds)


def _count_step() -> None:
    """One more step of this process; the totals go to disk every ``DUMP_EVERY``."""
    _state["steps"] += 1
    if _state["steps"] % DUMP_EVERY == 0:
        _dump()


def _group_step(function):
    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        entered = time.thread_time()
        if _state["last_exit"] is not None:
            _add("loop", entered - _state["last_exit"])
        try:
            return function(*args, **kwargs)
        finally:
            left = time.thread_time()
            _add("group_step", left - entered)
            _state["last_exit"] = left
            _count_step()
    return wrapper


def install() -> None:
    from raymoe.actors import router
    from raymoe.engine import engine, model
    from raymoe.engine.exchange import native_sides, python_sides, remote_experts, sides
    from raymoe.kernels import native_cpu

    router.Router._group_step = _group_step(router.Router._group_step)
    engine.LLMEngine.step = _timed("engine_step", engine.LLMEngine.step)
    # inside the engine step: the model's forward (the MoE layers' plan and exchange included),
    # sampling and each sequence's bookkeeping; the rest of the step is the scheduler and inputs
    model.MoEModel.forward = _timed("forward", model.MoEModel.forward)
    engine.sample = _timed("sample", engine.sample)
    engine.LLMEngine._postprocess = _timed("postprocess", engine.LLMEngine._postprocess)
    remote_experts.plan_exchange = _timed("plan", remote_experts.plan_exchange)
    remote_experts.plan_exchange_on_host = _timed("plan", remote_experts.plan_exchange_on_host)
    native_cpu.plan_pack = _timed("plan", native_cpu.plan_pack)  # (the native plan packs the rows too)
    remote_experts.RemoteExperts._record = _timed("record", remote_experts.RemoteExperts._record)
    sides.RouterExchange.exchange = _timed("exchange", sides.RouterExchange.exchange)  # (both sides' template)
    python_sides.run_rows = _timed("experts", python_sides.run_rows)
    python_sides.native_run_rows = _timed("experts", python_sides.native_run_rows)  # the native kernels' one call
    for side in (python_sides.PythonWorkerExchange, native_sides.NativeWorkerExchange):
        side.receive_headers = _timed("headers", side.receive_headers)
        side.serve_layer = _counted_serve_layer(_timed("serve", side.serve_layer),
                                                native=side is native_sides.NativeWorkerExchange)


def _counted_serve_layer(serve_layer, native: bool):
    def counted_serve_layer(self, layer, *args, **kwargs):  # a worker counts a step at its first layer
        result = serve_layer(self, layer, *args, **kwargs)
        if native:  # the layer in one native call: its experts' time comes back in the result
            _add("experts", result.compute_s)
        if layer == 0:
            _count_step()
        return result

    return counted_serve_layer
