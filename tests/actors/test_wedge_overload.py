"""Wedged or only overloaded (issue 30, "wedged ranks detected"): the rank watch
(actors/rank_watch.py) must not kill a rank whose Ray calls go unanswered while it steps.

Seen on the loaded 2-core machine (load average 7+): a healthy router's probe (a Ray call, which
needs the actor's call thread and GIL) went unanswered for the limit while its step thread kept
stepping, and the watch killed it. Here the probe is starved on purpose: the router's
``expert_loads_since`` is made to wait when the watch calls it (the cursor only the watch sends)
by a closure run in the actor (``__ray_call__``), while the router's step loop runs as ever. The
watch reads the router's progress slot (actors/progress_slot.py, in /dev/shm) outside its calls,
reports it ``busy`` with the reason, and does not kill it; past the busy bound (5 x the limit)
it kills it all the same. A worker spinning with the GIL held (a C loop in a thread of its own:
its serving thread, and its calls, stand still) is still killed within the limit. A SIGSTOPped
worker: tests/actors/test_wedged_ranks.py; a SIGSTOPped router: tests/serve/test_wedged_router.py.
"""

from __future__ import annotations

import functools
import threading
import time

import pytest
import ray

from ep_helpers import by_rank, cluster_config, prompts, rank_states, reference_engine
from ep_helpers import wait_until as _wait_until
from raymoe.actors.rank_watch import BUSY_BOUND_FACTOR, WEDGE_FRACTION
from raymoe.cluster.deploy import deploy
from raymoe.engine.sampling_params import SamplingParams

wait_for = functools.partial(_wait_until, interval_s=0.1)  # (each poll is a call to the controller)

TIMEOUT_S = 3.0  # comm.timeout_s
LIMIT_S = WEDGE_FRACTION * TIMEOUT_S  # comm.wedge_after_s: 2.4 s
PROBE_SLACK_S = 0.5  # the starved probe may have been sent up to a round after the starving began
REPORT_SLACK_S = 1.0  # the watch probes every 0.25 s; a verdict may come a round or two late on 2 loaded cores
LONG = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)


def starve_probe(router) -> None:
    """From now on the router's ``expert_loads_since`` waits (up to 120 s, or until
    ``feed_probe``) when called with the cursor only the watch's probe sends: its probe goes
    unanswered while everything else (its steps, submit, the controller's other calls) runs."""

    def patch(self):
        from raymoe.actors.rank_watch import NO_STEP

        gate = threading.Event()
        original = self.telemetry.expert_loads_since

        def expert_loads_since(cursor):
            if cursor == NO_STEP:
                gate.wait(120)
            return original(cursor)

        self.telemetry.expert_loads_since = expert_loads_since
        self._test_probe_gate = (gate, original)
        return True

    assert ray.get(router.__ray_call__.remote(patch), timeout=30)


def feed_probe(router) -> None:
    def release(self):
        gate, original = self._test_probe_gate
        self.telemetry.expert_loads_since = original
        gate.set()
        return True

    assert ray.get(router.__ray_call__.remote(release), timeout=30)


def pretend_ranks_are_remote(deployment) -> None:
    """The watch takes every rank for one on another node: it reads their progress slots with
    tasks pinned to their node (as it does across machines) instead of reading them itself."""

    def patch(self):
        self._rank_watch._node_id = "f" * 56
        return True

    assert ray.get(deployment.controller.__ray_call__.remote(patch), timeout=30)


@pytest.fixture(scope="module")
def expected(tiny_mixtral_dir):
    batch = prompts(8, seed=31)
    return batch, [o.output_token_ids for o in reference_engine(tiny_mixtral_dir).generate(batch, LONG)]


@pytest.fixture
def deployment(ray_session, tiny_mixtral_dir):
    config = cluster_config(tiny_mixtral_dir, expert_workers=2, routers=1,
                            comm={"backend": "sockets", "timeout_s": TIMEOUT_S}, balancer={"enabled": False})
    deployment = deploy(config, name="wedge-overload")
    try:
        wait_for(lambda: set(by_rank(rank_states(deployment))) == {"router 0", "worker 0", "worker 1"}, 60,
                 "the watch sees every rank")
        yield deployment
    finally:
        deployment.shutdown()


def serve_meanwhile(deployment, batch) -> tuple[threading.Thread, dict]:
    result: dict = {}

    def run() -> None:
        try:
            outputs = []
            while not result.get("stop"):  # the router keeps stepping while its probe starves
                outputs = deployment.generate(batch, LONG)
                result.setdefault("rounds", 0)
                result["rounds"] += 1
            result["outputs"] = outputs
        except Exception as error:  # re-raised by the test
            result["error"] = error

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, result


