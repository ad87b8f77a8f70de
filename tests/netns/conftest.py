"""The network-namespace cluster (netns_cluster.py) as a module-scoped fixture: one Ray start
per test module, torn down (processes by pid, namespaces, links) even when a test fails;
skipped, with the reason, where namespaces cannot be made (not root, no CAP_NET_ADMIN, no `ip`)."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))  # the driver's pool child unpickles netns_driver by name

from netns_cluster import NetnsCluster, cleanup_stale, why_unavailable  # noqa: E402


@pytest.fixture(scope="module")
def netns_cluster():
    reason = why_unavailable()
    if reason is not None:
        pytest.skip(f"network-namespace cluster unavailable: {reason}")
    cleanup_stale()
    cluster = NetnsCluster(nodes=2, cpus_per_node=2)
    with cluster:
        yield cluster
