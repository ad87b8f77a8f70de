"""How long a router without work waits before agreeing on the next group step."""

from __future__ import annotations

from raymoe.actors.router import IDLE_MAX_S, IDLE_MIN_S, TICK_S, idle_wait_s


def test_a_router_without_work_agrees_at_once_right_after_a_group_step():
    # another router has work and waits in the agreement for this one: no sleep here
    assert idle_wait_s(num_routers=2, idle_rounds=0) is None
    assert idle_wait_s(num_routers=8, idle_rounds=0) is None


def test_idle_routers_back_off_from_half_a_millisecond_to_the_cap():
    waits = [idle_wait_s(num_routers=2, idle_rounds=rounds) for rounds in range(1, 40)]
    assert waits[0] == IDLE_MIN_S and waits[1] == 2 * IDLE_MIN_S
    assert all(a <= b for a, b in zip(waits, waits[1:])) and max(waits) == IDLE_MAX_S


def test_a_lone_router_waits_for_work_up_to_the_tick():
    assert idle_wait_s(num_routers=1, idle_rounds=0) == TICK_S
    assert idle_wait_s(num_routers=1, idle_rounds=5) == TICK_S
