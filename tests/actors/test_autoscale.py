"""The expert pool and the router pool sized by load (issue 31 items 2 and 4,
actors/autoscaler.py, actors/self_heal.py) on a real Ray cluster: the policy grows each pool
under load and shrinks it when idle, with outputs equal to the in-process engine's throughout
and no request lost; its decisions are in status and in /metrics; a worker Ray will not
restart is replaced, seeded with the lost one's experts copied from the survivors, and the
pool is back at its size."""

from __future__ import annotations

import threading
import time

import pytest
import ray
from prometheus_client.parser import text_string_to_metric_families

from ep_helpers import GREEDY, cluster_config, prompts, reference_engine
from test_resize import generate_while
from raymoe.actors.router_spec import live_router_handles
from raymoe.actors.serving_metrics import ServingMetrics
from raymoe.cluster.deploy import deploy
from raymoe.cluster.status_cli import format_status

# One worker holds every expert (8 slots), so every size from 1 up fits; 2 routers of up to 8
# sequences each hand the pool ~16 rows a layer per step: 4 workers at a target of 4 (capped at
# 3); idle, 0 rows: 1 worker. Short window, interval and cooldown keep the test short.
AUTOSCALE = {"min_workers": 1, "max_workers": 3, "target_rows_per_worker": 4, "band": 0.25, "cooldown_s": 1.0,
             "window_s": 2.0, "interval_s": 0.25}
CONFIG = dict(expert_workers=1, routers=2, comm={"backend": "sockets", "timeout_s": 3.0},
              balancer={"enabled": True, "interval_steps": 10**9, "poll_interval_s": 0.2},
              engine={"max_num_seqs": 8})


@pytest.fixture(scope="module")
def expected(tiny_mixtral_dir):
    batch = prompts(32, seed=7)
    return batch, [o.output_token_ids for o in reference_engine(tiny_mixtral_dir).generate(batch, GREEDY)]


def wait_for(condition, what: str, deployment, timeout_s: float = 60.0):
    deadline = time.monotonic() + timeout_s
    while True:
        status = deployment.status()
        if condition(status):
            return status
        assert time.monotonic() < deadline, f"{what} within {timeout_s:g} s; status: {status.get('autoscale')}, " \
                                            f"workers {status['workers']}, last error {status.get('last_rebalance')}"
        time.sleep(0.1)


def test_grows_under_load_and_shrinks_when_idle_with_equal_outputs(ray_session, tiny_mixtral_dir, expected):
    batch, want = expected
    deployment = deploy(cluster_config(tiny_mixtral_dir, **CONFIG, autoscale=AUTOSCALE), name="autoscale")
    try:
        status = deployment.status()
        assert status["workers"] == 1 and status["autoscale"]["desired_workers"] == 1
        # Load: batch after batch until the pool has grown (bounded), each equal to the reference.
        stop, results, errors = threading.Event(), [], []

        def load() -> None:
            try:
                for _ in range(200):
                    if stop.is_set():
                        return
                    results.append([o.output_token_ids for o in deployment.generate(batch, GREEDY)])
            except Exception as error:  # re-raised below
                errors.append(error)

        runner = threading.Thread(target=load)
        runner.start()
        try:
            grown = wait_for(lambda s: s["workers"] == 3, "the pool never grew to 3 workers", deployment)
        finally:
            time.sleep(1.0)  # a little load at the new size too
            stop.set()
            runner.join(timeout=120)
        assert not runner.is_alive() and not errors, errors
        assert results and all(outputs == want for outputs in results), "outputs differ from the reference"
        auto = grown["autoscale"]
        assert auto["decisions"]["up"] >= 1 and auto["actual_workers"] == 3, auto
        assert auto["last_resize"]["resized"] and auto["last_resize"]["workers"] == 3, auto
        # Idle: the policy shrinks the pool to its minimum.
        idle = wait_for(lambda s: s["workers"] == 1, "the idle pool never shrank to 1 worker", deployment)
        auto = idle["autoscale"]
        assert auto["decisions"]["down"] >= 1 and auto["desired_workers"] == 1, auto
        assert "idle: no router step" in auto["reason"] or "hold at autoscale.min_workers" in auto["reason"], auto
        assert idle["counters"]["resize_rollbacks"] == 0
        # ...and serves on, outputs unchanged.
        assert [o.output_token_ids for o in deployment.generate(batch[:8], GREEDY)] == want[:8]
        # Visible in `raymoe status` and in /metrics (the ingress renders the controller's status).
        text = format_status(idle)
        assert "autoscale: 1 workers, desired 1 (limits 1..3, target 4 rows per worker; decisions up " in text, text
        assert "last decision" in text and auto["reason"] in text
        metrics = ServingMetrics(idle["slots_per_worker"], "m").render(deployment.telemetry(), idle).decode()
        samples = {(s.name, s.labels.get("direction")): s.value
                   for family in text_string_to_metric_families(metrics) for s in family.samples}
        assert samples[("raymoe:autoscale_desired_workers", None)] == 1
        assert samples[("raymoe:autoscale_actual_workers", None)] == 1
        assert samples[("raymoe:autoscale_decisions_total", "up")] == auto["decisions"]["up"] >= 1
        assert samples[("raymoe:autoscale_decisions_total", "down")] == auto["decisions"]["down"] >= 1
        assert samples[("raymoe:autoscale_last_decision_timestamp_seconds", None)] == pytest.approx(
            auto["last_decision_time"])
    finally:
        deployment.shutdown()


