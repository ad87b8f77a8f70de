"""The progress slot (actors/progress_slot.py) and the watch's verdict from it (actors/rank_watch.py),
without Ray: one reading must tell a stepping rank from a stuck one.

Seen in CI (stop 41): a router on "another node" stepped all along while its probe starved, but
on the loaded machine only one pinned reading of its slot came back within the limit, and with
a bare counter one reading cannot show it advancing: the watch called it wedged and killed it.
The slot now holds the time of its last tick, so one reading says how long ago it advanced.
Seen in CI again (stop 41's rerun), and here under load: the pinned reading came back only once,
early (the counter had paused under load for a second), or not at all, and the watch took the
missing news for a standing counter. Now a rank is wedged only on evidence (a reading showing
its counter still for the whole limit, or a stopped process); one on another node without a
recent enough reading is undecided, reported busy and killed only at the busy bound.
"""

from __future__ import annotations

import os
import threading
import time
from types import SimpleNamespace

import pytest

from raymoe.actors.progress_slot import ProgressSlot, read_slot, sample_progress
from raymoe.actors.rank_watch import RankRecord, RankWatch

LIMIT_S = 2.4


@pytest.fixture
def slot(tmp_path):
    slot = ProgressSlot(str(tmp_path))
    assert slot.path is not None
    yield slot
    slot.close()


def test_one_reading_says_how_long_ago_the_counter_advanced(slot, tmp_path):
    pid = os.getpid()
    slot.tick()
    slot.tick()
    fresh = sample_progress(pid, str(tmp_path))
    assert fresh["counter"] == 2 == read_slot(pid, str(tmp_path))
    assert fresh["state"] in ("R", "S")
    assert 0.0 <= fresh["age_s"] < 0.2
    time.sleep(0.3)
    stale = sample_progress(pid, str(tmp_path))
    assert stale["counter"] == 2 and stale["age_s"] >= 0.3
    slot.tick()
    again = sample_progress(pid, str(tmp_path))
    assert again["counter"] == 3 and again["age_s"] < 0.2


def test_no_slot_reads_as_no_counter(tmp_path):
    assert sample_progress(os.getpid(), str(tmp_path)) == {"state": sample_progress(os.getpid())["state"],
                                                          "counter": None, "age_s": None}


def _watch() -> RankWatch:
    stopped = threading.Event()
    stopped.set()  # its thread ends at once: only the judgement is used here
    host = SimpleNamespace(routers=[], workers=[], _stopped=stopped, groups={"timeout_s": 3.0,
                                                                            "wedge_after_s": LIMIT_S})
    watch = RankWatch(host)
    watch._node_id = "this node"
    return watch


def _record(node: str = "this node") -> RankRecord:
    record = RankRecord("router 0", "router", SimpleNamespace(_actor_id=SimpleNamespace(hex=lambda: "a0")))
    record.process = (node, 12345)
    return record


BOUND_S = 5 * LIMIT_S


@pytest.mark.parametrize("age_s, verdict", [(0.05, "busy"), (1.0, "busy"), (LIMIT_S + 0.5, "wedged")])
def test_a_single_reading_decides_busy_or_wedged(age_s, verdict):
    watch, record = _watch(), _record()
    now = time.monotonic()
    watch._apply_sample(record, now, {"state": "S", "counter": 1234, "age_s": age_s})
    got, why = watch._verdict(record, now, silent=LIMIT_S + 0.1, limit=LIMIT_S)
    assert got == verdict, why
    if verdict == "busy":
        assert "progress counter advanced" in why and "not killed" in why
    else:
        assert f"not advanced for {age_s:.1f} s" in why


def test_a_rank_on_another_node_without_a_reading_is_undecided_until_the_busy_bound():
    watch, record = _watch(), _record("another node")
    now = time.monotonic()
    got, why = watch._verdict(record, now, silent=LIMIT_S + 0.1, limit=LIMIT_S)
    assert got == "busy" and "undecided" in why and "not killed" in why, why
    got, why = watch._verdict(record, now, silent=BOUND_S + 0.1, limit=LIMIT_S)
    assert got == "wedged" and "cannot take requests" in why, why


def test_on_the_watchs_node_no_slot_is_wedged_at_the_limit():
    watch, record = _watch(), _record()
    got, why = watch._verdict(record, time.monotonic(), silent=LIMIT_S + 0.1, limit=LIMIT_S)
    assert got == "wedged" and "no progress slot" in why, why


def test_an_old_reading_that_saw_it_advance_does_not_make_it_wedged_a_fresh_one_that_saw_it_still_does():
    """The CI failure: the one reading that came back (1.8 s before the verdict) had the counter
    still for 1.1 s; extrapolated, 2.9 s > the limit, and the router was killed."""
    watch, record = _watch(), _record("another node")
    now = time.monotonic()
    watch._apply_sample(record, now - 1.8, {"state": "S", "counter": 40, "age_s": 1.1})
    got, why = watch._verdict(record, now, silent=LIMIT_S + 0.2, limit=LIMIT_S)
    assert got == "busy" and "undecided" in why and "1.8 s ago" in why, why
    watch._apply_sample(record, now, {"state": "S", "counter": 40, "age_s": LIMIT_S + 0.1})
    got, why = watch._verdict(record, now, silent=LIMIT_S + 0.2, limit=LIMIT_S)
    assert got == "wedged" and f"not advanced for {LIMIT_S + 0.1:.1f} s" in why, why


def test_a_counter_that_stays_the_same_over_readings_a_limit_apart_is_wedged_without_its_time():
    watch, record = _watch(), _record()
    now = time.monotonic()
    watch._apply_sample(record, now - LIMIT_S - 0.1, {"state": "S", "counter": 7, "age_s": None})
    watch._apply_sample(record, now - 1.0, {"state": "S", "counter": 7, "age_s": None})
    assert watch._verdict(record, now - 1.0, silent=LIMIT_S + 0.1, limit=LIMIT_S)[0] == "busy"
    watch._apply_sample(record, now, {"state": "S", "counter": 7, "age_s": None})
    assert watch._verdict(record, now, silent=LIMIT_S + 0.1, limit=LIMIT_S)[0] == "wedged"


def test_a_counter_that_moves_between_readings_is_progress_even_without_its_time():
    watch, record = _watch(), _record()
    now = time.monotonic()
    watch._apply_sample(record, now - 1.0, {"state": "S", "counter": 7, "age_s": None})
    got, why = watch._verdict(record, now, silent=LIMIT_S + 0.1, limit=LIMIT_S)
    assert got == "busy" and "undecided" in why, why  # one reading, no time: no evidence either way
    watch._apply_sample(record, now, {"state": "S", "counter": 9, "age_s": None})
    got, why = watch._verdict(record, now, silent=LIMIT_S + 0.1, limit=LIMIT_S)
    assert got == "busy" and "advanced 0.0 s ago" in why, why


def test_a_stopped_process_is_wedged_whatever_its_slot_says():
    watch, record = _watch(), _record()
    now = time.monotonic()
    watch._apply_sample(record, now, {"state": "T", "counter": 5, "age_s": 0.01})
    got, why = watch._verdict(record, now, silent=LIMIT_S + 0.1, limit=LIMIT_S)
    assert got == "wedged" and "stopped" in why
