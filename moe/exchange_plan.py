"""The router's plan of one MoE layer's exchange, in tensor ops on the activations' device.

Legend: T tokens, k experts per token, E logical experts, S slots per worker, W workers,
N rows sent (unique (worker, token) pairs).

The same rules as :mod:`raymoe.moe.plan` (the reference ledger, tested against plain loops):

1. each kept assignment gets a physical slot: the i-th kept assignment of expert e in token
   order goes to replica ``i % replicas(e)``;
2. each token is sent once per destination worker (DeepEP's dedup): rows grouped by worker,
   tokens ascending within a worker;
3. each row carries, at the token's k positions, the local slot of the expert it must run
   there (-1: none on that worker) and its gate weight, so the worker's sum over a row and
   the router's sum over a token's rows have a fixed order.

Built without host round trips: shapes never depend on data until the one place that must
know sizes, the per-worker row counts, which come to the host once (``send_counts``).
"""

from __future__ import annotations

from dataclasses import dataclass

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
        counts = torch.bincount(key, minlength=num_experts + 1)
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
    ``log2phy: [E, R]`` and ``logcnt: [E]`` on the device of ``topk_ids``."""
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
    slot_counts = torch.bincount(torch.where(valid, slot, num_slots).reshape(-1), minlength=num_slots + 1)
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
