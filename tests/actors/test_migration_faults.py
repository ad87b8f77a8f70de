"""A rebalance whose migration fails, at each of its steps, fails safe: nothing it staged stays
staged, its epoch is never used again, the migration group is rebuilt without a full
recovery, the placement in service does not change, and the retry succeeds. Outputs served
right after the failure and after the retry are the in-process engine's greedy tokens.

Faults are injected on purpose (``Controller.inject_fault``; the ``rebalance_during_*`` and
``rebalance_migrate_peer_missing`` points make one worker raise inside its own call), never
left to timing. The skewed model sends every token to experts 0 and 1, both on worker 0, so
a forced rebalance always moves experts both ways between the two workers."""

from __future__ import annotations

import time

import pytest
import ray

from ep_helpers import GREEDY, cluster_config, prompts
from raymoe.actors.controller import REBALANCE_FAULT_POINTS
from raymoe.actors.expert_worker import migration_mark
from raymoe.cluster.deploy import deploy
from raymoe.engine.engine import EngineConfig, LLMEngine
from raymoe.moe.placement import PlacementTable
from tiny_models import build_skewed_model, write_checkpoint

SKEWED = {"strategy": "explicit", "experts": {0: [0, 1, 2, 3], 1: [4, 5, 6, 7]}}
# (fault point, how many tries in a row fail there, the step the report names, which
# exception text the error carries)
CASES = [
    ("rebalance_before_migrate", 1, "migrate", "InjectedFault"),
    ("rebalance_during_migrate", 1, "migrate", "InjectedWorkerFault"),
    ("rebalance_migrate_peer_missing", 1, "migrate", "InjectedWorkerFault"),
    ("rebalance_before_activate", 2, "activate", "InjectedFault"),
    ("rebalance_during_activate", 1, "activate", "InjectedWorkerFault"),
]
assert {case[0] for case in CASES} == set(REBALANCE_FAULT_POINTS)


@pytest.fixture(scope="module")
def skewed(tmp_path_factory):
    """The skewed checkpoint, a batch, and its greedy outputs from the in-process engine."""
    path = write_checkpoint(build_skewed_model(), str(tmp_path_factory.mktemp("skewed")))
    batch = prompts(12, seed=7)
    engine = LLMEngine.from_pretrained(path, EngineConfig(dtype="float32"))
    return path, batch, [o.output_token_ids for o in engine.generate(batch, GREEDY)]


def skewed_deployment(path: str, name: str):
    config = cluster_config(path, expert_workers=2, routers=1, placement=SKEWED,
                            comm={"backend": "sockets", "timeout_s": 10.0},
                            balancer={"enabled": True, "interval_steps": 10**9})  # rebalance by hand only
    return deploy(config, name=name)


def served(deployment, batch) -> list[list[int]]:
    return [o.output_token_ids for o in deployment.generate(batch, GREEDY)]


def worker_infos(deployment) -> list[dict]:
    return ray.get([w.info.remote() for w in deployment.workers])


def assert_workers_serve_only(deployment, status: dict) -> None:
    """Every worker serves exactly the placement in service (one epoch, its experts), with
    nothing staged."""
    slots = status["slots_per_worker"]
    for index, info in enumerate(worker_infos(deployment)):
        assert info["staged"] == [], (index, info["staged"])
        assert info["epochs"] == [status["epoch"]], (index, info["epochs"])
        assert info["experts"] == [row[index * slots:(index + 1) * slots] for row in status["placement"]], index


@pytest.mark.parametrize("point,times,step,raised", CASES, ids=[case[0] for case in CASES])
def test_a_failed_migration_serves_nothing_stale_and_the_retry_succeeds(ray_session, skewed, point, times, step,
                                                                        raised):
    path, batch, want = skewed
    deployment = skewed_deployment(path, f"migfault-{point.replace('_', '-')}")
    try:
        assert served(deployment, batch[:6]) == want[:6]  # and the window's traffic
        before = deployment.status()
        joins = [info["migration_joins"] for info in worker_infos(deployment)]
        ray.get(deployment.controller.inject_fault.remote(point, times))
        failed_epochs = []
        for attempt in range(1, times + 1):
            started = time.monotonic()
            report = deployment.rebalance()
            elapsed = time.monotonic() - started
            assert report["rebalanced"] is False, report
            assert report["failed_step"] == step and report["failed_layer"] == 0, report
            assert raised in report["error"] and report["reason"] == f"migration failed: {report['error']}"
            assert "the placement in service is unchanged" in report["error"], report["error"]
            assert report["rolled_back"] and report["migration_group_rebuilt"], report
            assert report["workers_lost"] == [] and report["cleanup_errors"] == [], report
            assert report["epoch"] == before["epoch"] and report["layers_done"] == 0, report
            # A peer left waiting in the copy collective is freed by the abort, not its deadline.
            assert elapsed < 20, elapsed
            # What the failed try got to do before it failed is what was discarded.
            discarded = {d["worker"]: d for d in report["discarded"]}
            assert sorted(discarded) == [0, 1] and all(d["epoch"] == report["failed_epoch"] for d in discarded.values())
            staged = sum(d["staged_rows"] for d in discarded.values())
            activated = [w for w, d in discarded.items() if d["activated"]]
            if point in ("rebalance_before_migrate", "rebalance_migrate_peer_missing"):
                assert staged == 0 and activated == [], discarded
            elif point == "rebalance_during_migrate":  # worker 0 staged its copy, worker 1 one before failing
                assert staged == 2 and activated == [], discarded
            elif point == "rebalance_before_activate":  # every copy staged, nothing activated
                assert staged == 2 and activated == [], discarded
            else:  # worker 0 activated the epoch, worker 1 failed with its copy still staged
                assert staged == 1 and activated == [0], discarded
            failed_epochs.append(report["failed_epoch"])

            status = deployment.status()
            assert status["epoch"] == before["epoch"] and status["placement"] == before["placement"]
            assert status["rebalances"] == 0
            c = status["counters"]
            assert (c["rebalance_failures"], c["migration_group_rebuilds"], c["recoveries"]) == (attempt, attempt, 0), c
            assert status["last_rebalance"]["error"] == report["error"]
            # Nothing stays staged, the failed epoch is gone and refused for ever, and every
            # worker joined a new migration group.
            assert_workers_serve_only(deployment, status)
            for index, info in enumerate(worker_infos(deployment)):
                assert report["failed_epoch"] in info["discarded_epochs"], (index, info)
                assert info["migration_joins"] == joins[index] + attempt, (index, info)
            assert ray.get(deployment.routers[0].placement_epoch.remote()) == before["epoch"]
            assert served(deployment, batch) == want  # right after the failure
        assert failed_epochs == sorted(set(failed_epochs)) and failed_epochs[0] > before["epoch"], failed_epochs

        retry = deployment.rebalance()
        assert retry["rebalanced"] is True and retry["copies"] > 0, retry
        assert min(retry["epochs"]) > max(failed_epochs), (retry["epochs"], failed_epochs)  # never reused
        after = deployment.status()
        assert after["epoch"] == retry["epoch"] == max(retry["epochs"]) and after["rebalances"] == 1
        assert after["placement"] != before["placement"]
        assert after["counters"]["rebalance_failures"] == times and after["counters"]["recoveries"] == 0
        assert_workers_serve_only(deployment, after)
        assert ray.get(deployment.routers[0].placement_epoch.remote()) == after["epoch"]
        assert served(deployment, batch) == want  # after the retry
    finally:
        deployment.shutdown()