# Workers fixed at 1 (min = max); routers 1..2 by the requests they hold: 32 prompts on one
# router of max_num_seqs 8 are 8 running + 24 waiting, far above 4 a router (grow, capped at
# 2); idle, 0 requests: back to 1.
# (target_queue_s far above any queue here: read and shown, never the reason to grow)
ROUTER_AUTOSCALE = dict(AUTOSCALE, max_workers=1, min_routers=1, max_routers=2, target_requests_per_router=4,
                        target_queue_s=600.0)


def routers_resized_to(status: dict, routers: int) -> bool:
    """The pool has ``routers`` routers and the autoscaler's report of that resize is in (the
    router list changes a moment before ``resize_routers`` returns its report)."""
    last = status["autoscale"]["routers"]["last_resize"] or {}
    return status["num_routers"] == routers and last.get("routers") == routers


def serving_routers(deployment) -> list:
    """The handles of the routers that take requests now (the controller's count, by name),
    keeping the handles deploy made (dropping an owner's last handle would end its actor)."""
    count = ray.get(deployment.controller.serving_routers.remote())["serving"]
    live = live_router_handles(deployment.name, deployment.namespace)
    return [*deployment.routers[:count], *live[len(deployment.routers):count]]


def test_the_policy_alone_grows_the_routers_under_load_and_shrinks_them_when_idle(ray_session, tiny_mixtral_dir,
                                                                                 expected):
    batch, want = expected
    config = dict(CONFIG, routers=1)
    deployment = deploy(cluster_config(tiny_mixtral_dir, **config, autoscale=ROUTER_AUTOSCALE), name="router-auto")
    try:
        status = deployment.status()
        auto = status["autoscale"]["routers"]
        assert status["num_routers"] == 1 and (auto["actual_routers"], auto["desired_routers"]) == (1, 1), auto
        # Load: batch after batch, on whichever routers serve at the time (bounded), until the
        # policy has grown the pool to 2 and the new router has served a batch's share.
        stop, results, errors, shares = threading.Event(), [], [], []

        def load() -> None:
            try:
                for _ in range(100):
                    if stop.is_set():
                        return
                    deployment.routers = serving_routers(deployment)
                    shares.append(len(deployment.routers))
                    results.append([o.output_token_ids for o in deployment.generate(batch, GREEDY)])
            except Exception as error:  # re-raised below
                errors.append(error)

        runner = threading.Thread(target=load)
        runner.start()
        try:
            grown = wait_for(lambda s: routers_resized_to(s, 2), "the router pool never grew to 2", deployment)
            deadline = time.monotonic() + 60
            while 2 not in shares[-1:] and time.monotonic() < deadline and runner.is_alive():
                time.sleep(0.2)  # a batch spread over both routers has started
            count = len(results)
            while len(results) == count and time.monotonic() < deadline and runner.is_alive():
                time.sleep(0.2)  # ...and has finished
        finally:
            stop.set()
            runner.join(timeout=120)
        assert not runner.is_alive() and not errors, errors
        assert results and all(outputs == want for outputs in results), "outputs differ from the reference"
        assert 2 in shares, shares
        assert deployment.telemetry()[1]["generated_tokens"] > 0  # the policy's router served
        auto = grown["autoscale"]["routers"]
        assert auto["decisions"]["up"] == 1 and auto["last_resize"]["resized"], auto
        assert (auto["last_resize"]["routers_before"], auto["last_resize"]["routers"]) == (1, 2), auto
        assert grown["workers"] == 1 and grown["autoscale"]["decisions"] == {"up": 0, "down": 0}
        # the grow decision read the routers' queue times: 24 of 32 sequences waited for a place
        assert auto["queue_s"] is not None and 0 < auto["queue_s"] < 600, auto
        assert "queue time" in auto["reason"] and auto["queue_floor"] is None, auto
        # Idle: the policy shrinks the router pool back to its minimum.
        idle = wait_for(lambda s: routers_resized_to(s, 1), "the idle router pool never shrank to 1", deployment)
        auto = idle["autoscale"]["routers"]
        assert auto["decisions"] == {"up": 1, "down": 1} and auto["desired_routers"] == 1, auto
        assert auto["last_resize"]["resized"] and auto["last_resize"]["routers"] == 1, auto
        assert idle["counters"]["resize_rollbacks"] == 0
        deployment.routers = serving_routers(deployment)
        assert len(deployment.routers) == 1
        assert [o.output_token_ids for o in deployment.generate(batch[:8], GREEDY)] == want[:8]
        # Visible in `raymoe status` and in /metrics.
        text = format_status(idle)
        assert "autoscale: 1 routers, desired 1 (limits 1..2, target 4 requests per router, queue target 600 s; " \
               "decisions up 1, down 1)" in text, text
        assert "last router decision" in text and auto["reason"] in text, text
        metrics = ServingMetrics(idle["slots_per_worker"], "m").render(deployment.telemetry(), idle).decode()
        samples = {(s.name, s.labels.get("direction")): s.value
                   for family in text_string_to_metric_families(metrics) for s in family.samples}
        assert samples[("raymoe:autoscale_desired_routers", None)] == 1
        assert samples[("raymoe:autoscale_actual_routers", None)] == 1
        assert samples[("raymoe:autoscale_max_routers", None)] == 2
        assert samples[("raymoe:autoscale_target_requests_per_router", None)] == 4
        assert samples[("raymoe:autoscale_router_decisions_total", "up")] == 1
        assert samples[("raymoe:autoscale_router_decisions_total", "down")] == 1
        assert samples[("raymoe:autoscale_target_queue_time_seconds", None)] == 600
    finally:
        deployment.shutdown()


