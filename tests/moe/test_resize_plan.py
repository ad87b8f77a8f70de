"""Where experts go when the expert pool grows or shrinks (moe/resize_plan.py)."""

from __future__ import annotations

import numpy as np
import pytest

from raymoe.moe.placement import PlacementTable
from raymoe.moe.resize_plan import ResizeRefused, check_size, free_rows, plan_grow, plan_shrink, truncate


def table(rows, slots):
    return PlacementTable.from_phy2log(rows, slots, 8, epoch=3)


def test_grow_fills_new_slots_hottest_first_copied_from_holders():
    current = table([[0, 1, 2, 3, 4, 5, 6, 7]], 8)  # one worker holds all 8
    load = np.array([[1, 50, 2, 3, 40, 5, 6, 7]], dtype=float)
    phy2log, copies = plan_grow(current, 2, load)
    assert phy2log.shape == (1, 16)
    assert (phy2log[0, :8] == current.phy2log[0]).all()  # old worker keeps what it holds
    new = phy2log[0, 8:].tolist()
    assert new[:2] == [1, 4]  # the two hottest first
    assert len(set(new)) == 8  # never twice on one worker while another expert fits
    assert len(copies) == 8 and all(c.source_worker == 0 and c.destination_worker == 1 for c in copies)
    PlacementTable.from_phy2log(phy2log, 8, 8)  # valid


def test_grow_without_load_replicates_the_least_copied_first():
    current = table([[0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3]], 6)  # 2 workers, 0-3 twice
    phy2log, copies = plan_grow(current, 3, None)
    assert sorted(phy2log[0, 12:].tolist()) == [0, 1, 4, 5, 6, 7]  # 4..7 (one copy) first
    assert {c.source_worker for c in copies if c.expert in (4, 5)} == {0}
    assert {c.source_worker for c in copies if c.expert in (6, 7)} == {1}


def test_shrink_copies_only_what_the_leaving_worker_alone_holds():
    current = table([[0, 1, 2, 3, 4, 5, -1, -1, 4, 5, 6, 7, 0, 1, 2, 3]], 8)
    phy2log, copies = plan_shrink(current, 1, None, spare_rows=0)
    assert (phy2log[0, 8:] == -1).all()
    assert sorted(phy2log[0, :8].tolist()) == list(range(8))
    assert sorted((c.expert, c.source_worker, c.destination_worker) for c in copies) == [(6, 1, 0), (7, 1, 0)]
    kept = truncate(PlacementTable.from_phy2log(phy2log, 8, 8), 1, epoch=9)
    assert kept.num_workers == 1 and kept.epoch == 9


def test_shrink_below_the_experts_is_refused_before_any_copy():
    current = table([[0, 1, 2, 3, 0, 1, 4, 5, 6, 7, 2, 3]], 6)  # 6 slots a worker cannot hold 8 experts
    with pytest.raises(ResizeRefused, match="at least 2 workers"):
        plan_shrink(current, 1, None, spare_rows=6)


def test_shrink_replaces_spare_copies_within_the_spare_rows():
    current = table([[0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 6, 7, 4, 5, 6, 7]], 8)
    phy2log, copies = plan_shrink(current, 1, np.array([[9, 1, 8, 1, 1, 1, 1, 1]], dtype=float), spare_rows=4)
    assert sorted(phy2log[0, :8].tolist()) == list(range(8))
    assert len(copies) == 4 and all(c.destination_worker == 0 for c in copies)
    assert free_rows(current, 4).tolist() == [[4, 4]]
    with pytest.raises(ResizeRefused, match="free rows"):
        plan_shrink(current, 1, None, spare_rows=3)


def test_check_size_names_the_limit():
    current = table([[0, 1, 2, 3, 4, 5, 6, 7]], 4)
    check_size(current, 2)
    with pytest.raises(ResizeRefused, match=r"workers=1 .* 8 experts .* 4 slots .* at least 2 workers"):
        check_size(current, 1)
    with pytest.raises(ResizeRefused, match=">= 1"):
        check_size(current, 0)
