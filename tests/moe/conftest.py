"""Shared helpers for the placement tests: seeded Zipf loads and brute-force optima."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from raymoe.moe.traffic import TrafficKind, TrafficSpec, popularity, sample_load


def all_placements(num_experts: int, num_slots: int) -> np.ndarray:
    """[n, P] every slot assignment that gives each expert at least one slot."""
    rows = [row for row in itertools.product(range(num_experts), repeat=num_slots) if len(set(row)) == num_experts]
    return np.array(rows, dtype=np.int64)


class ZipfWorkload:
    """One Zipf popularity per layer and independent token samples of it."""

    def __init__(self, exponent: float, seed: int, num_layers: int = 6, num_experts: int = 64):
        self.rng = np.random.default_rng(seed)
        self.num_experts = num_experts
        self.spec = TrafficSpec(TrafficKind.ZIPF, zipf_s=exponent)
        self.probabilities = popularity(self.spec, num_layers, num_experts, self.rng)

    def sample(self, num_tokens: int = 4096, top_k: int = 8) -> np.ndarray:
        return sample_load(self.probabilities, num_tokens, top_k, self.rng).astype(np.float64)

    def moved(self) -> "ZipfWorkload":
        """The same exponent with a new hot set in every layer."""
        other = ZipfWorkload(self.spec.zipf_s, 0, self.probabilities.shape[0], self.num_experts)
        other.rng = self.rng
        other.probabilities = popularity(self.spec, self.probabilities.shape[0], self.num_experts, self.rng)
        return other


@pytest.fixture
def zipf_workload():
    return ZipfWorkload


@pytest.fixture
def placements_of():
    return all_placements
