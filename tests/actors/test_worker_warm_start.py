"""A worker runs its experts once per layer shape before it can join the group (issue 34, item 5);
runs on any machine.

The first call of an expert kernel pays one-time costs (the native library's packed weights,
oneDNN's primitives; cuBLAS and ``torch._grouped_mm`` set-up on a GPU). Inside the group's first
step that cost lands under every worker's deadline, so the worker's constructor runs
``engine/exchange/worker_warm_up.py::warm_up_experts`` (one row per pool row through the serving calls) before
``join`` can be called. These tests check the order (warm-up, then join), that every expert of
every layer ran once (the native kernels' packed weights are per layer), and that the warm-up
leaves the weights and the outputs alone.
"""

from __future__ import annotations

import pytest
import torch

import raymoe.actors.expert_worker as worker_module
import raymoe.engine.experts as experts_module
from raymoe.actors.expert_worker import ExpertWorker
from raymoe.engine.experts import run_rows
from raymoe.engine.exchange import worker_warm_up as warm_up_module
from raymoe.engine.exchange.worker_warm_up import warm_up_experts
from raymoe.kernels.comm import CommBackend, new_rendezvous
from ep_helpers import record_warm_up_then_join, single_worker_placement


def test_the_experts_warm_up_in_the_constructor_before_any_join(tiny_mixtral_dir, monkeypatch):
    events = record_warm_up_then_join(monkeypatch, worker_module, "warm_up_experts")
    monkeypatch.setattr(worker_module.ray.util, "get_node_ip_address", lambda: "127.0.0.1")
    worker = ExpertWorker(0, tiny_mixtral_dir, "float32", "cpu", single_worker_placement(tiny_mixtral_dir))
    assert events == ["warm-up"]
    assert worker.exchange is None  # not in any group yet
    # the tiny model's MoE layers share one shape: one record, every layer run
    assert len(worker.warm_up) == 1 and worker.warm_up[0]["layers"] == len(worker.w13)
    assert worker.warm_up[0]["shape"] == [list(worker.w13[0].shape), list(worker.w2[0].shape)]
    assert worker.warm_up[0]["seconds"] > 0
    with pytest.raises(RuntimeError, match="stop here"):
        worker.join("gloo", new_rendezvous(CommBackend.GLOO, host="127.0.0.1"), 1, 1, [0], 10.0)
    assert events == ["warm-up", "join"]
    worker.shutdown()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_warm_up_runs_every_expert_of_every_layer_once_and_changes_nothing(monkeypatch, dtype):
    torch.manual_seed(0)
    pool, hidden, intermediate, top_k = 4, 64, 32, 2
    w13 = [torch.randn(pool, 2 * intermediate, hidden, dtype=dtype) * 0.1 for _ in range(3)]
    w2 = [torch.randn(pool, hidden, intermediate, dtype=dtype) * 0.1 for _ in range(3)]
    w13.append(torch.randn(pool + 1, 2 * intermediate, hidden, dtype=dtype) * 0.1)  # a second shape (spare row)
    w2.append(torch.randn(pool + 1, hidden, intermediate, dtype=dtype) * 0.1)
    before = [t.clone() for t in w13 + w2]
    rows = torch.randn(5, hidden, dtype=dtype)
    row_pool = torch.tensor([[0, 1], [2, -1], [3, 0], [1, 2], [-1, 3]])
    row_weights = torch.rand(5, top_k)
    pool_counts = [int((row_pool == p).sum()) for p in range(pool)]
    expected = run_rows(rows, row_pool, row_weights, w13[0], w2[0], pool_counts)[0]
    calls = []
    real_run_rows = experts_module.run_rows

    def recorded(rows_, row_pool_, weights_, w13_, w2_, pool_counts_, executor=None):
        calls.append((w13_.shape[0], pool_counts_, row_pool_[:, 0].tolist()))
        return real_run_rows(rows_, row_pool_, weights_, w13_, w2_, pool_counts_, executor)

    monkeypatch.setattr(warm_up_module, "run_rows", recorded)
    report = warm_up_experts(w13, w2, top_k)
    assert [(entry["shape"][0][0], entry["layers"]) for entry in report] == [(pool, 3), (pool + 1, 1)]
    assert all(entry["dtype"] == str(dtype).replace("torch.", "") for entry in report)
    assert calls == [(pool, [1] * pool, list(range(pool)))] * 3 + [(pool + 1, [1] * (pool + 1), list(range(pool + 1)))]
    assert all(torch.equal(a, b) for a, b in zip(before, w13 + w2))
    assert torch.equal(run_rows(rows, row_pool, row_weights, w13[0], w2[0], pool_counts)[0], expected)
