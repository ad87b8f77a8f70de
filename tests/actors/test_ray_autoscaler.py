"""Ray's own autoscaler brings and takes away the expert nodes (issue 31 item 3).

The cluster is :class:`ray.cluster_utils.AutoscalingCluster` (autoscaling_cluster.py): Ray's
real autoscaler over simulated nodes on this machine. The head has no ``raymoe_expert``
resource; the ``expert`` node type has one (a worker's worth) and 0..3 nodes, as a `ray up`
file's expert node type (cluster/ray-up/, docs/DEPLOY.md). With
``placement.worker_resources: {raymoe_expert: 1}`` every worker's bundle fits only an expert
node, so the deploy and each grow make the autoscaler launch one; a shrink leaves them idle and
it removes them. Outputs stay equal to the in-process engine's throughout."""

from __future__ import annotations

import time

import pytest
import ray

from autoscaling_cluster import ScopedAutoscalingCluster
from ep_helpers import GREEDY, cluster_config, prompts, reference_engine
from raymoe.cluster.deploy import deploy

pytestmark = pytest.mark.slow

EXPERT = "raymoe_expert"
ROUTER = "raymoe_router"
# 15 s idle, then the autoscaler removes a node (3 s removed a node launched for a worker's
# bundle before the worker had started on it, on the loaded CI machine: the deploy failed)
IDLE_TIMEOUT_MIN = 0.25


@pytest.fixture(scope="module")
def autoscaling_ray():
    """A Ray of this module's own (never a neighbour's): head + 0..3 expert nodes."""
    cluster = ScopedAutoscalingCluster(
        head_resources={"CPU": 4, ROUTER: 2},
        worker_node_types={"expert": {"resources": {"CPU": 1, EXPERT: 1}, "node_config": {},
                                      "min_workers": 0, "max_workers": 3}},
        idle_timeout_minutes=IDLE_TIMEOUT_MIN)
    cluster.start()
    try:
        ray.init(address=cluster.address)
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()


def expert_nodes() -> set[str]:
    return {n["NodeID"] for n in ray.nodes() if n["Alive"] and n["Resources"].get(EXPERT)}


def wait_for(condition, timeout_s: float, what: str) -> float:
    """Seconds until ``condition()`` held; fails after ``timeout_s``, saying ``what``."""
    start = time.monotonic()
    while not condition():
        assert time.monotonic() - start < timeout_s, f"{what} within {timeout_s:g} s (expert nodes: {expert_nodes()})"
        time.sleep(0.25)
    return time.monotonic() - start


def test_grow_launches_expert_nodes_and_shrink_lets_the_autoscaler_remove_them(autoscaling_ray, tiny_mixtral_dir):
    batch = prompts(8, seed=313)
    want = [o.output_token_ids for o in reference_engine(tiny_mixtral_dir).generate(batch, GREEDY)]
    assert expert_nodes() == set()  # min_workers 0: no expert node until a worker asks for one
    config = cluster_config(tiny_mixtral_dir, expert_workers=1, routers=1,
                            comm={"backend": "sockets", "timeout_s": 3.0},
                            balancer={"enabled": True, "interval_steps": 10**9, "poll_interval_s": 0.2},
                            placement={"worker_resources": {EXPERT: 1}, "router_resources": {ROUTER: 1}})
    deployment = deploy(config, name="autoscaled", ready_timeout_s=60)
    try:
        head = {n["NodeID"] for n in ray.nodes() if n["Alive"] and not n["Resources"].get(EXPERT)}
        first = ray.get(deployment.workers[0].info.remote())["node_id"]
        assert expert_nodes() == {first}  # the autoscaler launched it for worker 0's bundle
        assert ray.get(deployment.routers[0].info.remote())["node_id"] in head  # routers stay off expert nodes
        assert [o.output_token_ids for o in deployment.generate(batch, GREEDY)] == want

        # Grow to 3: two bundles of {raymoe_expert: 1} fit no live node; Ray's autoscaler adds two.
        start = time.monotonic()
        grown = deployment.resize(3, ready_timeout_s=60)
        grow_s = time.monotonic() - start
        assert grown["resized"] is True and grown["workers"] == 3, grown
        nodes = [info["node_id"] for info in ray.get([w.info.remote() for w in deployment.workers])]
        assert len(set(nodes)) == 3 and set(nodes) == expert_nodes(), (nodes, expert_nodes())
        assert [o.output_token_ids for o in deployment.generate(batch, GREEDY)] == want
        rows = [t["worker_rows"] for t in deployment.telemetry()]
        assert all(len(r) == 3 for r in rows) and all(sum(r[w] for r in rows) > 0 for w in (1, 2)), rows

        # Shrink to 1: the two added nodes go idle; the autoscaler removes them after idle_timeout.
        shrunk = deployment.resize(1)
        assert shrunk["resized"] is True and shrunk["workers"] == 1, shrunk
        removed_s = wait_for(lambda: expert_nodes() == {first}, 90, "the autoscaler did not remove the idle nodes")
        assert [o.output_token_ids for o in deployment.generate(batch, GREEDY)] == want
        print(f"\ngrow 1->3 with 2 nodes launched: {grow_s:.1f} s; idle nodes removed {removed_s:.1f} s "
              f"after the shrink (idle_timeout {IDLE_TIMEOUT_MIN * 60:g} s)")
    finally:
        deployment.shutdown()
