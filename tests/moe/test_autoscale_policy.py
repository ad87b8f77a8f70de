"""The autoscaling policy (moe/autoscale_policy.py): sizes from load, limits, cooldown, the
hysteresis band, and no flapping under a steady or wobbling load."""

from __future__ import annotations

import dataclasses
import math
import random

import pytest

from raymoe.moe.autoscale_policy import (AutoscalePolicy, LoadSample, QueueFloor, RouterSample, decide,
                                         decide_routers, desired_routers, desired_size, group_sample)

POLICY = AutoscalePolicy(min_workers=1, max_workers=4, target_rows_per_worker=10.0, band=0.25, cooldown_s=30.0,
                         window_s=10.0)


def steady(rows_per_step: float, now: float, window_s: float = 10.0, steps_per_poll: int = 5) -> list[LoadSample]:
    """One poll a second over the window, each ``steps_per_poll`` steps of ``rows_per_step``."""
    return [LoadSample(now - window_s + 1 + i, steps_per_poll, rows_per_step * steps_per_poll)
            for i in range(int(window_s))]


def test_desired_size_is_the_ceiling_within_the_limits():
    assert desired_size(0, POLICY) == 1
    assert desired_size(10, POLICY) == 1
    assert desired_size(10.5, POLICY) == 2
    assert desired_size(30, POLICY) == 3
    assert desired_size(1000, POLICY) == 4


def test_grows_under_load_to_the_size_the_load_wants():
    d = decide(steady(35.0, now=100), current=1, last_resize_time=None, now=100, policy=POLICY)
    assert (d.desired, d.direction) == (4, "up") and d.reason.startswith("grow: 35.0 rows per worker"), d
    assert d.rows_per_step == pytest.approx(35.0)
    d = decide(steady(26.0, now=100), current=2, last_resize_time=None, now=100, policy=POLICY)
    assert (d.desired, d.direction) == (3, "up"), d


def test_shrinks_when_idle_and_says_so():
    d = decide([], current=3, last_resize_time=0.0, now=100, policy=POLICY)
    assert (d.desired, d.direction) == (1, "down") and "idle: no router step in the last 10 s" in d.reason, d
    d = decide(steady(12.0, now=100), current=4, last_resize_time=None, now=100, policy=POLICY)
    assert (d.desired, d.direction) == (2, "down"), d  # 3 rows each < 7.5: 12 rows want 2 workers


def test_holds_inside_the_band():
    # 2 workers, 22 rows: 11 each, above the target but inside 7.5..12.5
    d = decide(steady(22.0, now=100), current=2, last_resize_time=None, now=100, policy=POLICY)
    assert d.direction == "hold" and d.reason.startswith("hold: 11.0 rows per worker"), d
    d = decide(steady(16.0, now=100), current=2, last_resize_time=None, now=100, policy=POLICY)  # 8 each
    assert d.direction == "hold", d


def test_limits_are_named_when_they_hold_it():
    d = decide(steady(100.0, now=100), current=4, last_resize_time=None, now=100, policy=POLICY)
    assert d.direction == "hold" and "autoscale.max_workers (4)" in d.reason, d
    d = decide([], current=1, last_resize_time=None, now=100, policy=POLICY)
    assert d.direction == "hold" and "autoscale.min_workers (1)" in d.reason, d


def test_a_size_outside_the_limits_goes_back_inside_them():
    d = decide(steady(100.0, now=100), current=6, last_resize_time=None, now=100, policy=POLICY)
    assert d.desired == 4 and "outside [1, 4]" in d.reason, d
    d = decide(steady(100.0, now=100), current=6, last_resize_time=90.0, now=100, policy=POLICY)
    assert d.direction == "hold" and d.reason.startswith("cooling down"), d  # not at once after an operator's resize


def test_cooldown_and_a_window_from_before_the_last_resize_hold():
    samples = steady(35.0, now=100)
    d = decide(samples, current=1, last_resize_time=80.0, now=100, policy=POLICY)
    assert d.direction == "hold" and d.reason.startswith("cooling down: last resize 20.0 s ago, cooldown 30 s"), d
    quick = AutoscalePolicy(1, 4, 10.0, cooldown_s=0.0, window_s=10.0)
    d = decide(samples, current=1, last_resize_time=95.0, now=100, policy=quick)
    assert d.direction == "hold" and "5.0 of 10 s since the last resize" in d.reason, d
    assert decide(samples, current=1, last_resize_time=90.0, now=100, policy=quick).direction == "up"


