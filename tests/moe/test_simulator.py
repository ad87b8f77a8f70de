"""Routing simulator: the seeds' skew table, bytes by hand, drops, telemetry replay."""

from __future__ import annotations

import numpy as np
import pytest

from raymoe.moe.placement import PlacementTable
from raymoe.moe.simulator import load_from_telemetry, replay_load, simulate_routing
from raymoe.moe.traffic import sample_routing

SKEWED = [640, 320, 256, 224, 192, 160, 144, 112]


def skewed_routing():
    """1,024 tokens, top-2, expert e chosen SKEWED[e] times, two distinct experts per token."""
    ids = np.repeat(np.arange(8), SKEWED)  # 2,048 assignments, sorted by expert
    return np.stack([ids[:1024], ids[1024:]], axis=1)[None]  # [1, T, 2]


def test_seed_skew_table_busiest_rank_is_two_and_a_half_times_the_mean():
    routing = skewed_routing()
    assert all(a != b for a, b in routing[0])
    one_expert_per_rank = PlacementTable.from_phy2log([list(range(8))], 1, 8)
    result = simulate_routing(routing, one_expert_per_rank, hidden_size=4096, bytes_per_value=2)
    assert result.assignments_per_worker[0].tolist() == SKEWED
    assert result.assignments_per_worker.mean() == 256
    assert result.imbalance == 640 / 256 == 2.5
    assert result.dispatch_bytes_naive == 16 * (1 << 20)


def test_bytes_and_dedup_by_hand():
    # 2 workers on 2 nodes, experts 0,1 on worker 0 and 2,3 on worker 1; 2 tokens from each.
    placement = PlacementTable.from_phy2log([[0, 1, 2, 3]], 2, 4, worker2node=[0, 1])
    routing = np.array([[[2, 3], [0, 2], [0, 1], [1, 2]]])
    result = simulate_routing(routing, placement, hidden_size=4, bytes_per_value=2)
    # Tokens 0,1 start on worker 0; tokens 2,3 on worker 1. Remote: t0 x2, t1 x1, t2 x2, t3 x1.
    assert result.dispatch_bytes_naive == 8 * 8
    assert result.dispatch_bytes_remote == 6 * 8
    assert result.dispatch_bytes_dedup_worker == 4 * 8  # each token once to the other worker
    assert result.dispatch_bytes_dedup_node == 4 * 8
    assert result.cross_worker_fraction == 6 / 8
    assert result.assignments_per_worker.tolist() == [[4, 4]]


def test_replicas_split_evenly_and_capacity_drops():
    placement = PlacementTable.from_phy2log([[0, 1, 0, 1]], 2, 2)
    routing = np.zeros((1, 8, 1), dtype=np.int64)  # every token to expert 0
    result = simulate_routing(routing, placement, 1, 1, capacity_factor=1.0)
    assert result.assignments_per_worker.tolist() == [[4, 4]]
    assert result.dropped == 2 * (4 - 2)  # capacity ceil(8 / 4) = 2 per slot


def test_uniform_traffic_is_seven_eighths_remote():
    rng = np.random.default_rng(0)
    placement = PlacementTable.from_phy2log([list(range(64))], 8, 64)
    routing = sample_routing(np.full((1, 64), 1 / 64), 8192, 2, rng)
    result = simulate_routing(routing, placement, 4096, 2)
    assert result.cross_worker_fraction == pytest.approx(7 / 8, abs=0.01)


def test_replay_per_slot_telemetry_and_agreement_with_routing():
    placement = PlacementTable.from_phy2log([[0, 1, 0, 2]], 2, 3)
    load = load_from_telemetry({"slot_load": [[30, 10, 50, 20]]}, placement)
    np.testing.assert_array_equal(load, [[80, 10, 20]])
    replay = replay_load(load, placement)
    assert replay["assignments_per_worker"] == [[50.0, 60.0]]
    routing = np.repeat(np.array([0, 1, 2]), [80, 10, 20])[None, :, None]
    simulated = simulate_routing(routing, placement, 1, 1)
    assert simulated.assignments_per_worker.tolist() == [[50, 60]]


def test_bad_inputs_raise():
    placement = PlacementTable.from_phy2log([[0, 1]], 1, 2)
    with pytest.raises(ValueError, match="needs the placement"):
        load_from_telemetry({"slot_load": [[1, 2]]})
    with pytest.raises(ValueError, match="topk_ids"):
        simulate_routing(np.zeros((2, 3, 1), dtype=int), placement, 1, 1)
