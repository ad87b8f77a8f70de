"""Expert workers spread over the nodes of a real multi-node Ray cluster (on one machine)."""

from __future__ import annotations

import time

import pytest
import ray
from ray.cluster_utils import Cluster

from ep_helpers import GREEDY, cluster_config, prompts, reference_engine
from raymoe.cluster.deploy import deploy


@pytest.fixture(scope="module")
def three_nodes():
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    for _ in range(2):
        cluster.add_node(num_cpus=1)
    ray.init(address=cluster.address)
    yield cluster
    ray.shutdown()
    cluster.shutdown()


def test_strict_spread_puts_workers_on_different_nodes_and_outputs_do_not_change(three_nodes, tiny_mixtral_dir):
    batch = prompts(4, seed=11)
    expected = [o.output_token_ids for o in reference_engine(tiny_mixtral_dir).generate(batch, GREEDY)]
    config = cluster_config(
        tiny_mixtral_dir, expert_workers=3, routers=1,
        placement={"strategy": "round_robin", "redundant_slots_per_worker": 1, "node_strategy": "STRICT_SPREAD"},
    )
    deployment = deploy(config, name="ep-multinode")
    try:
        assert len(set(deployment.worker_nodes)) == 3
        assert sorted(deployment.placement.worker2node.tolist()) == [0, 1, 2]
        infos = ray.get([w.info.remote() for w in deployment.workers])
        assert len({info["node_id"] for info in infos}) == 3  # the actors really run there
        assert [o.output_token_ids for o in deployment.generate(batch, GREEDY)] == expected
    finally:
        deployment.shutdown()


def test_workers_per_node_puts_several_workers_on_each_node(three_nodes, tiny_mixtral_dir):
    """Four workers, two per bundle, STRICT_SPREAD: workers 0-1 share one node, 2-3 another."""
    batch = prompts(4, seed=12)
    expected = [o.output_token_ids for o in reference_engine(tiny_mixtral_dir).generate(batch, GREEDY)]
    config = cluster_config(
        tiny_mixtral_dir, expert_workers=4, routers=1,
        placement={"strategy": "round_robin", "node_strategy": "STRICT_SPREAD", "workers_per_node": 2},
    )
    deployment = deploy(config, name="ep-per-node")
    try:
        nodes = [info["node_id"] for info in ray.get([w.info.remote() for w in deployment.workers])]
        assert nodes[0] == nodes[1] and nodes[2] == nodes[3] and nodes[0] != nodes[2]
        assert deployment.worker_nodes == nodes
        table = deployment.placement.worker2node.tolist()
        assert table[0] == table[1] and table[2] == table[3] and table[0] != table[2]
        assert [o.output_token_ids for o in deployment.generate(batch, GREEDY)] == expected
    finally:
        deployment.shutdown()


def test_strict_spread_beyond_the_nodes_is_a_clear_error(three_nodes, tiny_mixtral_dir):
    config = cluster_config(tiny_mixtral_dir, expert_workers=4, placement={"node_strategy": "STRICT_SPREAD"})
    with pytest.raises(RuntimeError, match="could not reserve 4 expert-worker bundles"):
        deploy(config, name="ep-too-many", ready_timeout_s=5)


def test_a_hot_expert_migrates_across_nodes_and_outputs_do_not_change(three_nodes, tmp_path):
    from raymoe.engine.sampling_params import SamplingParams
    from tiny_models import build_skewed_model, write_checkpoint

    path = write_checkpoint(build_skewed_model(), str(tmp_path / "skewed"))
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    batch = prompts(12, seed=5)
    expected = [o.output_token_ids for o in reference_engine(path).generate(batch, params)]
    config = cluster_config(
        path, expert_workers=2, routers=1,
        placement={"strategy": "explicit", "node_strategy": "STRICT_SPREAD",
                   "experts": {0: [0, 1], 1: [2, 3, 4, 5, 6, 7]}},  # the hot experts 0, 1 on node A only
        balancer={"enabled": True, "interval_steps": 3, "window_steps": 30, "poll_interval_s": 0.2},
    )
    deployment = deploy(config, name="ep-migrate")
    try:
        assert len(set(deployment.worker_nodes)) == 2
        outputs = []
        deadline = time.monotonic() + 90  # the controller's decision needs its window; a loaded machine slows it
        for round_ in range(40):
            if time.monotonic() > deadline:
                break
            outputs = deployment.generate(batch, params)
            assert [o.output_token_ids for o in outputs] == expected  # before, during and after
            if deployment.status()["rebalances"] >= 1:
                break
        status = deployment.status()
        assert status["rebalances"] >= 1, status
        moved = status["last_rebalance"]["moved"]
        assert any(not copy["same_node"] and copy["expert"] in (0, 1) for copy in moved), moved
        assert [o.output_token_ids for o in deployment.generate(batch, params)] == expected
    finally:
        deployment.shutdown()


