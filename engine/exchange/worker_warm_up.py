"""A worker's experts run once before it joins its group (issue 34, item 5): the worker side of
the exchange, warmed through the calls serving makes."""

from __future__ import annotations

import time
from concurrent.futures import Executor

import torch

from raymoe.engine.experts import run_rows
from raymoe.kernels import native_cpu
from raymoe.kernels.comm.wire import RowFormat


def warm_up_experts(w13s: list[torch.Tensor], w2s: list[torch.Tensor], top_k: int,
                    executor: Executor | None = None) -> list[dict]:
    """Run a worker's experts once, every layer, before it joins its group (issue 34, item 5), so
    that first-call costs are paid here and not inside the group's first step, under the workers'
    deadline: per shape, cuBLAS and ``torch._grouped_mm`` set-up on a GPU, oneDNN's primitives;
    per layer, the native kernels' packed weights (kernels/weight_cache.py keeps one layout per
    stack). One row per pool row (every expert of the pool runs once, at the row's position 0;
    the other positions run nowhere), through the calls serving makes: :func:`run_rows` (the
    grouped SwiGLU) and, where the native kernels take the experts (float32 CPU),
    ``raymoe_run_rows`` on the wire's packed rows too. On a GPU the device is synchronised at the
    end, so the work has really run. Returns one record per distinct shape (``shape``,
    ``dtype``, ``layers``, ``seconds``)."""
    records: dict[tuple, dict] = {}
    with torch.inference_mode():
        for w13, w2 in zip(w13s, w2s):
            started = time.perf_counter()
            pool, hidden, device = w13.shape[0], w13.shape[2], w13.device
            rows = torch.zeros(pool, hidden, dtype=w13.dtype, device=device)
            row_pool = torch.full((pool, top_k), -1, dtype=torch.int64, device=device)
            row_pool[:, 0] = torch.arange(pool, device=device)
            weights = torch.zeros(pool, top_k, dtype=torch.float32, device=device)
            weights[:, 0] = 1.0
            run_rows(rows, row_pool, weights, w13, w2, [1] * pool, executor)
            if native_cpu.experts_apply(rows, w13, w2):
                payload = RowFormat(hidden, top_k, w13.dtype).pack(rows, row_pool.to(torch.int32), weights)
                native_cpu.run_rows(payload, top_k, torch.arange(pool).view(1, -1), [pool], w13, w2, pool)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            key = (tuple(w13.shape), tuple(w2.shape), w13.dtype, device)
            record = records.setdefault(key, {"shape": [list(w13.shape), list(w2.shape)],
                                              "dtype": str(w13.dtype).replace("torch.", ""), "layers": 0,
                                              "seconds": 0.0})
            record["layers"] += 1
            record["seconds"] += time.perf_counter() - started
    return list(records.values())
