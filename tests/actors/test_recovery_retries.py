"""Recovery that fails, made deterministic: a re-include that fails is retried (and rolled
back onto the replicas meanwhile), and a step that fails the same way after every rebuild
fails its requests instead of being retried for ever. Faults are injected on purpose
(``Controller.inject_fault``, or a worker put in a broken state through its own actor
methods), never left to timing."""

from __future__ import annotations

import functools
import os
import signal
import threading
import time

import numpy as np
import pytest
import ray

from ep_helpers import GREEDY, cluster_config, prompts, reference_engine
from ep_helpers import wait_until as _wait_until
from raymoe.cluster.deploy import RequestFailed, deploy
from raymoe.moe.placement import PlacementTable

wait_until = functools.partial(_wait_until, interval_s=0.2)  # (each poll reads the controller's status)

TIMEOUT_S = 3.0


@pytest.fixture(scope="module")
def expected(tiny_mixtral_dir):
    batch = prompts(40, seed=41)
    return batch, [o.output_token_ids for o in reference_engine(tiny_mixtral_dir).generate(batch, GREEDY)]


def counters(deployment) -> dict:
    return deployment.status()["counters"]


class Serving:
    """Batches of ``size`` requests run one after another on a thread (at most 200), each
    batch's outputs kept beside what the in-process engine gave, every error kept."""

    def __init__(self, deployment, batch: list, want: list, size: int):
        self.served: list[tuple[list, list]] = []
        self.errors: list[BaseException] = []
        self.stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(deployment, batch, want, size))

    def _run(self, deployment, batch, want, size) -> None:
        round_ = 0
        while not self.stop.is_set() and round_ < 200:
            share = slice((size * round_) % len(batch), (size * round_) % len(batch) + size)
            try:
                self.served.append(([o.output_token_ids for o in deployment.generate(batch[share], GREEDY)],
                                    want[share]))
            except Exception as error:  # every request must complete: recorded, asserted by the test
                self.errors.append(error)
            round_ += 1

    def start(self) -> None:
        self._thread.start()

    def halt(self) -> None:
        self.stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=120)

    def finish(self) -> None:
        self.halt()
        assert not self._thread.is_alive(), "requests hung"

    def check(self) -> None:
        """Every request completed, each equal to the in-process engine's."""
        self.finish()
        assert not self.errors, self.errors[:1]
        assert self.served and all(got == reference for got, reference in self.served)


def test_a_failed_reinclude_is_retried_while_the_replicas_serve_every_request(ray_session, tiny_mixtral_dir,
                                                                               expected):
    batch, want = expected
    config = cluster_config(tiny_mixtral_dir, expert_workers=2, routers=2,
                            placement={"strategy": "round_robin", "redundant_slots_per_worker": 4},
                            comm={"backend": "gloo", "timeout_s": TIMEOUT_S}, balancer={"enabled": False})
    deployment = deploy(config, name="retry-reinclude")
    pid = ray.get(deployment.workers[1].info.remote())["pid"]
    serving = Serving(deployment, batch, want, 4)  # requests all through the recovery, the failed attempts and the rollback
    try:
        # The first re-include attempt fails loading the restarted worker, the second joining
        # the groups (after the routers stopped: they must be rolled back); the third succeeds.
        ray.get(deployment.controller.inject_fault.remote("reinclude_load", 1))
        ray.get(deployment.controller.inject_fault.remote("reinclude_join", 1))
        serving.start()
        wait_until(lambda: serving.served, 60, "the first batch")
        os.kill(pid, signal.SIGSTOP)  # frozen: the step's deadline passes, recovery kills it
        status = wait_until(lambda: (s := deployment.status())["counters"]["reincludes"] >= 1 and s, 180,
                            "the re-include")
        serving.check()
        c = status["counters"]
        assert c["recoveries_on_replicas"] == 1, (c, status["recoveries"])
        assert (c["reinclude_attempts"], c["reinclude_failures"], c["reincludes"]) == (3, 2, 1), c
        assert c["reinclude_rollbacks"] == 1, c  # the failed join put the routers back on the replicas
        assert status["degraded"] is None
        assert "InjectedFault" in status["last_rebalance"]["error"]  # the last failure stays visible
        modes = [r["mode"] for r in status["recoveries"]]
        assert modes[0] == "replicas" and modes[-1] == "reinclude", modes
        # The worker is back: full placement, it serves its experts, outputs are unchanged.
        assert status["placement"] == deployment.placement.phy2log.tolist()
        info = ray.get(deployment.workers[1].info.remote())
        assert info["pid"] != pid and info["serving"]
        before = info["steps_served"]
        outputs = deployment.generate(batch, GREEDY)
        assert [o.output_token_ids for o in outputs] == want
        assert ray.get(deployment.workers[1].info.remote())["steps_served"] > before
    finally:
        serving.halt()
        try:
            os.kill(pid, signal.SIGCONT)  # if it was never killed by the recovery
        except ProcessLookupError:
            pass
        deployment.shutdown()


