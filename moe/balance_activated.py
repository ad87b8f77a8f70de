"""Activated-expert balancing for memory-bound decode.

Legend: L MoE layers, E logical experts, W workers, S slots per worker, P = W * S slots,
A assignments per decode step (tokens per step x top-k).

In small decode steps an expert's cost is mostly reading its weights, paid once if it
receives any token. So the busiest worker is the one with the most distinct activated
experts, not the most tokens ("Balance Activated Experts, Not Tokens", arXiv 2512.09277).
An expert with share ``q`` of the step's ``A`` assignments and ``c`` replicas (tokens
spread round-robin) wakes ``mean(min(n, c))`` replicas, ``n ~ Binomial(A, q)``. Because that is
concave in the load, packing by tokens piles many light experts onto one worker, and together
they wake up more often than one heavy expert. We replicate by load as the global
balancer does, then pack replicas by activation probability instead of tokens.
"""

from __future__ import annotations

import numpy as np

from raymoe.moe.balance_global import (
    pack_evenly,
    replicate_by_load,
    validate_shape,
    worker_to_node,
)
from raymoe.moe.placement import PlacementTable


def activation_probability(load: np.ndarray, counts: np.ndarray, assignments_per_step: float) -> np.ndarray:
    """Mean chance that one replica of each expert is activated in a step.

    The expert receives ``n ~ Binomial(A, q)`` assignments and spreads them round-robin, so
    ``min(n, c)`` of its ``c`` replicas wake up: each with chance ``mean(min(n, c)) / c``.
    load: [E]; counts: [E] replicas. Returns [E].
    """
    load = np.asarray(load, dtype=np.float64)
    counts = np.asarray(counts, dtype=np.int64)
    total = float(load.sum())
    if total <= 0:
        return np.zeros_like(load)
    share = np.clip(load / total, 0.0, 1.0)
    # Step 1: Pr(n >= j) for j = 1..max(c), from the binomial pmf built up term by term.
    pmf = (1.0 - share) ** assignments_per_step  # Pr(n = 0)
    at_least = 1.0 - pmf  # Pr(n >= 1)
    expected = np.zeros_like(share)
    for replicas in range(1, int(counts.max()) + 1):
        # Step 2: mean(min(n, c)) = sum over j <= c of Pr(n >= j).
        expected += np.where(counts >= replicas, np.clip(at_least, 0.0, 1.0), 0.0)
        with np.errstate(divide="ignore", invalid="ignore"):
            ratio = (assignments_per_step - replicas + 1) / replicas * share / (1.0 - share)
        pmf = np.where(share < 1.0, pmf * np.maximum(ratio, 0.0), np.where(replicas == assignments_per_step, 1.0, 0.0))
        at_least = at_least - pmf  # Pr(n >= replicas + 1)
    return expected / np.maximum(counts, 1)


def expected_activated(
    load: np.ndarray, phy2log: np.ndarray, slots_per_worker: int, assignments_per_step: float
) -> np.ndarray:
    """Expected distinct activated experts per worker per step.

    load: [L, E]; phy2log: [L, P]. Returns [L, W].
    """
    load = np.asarray(load, dtype=np.float64)
    phy2log = np.asarray(phy2log, dtype=np.int64)
    rows = []
    for layer_load, row in zip(load, phy2log):
        counts = np.bincount(row[row >= 0], minlength=layer_load.shape[0])
        probability = activation_probability(layer_load, np.maximum(counts, 1), assignments_per_step)
        slot_probability = np.where(row >= 0, probability[np.maximum(row, 0)], 0.0)
        rows.append(slot_probability.reshape(-1, slots_per_worker).sum(axis=1))
    return np.stack(rows)


def balance_activated(
    load: np.ndarray,
    num_workers: int,
    slots_per_worker: int,
    assignments_per_step: float,
    num_nodes: int = 1,
) -> PlacementTable:
    """Minimise the largest expected number of activated experts per worker per step.

    load: [L, E] tokens per expert over a window; assignments_per_step: decode tokens per
    step times top-k. Returns a table with slot ``s`` on worker ``s // S``.
    """
    load = validate_shape(load, num_workers, slots_per_worker)
    if assignments_per_step <= 0:
        raise ValueError(f"assignments_per_step must be > 0, got {assignments_per_step}")
    num_experts = load.shape[1]
    rows = []
    for layer_load in load:
        # Step 1: replicas by load, as the token balancer does.
        counts = replicate_by_load(layer_load, num_workers * slots_per_worker)
        item_expert = np.repeat(np.arange(num_experts), counts)
        # Step 2: weigh each replica by its activation probability.
        item_weight = np.repeat(activation_probability(layer_load, counts, assignments_per_step), counts)
        # Step 3: pack evenly by that weight.
        pack = pack_evenly(item_weight, num_workers)
        rows.append(item_expert[np.lexsort((item_expert, pack))])
    return PlacementTable.from_phy2log(
        np.stack(rows), slots_per_worker, num_experts, worker_to_node(num_workers, num_nodes)
    )
