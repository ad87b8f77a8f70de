"""Failures without hangs or lost requests: a worker killed or frozen under load."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import ray

from ep_helpers import GREEDY, cluster_config, prompts, reference_engine
from raymoe.cluster.deploy import deploy

TIMEOUT_S = 3.0


@pytest.fixture(scope="module")
def ray_session():
    ray.init(num_cpus=4, include_dashboard=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def expected(tiny_mixtral_dir):
    batch = prompts(100, seed=21)
    return batch, [o.output_token_ids for o in reference_engine(tiny_mixtral_dir).generate(batch, GREEDY)]


def run_with_fault(deployment, batch, fault) -> tuple[list, float]:
    """Run ``batch`` and inject ``fault`` once the routers have started stepping."""
    result: dict = {}
    runner = threading.Thread(target=lambda: result.setdefault("outputs", deployment.generate(batch, GREEDY)))
    started = time.monotonic()
    runner.start()
    deadline = time.monotonic() + 60
    while not any(t["steps"] for t in deployment.telemetry()) and time.monotonic() < deadline:
        time.sleep(0.05)
    fault()
    runner.join(timeout=300)
    assert not runner.is_alive(), "requests did not finish after the fault (a hang)"
    return result["outputs"], time.monotonic() - started


@pytest.mark.parametrize("redundant", [0, 4], ids=["no-replicas", "replicas"])
def test_a_worker_killed_mid_flight_loses_no_request(ray_session, tiny_mixtral_dir, expected, redundant):
    batch, want = expected
    config = cluster_config(tiny_mixtral_dir, expert_workers=2, routers=2,
                            placement={"strategy": "round_robin", "redundant_slots_per_worker": redundant},
                            comm={"backend": "gloo", "timeout_s": TIMEOUT_S}, balancer={"enabled": False})
    deployment = deploy(config, name=f"rec-kill-{redundant}")
    try:
        pid = ray.get(deployment.workers[1].info.remote())["pid"]
        outputs, elapsed = run_with_fault(deployment, batch, lambda: os.kill(pid, signal.SIGKILL))
        assert [o.output_token_ids for o in outputs] == want  # none failed, outputs identical
        recoveries = deployment.status()["recoveries"]
        assert recoveries and 1 in recoveries[0]["lost_workers"]
        # With a replica of every expert on the survivor, serving resumes on it at once;
        # without, recovery waits for Ray to restart the worker.
        assert recoveries[0]["mode"] == ("replicas" if redundant else "restart")
        print(f"{recoveries[0]['mode']} recovery took {recoveries[0]['seconds']:.2f} s; whole run {elapsed:.2f} s")
        if redundant:  # the restarted worker is re-included and serves again
            deadline = time.monotonic() + 120
            while not any(r.get("mode") == "reinclude" for r in deployment.status()["recoveries"]):
                assert time.monotonic() < deadline, deployment.status()["recoveries"]
                time.sleep(0.5)
            again = deployment.generate(batch[:10], GREEDY)
            assert [o.output_token_ids for o in again] == want[:10]
            assert deployment.status()["placement"] == deployment.placement.phy2log.tolist()
        new_pid = ray.get(deployment.workers[1].info.remote())["pid"]
        assert new_pid != pid
    finally:
        deployment.shutdown()


def test_a_frozen_peer_hits_the_deadline_and_is_recovered(ray_session, tiny_mixtral_dir, expected):
    batch, want = expected
    config = cluster_config(tiny_mixtral_dir, expert_workers=2, routers=1, comm={"backend": "gloo",
                            "timeout_s": TIMEOUT_S}, balancer={"enabled": False})
    deployment = deploy(config, name="rec-freeze")
    pid = ray.get(deployment.workers[0].info.remote())["pid"]
    try:
        outputs, elapsed = run_with_fault(deployment, batch[:20], lambda: os.kill(pid, signal.SIGSTOP))
        assert [o.output_token_ids for o in outputs] == want[:20]
        recoveries = deployment.status()["recoveries"]
        assert recoveries and recoveries[0]["lost_workers"] == [0]
        assert elapsed < 120
    finally:
        try:
            os.kill(pid, signal.SIGCONT)  # if it was never killed by the recovery
        except ProcessLookupError:
            pass
        deployment.shutdown()


def test_serving_goes_on_without_the_controller_and_a_restarted_one_recovers_its_state(ray_session, tmp_path):
    from tiny_models import build_skewed_model, write_checkpoint

    path = write_checkpoint(build_skewed_model(), str(tmp_path / "skewed"))
    config = cluster_config(path, expert_workers=2, routers=1,
                            placement={"strategy": "explicit", "experts": {0: [0, 1, 2, 3], 1: [4, 5, 6, 7]},
                                       "redundant_slots_per_worker": 1},
                            balancer={"enabled": True, "interval_steps": 10**6})
    deployment = deploy(config, name="rec-controller")
    try:
        deployment.generate(prompts(8, seed=2), GREEDY)
        report = deployment.rebalance()
        assert report["rebalanced"], report
        before = deployment.status()
        assert before["epoch"] > 0
        os.kill(before["pid"], signal.SIGKILL)
        # Serving does not need the controller.
        outputs = deployment.generate(prompts(4, seed=3), GREEDY)
        assert all(len(o.output_token_ids) == GREEDY.max_tokens for o in outputs)
        deadline = time.monotonic() + 120
        while True:
            try:
                after = deployment.status()
                break
            except ray.exceptions.RayActorError:
                assert time.monotonic() < deadline, "the controller did not come back"
                time.sleep(0.5)
        assert after["pid"] != before["pid"]
        assert after["epoch"] == before["epoch"] and after["placement"] == before["placement"]
    finally:
        deployment.shutdown()


def test_a_checkpoint_that_does_not_match_its_config_is_refused_before_any_actor_starts(ray_session, tmp_path):
    from safetensors.torch import load_file, save_file

    from raymoe.engine.checkpoint import CheckpointError
    from tiny_models import build_reference_model, write_checkpoint

    path = write_checkpoint(build_reference_model("mixtral"), str(tmp_path / "broken"))
    tensors = load_file(f"{path}/model.safetensors")
    del tensors["model.layers.0.block_sparse_moe.experts.3.w1.weight"]
    save_file(tensors, f"{path}/model.safetensors")
    before = len(ray.util.list_named_actors(all_namespaces=True))
    with pytest.raises(CheckpointError, match="experts.3.w1"):
        deploy(cluster_config(path, expert_workers=2), name="rec-broken")
    assert len(ray.util.list_named_actors(all_namespaces=True)) == before
