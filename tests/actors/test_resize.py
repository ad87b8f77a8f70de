"""Resizing the expert pool while serving (issue 31 items 1 and 5, actors/resize.py): grow and
shrink under load with outputs equal to the in-process engine's, refusals that name the limit
and change nothing, and a grow whose new worker dies while joining rolls back."""

from __future__ import annotations

import threading
import time

import pytest
import ray

from ep_helpers import GREEDY, cluster_config, prompts, reference_engine
from raymoe.cluster.deploy import deploy

# Every expert fits one worker (8 slots), so 1 worker is a valid size; the balancer is on for
# its spare pool rows (a shrink copies into them) but never decides to move anything.
CONFIG = dict(expert_workers=1, routers=2, comm={"backend": "sockets", "timeout_s": 3.0},
              balancer={"enabled": True, "interval_steps": 10**9, "poll_interval_s": 0.2},
              engine={"max_num_seqs": 8})  # many steps, so the resize lands mid-run


@pytest.fixture(scope="module")
def expected(tiny_mixtral_dir):
    batch = prompts(48, seed=31)
    return batch, [o.output_token_ids for o in reference_engine(tiny_mixtral_dir).generate(batch, GREEDY)]


@pytest.fixture(scope="module")
def deployment(ray_session, tiny_mixtral_dir):
    deployed = deploy(cluster_config(tiny_mixtral_dir, **CONFIG), name="resize")
    yield deployed
    deployed.shutdown()


def generate_while(deployment, batch, action):
    """Run ``batch`` and call ``action()`` once the routers have produced tokens for it;
    returns (outputs, action's result)."""
    result: dict = {}

    def run() -> None:
        try:
            result["outputs"] = deployment.generate(batch, GREEDY)
        except Exception as error:  # re-raised in the test's thread
            result["error"] = error

    before = sum(t["generated_tokens"] for t in deployment.telemetry())
    runner = threading.Thread(target=run)
    runner.start()
    deadline = time.monotonic() + 60
    while sum(t["generated_tokens"] for t in deployment.telemetry()) == before and runner.is_alive():
        assert time.monotonic() < deadline, "the batch never started"
        time.sleep(0.01)
    answer = action()
    runner.join(timeout=300)
    assert not runner.is_alive(), "requests did not finish after the resize (a hang)"
    if "error" in result:
        raise result["error"]
    return result["outputs"], answer


def test_grow_then_shrink_under_load_keeps_outputs(deployment, expected):
    batch, want = expected
    outputs, grown = generate_while(deployment, batch, lambda: deployment.resize(3))
    assert [o.output_token_ids for o in outputs] == want  # none failed, outputs identical
    assert grown["resized"] is True, grown
    assert grown["workers_before"] == 1 and grown["workers"] == 3
    status = deployment.status()
    assert status["workers"] == 3 and len(status["worker2node"]) == 3
    assert len(deployment.workers) == 3
    # the new workers serve copies of experts (copied from worker 0, never read from disk)
    infos = ray.get([w.info.remote() for w in deployment.workers])
    assert all(all(e >= 0 for e in layer) for info in infos[1:] for layer in info["experts"])
    assert grown["copies"] == 2 * 8 * len(infos[0]["experts"])  # 2 new workers x 8 slots x layers
    assert 0 < grown["bytes_copied"] <= 2 * grown["bytes_all_experts"]
    # tokens really ran on the new workers
    again = deployment.generate(batch[:16], GREEDY)
    assert [o.output_token_ids for o in again] == want[:16]
    rows = [t["worker_rows"] for t in deployment.telemetry()]
    assert all(len(r) == 3 for r in rows) and sum(r[2] for r in rows) > 0, rows

    outputs, shrunk = generate_while(deployment, batch, lambda: deployment.resize(1))
    assert [o.output_token_ids for o in outputs] == want
    assert shrunk["resized"] is True and shrunk["workers"] == 1, shrunk
    assert shrunk["copies"] == 0  # worker 0 held every expert: nothing had to move
    assert deployment.status()["workers"] == 1 and len(deployment.workers) == 1
    with pytest.raises(ValueError):
        ray.get_actor("resize-worker-1", namespace="raymoe")  # its actor ended
    counters = deployment.status()["counters"]
    assert counters["resizes"] == 2 and counters["resize_rollbacks"] == 0


