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
