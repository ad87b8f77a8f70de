"""When to rebalance: hysteresis around the migration-aware balancer.

Legend: L MoE layers, E logical experts, W workers, S slots per worker.

A rebalance is worth it only when the window's load is imbalanced (balancedness below the
threshold) and the new plan gains enough to pay for the weights it copies. Balanced load,
or a plan that would copy nothing, never moves anything (no churn).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from raymoe.moe.balance_metrics import balancedness, worker_load
from raymoe.moe.balancer import BalanceResult, BalancerAlgorithm, plan_placement
from raymoe.moe.placement import PlacementTable


@dataclass(frozen=True)
class RebalancePolicy:
    threshold: float = 0.8
    min_gain: float = 0.05
    algorithm: BalancerAlgorithm = BalancerAlgorithm.MIGRATION
    max_copies_per_layer: int | None = 8


@dataclass(frozen=True)
class RebalanceDecision:
    rebalance: bool
    reason: str
    current_balancedness: float
    predicted_balancedness: float
    result: BalanceResult | None = None

    @property
    def num_copies(self) -> int:
        return self.result.migration.num_copies if self.result and self.result.migration else 0


def placement_balancedness(load: np.ndarray, placement: PlacementTable) -> tuple[float, np.ndarray]:
    """Balancedness of ``placement`` under ``load: [L, E]``, and the worker loads ``[L, W]``."""
    loads = worker_load(load, placement.phy2log, placement.slots_per_worker)
    return balancedness(loads), loads


def decide(load: np.ndarray, placement: PlacementTable, policy: RebalancePolicy, force: bool = False) -> RebalanceDecision:
    """Decide on ``load: [L, E]`` (tokens per logical expert over the window).

    ``force`` skips the threshold and gain checks (an operator asked), never the plan itself.
    """
    load = np.asarray(load, dtype=np.float64)
    current, _ = placement_balancedness(load, placement)
    if load.sum() <= 0:
        return RebalanceDecision(False, "no traffic in the window", current, current)
    if not force and current >= policy.threshold:
        return RebalanceDecision(False, f"balanced: {current:.3f} >= threshold {policy.threshold}", current, current)
    result = plan_placement(
        load, placement.num_workers, placement.slots_per_worker, policy.algorithm,
        num_nodes=max(placement.num_nodes, 1), current=placement,
        max_copies_per_layer=policy.max_copies_per_layer if policy.algorithm is BalancerAlgorithm.MIGRATION else None,
    )
    predicted = result.balancedness
    decision = RebalanceDecision(True, "imbalanced and the plan pays", current, predicted, result)
    if result.placement.same_placement(placement):
        return RebalanceDecision(False, "the plan changes nothing", current, predicted, result)
    if not force and predicted - current < policy.min_gain:
        return RebalanceDecision(
            False, f"gain {predicted - current:.3f} below min_gain {policy.min_gain}", current, predicted, result)
    if policy.max_copies_per_layer is not None:
        per_layer = np.bincount([c.layer for c in result.migration.copies], minlength=placement.num_layers)
        if per_layer.max() > policy.max_copies_per_layer:
            return RebalanceDecision(False, f"the plan needs {per_layer.max()} copies in one layer, over the "
                                     f"budget of {policy.max_copies_per_layer}", current, predicted, result)
    return decision