def test_bad_sizes_are_refused_naming_the_limit_and_change_nothing(deployment):
    before = deployment.status()
    below = deployment.resize(0)
    assert below["refused"] and below["status"] == 400 and ">= 1" in below["error"], below
    too_many = deployment.resize(600, ready_timeout_s=2.0)  # 599 more bundles of 0.01 CPU > 4 CPUs
    assert too_many["refused"] and too_many["status"] == 503, too_many
    assert "could not place 599 more expert workers" in too_many["error"] and "2 s" in too_many["error"]
    after = deployment.status()
    assert after["workers"] == 1 and after["epoch"] == before["epoch"]
    assert after["counters"]["resizes_refused"] == before["counters"]["resizes_refused"] + 2


def test_a_resize_while_another_runs_is_refused(deployment):
    first = deployment.controller.resize.remote(2)
    deadline = time.monotonic() + 30
    while deployment.status()["resizing"] is None:
        assert time.monotonic() < deadline, "the first resize never started"
        time.sleep(0.01)
    second = ray.get(deployment.controller.resize.remote(3))
    assert second["refused"] and second["status"] == 409 and "another resize is running (to 2 workers" in \
        second["error"], second
    assert ray.get(first)["resized"] is True
    assert deployment.resize(1)["resized"] is True


@pytest.mark.parametrize("fault", ["resize_join", "resize_copy"])
def test_a_grow_that_fails_halfway_rolls_back_without_losing_a_request(deployment, expected, fault):
    batch, want = expected
    before = deployment.status()
    ray.get(deployment.controller.inject_fault.remote(fault))
    outputs, report = generate_while(deployment, batch, lambda: deployment.resize(2))
    assert [o.output_token_ids for o in outputs] == want
    assert report["resized"] is False and not report.get("refused"), report
    assert report["rolled_back"], report
    status = deployment.status()
    assert status["workers"] == 1 and len(deployment.workers) == 1
    assert status["counters"]["resize_rollbacks"] == before["counters"]["resize_rollbacks"] + 1
    with pytest.raises(ValueError):
        ray.get_actor("resize-worker-1", namespace="raymoe")
    again = deployment.generate(batch[:8], GREEDY)  # it serves on at the old size
    assert [o.output_token_ids for o in again] == want[:8]


def test_a_shrink_copies_what_only_the_leaving_worker_holds(ray_session, tiny_mixtral_dir, expected):
    batch, want = expected
    config = cluster_config(tiny_mixtral_dir, **dict(CONFIG, expert_workers=3,
                                                     placement={"strategy": "round_robin",
                                                                "redundant_slots_per_worker": 1}))
    deployment = deploy(config, name="resize-copies")  # 4 slots a worker: 8 fit on 2 workers
    try:
        leaving = set(ray.get(deployment.workers[2].info.remote())["experts"][0])
        staying = {e for w in deployment.workers[:2] for e in ray.get(w.info.remote())["experts"][0]}
        assert leaving - staying  # worker 2 alone holds some experts
        outputs, shrunk = generate_while(deployment, batch, lambda: deployment.resize(2))
        assert [o.output_token_ids for o in outputs] == want
        assert shrunk["resized"] is True and shrunk["workers"] == 2, shrunk
        layers = len(deployment.status()["placement"])
        assert 0 < shrunk["copies"] <= 4 * layers and shrunk["bytes_copied"] < shrunk["bytes_all_experts"]
        assert all(c["source_worker"] == 2 and c["destination_worker"] < 2 for c in shrunk["moved"])
        for layer in deployment.status()["placement"]:
            assert set(layer) == set(range(8))  # every expert on the 2 staying workers
        again = deployment.generate(batch[:16], GREEDY)
        assert [o.output_token_ids for o in again] == want[:16]
    finally:
        deployment.shutdown()