@pytest.mark.parametrize("where", ["this node", "another node"])
def test_a_router_that_steps_while_its_probe_starves_is_busy_not_killed(deployment, expected, where):
    batch, want = expected
    if where == "another node":
        pretend_ranks_are_remote(deployment)
    router = deployment.routers[0]
    pid = ray.get(router.info.remote(), timeout=30)["pid"]
    runner, result = serve_meanwhile(deployment, batch)
    starve_probe(router)
    starved_at = time.monotonic()
    seen_busy = None
    try:
        # Three limits and more without an answer to its probe: never killed, reported busy.
        while time.monotonic() - starved_at < 3 * LIMIT_S + REPORT_SLACK_S:
            report = rank_states(deployment)
            row = by_rank(report)["router 0"]
            assert not report["wedged"], report["wedged"]
            assert row["state"] not in ("wedged", "dead"), row
            if row["state"] == "busy":
                seen_busy = row
            time.sleep(0.2)
        assert "error" not in result, result.get("error")
    finally:
        result["stop"] = True
        try:
            feed_probe(router)
        except ray.exceptions.RayError:  # killed after all (the assertions above say so)
            pass
    print(f"router 0 ({where}): {seen_busy}")
    assert seen_busy is not None, "router 0 was never reported busy while its probe starved"
    assert "not killed" in seen_busy["reason"] and "progress counter advanced" in seen_busy["reason"], seen_busy
    runner.join(timeout=120)
    assert not runner.is_alive(), "the requests did not finish"
    if "error" in result:
        raise result["error"]
    assert result["rounds"] >= 1 and [o.output_token_ids for o in result["outputs"]] == want
    assert ray.get(router.info.remote(), timeout=30)["pid"] == pid  # the same process: never killed
    report = wait_for(lambda: (lambda r: r if by_rank(r)["router 0"]["state"] in ("serving", "alive") else None)(
        rank_states(deployment)), 30, "router 0 healthy again once its probe is answered")
    assert not report["wedged"], report["wedged"]
    # (router 0 alone was spared; on a loaded machine its probe may also have gone unanswered
    # past the limit before the starving began: one more episode, as busy)
    assert {s["rank"] for s in report["spared"]} == {"router 0"}, report["spared"]


def test_a_busy_router_whose_calls_stay_unanswered_is_killed_at_the_busy_bound(deployment):
    router = deployment.routers[0]
    pid = ray.get(router.info.remote(), timeout=30)["pid"]
    bound = BUSY_BOUND_FACTOR * LIMIT_S
    starve_probe(router)
    starved_at = time.time()
    try:
        report = wait_for(lambda: (lambda r: r if r["wedged"] else None)(rank_states(deployment)),
                          bound + 30, "router 0 killed at the busy bound")
    finally:
        try:
            feed_probe(router)  # if it was never killed (a new incarnation has no gate)
        except (ray.exceptions.RayError, AttributeError):
            pass
    (wedged,) = report["wedged"]
    after_s = wedged["time"] - starved_at
    print(f"router 0 busy: killed {after_s:.2f} s after its probe starved (bound {bound:.1f} s); {wedged['reason']}")
    assert wedged["rank"] == "router 0" and "cannot take requests" in wedged["reason"], wedged
    assert bound - 0.5 < after_s <= bound + REPORT_SLACK_S + PROBE_SLACK_S, after_s
    assert [s["rank"] for s in report["spared"]] == ["router 0"], report["spared"]  # busy first, then killed
    new_pid = wait_for(lambda: _pid_or_none(router), 120, "router 0 restarted")
    assert new_pid != pid


def _pid_or_none(actor) -> int | None:
    try:
        return ray.get(actor.info.remote(), timeout=10)["pid"]
    except Exception:
        return None


def test_a_worker_spinning_with_the_gil_held_is_still_killed_within_the_limit(deployment):
    worker = deployment.workers[1]
    pid = ray.get(worker.info.remote(), timeout=30)["pid"]
    assert deployment.generate([[5, 6, 7]], SamplingParams(max_tokens=4, temperature=0.0))

    def spin(self):
        def hold_the_gil():
            time.sleep(0.3)  # this call's answer goes out first
            sum(range(10**13))  # one C call: the GIL is not let go for hours

        threading.Thread(target=hold_the_gil, daemon=True).start()
        return True

    assert ray.get(worker.__ray_call__.remote(spin), timeout=30)
    spun_at = time.time() + 0.3
    report = wait_for(lambda: (lambda r: r if r["wedged"] else None)(rank_states(deployment)),
                      LIMIT_S + 30, "worker 1 killed")
    (wedged,) = report["wedged"]
    after_s = wedged["time"] - spun_at
    print(f"worker 1 spinning with the GIL: killed after {after_s:.2f} s (limit {LIMIT_S:.1f} s); {wedged['reason']}")
    assert wedged["rank"] == "worker 1" and "not advanced" in wedged["reason"], wedged
    assert after_s <= TIMEOUT_S + REPORT_SLACK_S, after_s
    assert not report["spared"], report["spared"]
    new_pid = wait_for(lambda: _pid_or_none(worker), 120, "worker 1 restarted")
    assert new_pid != pid
    # Serving resumes on the restarted worker (recovery: actors/recovery.py).
    assert deployment.generate([[5, 6, 7]], SamplingParams(max_tokens=4, temperature=0.0))
