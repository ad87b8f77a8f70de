"""One entry point for every balancer: ``plan_placement``.

Legend: L MoE layers, E logical experts, W workers, S slots per worker, P = W * S slots.

Each algorithm is a pure function from a load matrix ``[L, E]`` to a
:class:`~raymoe.moe.placement.PlacementTable`; this module picks one by enum and, when a
current placement is given, diffs the two into a :class:`MigrationPlan`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import numpy as np

from raymoe.moe.balance_activated import balance_activated
from raymoe.moe.balance_global import balance_global, balance_hierarchical, worker_to_node
from raymoe.moe.balance_metrics import MigrationPlan, balancedness, imbalance, plan_migration, worker_load
from raymoe.moe.balance_migration import balance_migration
from raymoe.moe.eplb_reference import eplb_reference
from raymoe.moe.placement import PlacementTable


class BalancerAlgorithm(enum.Enum):
    GLOBAL = "global"  # EPLB's global policy with refined packing
    HIERARCHICAL = "hierarchical"  # groups onto nodes, then the global policy per node
    MIGRATION = "migration"  # near the global optimum, copying few weights (needs current)
    ACTIVATED = "activated"  # fewest distinct activated experts per worker (decode)
    EPLB = "eplb"  # the plain DeepSeek EPLB reference, for comparison


@dataclass(frozen=True)
class BalanceResult:
    """A new placement and the copies that take the current one to it."""

    placement: PlacementTable
    migration: MigrationPlan | None  # None when there was no current placement
    imbalance: float  # mean over layers of max/mean worker load
    balancedness: float  # mean over layers of mean/max worker load


def plan_placement(
    load: np.ndarray,
    num_workers: int,
    slots_per_worker: int,
    algorithm: BalancerAlgorithm = BalancerAlgorithm.GLOBAL,
    *,
    num_nodes: int = 1,
    num_groups: int = 1,
    current: PlacementTable | None = None,
    max_copies_per_layer: int | None = None,
    tolerance: float = 0.02,
    assignments_per_step: float | None = None,
) -> BalanceResult:
    """Plan a placement for ``load`` [L, E] with the chosen algorithm.

    num_nodes: workers are split into contiguous blocks per node (``w // (W / N)``).
    num_groups: expert groups for the hierarchical policy.
    current: the placement in service; required by ``MIGRATION``, diffed for all others.
    max_copies_per_layer, tolerance: the migration budget and slack (``MIGRATION`` only).
    assignments_per_step: decode tokens per step x top-k (``ACTIVATED`` only).
    """
    algorithm = BalancerAlgorithm(algorithm)
    load = np.asarray(load, dtype=np.float64)
    if current is not None and (current.num_workers, current.slots_per_worker) != (num_workers, slots_per_worker):
        raise ValueError(
            f"current placement has {current.num_workers} workers x {current.slots_per_worker} slots, "
            f"asked for {num_workers} x {slots_per_worker}"
        )
    # Step 1: run the chosen balancer.
    if algorithm is BalancerAlgorithm.GLOBAL:
        placement = balance_global(load, num_workers, slots_per_worker, num_nodes)
    elif algorithm is BalancerAlgorithm.HIERARCHICAL:
        placement = balance_hierarchical(load, num_workers, slots_per_worker, num_nodes, num_groups)
    elif algorithm is BalancerAlgorithm.MIGRATION:
        if current is None:
            raise ValueError("the migration-aware balancer needs the current placement")
        placement = balance_migration(load, current, tolerance, max_copies_per_layer)
    elif algorithm is BalancerAlgorithm.ACTIVATED:
        if assignments_per_step is None:
            raise ValueError("the activated-expert balancer needs assignments_per_step")
        placement = balance_activated(load, num_workers, slots_per_worker, assignments_per_step, num_nodes)
    else:
        phy2log = eplb_reference(load, num_workers, slots_per_worker, num_groups, num_nodes)
        placement = PlacementTable.from_phy2log(
            phy2log, slots_per_worker, load.shape[1], worker_to_node(num_workers, num_nodes)
        )
    # Step 2: carry the current epoch and node labels forward (they win over num_nodes), and diff.
    migration = None
    if current is not None:
        placement = current.with_phy2log(placement.phy2log)
        migration = plan_migration(current, placement)
    loads = worker_load(load, placement.phy2log, slots_per_worker)
    return BalanceResult(placement, migration, imbalance(loads), balancedness(loads))

