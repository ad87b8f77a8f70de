"""The expert-parallel exchange of one MoE layer, both sides in one place.

Legend: T tokens, k experts per token, D hidden, W workers, N_w rows for worker w,
S slots per worker. Group layout: rank 0 is the router, rank ``1 + w`` is worker ``w``.

Per MoE layer, router and workers make the same four collectives in the same order with the
same tags (otherwise they would hang; every collective has a deadline that turns a hang into
a ``CollectiveTimeout`` naming the peer and the layer):

1. counts:   router -> workers, rows per worker (workers send zeros);
2. dispatch: router -> workers, one row per (token, destination worker): DeepEP's dedup;
3. meta:     router -> workers, per row its k (local slot, weight) pairs, slot -1 = none;
4. combine:  workers -> router, per row the weighted sum of its experts' outputs.

The router then adds the partial sums back per token. Nothing here imports Ray.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from raymoe.engine.experts import run_worker_slots, scatter_rows_add
from raymoe.kernels.comm.base import Communicator
from raymoe.moe.plan import DispatchPlan

ROUTER_RANK = 0


@dataclass(frozen=True)
class LayerTraffic:
    """What one layer's exchange moved, as the router saw it."""

    rows_per_worker: list[int]
    payload_bytes: int  # dispatch rows (each combine moves the same again)
    meta_bytes: int
    dispatch_s: float
    combine_s: float


def build_meta(plan: DispatchPlan, top_k: int) -> torch.Tensor:
    """``[N, 2k]`` float32 per sent row: k local slots (-1 padded), then k weights."""
    num_rows = plan.send_token.numel()
    meta = torch.zeros(num_rows, 2 * top_k, dtype=torch.float32)
    meta[:, :top_k] = -1.0
    if plan.assign_row.numel():
        # Position of each assignment among its row's (a row holds <= k assignments).
        order = torch.argsort(plan.assign_row, stable=True)
        rows_sorted = plan.assign_row[order]
        first = torch.searchsorted(rows_sorted, rows_sorted)
        position = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel()) - first)
        local_slot = torch.remainder(plan.assign_slot, plan.slots_per_worker).float()
        meta[plan.assign_row, position] = local_slot
        meta[plan.assign_row, top_k + position] = plan.assign_weight
    return meta


def router_exchange(
    comm: Communicator, plan: DispatchPlan, hidden: torch.Tensor, top_k: int, layer: int,
    participants: list[int] | None = None,
) -> tuple[torch.Tensor, LayerTraffic]:
    """The router's side: send rows and meta, receive partial sums; returns ``[T, D]``.

    ``participants``: the workers in the group, worker ``participants[i]`` at rank ``1 + i``
    (all workers when None). A worker outside the group must have no rows in ``plan``.
    """
    world = comm.world_size
    started = time.perf_counter()
    if participants is None:
        participants = list(range(plan.num_workers))
    outside = [w for w in range(plan.num_workers) if w not in participants and int(plan.send_counts[w])]
    if outside:
        raise ValueError(f"layer {layer}: the plan sends rows to workers {outside}, which are not in the group")
    send_counts = torch.cat([torch.zeros(1, dtype=torch.int64), plan.send_counts[participants]])  # [1 + |group|]
    comm.exchange_counts(send_counts, tag=f"layer {layer} counts")
    zeros = [0] * world
    counts = send_counts.tolist()
    rows = hidden.index_select(0, plan.send_token.to(hidden.device))  # [N, D]
    comm.exchange_payload(rows, counts, zeros, tag=f"layer {layer} dispatch")
    meta = build_meta(plan, top_k).to(hidden.device)
    comm.exchange_payload(meta, counts, zeros, tag=f"layer {layer} meta")
    dispatched = time.perf_counter()
    partial = comm.exchange_payload(hidden.new_empty(0, hidden.shape[1]), zeros, counts,
                                    tag=f"layer {layer} combine")  # [N, D]
    out = scatter_rows_add(hidden.shape[0], plan.send_token.to(hidden.device), partial)
    finished = time.perf_counter()
    traffic = LayerTraffic(
        rows_per_worker=plan.send_counts.tolist(),
        payload_bytes=rows.numel() * rows.element_size(),
        meta_bytes=meta.numel() * meta.element_size(),
        dispatch_s=dispatched - started,
        combine_s=finished - dispatched,
    )
    return out, traffic


@dataclass(frozen=True)
class WorkerLayerResult:
    rows: int
    assignments: int
    compute_s: float


def worker_exchange(
    comm: Communicator, w13: torch.Tensor, w2: torch.Tensor, slot_rows: list[int], hidden_size: int, top_k: int,
    dtype: torch.dtype, device: torch.device, layer: int,
) -> WorkerLayerResult:
    """A worker's side of one layer: receive rows and meta, run its slots, send sums back."""
    world = comm.world_size
    zeros = [0] * world
    recv_counts = comm.exchange_counts(torch.zeros(world, dtype=torch.int64), tag=f"layer {layer} counts").tolist()
    rows = comm.exchange_payload(torch.empty(0, hidden_size, dtype=dtype, device=device), zeros, recv_counts,
                                 tag=f"layer {layer} dispatch")  # [N, D]
    meta = comm.exchange_payload(torch.empty(0, 2 * top_k, dtype=torch.float32, device=device), zeros,
                                 recv_counts, tag=f"layer {layer} meta")  # [N, 2k]
    started = time.perf_counter()
    slots = meta[:, :top_k].long()  # [N, k]
    valid = slots >= 0
    row_index = torch.arange(rows.shape[0], device=device).unsqueeze(1).expand_as(slots)[valid]
    local_slot = slots[valid]
    weight = meta[:, top_k:][valid]
    order = torch.argsort(local_slot, stable=True)
    slot_counts = torch.bincount(local_slot, minlength=len(slot_rows)).cpu()
    partial = run_worker_slots(rows, row_index[order], weight[order], slot_counts, w13, w2, slot_rows)
    compute_s = time.perf_counter() - started
    send_counts = [0] * world
    send_counts[ROUTER_RANK] = rows.shape[0]
    comm.exchange_payload(partial, send_counts, zeros, tag=f"layer {layer} combine")
    return WorkerLayerResult(rows=rows.shape[0], assignments=int(valid.sum()), compute_s=compute_s)
