"""The autoscaling policy (moe/autoscale_policy.py): sizes from load, limits, cooldown, the
hysteresis band, and no flapping under a steady or wobbling load."""

from __future__ import annotations

import math
import random

import pytest

from raymoe.moe.autoscale_policy import AutoscalePolicy, LoadSample, decide, desired_size

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
