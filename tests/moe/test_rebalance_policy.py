"""The rebalance decision: hysteresis, gain, budget, and no churn on balanced load."""

from __future__ import annotations

import numpy as np

from raymoe.moe.balancer import BalancerAlgorithm
from raymoe.moe.initial_placement import initial_placement
from raymoe.moe.placement import PlacementTable
from raymoe.moe.rebalance_policy import RebalancePolicy, decide, placement_balancedness


def skewed_placement() -> PlacementTable:
    # Hot experts 0 and 1 both on worker 0; workers 1-3 hold cold replicas.
    rows = [0, 1, 2, 3, 4, 5, 6, 7, 4, 5, 6, 7, 4, 5, 6, 7]
    return PlacementTable.from_phy2log([rows, rows], 4, 8)


def hot_load() -> np.ndarray:
    load = np.full((2, 8), 10.0)
    load[:, :2] = 1000.0
    return load


def test_skewed_load_rebalances_and_the_plan_balances_it():
    decision = decide(hot_load(), skewed_placement(), RebalancePolicy())
    assert decision.rebalance
    assert decision.current_balancedness < 0.5
    assert decision.predicted_balancedness >= 0.9
    assert decision.result.placement.epoch == 1
    assert 0 < decision.num_copies <= 2 * 8
    # Every copy's source really holds the expert, and the destination did not.
    old = skewed_placement()
    for copy in decision.result.migration.copies:
        assert copy.expert in old.worker_experts(copy.layer, copy.source_worker)
        assert copy.expert not in old.worker_experts(copy.layer, copy.destination_worker)


def test_balanced_load_causes_no_migration():
    placement = initial_placement(2, 8, 4, "round_robin", redundant_slots_per_worker=1)
    rng = np.random.default_rng(0)
    for _ in range(20):  # noisy samples of a uniform load
        load = rng.poisson(200, size=(2, 8)).astype(float)
        decision = decide(load, placement, RebalancePolicy())
        assert not decision.rebalance
        assert decision.num_copies == 0 or "balanced" in decision.reason


def test_after_rebalancing_the_same_load_moves_nothing_more():
    first = decide(hot_load(), skewed_placement(), RebalancePolicy())
    again = decide(hot_load() * 1.01, first.result.placement, RebalancePolicy())
    assert not again.rebalance


def test_gain_below_min_gain_is_not_worth_a_migration():
    placement = skewed_placement()
    current, _ = placement_balancedness(hot_load(), placement)
    policy = RebalancePolicy(threshold=0.99, min_gain=1.0 - current + 0.01)  # demands more than is possible
    decision = decide(hot_load(), placement, policy)
    assert not decision.rebalance and "min_gain" in decision.reason


def test_budget_limits_copies_per_layer():
    unlimited = decide(hot_load(), skewed_placement(), RebalancePolicy(max_copies_per_layer=None))
    unlimited_per_layer = np.bincount([c.layer for c in unlimited.result.migration.copies], minlength=2)
    assert unlimited.rebalance and unlimited_per_layer.max() > 2  # the budget below really binds
    decision = decide(hot_load(), skewed_placement(), RebalancePolicy(max_copies_per_layer=2))
    assert decision.rebalance, decision.reason  # a budgeted plan still pays here
    per_layer = np.bincount([c.layer for c in decision.result.migration.copies], minlength=2)
    assert per_layer.tolist() == [2, 2]
    assert decision.current_balancedness < decision.predicted_balancedness < unlimited.predicted_balancedness


def test_a_plan_over_the_budget_is_refused(monkeypatch):
    """decide's own check, should the balancer ever return more copies than asked for."""
    import raymoe.moe.rebalance_policy as policy_module

    real = policy_module.plan_placement
    monkeypatch.setattr(policy_module, "plan_placement",
                        lambda *args, **kwargs: real(*args, **dict(kwargs, max_copies_per_layer=None)))
    decision = decide(hot_load(), skewed_placement(), RebalancePolicy(max_copies_per_layer=2))
    assert not decision.rebalance and "over the budget of 2" in decision.reason


def test_no_traffic_and_forced_decisions():
    placement = skewed_placement()
    assert not decide(np.zeros((2, 8)), placement, RebalancePolicy()).rebalance
    balanced = initial_placement(2, 8, 4, "round_robin")
    forced = decide(np.full((2, 8), 5.0), balanced, RebalancePolicy(algorithm=BalancerAlgorithm.MIGRATION), force=True)
    assert not forced.rebalance and forced.reason == "the plan changes nothing"
