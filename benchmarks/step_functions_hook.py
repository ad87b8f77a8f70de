"""Thread-CPU timers around the functions of a decode step, for benchmarks/bench_step_functions.py.

``install()`` wraps each function in ``FUNCTIONS`` (inclusive times: a function's figure holds
what it calls) and, where ``$RAYMOE_STEP_FUNCTIONS_DIR`` is set, writes the running totals to
``<dir>/<pid>.json`` every ``DUMP_EVERY`` engine steps. With
``$RAYMOE_STEP_FUNCTIONS_PYTHON_LAYERS=1`` a router plans each MoE layer in Python around the
exchange instead of the one native call (``RemoteExperts.one_call_layers``). Used two ways: imported and installed in
the benchmark's own process (the in-process engine), and as Ray's ``worker_process_setup_hook``
in every actor process (the served router). Nothing in raymoe imports it.
"""

from __future__ import annotations

import importlib
import os

from served_phases_hook import thread_timed, write_totals

DUMP_EVERY = 32
FUNCTIONS = [  # module: qualified name (a function of the module or a method of one of its classes)
    ("raymoe.actors.router", "Router._group_step"),
    ("raymoe.actors.router", "Router._deliver"),
    ("raymoe.engine.engine", "LLMEngine.step"),
    ("raymoe.engine.engine", "LLMEngine._inputs"),
    ("raymoe.engine.engine", "LLMEngine._postprocess"),
    ("raymoe.engine.engine", "sample"),
    ("raymoe.engine.model", "MoEModel.forward"),
    ("raymoe.engine.model", "MoEModel._gqa"),
    ("raymoe.kernels.attention_block", "attention_block"),
    ("raymoe.engine.model", "MoEModel._route"),
    ("raymoe.engine.model", "MoEModel.logits"),
    ("raymoe.engine.experts", "LocalExperts.forward"),
    ("raymoe.engine.exchange.remote_experts", "RemoteExperts._send"),
    ("raymoe.engine.exchange.remote_experts", "RemoteExperts._receive"),
    ("raymoe.engine.exchange.remote_experts", "RemoteExperts._plan_native"),
    ("raymoe.engine.exchange.remote_experts", "RemoteExperts.complete_step"),
    ("raymoe.engine.exchange.remote_experts", "RemoteExperts._moe_layer"),
    ("raymoe.engine.exchange.native_sides", "NativeRouterExchange.moe_layer"),
    ("raymoe.engine.exchange.sides", "RouterExchange.exchange"),
    ("raymoe.engine.exchange.sides", "RouterExchange._prepare"),
    ("raymoe.engine.exchange.sides", "RouterExchange._combine"),
    ("raymoe.engine.exchange.sides", "RouterExchange.read_trailers"),
    ("raymoe.engine.exchange.native_sides", "NativeRouterExchange._transfer_layer"),
    ("raymoe.engine.telemetry", "Telemetry.end_step"),
    ("raymoe.engine.scheduler", "Scheduler.schedule"),
    ("raymoe.kernels.attention", "SdpaAttention.plan"),
    # an expert worker's serving thread (its step: one receive_headers of a step's first layer)
    ("raymoe.engine.exchange.native_sides", "NativeWorkerExchange.receive_headers"),
    ("raymoe.engine.exchange.native_sides", "NativeWorkerExchange.serve_layer"),
    ("raymoe.kernels.native_exchange", "worker_layer"),
]
STEPS = ("LLMEngine.step", "NativeWorkerExchange.receive_headers")  # a step is counted when one returns
totals: dict[str, float] = {}
steps = [0]


def _record(name: str, seconds: float) -> None:
    totals[name] = totals.get(name, 0.0) + seconds
    if name in STEPS:
        steps[0] += 1
        directory = os.environ.get("RAYMOE_STEP_FUNCTIONS_DIR")
        if directory and steps[0] % DUMP_EVERY == 0:
            write_totals(directory, steps[0], totals)


def install() -> None:
    if os.environ.get("RAYMOE_STEP_FUNCTIONS_PYTHON_LAYERS") == "1":  # the router's Python plan around the exchange
        from raymoe.engine.exchange.remote_experts import RemoteExperts

        RemoteExperts.one_call_layers = False
    for module_name, qualified in FUNCTIONS:
        module = importlib.import_module(module_name)
        *owners, attribute = qualified.split(".")
        owner = module
        for name in owners:
            owner = getattr(owner, name)
        # (a module function, e.g. engine.sample, is called by its global name: replacing the
        # module's attribute is what its callers in that module see)
        setattr(owner, attribute, thread_timed(getattr(owner, attribute),
                                               lambda seconds, name=qualified: _record(name, seconds)))


def reset() -> None:
    totals.clear()
    steps[0] = 0
