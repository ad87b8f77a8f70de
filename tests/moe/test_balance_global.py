"""Global and hierarchical balancers against brute force, EPLB, and their own invariants."""

from __future__ import annotations

import numpy as np
import pytest

from raymoe.moe.balance_global import (
    balance_global,
    balance_hierarchical,
    greedy_packing,
    refine_by_swaps,
    replicate_by_load,
)
from raymoe.moe.balance_metrics import imbalance, worker_load
from raymoe.moe.eplb_reference import balanced_packing, eplb_reference, replicate_experts

TINY_SHAPES = [(4, 2, 3), (3, 3, 2), (4, 2, 2), (5, 2, 3), (4, 3, 2)]  # (experts, workers, slots/worker)


def peak(load, phy2log, slots_per_worker):
    return worker_load(np.atleast_2d(load), np.atleast_2d(phy2log), slots_per_worker).max()


@pytest.mark.parametrize("shape", TINY_SHAPES)
def test_global_against_brute_force(shape, placements_of):
    num_experts, num_workers, slots_per_worker = shape
    rng = np.random.default_rng(sum(shape))
    rows = placements_of(num_experts, num_workers * slots_per_worker)
    ratios = []
    for _ in range(8):
        load = rng.integers(1, 100, num_experts).astype(float)
        loads = worker_load(np.broadcast_to(load, (len(rows), num_experts)), rows, slots_per_worker)
        optimum = loads.max(axis=1).min()
        ours = peak(load, balance_global(load[None], num_workers, slots_per_worker).phy2log, slots_per_worker)
        eplb = peak(load, eplb_reference(load[None], num_workers, slots_per_worker), slots_per_worker)
        assert ours >= optimum - 1e-9  # the brute force really is a lower bound
        assert ours <= eplb + 1e-9
        ratios.append(ours / optimum)
    # A heuristic, not an exact solver: within 10% on every tiny instance, ~optimal on average.
    assert max(ratios) <= 1.10
    assert np.mean(ratios) <= 1.02


def test_hierarchical_against_brute_force(placements_of):
    # 4 experts in 2 groups; 2 nodes x 2 workers x 2 slots: each node holds one whole group.
    rng = np.random.default_rng(7)
    rows = placements_of(4, 8)
    node_groups = np.stack([rows[:, :4] // 2, rows[:, 4:] // 2], axis=1)  # [n, node, slot]
    whole = (node_groups.min(axis=2) == node_groups.max(axis=2)).all(axis=1)
    rows = rows[whole & (node_groups[:, 0, 0] != node_groups[:, 1, 0])]
    for _ in range(10):
        load = rng.integers(1, 100, 4).astype(float)
        optimum = worker_load(np.broadcast_to(load, (len(rows), 4)), rows, 2).max(axis=1).min()
        table = balance_hierarchical(load[None], 4, 2, num_nodes=2, num_groups=2)
        assert len({int(e) // 2 for e in table.phy2log[0, :4]}) == 1  # a group never straddles nodes
        assert peak(load, table.phy2log, 2) == pytest.approx(optimum)


@pytest.mark.parametrize("exponent", [0.6, 0.9, 1.2, 1.5])
def test_global_at_least_as_balanced_as_eplb_on_zipf(exponent, zipf_workload):
    load = zipf_workload(exponent, seed=int(exponent * 10)).sample()
    for num_workers, slots_per_worker in ((8, 9), (16, 5)):
        ours = balance_global(load, num_workers, slots_per_worker)
        eplb = eplb_reference(load, num_workers, slots_per_worker)
        ours_layers = worker_load(load, ours.phy2log, slots_per_worker).max(axis=1)
        eplb_layers = worker_load(load, eplb, slots_per_worker).max(axis=1)
        assert (ours_layers <= eplb_layers + 1e-9).all()


def test_hierarchical_keeps_groups_on_nodes_and_matches_eplb_or_better(zipf_workload):
    load = zipf_workload(1.2, seed=3, num_layers=4, num_experts=32).sample()
    table = balance_hierarchical(load, 8, 5, num_nodes=2, num_groups=4)
    eplb = eplb_reference(load, 8, 5, num_groups=4, num_nodes=2)
    for row in table.phy2log:
        node_groups = [set(row[:20] // 8), set(row[20:] // 8)]
        assert not node_groups[0] & node_groups[1]
        assert len(node_groups[0]) == len(node_groups[1]) == 2
    ours = worker_load(load, table.phy2log, 5).max(axis=1)
    assert (ours <= worker_load(load, eplb, 5).max(axis=1) + 1e-9).all()
    assert table.worker2node.tolist() == [0, 0, 0, 0, 1, 1, 1, 1]


def test_replication_matches_eplb_reference():
    rng = np.random.default_rng(0)
    weight = rng.random((5, 12)) * 100
    _, _, logcnt = replicate_experts(weight, 20)
    ours = np.stack([replicate_by_load(row, 20) for row in weight])
    np.testing.assert_array_equal(ours, logcnt)


def test_greedy_packing_matches_eplb_and_refinement_never_hurts():
    rng = np.random.default_rng(1)
    for _ in range(20):
        weight = rng.random(24) ** 3
        greedy = greedy_packing(weight, 4)
        reference, _ = balanced_packing(weight[None], 4)
        np.testing.assert_array_equal(greedy, reference[0])
        refined = refine_by_swaps(weight, greedy, 4)
        assert np.bincount(refined, minlength=4).tolist() == [6, 6, 6, 6]
        assert np.bincount(refined, weights=weight).max() <= np.bincount(greedy, weights=weight).max() + 1e-12


def test_every_expert_placed_with_equal_slots():
    load = np.array([[100.0, 1, 1, 1, 1, 1], [0, 0, 0, 0, 0, 0]])
    table = balance_global(load, 2, 4)
    assert table.phy2log.shape == (2, 8)
    assert (table.logcnt >= 1).all()
    assert table.logcnt[0, 0] == 2  # one replica per worker, and one light expert split too:
    assert worker_load(load, table.phy2log, 4)[0].tolist() == [52.5, 52.5]  # {50, 1, 1, .5} x 2
    assert imbalance(worker_load(load, table.phy2log, 4)) == pytest.approx(1.0)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(load=np.ones((1, 8)), num_workers=2, slots_per_worker=3), "cannot hold"),
        (dict(load=np.ones(8), num_workers=2, slots_per_worker=4), "layers, experts"),
        (dict(load=-np.ones((1, 4)), num_workers=2, slots_per_worker=2), "non-negative"),
        (dict(load=np.ones((1, 8)), num_workers=3, slots_per_worker=4, num_nodes=2), "split evenly"),
        (dict(load=np.ones((1, 8)), num_workers=4, slots_per_worker=4, num_nodes=2, num_groups=3), "groups"),
    ],
)
def test_invalid_inputs_raise(kwargs, message):
    with pytest.raises(ValueError, match=message):
        balance_hierarchical(**kwargs)
