"""The router's plan of one MoE layer's exchange, in tensor ops on the activations' device.

Legend: T tokens, k experts per token, E logical experts, S slots per worker, W workers,
P = W * S physical slots, D hidden size, N rows sent (unique (worker, token) pairs), Rc the
largest replica count of any expert.

The same rules as :mod:`raymoe.moe.plan` (the reference ledger, tested against plain loops):

1. each kept assignment gets a physical slot: the i-th kept assignment of expert e in token
   order goes to replica ``i % replicas(e)``;
2. each token is sent once per destination worker (DeepEP's dedup): rows grouped by worker,
   tokens ascending within a worker;
3. each row carries, at the token's k positions, the local slot of the expert it must run
   there (-1: none on that worker) and its gate weight, so the worker's sum over a row and
   the router's sum over a token's rows have a fixed order.

Built without host round trips: shapes never depend on data until the one place that must
know sizes, the per-worker row counts, which come to the host once (``send_counts``). Where the
activations live on the CPU, :func:`plan_exchange_on_host` builds the same plan, bit for bit,
in numpy (the router picks by device; tests/moe/test_exchange_plan.py checks both).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class ExchangePlan:
    num_tokens: int
    num_workers: int
    slot: torch.Tensor  # [T, k] physical slot of each assignment, -1 where dropped or unplaced
    send_counts: list[int]  # [W] rows for each worker (host ints: the layer's one sync)
    slot_counts: list[int]  # [P] kept assignments per physical slot (host ints, same sync)
    row_token: torch.Tensor  # [N] token of each row, grouped by worker, ascending within one
    row_slots: torch.Tensor  # [N, k] int32 local slot at each of the token's k positions, or -1
    row_weights: torch.Tensor  # [N, k] float32 gate weight there (0 where row_slots is -1)
    # [N, 4D + 8k] uint8: the rows as they go on the wire (activations, row_slots, row_weights),
    # when the planner packed them too (kernels/native_cpu.py::plan_pack); row_slots and
    # row_weights are then views of it
    packed: torch.Tensor | None = None

    @property
    def num_rows(self) -> int:
        return self.row_token.shape[0]


def choose_slots(topk_ids: torch.Tensor, kept: torch.Tensor | None, log2phy: torch.Tensor,
                 logcnt: torch.Tensor) -> torch.Tensor:
    """``[T, k]`` physical slot of every assignment (-1 where dropped): step 1 of the module doc."""
    flat = topk_ids.reshape(-1)
    if log2phy.shape[1] == 1:  # no expert is replicated: its only slot
        slot = log2phy[flat, 0]
    else:
        num_experts = log2phy.shape[0]
        key = flat if kept is None else torch.where(kept.reshape(-1), flat, num_experts)
        order = torch.argsort(key, stable=True)
        counts = _counts(key, num_experts + 1)
        starts = torch.cumsum(counts, 0) - counts
        rank_sorted = torch.arange(flat.numel(), device=flat.device) - starts[key[order]]
        rank = torch.empty_like(rank_sorted).scatter_(0, order, rank_sorted)
        replica = torch.remainder(rank, logcnt[flat].clamp(min=1))
        slot = log2phy[flat, replica]
    if kept is not None:
        slot = torch.where(kept.reshape(-1), slot, -1)
    return slot.view_as(topk_ids)


def plan_exchange(
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    kept: torch.Tensor | None,
    log2phy: torch.Tensor,
    logcnt: torch.Tensor,
    slots_per_worker: int,
    num_workers: int,
) -> ExchangePlan:
    """Plan one layer. ``kept``: ``[T, k]`` bool from the capacity policy, None when all are kept;
    ``log2phy: [E, Rc]`` and ``logcnt: [E]`` on the device of ``topk_ids``."""
    num_tokens, top_k = topk_ids.shape
    device = topk_ids.device
    slot = choose_slots(topk_ids, kept, log2phy, logcnt)  # [T, k]
    valid = slot >= 0
    worker = torch.div(slot, slots_per_worker, rounding_mode="floor")  # [T, k]
    tokens = torch.arange(num_tokens, device=device).unsqueeze(1)
    # Step 2: a presence matrix [W, T] (+1 sink for dropped assignments); its true entries,
    # in order, are the rows: worker-major, tokens ascending.
    sink = num_workers * num_tokens
    cell = torch.where(valid, worker * num_tokens + tokens, sink).reshape(-1)
    present = torch.zeros(sink + 1, dtype=torch.bool, device=device)
    present[cell] = True
    present = present[:sink]
    num_slots = num_workers * slots_per_worker
    slot_counts = _counts(torch.where(valid, slot, num_slots).reshape(-1), num_slots + 1)
    counts = torch.cat([present.view(num_workers, num_tokens).sum(dim=1), slot_counts[:num_slots]]).tolist()
    send_counts, slot_counts = counts[:num_workers], counts[num_workers:]  # the one host sync, above
    cells = torch.nonzero_static(present, size=sum(send_counts)).squeeze(1)  # [N]
    row_worker = torch.div(cells, max(num_tokens, 1), rounding_mode="floor")
    row_token = cells - row_worker * num_tokens
    # Step 3: each row's k positions, for its worker only.
    mine = worker.index_select(0, row_token) == row_worker.unsqueeze(1)  # [N, k]
    mine &= valid.index_select(0, row_token)
    row_slots = torch.where(mine, torch.remainder(slot.index_select(0, row_token), slots_per_worker), -1)
    row_weights = torch.where(mine, topk_weights.index_select(0, row_token).float(), 0.0)
    return ExchangePlan(num_tokens, num_workers, slot, send_counts, slot_counts, row_token,
                        row_slots.to(torch.int32), row_weights)


def plan_exchange_on_host(
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    kept: torch.Tensor | None,
    log2phy: np.ndarray,
    logcnt: np.ndarray,
    slots_per_worker: int,
    num_workers: int,
) -> ExchangePlan:
    """:func:`plan_exchange` for activations on the CPU, in numpy: the same plan, bit for bit.

    On the CPU the activations' device is the host, so reading the gate's choices costs a view,
    not a sync, and a numpy call on these few hundred integers costs a fraction of a torch call
    (~30 of them per layer): 1.7-2.1x faster at 1-128 tokens and 1-4 workers on the 2-vCPU
    guest of docs/BENCHMARKS.md (benchmarks/bench_exchange_plan.py). One host conversion per
    layer, as on a device: the choices, weights and kept flags come over as one array.
    ``log2phy: [E, Rc]`` and ``logcnt: [E]`` are the placement's own arrays.
    """
    num_tokens, top_k = topk_ids.shape
    columns = [topk_ids, topk_weights.to(torch.float64).view(torch.int64)]
    if kept is not None:
        columns.append(kept.to(torch.int64))
    host = torch.cat(columns, dim=1).numpy()  # [T, 2k or 3k]: the layer's one host conversion
    ids = host[:, :top_k]
    weights = np.ascontiguousarray(host[:, top_k:2 * top_k]).view(np.float64)
    kept_flat = None if kept is None else host[:, 2 * top_k:].reshape(-1) != 0
    flat = ids.reshape(-1)
    if log2phy.shape[1] == 1:  # no expert is replicated: its only slot
        slot = log2phy[flat, 0]
    else:
        num_experts = log2phy.shape[0]
        key = flat if kept_flat is None else np.where(kept_flat, flat, num_experts)
        order = np.argsort(key, kind="stable")
        counts = np.bincount(key, minlength=num_experts + 1)
        starts = np.cumsum(counts) - counts
        rank = np.empty_like(order)
        rank[order] = np.arange(flat.size) - starts[key[order]]
        slot = log2phy[flat, rank % np.maximum(logcnt[flat], 1)]
    if kept_flat is not None:
        slot = np.where(kept_flat, slot, -1)
    slot = slot.reshape(num_tokens, top_k)
    valid = slot >= 0
    if num_workers == 1 and valid.all():  # every assignment runs on the one worker: a row per token, as is
        return ExchangePlan(num_tokens, 1, torch.from_numpy(slot), [num_tokens],
                            np.bincount(slot.reshape(-1), minlength=slots_per_worker).tolist(),
                            torch.arange(num_tokens), torch.from_numpy(slot.astype(np.int32)),
                            torch.from_numpy(weights.astype(np.float32)))
    worker = slot // slots_per_worker  # [T, k]; -1 where not valid
    # Step 2: rows are the true cells of a presence matrix [W, T], worker-major, tokens ascending.
    sink = num_workers * num_tokens
    cell = np.where(valid, worker * num_tokens + np.arange(num_tokens)[:, None], sink)
    present = np.zeros(sink + 1, dtype=bool)
    present[cell.reshape(-1)] = True
    cells = np.flatnonzero(present[:sink])
    row_worker, row_token = np.divmod(cells, max(num_tokens, 1))
    num_slots = num_workers * slots_per_worker
    send_counts = np.bincount(row_worker, minlength=num_workers).tolist()
    slot_counts = np.bincount(slot[valid], minlength=num_slots).tolist()
    # Step 3: each row's k positions, for its worker only.
    row_slot = slot[row_token]  # [N, k]
    mine = (row_slot >= 0) & (row_slot // slots_per_worker == row_worker[:, None])
    row_slots = np.where(mine, row_slot % slots_per_worker, -1).astype(np.int32)
    row_weights = np.where(mine, weights[row_token], 0.0).astype(np.float32)
    return ExchangePlan(num_tokens, num_workers, torch.from_numpy(slot), send_counts, slot_counts,
                        torch.from_numpy(row_token), torch.from_numpy(row_slots), torch.from_numpy(row_weights))


def _counts(values: torch.Tensor, size: int) -> torch.Tensor:
    """``torch.bincount(values, minlength=size)`` for values in ``[0, size)``, without its host
    sync on a GPU (bincount reads the maximum back to size its output): a scatter-add."""
    index = values.reshape(-1).long()
    return torch.zeros(size, dtype=torch.long, device=values.device).scatter_add_(0, index, torch.ones_like(index))
