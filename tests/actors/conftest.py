"""Fixtures the actor tests share."""

from __future__ import annotations

import pytest
import ray


@pytest.fixture(scope="module")
def ray_session():
    """A Ray of our own for one test module (never a neighbour's), shut down after it."""
    ray.init(address="local", num_cpus=4, include_dashboard=False)
    yield
    ray.shutdown()
