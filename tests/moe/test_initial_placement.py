"""Initial placement: exact layouts for small cases, replica filling, explicit maps, errors."""

from __future__ import annotations

import enum

import numpy as np
import pytest

from raymoe.moe.initial_placement import initial_placement


def layout(table, layer: int = 0) -> list[list[int]]:
    """``[W][S]`` experts per worker slot at ``layer``."""
    return [table.worker_experts(layer, w) for w in range(table.num_workers)]


def assert_valid(table, num_experts: int) -> None:
    """Every expert placed, no empty slot, no expert twice on one worker when avoidable."""
    assert (table.phy2log >= 0).all()
    assert (table.logcnt >= 1).all()
    for layer in range(table.num_layers):
        for experts in layout(table, layer):
            if len(experts) <= num_experts:
                assert len(set(experts)) == len(experts), experts


@pytest.mark.parametrize(
    "num_experts, num_workers, expected",
    [
        (6, 3, [[0, 1], [2, 3], [4, 5]]),
        (4, 4, [[0], [1], [2], [3]]),
        (8, 2, [[0, 1, 2, 3], [4, 5, 6, 7]]),
        (5, 2, [[0, 1, 2], [3, 4, 0]]),  # uneven: the spare slot replicates expert 0
        (5, 3, [[0, 1], [2, 3], [4, 0]]),
        (2, 3, [[0], [1], [0]]),  # more workers than experts
    ],
)
def test_contiguous(num_experts, num_workers, expected):
    table = initial_placement(2, num_experts, num_workers, "contiguous")
    assert layout(table, 0) == expected and layout(table, 1) == expected
    assert table.slots_per_worker == -(-num_experts // num_workers)
    assert table.epoch == 0


@pytest.mark.parametrize(
    "num_experts, num_workers, expected",
    [
        (6, 3, [[0, 3], [1, 4], [2, 5]]),
        (8, 2, [[0, 2, 4, 6], [1, 3, 5, 7]]),
        (5, 2, [[0, 2, 4], [1, 3, 0]]),
        (7, 3, [[0, 3, 6], [1, 4, 0], [2, 5, 1]]),
    ],
)
def test_round_robin(num_experts, num_workers, expected):
    assert layout(initial_placement(1, num_experts, num_workers, "round_robin")) == expected


def test_redundant_slots_go_round_robin_over_experts_without_duplicates():
    table = initial_placement(1, 6, 3, "round_robin", redundant_slots_per_worker=1)
    # Base [[0, 3], [1, 4], [2, 5]]; replicas of 0, 1, 2 in turn. Greedily 0 -> worker 1,
    # 1 -> worker 0 would leave only worker 2's slot for expert 2, which it holds: the
    # replica of 1 moves there and 2 takes its slot on worker 0.
    assert layout(table) == [[0, 3, 2], [1, 4, 0], [2, 5, 1]]
    assert table.logcnt.tolist() == [[2, 2, 2, 1, 1, 1]]
    assert_valid(table, 6)
    table = initial_placement(1, 4, 2, "contiguous", redundant_slots_per_worker=1)
    assert layout(table) == [[0, 1, 2], [2, 3, 0]]


@pytest.mark.parametrize("strategy", ["contiguous", "round_robin"])
@pytest.mark.parametrize("num_experts, num_workers, redundant", [(8, 4, 2), (16, 4, 3), (5, 3, 1), (64, 8, 2), (3, 3, 1)])
def test_layouts_are_complete_and_spread(strategy, num_experts, num_workers, redundant):
    table = initial_placement(3, num_experts, num_workers, strategy, redundant)
    assert table.slots_per_worker == -(-num_experts // num_workers) + redundant
    assert_valid(table, num_experts)
    # Without load, replica counts differ by at most one: round robin over the experts.
    assert table.logcnt.max() - table.logcnt.min() <= 1


def test_duplicates_only_when_unavoidable():
    # 2 experts, 3 slots per worker: every worker must hold one expert twice.
    table = initial_placement(1, 2, 2, "round_robin", redundant_slots_per_worker=2)
    for experts in layout(table):
        assert sorted(set(experts)) == [0, 1]
    assert table.logcnt.tolist() == [[3, 3]]


def test_hottest_expert_gets_replicas_first():
    load = np.array([[1.0, 1.0, 10.0, 1.0]])
    table = initial_placement(1, 4, 2, "round_robin", redundant_slots_per_worker=1, load=load)
    # Expert 2 (on worker 0) is replicated on worker 1; then the coldest-per-replica ties
    # go by fewest replicas and lowest id: expert 1 onto worker 0.
    assert layout(table) == [[0, 2, 1], [1, 3, 2]]


def test_replicas_follow_load_per_replica():
    load = np.array([[100.0, 1, 1, 1, 30, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1, 100]])
    table = initial_placement(2, 8, 4, "contiguous", redundant_slots_per_worker=1, load=load)
    # Layer 0: 100/1, 100/2, 100/3 beat 30, so expert 0 gets three replicas, then expert 4.
    assert table.logcnt[0].tolist() == [4, 1, 1, 1, 2, 1, 1, 1]
    # Layer 1: expert 7 is on all 4 workers after three replicas; the last spare slot's
    # worker already holds it, so the next in line (fewest replicas, lowest id) goes there.
    assert table.logcnt[1, 7] == 4 and table.logcnt[1].sum() == 12
    assert_valid(table, 8)


def test_load_per_replica_greedy_matches_reference():
    rng = np.random.default_rng(0)
    load = rng.random((4, 12)) * 10
    table = initial_placement(4, 12, 4, "contiguous", redundant_slots_per_worker=2, load=load)
    for layer in range(4):
        # Reference: EPLB's replica count rule, repeatedly +1 for the max load / count.
        count = np.ones(12, dtype=int)
        for _ in range(4 * 2):
            count[np.argmax(load[layer] / count)] += 1
        assert table.logcnt[layer].tolist() == count.tolist()
    assert_valid(table, 12)


def test_strategy_accepts_an_enum_value():
    class Strategy(enum.Enum):
        ROUND_ROBIN = "round_robin"

    by_enum = initial_placement(2, 6, 3, Strategy.ROUND_ROBIN, 1)
    assert by_enum.same_placement(initial_placement(2, 6, 3, "round_robin", 1))


def test_deterministic_and_worker2node():
    a = initial_placement(3, 10, 4, "contiguous", 2, worker2node=[0, 0, 1, 1])
    b = initial_placement(3, 10, 4, "contiguous", 2, worker2node=[0, 0, 1, 1])
    assert a.same_placement(b) and a.worker2node.tolist() == [0, 0, 1, 1] and a.num_nodes == 2


def test_explicit_with_per_layer_override_and_padding():
    table = initial_placement(
        3,
        6,
        2,
        "explicit",
        redundant_slots_per_worker=1,
        explicit={0: [0, 1, 2, 3], 1: [4, 5]},
        explicit_layers={2: {0: [5], 1: [0, 1, 2, 3, 4]}},
    )
    assert table.slots_per_worker == 5 + 1  # longest list over all layers, plus redundant
    for layer in (0, 1):
        assert layout(table, layer)[0][:4] == [0, 1, 2, 3]
        assert layout(table, layer)[1][:2] == [4, 5]
    assert layout(table, 2)[0][:1] == [5]
    assert layout(table, 2)[1][:5] == [0, 1, 2, 3, 4]
    assert_valid(table, 6)


def test_explicit_worker_left_out_holds_replicas():
    table = initial_placement(1, 4, 3, "explicit", explicit={0: [0, 1], 1: [2, 3]})
    assert layout(table) == [[0, 1], [2, 3], [0, 1]]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(explicit={0: [0, 1], 1: [2]}), r"explicit map: experts \[3\] are not placed on any worker"),
        (
            dict(explicit={0: [0, 1], 1: [2, 3]}, explicit_layers={1: {0: [0], 1: [3]}}),
            r"layer 1 override: experts \[1, 2\] are not placed on any worker",
        ),
        (dict(explicit={0: [0, 1, 1], 1: [2, 3]}), r"worker 0 lists experts \[1\] more than once"),
        (dict(explicit={0: [0, 1], 2: [2, 3]}), r"worker 2 does not exist \(workers 0..1\)"),
        (dict(explicit={0: [0, 1], 1: [2, 3, 4]}), r"worker 1 lists experts \[4\] outside 0..3"),
        (dict(explicit={0: [0, 1], 1: [2, 3]}, explicit_layers={5: {0: [0, 1, 2, 3]}}), r"layers \[5\]"),
        (dict(), r"strategy 'explicit' needs an explicit"),
    ],
)
def test_explicit_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        initial_placement(2, 4, 2, "explicit", **kwargs)


@pytest.mark.parametrize(
    "args, kwargs, message",
    [
        ((2, 4, 2, "diagonal"), {}, r"strategy: expected one of contiguous, round_robin, explicit; got 'diagonal'"),
        ((2, 4, 0, "contiguous"), {}, r"num_workers: expected an integer >= 1; got 0"),
        ((2, 0, 2, "contiguous"), {}, r"num_experts"),
        ((2, 4, 2, "contiguous", -1), {}, r"redundant_slots_per_worker"),
        ((2, 4, 2, "contiguous"), dict(explicit={0: [0]}), r"only used by strategy 'explicit'"),
        ((2, 4, 2, "contiguous"), dict(load=np.ones((2, 3))), r"load must be"),
        ((2, 4, 2, "contiguous"), dict(load=-np.ones((2, 4))), r"load must be"),
        ((2, 4, 2, "contiguous"), dict(worker2node=[0, 0, 1]), r"worker2node"),
    ],
)
def test_argument_errors(args, kwargs, message):
    with pytest.raises(ValueError, match=message):
        initial_placement(*args, **kwargs)