def test_activate_never_serves_rows_staged_by_a_failed_try(ray_session, skewed):
    """The issue's failure, on the workers themselves: a try stages rows for epoch 5 and fails
    before activating. A retry that reused epoch 5 with a plan leaving those slots unchanged
    would swap the stale rows in (worker 0's slot 0 would serve expert 4 where routers send
    the hot expert 0's tokens): ``activate`` refuses it. Once discarded, epoch 5 can never be
    staged or activated again; a new epoch never swaps another epoch's rows in (a worker the
    discard never reached drops them instead), so outputs stay the in-process engine's."""
    path, batch, want = skewed
    deployment = skewed_deployment(path, "migfault-guard")
    w0, w1 = deployment.workers
    try:
        base = deployment.placement
        # Layer 0: expert 4 from worker 1 into worker 0's slot 0, expert 0 the other way.
        # (serving workers copy at a step boundary the router marks: queued, marked, waited for)
        mark = migration_mark(5, 0)
        ray.get([w0.queue_migration.remote(mark, base.epoch, 0, 5, [(1, 0)], [(1, 0, 4)]),
                 w1.queue_migration.remote(mark, base.epoch, 0, 5, [(0, 4)], [(0, 0, 0)])])
        ray.get(deployment.routers[0].mark_migration.remote(mark))
        ray.get([w.wait_migration.remote(mark, 30.0) for w in (w0, w1)])
        assert [info["staged"] for info in worker_infos(deployment)] == [[[5, 0, 0]], [[5, 0, 0]]]

        def unchanged(epoch: int) -> dict:  # a plan that leaves every slot as it is
            return PlacementTable.from_phy2log(base.phy2log, base.slots_per_worker, base.num_experts,
                                               base.worker2node, epoch).to_dict()

        with pytest.raises(ray.exceptions.RayTaskError, match="StaleStagedRows.*expert 4 staged under epoch 5.*"
                                                                 "puts expert 0 there"):
            ray.get(w0.activate.remote(5, base.epoch, unchanged(5)))
        info = worker_infos(deployment)[0]
        assert info["epochs"] == [base.epoch] and info["staged"] == [[5, 0, 0]]  # refused: nothing changed

        # The discard reaches worker 1 only; worker 0 keeps its stale row.
        assert ray.get(w1.discard_staged.remote(5)) == {"worker": 1, "epoch": 5, "staged_rows": 1, "activated": False}
        assert [info["staged"] for info in worker_infos(deployment)] == [[[5, 0, 0]], []]
        with pytest.raises(ray.exceptions.RayTaskError, match="cannot activate epoch 5: it was discarded"):
            ray.get(w1.activate.remote(5, base.epoch, unchanged(5)))
        with pytest.raises(ray.exceptions.RayTaskError, match="cannot stage epoch 5: it was discarded"):
            ray.get(w1.queue_migration.remote(migration_mark(5, 1), base.epoch, 0, 5, [], []))
        # A new epoch: worker 0 drops the stale row rather than serve it, the routers switch,
        # and outputs are unchanged.
        ray.get([w.activate.remote(6, base.epoch, unchanged(6)) for w in (w0, w1)])
        infos = worker_infos(deployment)
        assert [info["staged"] for info in infos] == [[], []] and all(5 in i["discarded_epochs"] for i in infos)
        ray.get(deployment.routers[0].set_placement.remote(unchanged(6)))
        ray.get([w.retire.remote(6) for w in (w0, w1)])
        assert [info["epochs"] for info in worker_infos(deployment)] == [[6], [6]]
        assert served(deployment, batch) == want
    finally:
        deployment.shutdown()
