"""The exchange's host round trips, counted, over a real gloo group of real Router and
ExpertWorker objects in this process (2 routers x 2 workers, threads instead of actors).

A host conversion (``.item()``, ``.tolist()``, ``.cpu()``, ``.numpy()``, ``int()``,
``float()``, ``bool()`` of a tensor) is a device synchronisation on a GPU. The budget: at
most one per MoE layer on each side (the router's plan counts; the worker's headers), and at
most two per step outside the layers on the router (the combine trailers; telemetry counts).
Counting the calls on the CPU is what makes the budget testable without a GPU: a change that
adds a conversion to the layer path fails here. The same run checks the outputs against the
in-process engine.
"""

from __future__ import annotations

import threading
from collections import defaultdict

import pytest
import torch

from raymoe.actors.expert_worker import ExpertWorker
from raymoe.actors.router import Router
from raymoe.engine.exchange.python_sides import PythonWorkerExchange
from raymoe.engine.engine import EngineConfig, LLMEngine
from raymoe.engine.exchange.remote_experts import RemoteExperts
from raymoe.engine.sampling_params import SamplingParams
from raymoe.kernels.comm import CommBackend, new_rendezvous
from raymoe.moe.initial_placement import initial_placement
from raymoe.engine.hf_config import load_model_config

CONVERSIONS = ("item", "tolist", "cpu", "numpy", "__int__", "__float__", "__bool__")


class ConversionCounter:
    """Counts tensor-to-host conversions per scope entry, on the thread that entered the scope;
    a scope entered inside another counts its own (a worker's layer reads its headers inside)."""

    def __init__(self):
        self.local = threading.local()
        self.counts: dict[str, list[int]] = defaultdict(list)  # scope -> conversions per scope entry
        self.originals = {}
        self.lock = threading.Lock()

    def install(self, monkeypatch):
        for name in CONVERSIONS:
            original = getattr(torch.Tensor, name)
            self.originals[name] = original

            def counted(tensor, *args, _original=original, **kwargs):
                entries = getattr(self.local, "entries", None)
                if entries:
                    scope, index = entries[-1]
                    self.counts[scope][index] += 1
                return _original(tensor, *args, **kwargs)

            monkeypatch.setattr(torch.Tensor, name, counted)

    def scoped(self, scope: str, function):
        def wrapper(*args, **kwargs):
            entries = getattr(self.local, "entries", None)
            if entries is None:
                entries = self.local.entries = []
            if entries and entries[-1][0] == scope:  # a scope calling itself counts once
                return function(*args, **kwargs)
            with self.lock:
                self.counts[scope].append(0)
                entries.append((scope, len(self.counts[scope]) - 1))
            try:
                return function(*args, **kwargs)
            finally:
                entries.pop()
        return wrapper


@pytest.fixture(scope="module")
def in_process_deployment(tiny_mixtral_dir):
    """2 routers and 2 workers over one gloo group on loopback; every object is the real one."""
    config = load_model_config(tiny_mixtral_dir)
    placement = initial_placement(num_layers=len(config.moe_layers), num_experts=config.num_experts, num_workers=2,
                                  strategy="round_robin", redundant_slots_per_worker=1)
    engine_config = EngineConfig(dtype="float32")
    workers = [ExpertWorker(w, tiny_mixtral_dir, "float32", "cpu", placement.to_dict()) for w in range(2)]
    routers = [Router(f"router-{r}", tiny_mixtral_dir, engine_config, placement.to_dict(), workers, "gloo", 20.0,
                      r, 2) for r in range(2)]
    rendezvous = new_rendezvous(CommBackend.GLOO, host="127.0.0.1", group_name="host-sync-test")
    joins = [threading.Thread(target=r.join, args=(rendezvous, 0, [0, 1])) for r in routers]
    joins += [threading.Thread(target=w.join, args=("gloo", rendezvous, 2 + w.worker, 2, [0, 1], 20.0))
              for w in workers]
    for thread in joins:
        thread.start()
    for thread in joins:
        thread.join(timeout=60)
    assert all(w.exchange is not None for w in workers) and all(r.experts.exchange is not None for r in routers)
    yield routers, workers
    for router in routers:
        router.shutdown()
    for worker in workers:
        worker.shutdown()


def test_one_conversion_per_layer_per_side_and_outputs_equal_the_engine(in_process_deployment, tiny_mixtral_dir,
                                                                       monkeypatch):
    routers, workers = in_process_deployment
    counter = ConversionCounter()
    counter.install(monkeypatch)
    monkeypatch.setattr(RemoteExperts, "forward", counter.scoped("router layer", RemoteExperts.forward))
    monkeypatch.setattr(RemoteExperts, "complete_step", counter.scoped("router step end", RemoteExperts.complete_step))
    assert all(type(w.exchange) is PythonWorkerExchange for w in workers)  # gloo: the Python side
    monkeypatch.setattr(PythonWorkerExchange, "receive_headers", counter.scoped("worker headers",
                                                                               PythonWorkerExchange.receive_headers))
    monkeypatch.setattr(PythonWorkerExchange, "serve_layer", counter.scoped("worker rows",
                                                                           PythonWorkerExchange.serve_layer))
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompts = [[5, 9, 11, 40], [7, 7, 3], [100, 20, 30, 40, 50], [8]]
    results = {}

    def run(index: int, router: Router):  # router 1 gets one request: routers step with uneven work
        share = [(f"r{index}-{i}", p, params) for i, p in enumerate(prompts) if i % 4 == 0 or index == 0]
        results[index] = (share, router.generate(share))

    threads = [threading.Thread(target=run, args=(i, r)) for i, r in enumerate(routers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    reference = LLMEngine.from_pretrained(tiny_mixtral_dir, EngineConfig(dtype="float32"))
    for share, outputs in results.values():
        expected = reference.generate([p for _, p, _ in share], params)
        assert [o.output_token_ids for o in outputs] == [e.output_token_ids for e in expected]
    layers = counter.counts["router layer"]
    assert len(layers) >= 8 * 2  # >= 8 steps with tokens, 2 MoE layers each
    assert max(layers) <= 1, f"router conversions per MoE layer: {sorted(set(layers))}"
    assert max(counter.counts["router step end"]) <= 2
    # A worker's layer: its headers (the one conversion; read inside serve_layer after the
    # step's first layer), then the rows (none at all).
    served = counter.counts["worker rows"]
    assert len(served) >= 2 * 8 * 2  # both workers served every layer of every step
    assert max(served) == 0, f"worker conversions while serving rows: {sorted(set(served))}"
    assert max(counter.counts["worker headers"]) <= 1
