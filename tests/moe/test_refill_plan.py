"""Refilling a replaced worker from the survivors (moe/refill_plan.py): one copy per slot of the
lost worker, each from a survivor that holds the expert, spread over the sources, and a clear
error for an expert no survivor holds."""

from __future__ import annotations

import numpy as np
import pytest

from raymoe.moe.placement import PlacementTable
from raymoe.moe.refill_plan import plan_refill


def table(rows, slots, experts=2, worker2node=None, epoch=1):
    workers = len(rows[0]) // slots
    return PlacementTable.from_phy2log(np.array(rows), slots, experts, worker2node or [0] * workers, epoch)


def test_every_slot_of_the_lost_worker_is_copied_from_a_survivor_spreading_the_sources():
    # 3 workers x 2 slots; worker 2 lost. Experts 0, 1 held by workers 0 and 1 both.
    restored = table([[0, 1, 1, 0, 0, 1]], 2)
    current = table([[0, 1, 1, 0, -1, -1]], 2, epoch=2)
    copies = plan_refill(current, restored, [2])
    assert [(c.layer, c.expert, c.destination_worker, c.destination_slot) for c in copies] == [(0, 0, 2, 4),
                                                                                                (0, 1, 2, 5)]
    assert [c.source_worker for c in copies] == [0, 1]  # each source sends one, not worker 0 both
    assert all(current.phy2log[0][c.source_worker * 2:(c.source_worker + 1) * 2].tolist().count(c.expert)
               for c in copies)


def test_a_source_on_the_destinations_node_comes_first():
    restored = table([[0, 1, 0, 1, 0, 1]], 2, worker2node=[0, 1, 1])
    current = table([[0, 1, 0, 1, -1, -1]], 2, worker2node=[0, 1, 1])
    assert {c.source_worker for c in plan_refill(current, restored, [2])} == {1}
    assert all(c.same_node for c in plan_refill(current, restored, [2]))


def test_empty_slots_are_not_copied_and_layers_are_planned_each():
    current = table([[0, 1, 2, -1, -1, -1], [2, 0, 1, 2, -1, -1]], 2, experts=3)  # worker 2 lost
    restored = table([[0, 1, 2, -1, 0, -1], [2, 0, 1, 2, 1, 0]], 2, experts=3)
    copies = plan_refill(current, restored, [2])
    assert [(c.layer, c.expert, c.destination_slot) for c in copies] == [(0, 0, 4), (1, 1, 4), (1, 0, 5)]


def test_an_expert_only_the_refilled_worker_holds_is_named():
    both = table([[0, 2, 1, -1], [1, 2, 0, 1]], 2, experts=3)  # layer 0: expert 1 on worker 1 alone
    with pytest.raises(ValueError, match="layer 0 expert 1 is held by no worker outside \\[1\\]"):
        plan_refill(both, both, [1])
