"""Activated-expert balancing: brute force on tiny instances, and fewer activations in decode."""

from __future__ import annotations

import numpy as np

from raymoe.moe.balance_activated import balance_activated, expected_activated
from raymoe.moe.balance_global import balance_global
from raymoe.moe.balancer import BalancerAlgorithm, plan_placement
from raymoe.moe.simulator import simulate_routing
from raymoe.moe.traffic import TrafficKind, TrafficSpec, popularity, sample_routing


def test_tiny_instances_against_brute_force(placements_of):
    rng = np.random.default_rng(11)
    rows = placements_of(5, 6)
    for _ in range(10):
        load = (rng.random(5) ** 3 * 100 + 1)[None]
        counts = balance_activated(load, 2, 3, 4.0).logcnt[0]
        # Brute force over packings with the same replica counts the balancer chose.
        same_counts = rows[(np.stack([np.bincount(r, minlength=5) for r in rows]) == counts).all(axis=1)]
        best = min(expected_activated(load, r[None], 3, 4.0).max() for r in same_counts)
        ours = expected_activated(load, balance_activated(load, 2, 3, 4.0).phy2log, 3, 4.0).max()
        assert ours <= best * 1.05 + 1e-12


def test_fewer_activated_experts_than_token_balancing_in_decode():
    rng = np.random.default_rng(2)
    probabilities = popularity(TrafficSpec(TrafficKind.ZIPF, zipf_s=1.5), 4, 64, rng)
    history = np.stack([np.bincount(ids.reshape(-1), minlength=64) for ids in sample_routing(probabilities, 20000, 2, rng)])
    tokens_per_step, top_k = 32, 2
    activated = plan_placement(
        history, 8, 9, BalancerAlgorithm.ACTIVATED, assignments_per_step=tokens_per_step * top_k
    ).placement
    tokens = balance_global(history, 8, 9)
    # The objective itself: the expected activated experts of the busiest worker.
    expected = {
        name: expected_activated(history, table.phy2log, 9, tokens_per_step * top_k).max(axis=1).mean()
        for name, table in (("activated", activated), ("tokens", tokens))
    }
    assert expected["activated"] < 0.95 * expected["tokens"]
    # Simulated decode steps: the busiest worker's distinct activated experts, per step.
    peaks = {"activated": [], "tokens": []}
    for _ in range(200):
        step = sample_routing(probabilities, tokens_per_step, top_k, rng)
        for name, table in (("activated", activated), ("tokens", tokens)):
            peaks[name].append(simulate_routing(step, table, 16, 2).activated_per_worker.max(axis=1).mean())
    assert np.mean(peaks["activated"]) < np.mean(peaks["tokens"])