def test_samples_outside_the_window_are_ignored():
    old = steady(100.0, now=50)  # a burst long gone
    d = decide(old + steady(2.0, now=100), current=3, last_resize_time=None, now=100, policy=POLICY)
    assert d.desired == 1 and d.rows_per_step == pytest.approx(2.0), d


@pytest.mark.parametrize("rows", [0.0, 3.0, 9.9, 10.0, 10.1, 19.0, 20.5, 29.0, 31.0, 39.9, 55.0])
def test_a_steady_load_reaches_a_fixed_point_in_one_resize(rows):
    """Whatever the load and the starting size, at most one resize, then it holds forever."""
    for start in range(1, 5):
        current, resizes, last, now = start, 0, None, 0.0
        for _ in range(200):
            now += 2.0
            d = decide(steady(rows, now), current, last, now, POLICY)
            if d.desired != current:
                current, resizes, last = d.desired, resizes + 1, now
        assert resizes <= 1, (rows, start, resizes)
        assert current == desired_size(rows, POLICY) or (
            POLICY.target_rows_per_worker * (1 - POLICY.band) * current <= rows
            <= POLICY.target_rows_per_worker * (1 + POLICY.band) * current), (rows, start, current)


def test_a_load_wobbling_around_a_size_boundary_never_flaps():
    """Load wobbling +-15% around the 1|2 boundary (10 rows) and around 2 workers' target:
    inside the band, so no resize at all once sized."""
    rng = random.Random(31)
    for centre, start in ((10.0, 1), (20.0, 2), (30.0, 3)):
        current, resizes, last, now = start, 0, None, 0.0
        samples: list[LoadSample] = []
        for _ in range(600):
            now += 1.0
            rows = centre * (1 + rng.uniform(-0.15, 0.15))
            samples.append(LoadSample(now, 5, rows * 5))
            d = decide(samples[-20:], current, last, now, POLICY)
            if d.desired != current:
                current, resizes, last = d.desired, resizes + 1, now
        assert resizes == 0, (centre, resizes)


def test_without_a_band_a_wobbling_load_would_flap_but_the_cooldown_bounds_it():
    """The same wobble with band 0: the cooldown alone limits resizes to one per cooldown."""
    policy = AutoscalePolicy(1, 4, 10.0, band=0.0, cooldown_s=30.0, window_s=1.0)
    rng = random.Random(7)
    current, last, times = 1, None, []
    for second in range(1, 601):
        rows = 10.0 * (1 + rng.uniform(-0.15, 0.15))
        d = decide([LoadSample(second, 1, rows)], current, last, float(second), policy)
        if d.desired != current:
            current, last = d.desired, float(second)
            times.append(second)
    assert times, "band 0 should have resized at least once on this wobble (else this test proves nothing)"
    assert all(b - a >= 30 for a, b in zip(times, times[1:])), times
    assert len(times) <= math.ceil(600 / 30)


@pytest.mark.parametrize("fields, message", [
    (dict(min_workers=0), "min_workers must be >= 1, got 0"),
    (dict(min_workers=3, max_workers=2), "max_workers (2) must be >= min_workers (3)"),
    (dict(target_rows_per_worker=0.0), "target_rows_per_worker must be > 0, got 0.0"),
    (dict(band=1.0), "band must be in [0, 1), got 1.0"),
    (dict(cooldown_s=-1.0), "cooldown_s must be >= 0, got -1.0"),
    (dict(window_s=0.0), "window_s must be > 0, got 0.0"),
])
def test_bad_policies_are_refused_naming_the_field(fields, message):
    values = dict(min_workers=1, max_workers=4, target_rows_per_worker=10.0)
    values.update(fields)
    with pytest.raises(ValueError) as error:
        AutoscalePolicy(**values)
    assert message in str(error.value)


# ---- routers ---------------------------------------------------------------------------------
ROUTERS = AutoscalePolicy(min_workers=1, max_workers=4, target_rows_per_worker=10.0, band=0.25, cooldown_s=30.0,
                          window_s=10.0, min_routers=1, max_routers=4, target_requests_per_router=8.0)
QUEUE = dataclasses.replace(ROUTERS, target_queue_s=0.2)


def held(requests: float, now: float, window_s: float = 10.0, admitted: int = 0, queue_s: float = 0.0):
    """One poll a second over the window: ``requests`` held in all; ``admitted`` sequences per
    poll that waited ``queue_s`` each."""
    return [RouterSample(now - window_s + 1 + i, requests, admitted, admitted * queue_s) for i in range(int(window_s))]


