"""The dispatch plan: the ledger of (token, logical expert, physical slot, worker, weight).

Legend: T tokens, k experts per token, E logical experts, A kept assignments, P physical slots,
W workers, N rows sent (unique (worker, token) pairs), D hidden size, Rc the largest replica
count of any expert.

The plan is pure data computed by the router from the gate's output and one layer of the
:class:`~raymoe.moe.placement.PlacementTable`; executing it is someone else's job:

1. choose a physical slot for every kept assignment: the i-th assignment of expert e in
   token order goes to replica ``i % replicas(e)`` (deterministic, spreads tokens evenly);
2. sort kept assignments by slot (so by worker, then by the worker's local slot);
3. dedup: each token is sent once per destination worker (DeepEP's normal-mode dedup),
   rows grouped by worker in ascending token order;
4. each worker runs its slots over the rows it received (``assign_row``), scales by
   ``assign_weight`` and sums per received row, so the combine also moves one row per
   (worker, token); the router adds the partial sums back per token (``send_token``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DispatchPlan:
    """One MoE layer's ledger for one batch. All tensors are int64 unless noted."""

    num_tokens: int
    num_workers: int
    slots_per_worker: int
    slot: torch.Tensor  # [T, k] physical slot of each assignment, -1 where dropped
    assign_slot: torch.Tensor  # [A] slot of each kept assignment, ascending
    assign_token: torch.Tensor  # [A] token of each kept assignment
    assign_flat: torch.Tensor  # [A] token * k + position of each kept assignment (its place in [T, k])
    assign_weight: torch.Tensor  # [A] float32 combine weight
    assign_row: torch.Tensor  # [A] row in the send buffer holding its token
    slot_counts: torch.Tensor  # [P] kept assignments per slot
    send_token: torch.Tensor  # [N] token of each sent row, grouped by worker
    send_counts: torch.Tensor  # [W] rows sent to each worker
    num_dropped: int

    @property
    def worker_assign_counts(self) -> torch.Tensor:
        """``[W]`` kept assignments per worker."""
        return self.slot_counts.view(self.num_workers, self.slots_per_worker).sum(dim=1)

    def send_offsets(self) -> torch.Tensor:
        """``[W + 1]`` start of each worker's rows in the send buffer."""
        return torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(self.send_counts, 0)])

    def assign_offsets(self) -> torch.Tensor:
        """``[W + 1]`` start of each worker's assignments in the ``assign_*`` arrays."""
        return torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(self.worker_assign_counts, 0)])


def plan_dispatch(
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    kept: torch.Tensor,
    log2phy: torch.Tensor,
    logcnt: torch.Tensor,
    slots_per_worker: int,
    num_slots: int,
) -> DispatchPlan:
    """Plan one layer's dispatch.

    Args:
        topk_ids: ``[T, k]`` logical experts; ``topk_weights``: ``[T, k]``.
        kept: ``[T, k]`` bool, the assignments that survived capacity.
        log2phy: ``[E, Rc]`` slots of each logical expert (-1 padded); ``logcnt: [E]``.
    """
    num_tokens, top_k = topk_ids.shape
    num_workers = num_slots // slots_per_worker
    flat_expert = topk_ids.reshape(-1)  # [T*k], token-major
    flat_kept = kept.reshape(-1)
    # Step 1: replica choice by the assignment's rank among its expert's kept assignments.
    counts = torch.bincount(flat_expert[flat_kept], minlength=log2phy.shape[0])
    num_dropped = int(flat_kept.numel() - counts.sum())
    if log2phy.shape[1] == 1:  # no expert is replicated: its only slot
        flat_slot = torch.where(flat_kept, log2phy[flat_expert, 0], -1)  # [T*k]
    else:
        order = torch.argsort(torch.where(flat_kept, flat_expert, -1), stable=True)
        starts = torch.cumsum(counts, 0) - counts
        rank_sorted = torch.arange(order.numel()) - num_dropped - starts[flat_expert[order]]
        rank = torch.empty_like(rank_sorted).scatter_(0, order, rank_sorted)
        replica = torch.remainder(rank, logcnt[flat_expert])
        flat_slot = torch.where(flat_kept, log2phy[flat_expert, replica], -1)  # [T*k]
    # Step 2: kept assignments sorted by slot; ties keep token order.
    kept_index = torch.nonzero(flat_kept).squeeze(1)
    by_slot = kept_index[torch.argsort(flat_slot[kept_index], stable=True)]  # [A]
    assign_slot = flat_slot[by_slot]
    assign_token = torch.div(by_slot, top_k, rounding_mode="floor")
    assign_weight = topk_weights.reshape(-1)[by_slot].float()
    slot_counts = torch.bincount(assign_slot, minlength=num_slots)
    # Step 3: dedup to unique (worker, token) rows, ordered by worker then token.
    if num_workers == 1 and num_dropped == 0:  # one worker sees every token once, in order
        send_token = torch.arange(num_tokens)
        assign_row = assign_token
        send_counts = torch.tensor([num_tokens])
    else:
        assign_worker = torch.div(assign_slot, slots_per_worker, rounding_mode="floor")
        key = assign_worker * num_tokens + assign_token
        unique_key, assign_row = torch.unique(key, sorted=True, return_inverse=True)
        send_token = torch.remainder(unique_key, num_tokens) if num_tokens else unique_key
        send_worker = torch.div(unique_key, max(num_tokens, 1), rounding_mode="floor")
        send_counts = torch.bincount(send_worker, minlength=num_workers)
    return DispatchPlan(
        num_tokens=num_tokens,
        num_workers=num_workers,
        slots_per_worker=slots_per_worker,
        slot=flat_slot.view(num_tokens, top_k),
        assign_slot=assign_slot,
        assign_token=assign_token,
        assign_flat=by_slot,
        assign_weight=assign_weight,
        assign_row=assign_row,
        slot_counts=slot_counts,
        send_token=send_token,
        send_counts=send_counts,
        num_dropped=num_dropped,
    )
