"""The re-include of a restarted worker without stopping anyone (make-before-break, CPU
transports): the new group, with the restarted worker, forms beside the one in service while
the routers go on serving over it, and every rank switches at one agreed step boundary. No
request is lost, every output equals the in-process engine's, and no router's step fails."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import ray

from ep_helpers import GREEDY, cluster_config, prompts, reference_engine, wait_until
from raymoe.cluster.deploy import deploy

TIMEOUT_S = 3.0


@pytest.fixture(scope="module")
def expected(tiny_mixtral_dir):
    batch = prompts(40, seed=43)
    return batch, [o.output_token_ids for o in reference_engine(tiny_mixtral_dir).generate(batch, GREEDY)]


def generated(deployment) -> int:
    """Tokens the routers have sampled since they started."""
    return sum(ray.get([router.info.remote() for router in deployment.routers])[i]["generated_tokens"]
               for i in range(len(deployment.routers)))


@pytest.mark.parametrize("backend", ["sockets", "gloo"])
def test_the_reinclude_forms_its_group_while_serving_and_switches_losing_nothing(ray_session, tiny_mixtral_dir,
                                                                                 expected, backend):
    batch, want = expected
    config = cluster_config(tiny_mixtral_dir, expert_workers=2, routers=2,
                            placement={"strategy": "round_robin", "redundant_slots_per_worker": 4},
                            comm={"backend": backend, "timeout_s": TIMEOUT_S}, balancer={"enabled": False})
    deployment = deploy(config, name=f"reinclude-live-{backend}")
    served, errors, stop = [], [], threading.Event()

    def serve() -> None:  # batches of 4 requests, one after another, through the fault and the re-include
        for round_ in range(300):
            if stop.is_set():
                return
            share = slice((4 * round_) % len(batch), (4 * round_) % len(batch) + 4)
            try:
                served.append(([o.output_token_ids for o in deployment.generate(batch[share], GREEDY)], want[share]))
            except Exception as error:  # every request must complete: asserted below
                errors.append(error)

    runner = threading.Thread(target=serve)
    try:
        # The new group, once formed beside the old one, is held 3 s before the switch mark.
        ray.get(deployment.controller.inject_fault.remote("reinclude_hold", 1))
        pid = ray.get(deployment.workers[1].info.remote())["pid"]
        runner.start()
        wait_until(lambda: served, 60, "the first batch")
        os.kill(pid, signal.SIGKILL)  # its experts have replicas on worker 0: served on at once
        wait_until(lambda: (d := deployment.status()["degraded"]) is not None and d.get("phase") == "new group formed",
                   120, "the restarted worker's new group formed beside the one in service")
        router_recoveries = [info["recoveries"] for info in ray.get([r.info.remote() for r in deployment.routers])]
        tokens_before = generated(deployment)
        time.sleep(1.0)
        tokens_during = generated(deployment) - tokens_before
        still_holding = (deployment.status()["degraded"] or {}).get("phase") == "new group formed"
        status = wait_until(lambda: (s := deployment.status())["counters"]["reincludes"] >= 1 and s, 60,
                            "the re-include")
        assert still_holding, "the hold ended before the second sample: the check of serving during it is void"
        assert tokens_during > 0, "no token was produced while the new group was being formed"
        count = len(served)
        wait_until(lambda: len(served) >= count + 3, 60, "batches after the switch")
        stop.set()
        runner.join(timeout=120)
        assert not runner.is_alive(), "requests hung"
        assert not errors, errors[:1]
        assert served and all(got == reference for got, reference in served)  # identical, none lost
        record = [r for r in status["recoveries"] if r.get("mode") == "reinclude"][-1]
        print(f"{tokens_during} tokens in 1 s while the new group was held; re-include {record}")
        assert record["switch"] == "live", record
        assert [name for name, _ in record["phases"]][:4] == ["loaded", "activated", "new group formed", "marked"], \
            record["phases"]
        counters = status["counters"]
        assert (counters["reincludes"], counters["reinclude_failures"], counters["reinclude_rollbacks"],
                counters["live_switch_failures"]) == (1, 0, 0, 0), counters
        # No router's step failed for the switch: neither asked for a recovery after the fault's.
        after = [info for info in ray.get([r.info.remote() for r in deployment.routers])]
        assert [info["recoveries"] for info in after] == router_recoveries, (router_recoveries, after)
        assert all(info["comm_generation"] == record["generation"] for info in after)
        # The restarted worker serves its experts in the full placement; outputs unchanged.
        assert status["placement"] == deployment.placement.phy2log.tolist()
        before = ray.get(deployment.workers[1].info.remote())
        assert before["pid"] != pid and before["serving"] and before["generation"] == record["generation"]
        outputs = deployment.generate(batch, GREEDY)
        assert [o.output_token_ids for o in outputs] == want
        assert ray.get(deployment.workers[1].info.remote())["steps_served"] > before["steps_served"]
    finally:
        stop.set()
        if runner.is_alive():
            runner.join(timeout=120)
        deployment.shutdown()
