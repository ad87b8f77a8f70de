"""How the model reaches its routed experts: one small interface, local and remote backends.

Legend: T tokens, k experts per token, D hidden, A assignments, N received rows.

The model hands each MoE layer's gate output to an :class:`ExpertBackend` and gets back the
routed experts' combined output. :class:`LocalExperts` holds every expert in this process
(the in-process engine, the reference); the distributed engine's remote backend plans the
same way, sends rows to expert workers, and those workers call :func:`run_worker_slots`.
"""

from __future__ import annotations

from concurrent.futures import Executor
from typing import Protocol

import torch

from raymoe.kernels.expert_mlp import grouped_swiglu
from raymoe.moe.capacity import CapacityConfig, keep_mask
from raymoe.moe.plan import DispatchPlan, plan_dispatch
from raymoe.moe.placement import PlacementTable, single_worker_placement


class ExpertBackend(Protocol):
    def forward(
        self, moe_layer: int, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> torch.Tensor:
        """``hidden: [T, D]``, ``topk_ids/topk_weights: [T, k]`` -> routed output ``[T, D]``."""
        ...


def run_worker_slots(
    rows: torch.Tensor,
    assign_row: torch.Tensor,
    assign_weight: torch.Tensor,
    slot_counts: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    slot_rows: list[int] | None = None,
) -> torch.Tensor:
    """One worker's share of a plan: experts over its rows, weighted, summed per row.

    Args:
        rows: ``[N, D]`` received rows (one per token routed to this worker).
        assign_row: ``[A]`` row of each assignment, assignments sorted by local slot.
        assign_weight: ``[A]`` combine weights; slot_counts: ``[S]`` assignments per slot.
        w13, w2: this worker's stacked expert weights; slot_rows: which serves each slot.
    Returns:
        ``[N, D]`` partial sums, aligned with ``rows``.
    """
    expert_in = rows.index_select(0, assign_row)  # [A, D]
    expert_out = grouped_swiglu(expert_in, slot_counts, w13, w2, slot_rows)  # [A, D]
    expert_out = expert_out * assign_weight.to(expert_out.dtype).unsqueeze(1)
    return scatter_rows_add(rows.shape[0], assign_row, expert_out)


def combine_assignments(num_tokens: int, top_k: int, flat: torch.Tensor, expert_out: torch.Tensor,
                        weights: torch.Tensor) -> torch.Tensor:
    """The routed output ``[T, D]``: per token, its k expert outputs times their gate weights,
    added in position order in float32, rounded once to ``expert_out``'s dtype.

    ``flat: [A]`` is ``token * k + position`` of each row of ``expert_out: [A, D]`` (the experts'
    outputs, unweighted) and ``weights: [A]`` its gate weight; positions that ran nowhere (dropped)
    add zero. The in-process engine and every router of a deployment combine through this one
    function, from the same expert outputs (the kernels are row-invariant), so where the experts
    ran (placement, replicas, how many workers) cannot change a bit of the result, whatever k.
    """
    width = expert_out.shape[1]
    slots = torch.zeros(num_tokens * top_k, width, dtype=torch.float32, device=expert_out.device)
    slots.index_copy_(0, flat, expert_out.to(torch.float32) * weights.to(torch.float32).unsqueeze(1))
    return slots.view(num_tokens, top_k, width).sum(dim=1).to(expert_out.dtype)


def scatter_rows_add(num_rows: int, index: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``out[index[a]] += values[a]`` into ``[num_rows, D]`` zeros.

    ``scatter_add_`` rather than ``index_add_``: on the CPU the latter loops row by row
    and was measured 100x slower at decode sizes.
    """
    out = values.new_zeros(num_rows, values.shape[1])
    return out.scatter_add_(0, index.unsqueeze(1).expand(-1, values.shape[1]), values)


def combine_partials(num_tokens: int, row_token: torch.Tensor, partial: torch.Tensor,
                     max_rows_per_token: int) -> torch.Tensor:
    """Add each row of ``partial`` (``[N, D]``) into its token (``row_token: [N]``): ``[T, D]``.

    Deterministic on every device: a token's rows are summed in float32 in a fixed order (the
    order they appear in, i.e. by worker), never with atomics (``index_add_``/``scatter_add_``
    on CUDA add in whatever order threads arrive, with one rounding per add in bf16).
    ``max_rows_per_token`` bounds a token's rows (``min(k, W)``).
    """
    num_rows, width = partial.shape
    if num_rows == num_tokens and max_rows_per_token == 1:  # every token has its one row, in order
        return partial
    order = torch.argsort(row_token, stable=True)  # a token's rows stay in arrival order
    sorted_token = row_token.index_select(0, order)
    position = torch.arange(num_rows, device=row_token.device) - torch.searchsorted(sorted_token, sorted_token)
    accumulate = torch.promote_types(partial.dtype, torch.float32)
    slots = torch.zeros(num_tokens * max_rows_per_token, width, dtype=accumulate, device=partial.device)
    slots.index_copy_(0, sorted_token * max_rows_per_token + position, partial.index_select(0, order).to(accumulate))
    return slots.view(num_tokens, max_rows_per_token, width).sum(dim=1).to(partial.dtype)


def run_rows(rows: torch.Tensor, row_pool: torch.Tensor, row_weights: torch.Tensor, w13: torch.Tensor,
             w2: torch.Tensor, pool_counts: list[int], executor: Executor | None = None) -> tuple[torch.Tensor, int]:
    """A worker's experts over the rows it received; returns ``([N, D]`` partial sums, assignments).

    Args:
        rows: ``[N, D]``; row_pool: ``[N, k]`` weight-pool row of the expert to run at each of
            the row's k positions (-1: none); row_weights: ``[N, k]`` float32 gate weights.
        w13, w2: the worker's weight pool, ``[P, 2I, D]`` and ``[P, D, I]``.
        pool_counts: ``[P]`` host ints, assignments per pool row (the routers sent them in
            their headers, so the GEMM sizes need no host sync here).
    One grouped SwiGLU over every row of every router, then each row's weighted outputs summed
    in float32 in position order (deterministic).
    """
    num_rows, top_k = row_pool.shape
    assignments = sum(pool_counts)
    chosen, expert_out = _pool_experts(rows, row_pool, w13, w2, pool_counts, executor)
    accumulate = torch.promote_types(rows.dtype, torch.float32)
    weighted = expert_out.to(accumulate) * row_weights.reshape(-1).index_select(0, chosen).unsqueeze(1)
    # Every (row, position) is written when every position holds an assignment: no zero fill.
    make = torch.empty if assignments == num_rows * top_k else torch.zeros
    slots = make(num_rows * top_k, rows.shape[1], dtype=accumulate, device=rows.device)
    slots.index_copy_(0, chosen, weighted)
    return slots.view(num_rows, top_k, rows.shape[1]).sum(dim=1).to(rows.dtype), assignments


def _pool_experts(rows: torch.Tensor, row_pool: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                  pool_counts: list[int], executor: Executor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(chosen [A], expert outputs [A, D])``: every (row, position) with a pool row, as flat indices
    sorted by pool row, and one grouped SwiGLU over their rows in that order."""
    num_rows, top_k = row_pool.shape
    assignments = sum(pool_counts)
    key = row_pool.reshape(-1)  # [N*k]
    if assignments != num_rows * top_k:  # some positions run nowhere here (-1): they sort last
        key = torch.where(key >= 0, key, w13.shape[0])
    chosen = torch.argsort(key, stable=True)[:assignments]  # flat (row, position), sorted by pool row
    expert_in = rows.index_select(0, torch.div(chosen, top_k, rounding_mode="floor"))
    return chosen, grouped_swiglu(expert_in, pool_counts, w13, w2, executor=executor)  # [A, D]


def run_assignments(rows: torch.Tensor, row_pool: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                    pool_counts: list[int], executor: Executor | None = None) -> torch.Tensor:
    """A worker's experts over the rows it received, one output row per assignment, unweighted:
    ``[A, D]`` in (row, position) order, the order a router reads them back in (the combine of
    every dtype but float32: kernels/comm/wire.py::RowFormat.per_assignment). Arguments as
    :func:`run_rows`'."""
    chosen, expert_out = _pool_experts(rows, row_pool, w13, w2, pool_counts, executor)
    return expert_out.index_select(0, torch.argsort(chosen))  # (row, position) order


def plan_layer(
    placement: PlacementTable,
    moe_layer: int,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    capacity: CapacityConfig,
    log2phy: torch.Tensor | None = None,
    logcnt: torch.Tensor | None = None,
) -> DispatchPlan:
    """Capacity, then the dispatch plan, for one MoE layer of ``placement``.

    Plans are small index arithmetic and always run on the CPU; executing them moves the
    indices to the activations' device.
    """
    topk_ids, topk_weights = topk_ids.cpu(), topk_weights.cpu()
    kept = keep_mask(topk_ids, placement.num_experts, capacity)
    if log2phy is None:
        log2phy = torch.tensor(placement.log2phy[moe_layer])
        logcnt = torch.tensor(placement.logcnt[moe_layer])
    return plan_dispatch(
        topk_ids, topk_weights, kept, log2phy, logcnt, placement.slots_per_worker, placement.num_slots
    )


class LocalExperts:
    """All experts of every MoE layer in this process; one worker, slot ``e`` = expert ``e``."""

    def __init__(self, w13: list[torch.Tensor], w2: list[torch.Tensor], capacity: CapacityConfig):
        self.w13 = w13  # per MoE layer: [E, 2I, D]
        self.w2 = w2  # per MoE layer: [E, D, I]
        self.capacity = capacity
        self.placement = single_worker_placement(len(w13), w13[0].shape[0]) if w13 else None
        self._log2phy = [torch.tensor(self.placement.log2phy[i]) for i in range(len(w13))]
        self._logcnt = [torch.tensor(self.placement.logcnt[i]) for i in range(len(w13))]
        self.num_dropped = 0
        self.tokens_per_expert = [torch.zeros(w.shape[0], dtype=torch.int64) for w in w13]

    def forward(
        self, moe_layer: int, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> torch.Tensor:
        plan = plan_layer(
            self.placement, moe_layer, topk_ids, topk_weights, self.capacity,
            self._log2phy[moe_layer], self._logcnt[moe_layer],
        )
        self.num_dropped += plan.num_dropped
        self.tokens_per_expert[moe_layer] += plan.slot_counts
        # Every kept assignment runs here; the outputs are combined as a router combines them.
        device = hidden.device
        expert_in = hidden.index_select(0, plan.assign_token.to(device))  # [A, D], sorted by slot
        expert_out = grouped_swiglu(expert_in, plan.slot_counts, self.w13[moe_layer], self.w2[moe_layer])
        return combine_assignments(hidden.shape[0], topk_ids.shape[1], plan.assign_flat.to(device), expert_out,
                                   plan.assign_weight.to(device))
