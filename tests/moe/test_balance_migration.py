"""Migration-aware balancing: little churn on noise, follows a moved hot set, brute force."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from raymoe.moe.balance_global import balance_global
from raymoe.moe.balance_metrics import copy_mask, count_copies, imbalance, layer_imbalance, worker_load
from raymoe.moe.balance_migration import align_to_current, assign_max_overlap, balance_migration
from raymoe.moe.balancer import BalancerAlgorithm, plan_placement
from raymoe.moe.eplb_reference import eplb_reference
from raymoe.moe.placement import PlacementTable

WORKERS, SLOTS = 8, 10  # 64 experts, 16 redundant slots per layer


def eplb_table(load):
    return PlacementTable.from_phy2log(eplb_reference(load, WORKERS, SLOTS), SLOTS, load.shape[1])


def max_over_mean(load, table):
    return imbalance(worker_load(load, table.phy2log, SLOTS))


@pytest.mark.parametrize("exponent", [0.6, 0.9, 1.2, 1.5])
def test_resample_copies_a_quarter_of_eplb_or_less(exponent, zipf_workload):
    workload = zipf_workload(exponent, seed=100 + int(exponent * 10))
    first, second = workload.sample(), workload.sample()
    current = eplb_table(first)
    eplb_again = eplb_table(second)
    ours = balance_migration(second, current)
    eplb_copies = count_copies(current, eplb_again)
    assert eplb_copies >= 0.5 * second.shape[0] * WORKERS * SLOTS  # EPLB's churn is real
    assert count_copies(current, ours) <= eplb_copies / 4
    assert max_over_mean(second, ours) <= max_over_mean(second, eplb_again) + 0.05
    assert ours.epoch == current.epoch + 1


@pytest.mark.parametrize("exponent", [0.6, 1.2, 1.5])
def test_moved_hot_set_is_followed(exponent, zipf_workload):
    workload = zipf_workload(exponent, seed=200 + int(exponent * 10))
    current = eplb_table(workload.sample())
    moved = workload.moved().sample()
    ours = balance_migration(moved, current)
    fresh = balance_global(moved, WORKERS, SLOTS)
    assert max_over_mean(moved, current) > max_over_mean(moved, fresh) + 0.05  # the move matters
    assert max_over_mean(moved, ours) <= max_over_mean(moved, fresh) + 0.05
    assert count_copies(current, ours) <= count_copies(current, eplb_table(moved))


def test_identical_load_copies_nothing(zipf_workload):
    load = zipf_workload(1.0, seed=5).sample()
    current = balance_global(load, WORKERS, SLOTS)
    ours = balance_migration(load * 1.0001, current)
    assert count_copies(current, ours) == 0
    np.testing.assert_array_equal(ours.phy2log, current.phy2log)


def test_budget_is_respected(zipf_workload):
    workload = zipf_workload(1.2, seed=9)
    current = eplb_table(workload.sample())
    moved = workload.moved().sample()
    for budget in (0, 3, 10):
        ours = balance_migration(moved, current, max_copies_per_layer=budget)
        per_layer = copy_mask(current.phy2log, ours.phy2log, SLOTS, 64).sum(axis=(1, 2))
        assert (per_layer <= budget).all()
        assert max_over_mean(moved, ours) <= max_over_mean(moved, current) + 1e-9


def test_tiny_instances_against_brute_force(placements_of):
    # The fewest copies that reach the goal (fresh optimum + tolerance), found by brute force.
    num_experts, slots_per_worker, tolerance = 4, 3, 0.02
    rows = placements_of(num_experts, 6)
    rng = np.random.default_rng(3)
    for _ in range(20):
        load = rng.integers(1, 100, num_experts).astype(float)[None]
        current = PlacementTable.from_phy2log(rows[rng.integers(len(rows))][None], slots_per_worker, num_experts)
        ours = balance_migration(load, current, tolerance)
        goal = layer_imbalance(worker_load(load, balance_global(load, 2, slots_per_worker).phy2log, 3))[0] + tolerance
        ratios = layer_imbalance(worker_load(np.broadcast_to(load[0], (len(rows), 4)), rows, 3))
        copies = copy_mask(np.broadcast_to(current.phy2log[0], rows.shape), rows, 3, 4).sum(axis=(1, 2))
        fewest = copies[ratios <= goal + 1e-12].min()
        assert layer_imbalance(worker_load(load, ours.phy2log, 3))[0] <= goal + 1e-12
        assert count_copies(current, ours) <= fewest + 1


def test_assignment_is_optimal_against_permutations():
    rng = np.random.default_rng(0)
    for size in range(1, 6):
        for _ in range(10):
            overlap = rng.integers(0, 5, (size, size))
            best = max(sum(overlap[i, p[i]] for i in range(size)) for p in itertools.permutations(range(size)))
            chosen = assign_max_overlap(overlap)
            assert sorted(chosen.tolist()) == list(range(size))
            assert sum(overlap[i, chosen[i]] for i in range(size)) == best


def test_alignment_keeps_bins_and_slots():
    current = np.array([0, 1, 2, 3, 4, 5])  # workers {0,1}, {2,3}, {4,5}
    new = np.array([5, 4, 1, 0, 3, 2])  # the same bins, relabelled and reordered
    aligned = align_to_current(new, current, 2)
    np.testing.assert_array_equal(aligned, current)


def test_plan_placement_reports_migration_with_same_node_sources():
    load = np.array([[50.0, 10, 10, 10, 10, 10, 10, 10]])
    worker2node = [0, 0, 1, 1]
    current = PlacementTable.from_phy2log([[0, 1, 2, 3, 4, 5, 6, 7, 1, 2, 3, 4]], 3, 8, worker2node)
    result = plan_placement(load, 4, 3, BalancerAlgorithm.MIGRATION, current=current, tolerance=0.0)
    assert result.migration.num_copies == count_copies(current, result.placement) > 0
    old_workers = {(e, w) for w in range(4) for e in current.worker_experts(0, w)}
    for copy in result.migration.copies:
        assert (copy.expert, copy.source_worker) in old_workers
        assert (copy.expert, copy.destination_worker) not in old_workers
        assert result.placement.phy2log[0, copy.destination_slot] == copy.expert
        has_local_source = any(
            (copy.expert, w) in old_workers for w in range(4) if worker2node[w] == worker2node[copy.destination_worker]
        )
        assert copy.same_node == has_local_source


def test_migration_needs_matching_shapes():
    current = PlacementTable.from_phy2log([[0, 1, 2, 3]], 2, 4)
    with pytest.raises(ValueError, match="does not match"):
        balance_migration(np.ones((2, 4)), current)
    with pytest.raises(ValueError, match="needs the current placement"):
        plan_placement(np.ones((1, 4)), 2, 2, BalancerAlgorithm.MIGRATION)
