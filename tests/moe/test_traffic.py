"""Traffic generators: popularity shapes, top-k sampling, drift."""

from __future__ import annotations

import numpy as np
import pytest

from raymoe.moe.traffic import (
    TrafficKind,
    TrafficSpec,
    drifting_popularity,
    popularity,
    sample_load,
    sample_routing,
    zipf_weights,
)


@pytest.mark.parametrize("kind", list(TrafficKind))
def test_popularity_rows_are_distributions(kind):
    rows = popularity(TrafficSpec(kind), 3, 16, np.random.default_rng(0))
    assert rows.shape == (3, 16)
    np.testing.assert_allclose(rows.sum(axis=1), 1.0)
    assert (rows >= 0).all()


def test_zipf_ranks_and_per_layer_shuffle():
    weights = zipf_weights(8, 1.0)
    assert weights[0] / weights[3] == pytest.approx(4.0)
    rows = popularity(TrafficSpec(TrafficKind.ZIPF, zipf_s=1.0), 4, 8, np.random.default_rng(1))
    np.testing.assert_allclose(np.sort(rows, axis=1)[:, ::-1], np.tile(weights, (4, 1)))
    assert len({int(np.argmax(row)) for row in rows}) > 1


def test_hot_experts_carry_their_fraction():
    rows = popularity(TrafficSpec(TrafficKind.HOT, num_hot=2, hot_fraction=0.6), 1, 10, np.random.default_rng(2))
    assert np.sort(rows[0])[-2:].sum() == pytest.approx(0.6)


def test_routing_picks_distinct_experts_in_proportion():
    rng = np.random.default_rng(3)
    probabilities = np.array([[0.5, 0.3, 0.1, 0.1]])
    ids = sample_routing(probabilities, 20000, 1, rng)
    np.testing.assert_allclose(np.bincount(ids.reshape(-1)) / 20000, probabilities[0], atol=0.01)
    ids = sample_routing(probabilities, 500, 3, rng)
    assert all(len(set(token)) == 3 for token in ids[0])


def test_sampling_is_seeded():
    probabilities = popularity(TrafficSpec(TrafficKind.DOMAIN_MIX), 2, 8, np.random.default_rng(4))
    first = sample_load(probabilities, 100, 2, np.random.default_rng(5))
    second = sample_load(probabilities, 100, 2, np.random.default_rng(5))
    np.testing.assert_array_equal(first, second)
    assert first.sum() == 2 * 100 * 2


def test_drift_moves_from_one_hot_set_to_another():
    steps = drifting_popularity(TrafficSpec(TrafficKind.ZIPF, zipf_s=1.5), 1, 32, 5, np.random.default_rng(6))
    assert steps.shape == (5, 1, 32)
    np.testing.assert_allclose(steps.sum(axis=2), 1.0)
    assert np.argmax(steps[0, 0]) != np.argmax(steps[-1, 0])
    still = drifting_popularity(TrafficSpec(TrafficKind.ZIPF), 1, 8, 3, np.random.default_rng(7), drift=0.0)
    np.testing.assert_allclose(still[0], still[-1])


def test_invalid_specs_raise():
    with pytest.raises(ValueError):
        TrafficSpec(TrafficKind.HOT, hot_fraction=1.5)
    with pytest.raises(ValueError):
        sample_routing(np.full((1, 4), 0.25), 10, 5, np.random.default_rng(0))