def test_a_worker_ray_will_not_restart_is_replaced_and_the_pool_is_whole_again(ray_session, tiny_mixtral_dir,
                                                                              expected):
    batch, want = expected
    config = dict(CONFIG, balancer={"enabled": False, "poll_interval_s": 0.2})
    deployment = deploy(cluster_config(tiny_mixtral_dir, **config), name="heal")
    try:
        assert deployment.resize(2)["resized"]  # worker 1 gets a copy of every expert: worker 0 covers it
        lost = deployment.workers[1]
        old_pid = ray.get(lost.info.remote())["pid"]
        result: dict = {}

        def run() -> None:
            try:
                result["outputs"] = deployment.generate(batch, GREEDY)
            except Exception as error:
                result["error"] = error

        runner = threading.Thread(target=run)
        runner.start()
        time.sleep(0.3)
        ray.kill(lost, no_restart=True)  # Ray gives up on it: it never comes back by itself
        runner.join(timeout=180)
        assert not runner.is_alive(), "requests did not finish after the worker was lost"
        assert "error" not in result, result.get("error")
        assert [o.output_token_ids for o in result["outputs"]] == want  # none lost, outputs identical
        status = wait_for(lambda s: s["degraded"] is None and s["counters"]["workers_replaced"] == 1
                          and s["counters"]["reincludes"] >= 1, "the lost worker was never replaced", deployment)
        assert status["workers"] == 2
        replacement = ray.get_actor("heal-worker-1", namespace="raymoe")
        info = ray.get(replacement.info.remote())
        assert info["pid"] != old_pid
        assert all(all(e >= 0 for e in layer) for layer in info["experts"])  # it holds the lost one's experts
        assert [row[8:] for row in status["placement"]] == [list(layer) for layer in info["experts"]]
        # ...copied from worker 0, which served them on replicas (not read from the checkpoint)
        layers = len(status["placement"])
        assert [(h["workers"], h["copies"]) for h in status["heals"]] == [([1], 8 * layers)], status["heals"]
        assert status["heals"][0]["bytes_copied"] > 0
        # tokens run on it again
        deployment.workers = [deployment.workers[0], replacement]
        again = deployment.generate(batch[:16], GREEDY)
        assert [o.output_token_ids for o in again] == want[:16]
        rows = [t["worker_rows"] for t in deployment.telemetry()]
        assert sum(r[1] for r in rows) > 0, rows
    finally:
        deployment.shutdown()