def test_group_sample_counts_the_groups_steps_not_every_routers():
    # 2 routers stepping together, 10 steps each, 40 rows each: 80 rows in 10 group steps
    sample = group_sample(5.0, [(10, 40.0), (10, 40.0)])
    assert (sample.steps, sample.rows) == (10, 80.0)
    # one router idle (no steps recorded): the busy one's steps are the group's
    assert group_sample(5.0, [(7, 21.0), (0, 0.0)]) == LoadSample(5.0, 7, 21.0)
    assert group_sample(5.0, []) == LoadSample(5.0, 0, 0.0)


def test_desired_routers_is_the_ceiling_within_the_limits():
    assert [desired_routers(r, ROUTERS) for r in (0, 8, 8.5, 24, 100)] == [1, 1, 2, 3, 4]


def test_routers_grow_to_what_the_requests_want_and_shrink_when_idle():
    d = decide_routers(held(20.0, now=100), 1, None, 100, ROUTERS)
    assert (d.desired, d.direction) == (3, "up") and d.reason.startswith("grow: 20.0 requests per router"), d
    assert d.requests == pytest.approx(20.0) and d.queue_s is None
    d = decide_routers(held(0.0, now=100), 3, None, 100, ROUTERS)
    assert (d.desired, d.direction) == (1, "down") and d.reason.startswith("shrink: 0.0 requests per router"), d
    d = decide_routers(held(0.0, now=100), 1, None, 100, ROUTERS)
    assert d.direction == "hold" and "autoscale.min_routers (1)" in d.reason, d
    d = decide_routers(held(100.0, now=100), 4, None, 100, ROUTERS)
    assert d.direction == "hold" and "autoscale.max_routers (4)" in d.reason, d


def test_routers_hold_inside_the_band_and_wait_out_cooldown_and_window():
    # 2 routers, 18 requests: 9 each, inside 6..10
    assert decide_routers(held(18.0, now=100), 2, None, 100, ROUTERS).direction == "hold"
    d = decide_routers(held(30.0, now=100), 1, 80.0, 100, ROUTERS)
    assert d.direction == "hold" and d.reason.startswith("cooling down: last router resize 20.0 s ago"), d
    quick = dataclasses.replace(ROUTERS, cooldown_s=0.0)
    d = decide_routers(held(30.0, now=100), 1, 95.0, 100, quick)
    assert d.direction == "hold" and "5.0 of 10 s since the last router resize" in d.reason, d
    assert decide_routers(held(30.0, now=100), 1, 90.0, 100, quick).desired == 4
    d = decide_routers(held(30.0, now=100), 6, None, 100, ROUTERS)
    assert d.desired == 4 and "outside [1, 4] (autoscale.min_routers/max_routers)" in d.reason, d


@pytest.mark.parametrize("requests", [0.0, 5.0, 8.0, 8.5, 16.0, 20.0, 31.0, 40.0])
def test_a_steady_request_load_reaches_a_fixed_point_in_one_router_resize(requests):
    for start in range(1, 5):
        current, resizes, last, now = start, 0, None, 0.0
        for _ in range(200):
            now += 2.0
            d = decide_routers(held(requests, now), current, last, now, ROUTERS)
            if d.desired != current:
                current, resizes, last = d.desired, resizes + 1, now
        assert resizes <= 1, (requests, start, resizes)


def test_a_wobbling_request_load_never_flaps_the_routers():
    rng = random.Random(5)
    for centre, start in ((8.0, 1), (16.0, 2), (24.0, 3)):
        current, resizes, last, now, samples = start, 0, None, 0.0, []
        for _ in range(600):
            now += 1.0
            samples.append(RouterSample(now, centre * (1 + rng.uniform(-0.15, 0.15))))
            d = decide_routers(samples[-20:], current, last, now, ROUTERS)
            if d.desired != current:
                current, resizes, last = d.desired, resizes + 1, now
        assert resizes == 0, (centre, resizes)


def queue_at(routers: int, requests: float) -> float:
    """A made-up router pool whose queue time falls with more routers: 12 places per router."""
    return 0.5 if requests > 12 * routers else 0.01