def test_a_node_removed_under_load_loses_no_request(three_nodes, tiny_mixtral_dir):
    import threading

    batch = prompts(40, seed=9)
    expected = [o.output_token_ids for o in reference_engine(tiny_mixtral_dir).generate(batch, GREEDY)]
    config = cluster_config(tiny_mixtral_dir, expert_workers=2, routers=1,
                            placement={"strategy": "round_robin", "node_strategy": "STRICT_SPREAD"},
                            comm={"backend": "gloo", "timeout_s": 3.0}, balancer={"enabled": False})
    deployment = deploy(config, name="ep-node-loss")
    try:
        head = ray.get_runtime_context().get_node_id()
        router_node = ray.get(deployment.routers[0].info.remote())["node_id"]
        controller_node = ray.get(deployment.controller.status.remote())  # up
        assert controller_node
        # A node that holds an expert worker but neither the driver nor the router.
        victim_node = next(n for n in deployment.worker_nodes if n not in (head, router_node))
        victim = next(node for node in three_nodes.list_all_nodes() if node.node_id == victim_node)
        result: dict = {}
        runner = threading.Thread(target=lambda: result.setdefault("outputs", deployment.generate(batch, GREEDY)))
        runner.start()
        deadline = time.monotonic() + 60
        while not deployment.telemetry()[0]["steps"] and time.monotonic() < deadline:
            time.sleep(0.05)
        three_nodes.remove_node(victim)
        runner.join(timeout=400)
        assert not runner.is_alive(), "requests did not finish after the node was removed"
        assert [o.output_token_ids for o in result["outputs"]] == expected
        recoveries = deployment.status()["recoveries"]
        assert recoveries and recoveries[0]["lost_workers"], recoveries
    finally:
        deployment.shutdown()


def test_a_shrink_leaves_no_actor_on_the_nodes_it_freed(three_nodes, tiny_mixtral_dir):
    """An actor keeps its node from counting idle, even with num_cpus=0 (Ray's idle-node rule),
    so one left on a node a shrink freed keeps Ray's autoscaler from ever removing that node.
    Seen in CI: the rank watch's SlotReaders (one per node with a rank, actors/rank_watch.py)
    outlived the workers they read, and the two expert nodes a shrink freed stayed up."""
    from ray._private.state import actors

    while sum(node["Alive"] for node in ray.nodes()) < 3:  # (a test before this one removes a node)
        three_nodes.add_node(num_cpus=1)
    three_nodes.wait_for_nodes()
    batch = prompts(4, seed=14)
    expected = [o.output_token_ids for o in reference_engine(tiny_mixtral_dir).generate(batch, GREEDY)]
    config = cluster_config(tiny_mixtral_dir, expert_workers=3, routers=1,  # 3 + 5 slots: one worker holds all 8
                            placement={"strategy": "round_robin", "node_strategy": "STRICT_SPREAD",
                                       "redundant_slots_per_worker": 5},
                            balancer={"enabled": False})
    deployment = deploy(config, name="ep-shrink-idle")
    try:
        # The watch takes every rank for one on another node (as test_wedge_overload.py does):
        # it keeps a reader on every node with a rank, wherever Ray put the controller.
        def pretend_remote(self):
            self._rank_watch._node_id = "f" * 56
            return True

        def reader_nodes(self):
            return sorted(self._rank_watch._readers)

        assert ray.get(deployment.controller.__ray_call__.remote(pretend_remote), timeout=30)
        nodes = [info["node_id"] for info in ray.get([w.info.remote() for w in deployment.workers])]
        router_node = ray.get(deployment.routers[0].info.remote())["node_id"]

        def alive_on(where: set[str]) -> list[str]:
            return [f"{a.get('ActorClassName')} on {a['Address']['NodeID'][:8]}" for a in actors().values()
                    if a.get("State") == "ALIVE" and (a.get("Address") or {}).get("NodeID") in where]

        deadline = time.monotonic() + 60  # a reader up on every worker's node (else the test proves nothing)
        while not (set(nodes) <= set(ray.get(deployment.controller.__ray_call__.remote(reader_nodes)))
                   and all(f"SlotReader on {node[:8]}" in alive_on({node}) for node in nodes)):
            assert time.monotonic() < deadline, "the watch started no reader on the workers' nodes"
            time.sleep(0.2)

        shrunk = deployment.resize(1)
        assert shrunk["resized"] is True and shrunk["workers"] == 1, shrunk
        kept = {ray.get(deployment.workers[0].info.remote())["node_id"], router_node}
        freed = set(nodes) - kept
        assert freed  # three workers on three nodes, one left: a node the router is not on is free
        deadline = time.monotonic() + 30
        while alive_on(freed):
            assert time.monotonic() < deadline, f"actors still alive on the freed nodes: {alive_on(freed)}"
            time.sleep(0.2)
        assert set(ray.get(deployment.controller.__ray_call__.remote(reader_nodes))) <= kept
        assert [o.output_token_ids for o in deployment.generate(batch, GREEDY)] == expected
    finally:
        deployment.shutdown()