def test_a_replacement_whose_copy_fails_loads_from_the_checkpoint_and_loses_nothing(ray_session, tiny_mixtral_dir,
                                                                                 expected):
    batch, want = expected
    config = dict(CONFIG, balancer={"enabled": False, "poll_interval_s": 0.2})
    deployment = deploy(cluster_config(tiny_mixtral_dir, **config), name="heal-fault")
    try:
        assert deployment.resize(2)["resized"]
        ray.get(deployment.controller.inject_fault.remote("heal_copy"))
        outputs, _ = generate_while(deployment, batch, lambda: ray.kill(deployment.workers[1], no_restart=True))
        assert [o.output_token_ids for o in outputs] == want
        status = wait_for(lambda s: s["degraded"] is None and s["counters"]["reincludes"] >= 1,
                          "the lost worker was never re-included", deployment)
        counters = status["counters"]
        assert counters["workers_replaced"] == 1 and counters["reinclude_failures"] == 1, counters
        assert status["heals"] == [] and status["workers"] == 2  # no copy made it: the checkpoint did
        replacement = ray.get_actor("heal-fault-worker-1", namespace="raymoe")
        deployment.workers = [deployment.workers[0], replacement]
        assert [o.output_token_ids for o in deployment.generate(batch[:16], GREEDY)] == want[:16]
        assert sum(t["worker_rows"][1] for t in deployment.telemetry()) > 0
    finally:
        deployment.shutdown()


def test_the_cooldown_runs_from_the_last_resize_or_the_autoscalers_last_try():
    """A refused try (Ray had no room) counts like a resize for the cooldown: not retried every
    interval; a resize anyone made counts too."""
    from raymoe.actors.autoscaler import Autoscaler

    host = Autoscaler()
    host.resizes, host.autoscale_last_resize = [], None
    assert host._last_resize_time() is None
    host.resizes = [{"resized": True, "time": 10.0}, {"resized": False, "refused": True, "time": 20.0}]
    assert host._last_resize_time() == 10.0  # an operator's refused resize changes nothing
    host.autoscale_last_resize = {"resized": False, "error": "Ray could not place 2 more expert workers", "time": 30.0}
    assert host._last_resize_time() == 30.0
    # each pool's cooldown runs from its own resizes: a router resize (its report has
    # routers_before) is not a worker resize, nor the other way round
    host.autoscale_last_router_resize = None
    host.resizes.append({"resized": True, "routers_before": 1, "routers": 2, "time": 40.0})
    assert host._last_resize_time() == 30.0 and host._last_resize_time("routers") == 40.0
    host.autoscale_last_router_resize = {"resized": False, "error": "a recovery is running", "time": 50.0}
    assert host._last_resize_time("routers") == 50.0 and host._last_resize_time() == 30.0