@pytest.mark.parametrize("keep_floor", [True, False])
def test_queue_time_grows_the_routers_and_its_floor_stops_the_flap(keep_floor):
    """20 requests at a target of 25 a router want 1 router by count, but a router has 12
    places, so at 1 router sequences queue. Queue time grows it to 2; there the queue is short
    and the count alone would shrink it back to 1 (and so on, once per cooldown): the floor
    keeps it at 2. Without the floor (keep_floor False) it must flap, or this test proves
    nothing."""
    policy = dataclasses.replace(QUEUE, target_requests_per_router=25.0, cooldown_s=5.0, window_s=4.0)
    current, last, floor, sizes, now, samples = 1, None, None, [], 0.0, []
    for _ in range(300):
        now += 1.0
        samples.append(RouterSample(now, 20.0, 4, 4 * queue_at(current, 20.0)))
        d = decide_routers(samples[-10:], current, last, now, policy, floor)
        floor = d.floor if keep_floor else None
        if d.desired != current:
            current, last = d.desired, now
            sizes.append(current)
    if keep_floor:
        assert sizes == [2], sizes
        # the load goes away: the floor clears and the pool shrinks to its minimum
        for _ in range(60):
            now += 1.0
            samples.append(RouterSample(now, 0.0))
            d = decide_routers(samples[-10:], current, last, now, policy, floor)
            floor = d.floor
            if d.desired != current:
                current, last = d.desired, now
                sizes.append(current)
        assert sizes == [2, 1] and floor is None, (sizes, floor)
    else:
        assert len(sizes) > 4 and set(sizes) == {1, 2}, sizes


def test_a_long_queue_alone_grows_by_one_and_blocks_a_shrink():
    d = decide_routers(held(4.0, now=100, admitted=2, queue_s=1.0), 1, None, 100, QUEUE)
    assert (d.desired, d.floor) == (2, QueueFloor(2, 4.0)) and "queue time above 0.250 s" in d.reason, d
    d = decide_routers(held(4.0, now=100, admitted=2, queue_s=0.18), 3, None, 100, QUEUE)  # 0.15 < 0.18 < 0.25
    assert d.direction == "hold" and "the queue time is not below 0.150 s" in d.reason, d
    d = decide_routers(held(4.0, now=100, admitted=2, queue_s=0.01), 3, None, 100, QUEUE)
    assert d.desired == 1 and d.queue_s == pytest.approx(0.01), d


@pytest.mark.parametrize("fields, message", [
    (dict(target_requests_per_router=8.0), "min_routers and max_routers are required with target_requests_per_router"),
    (dict(target_requests_per_router=8.0, min_routers=3, max_routers=2), "1 <= min_routers <= max_routers, got 3..2"),
    (dict(target_requests_per_router=0.0, min_routers=1, max_routers=2), "target_requests_per_router must be > 0"),
    (dict(target_queue_s=0.5), "target_queue_s needs target_requests_per_router"),
    (dict(target_requests_per_router=8.0, min_routers=1, max_routers=2, target_queue_s=0.0),
     "target_queue_s must be > 0, got 0.0"),
])
def test_bad_router_policies_are_refused(fields, message):
    with pytest.raises(ValueError) as error:
        AutoscalePolicy(min_workers=1, max_workers=4, target_rows_per_worker=10.0, **fields)
    assert message in str(error.value)


def test_decide_routers_refuses_a_policy_without_router_targets():
    with pytest.raises(ValueError, match="router autoscaling is off"):
        decide_routers([], 1, None, 0.0, POLICY)


def test_a_window_without_steps_while_requests_wait_is_a_stall_not_idle():
    """Seen in the benchmark: a 4.7 s stall under 32 clients read as idle shrank 3 -> 1 workers
    (and grew back 6 s later). With the requests held in the samples it holds."""
    stalled = [LoadSample(t, 0, 0.0, requests=32.0) for t in range(91, 101)]
    d = decide(stalled, current=3, last_resize_time=None, now=100, policy=POLICY)
    assert d.direction == "hold" and "while the routers hold 32 requests (stalled, not idle)" in d.reason, d
    idle = [LoadSample(t, 0, 0.0, requests=0.0) for t in range(91, 101)]
    assert decide(idle, current=3, last_resize_time=None, now=100, policy=POLICY).desired == 1
    unread = [LoadSample(t, 0, 0.0) for t in range(91, 101)]  # requests not read: as before, idle
    assert decide(unread, current=3, last_resize_time=None, now=100, policy=POLICY).desired == 1
    assert group_sample(5.0, [], requests=4.0) == LoadSample(5.0, 0, 0.0, 4.0)
