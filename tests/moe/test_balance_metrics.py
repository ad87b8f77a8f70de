"""The shared definitions: worker load, balancedness, copies."""

from __future__ import annotations

import numpy as np
import pytest

from raymoe.moe.balance_metrics import balancedness, count_copies, imbalance, plan_migration, worker_load
from raymoe.moe.placement import PlacementTable


def test_worker_load_splits_replicated_experts_evenly():
    load = np.array([[60.0, 10.0, 20.0]])
    phy2log = np.array([[0, 1, 0, 2]])  # expert 0 on both workers
    np.testing.assert_allclose(worker_load(load, phy2log, 2), [[40.0, 50.0]])


def test_balancedness_and_imbalance_by_hand():
    loads = np.array([[1.0, 3.0], [2.0, 2.0]])
    assert balancedness(loads) == pytest.approx((2 / 3 + 1.0) / 2)
    assert imbalance(loads) == pytest.approx((1.5 + 1.0) / 2)
    assert imbalance(np.zeros((1, 4))) == 1.0


def test_constructed_skew_table_is_two_and_a_half():
    skewed = np.array([[640, 320, 256, 224, 192, 160, 144, 112]], dtype=float)
    assert skewed.sum() == 1024 * 2
    assert imbalance(skewed) == pytest.approx(640 / 256) == pytest.approx(2.5)
    assert imbalance(np.full((1, 8), 256.0)) == 1.0


def test_copies_count_only_new_worker_expert_pairs():
    old = PlacementTable.from_phy2log([[0, 1, 2, 3]], 2, 4)
    moved_within = old.with_phy2log(np.array([[1, 0, 3, 2]]))
    assert count_copies(old, moved_within) == 0
    swapped = old.with_phy2log(np.array([[0, 2, 1, 3]]))
    assert count_copies(old, swapped) == 2
    plan = plan_migration(old, swapped)
    assert {(c.expert, c.source_worker, c.destination_worker) for c in plan.copies} == {(2, 1, 0), (1, 0, 1)}


def test_incompatible_placements_raise():
    with pytest.raises(ValueError, match="same slots"):
        count_copies(PlacementTable.from_phy2log([[0, 1]], 1, 2), PlacementTable.from_phy2log([[0, 1, 1, 0]], 2, 2))