def test_a_recovery_that_fails_part_way_is_asked_for_again_and_loses_nothing(ray_session, tiny_mixtral_dir,
                                                                              expected):
    """A recovery can fail in the middle (a survivor lost while the group is switched: seen in
    tests/netns, a node killed while another came back). The routers ask for it again, it
    starts over from who answers, and the requests in flight complete; before, the router whose
    recovery failed failed all of them."""
    batch, want = expected
    config = cluster_config(tiny_mixtral_dir, expert_workers=2, routers=2,
                            placement={"strategy": "round_robin", "redundant_slots_per_worker": 4},
                            comm={"backend": "sockets", "timeout_s": TIMEOUT_S}, balancer={"enabled": False})
    deployment = deploy(config, name="retry-recovery")
    pid = ray.get(deployment.workers[1].info.remote())["pid"]
    serving = Serving(deployment, batch, want, 8)
    try:
        serving.start()
        wait_until(lambda: serving.served or serving.errors, 120, "the first batch")
        assert not serving.errors, serving.errors[:1]
        # Armed now, so that only the kill's recovery meets it (not one a loaded machine's
        # deadline might start earlier).
        ray.get(deployment.controller.inject_fault.remote("recovery_switch", 1))
        os.kill(pid, signal.SIGKILL)
        def whole_again():  # the failed recovery and one that worked; worker 1 back in (re-included, or
            s = deployment.status()  # reloaded by a recovery when Ray restarted it before the retry)
            back = s["counters"]["reincludes"] >= 1 or any(r.get("mode") == "restart" and 1 in r["lost_workers"]
                                                           for r in s["recoveries"])
            return s["counters"]["recoveries"] >= 2 and s["degraded"] is None and back and s

        try:
            status = wait_until(whole_again, 180, "worker 1 back in service")
        except AssertionError:
            status = deployment.status()
            raise AssertionError(f"not whole again: counters {status['counters']}, recoveries {status['recoveries']}, "
                                 f"degraded {status['degraded']}, last {status['last_rebalance']}, routers "
                                 f"{[r.get('last_failure') for r in status['routers']]}, errors {serving.errors[:1]}")
        serving.check()
        assert sum(ray.get(r.info.remote())["recoveries"] for r in deployment.routers) >= 1
        assert ray.get(deployment.workers[1].info.remote())["pid"] != pid
        assert [o.output_token_ids for o in deployment.generate(batch[:8], GREEDY)] == want[:8]
    finally:
        serving.halt()
        deployment.shutdown()


def test_a_fault_point_must_exist(ray_session, tiny_mixtral_dir):
    deployment = deploy(cluster_config(tiny_mixtral_dir, expert_workers=1, balancer={"enabled": False}),
                        name="retry-fault-name")
    try:
        with pytest.raises(ray.exceptions.RayTaskError, match="unknown fault point 'reinclude'.*reinclude_load"):
            ray.get(deployment.controller.inject_fault.remote("reinclude"))
    finally:
        deployment.shutdown()


def test_a_deterministic_compute_error_fails_its_requests_after_bounded_retries(ray_session, tiny_mixtral_dir,
                                                                                 expected):
    from raymoe.actors.recovery import MAX_IDENTICAL_STEP_FAILURES

    batch, want = expected
    config = cluster_config(tiny_mixtral_dir, expert_workers=2, routers=1,
                            comm={"backend": "gloo", "timeout_s": TIMEOUT_S}, balancer={"enabled": False})
    deployment = deploy(config, name="retry-deterministic")
    try:
        placement = deployment.placement
        # Worker 1 serves only epoch 99 from now on, while the routers dispatch with epoch 0:
        # every step it serves raises the same RuntimeError, and a rebuilt group changes nothing.
        later = PlacementTable.from_phy2log(placement.phy2log, placement.slots_per_worker, placement.num_experts,
                                            placement.worker2node, 99)
        worker = deployment.workers[1]
        ray.get(worker.activate.remote(99, placement.epoch, later.to_dict()))
        ray.get(worker.retire.remote(99))
        started = time.monotonic()
        with pytest.raises(RequestFailed) as failed:
            deployment.generate(batch[:4], GREEDY)
        elapsed = time.monotonic() - started
        message = str(failed.value)
        assert "4 of 4 requests failed" in message
        assert f"failed {MAX_IDENTICAL_STEP_FAILURES} times in a row" in message
        assert "worker 1: RuntimeError" in message and "epoch 0" in message, message
        status = deployment.status()
        c = status["counters"]
        assert c["repeated_step_failures"] == 1 and c["recoveries"] == MAX_IDENTICAL_STEP_FAILURES, c
        assert elapsed < 120, elapsed  # bounded: not the router's 600 s recovery deadline
        # The groups were rebuilt all the same: once the worker serves the placement again,
        # the deployment serves, with unchanged outputs.
        ray.get(worker.load_placement.remote(placement.to_dict()))
        outputs = deployment.generate(batch[:8], GREEDY)
        assert [o.output_token_ids for o in outputs] == want[:8]
        assert np.array_equal(np.asarray(status["placement"]), placement.phy2log)
    finally:
        deployment.shutdown()
