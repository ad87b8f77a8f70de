"""Wedged ranks (issue 30 item 3): an expert worker that Ray still calls alive but that answers
nothing (SIGSTOP) is reported wedged by the controller's rank watch (actors/rank_watch.py)
within the exchange deadline, killed, and recovered like a dead one; the requests in flight
complete with the in-process engine's outputs."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import ray

from ep_helpers import GREEDY, by_rank, cluster_config, prompts, rank_states, reference_engine, wait_until
from raymoe.actors.rank_watch import WEDGE_FRACTION
from raymoe.cluster.deploy import deploy
from raymoe.engine.sampling_params import SamplingParams

TIMEOUT_S = 3.0  # comm.timeout_s: the exchange's deadline
# The watch probes every 0.25 s; a report may come one round late on a loaded 2-core machine.
REPORT_SLACK_S = 1.0
# Long enough that the batch is surely mid-flight when the worker freezes (10 tokens each could
# finish between the first exchange and the SIGSTOP on a quick moment of the machine).
LONG = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def expected(tiny_mixtral_dir):
    batch = prompts(24, seed=30)
    return batch, [o.output_token_ids for o in reference_engine(tiny_mixtral_dir).generate(batch, LONG)]


def test_a_frozen_worker_is_reported_wedged_within_the_deadline_and_serving_resumes(ray_session, tiny_mixtral_dir,
                                                                                     expected):
    batch, want = expected
    config = cluster_config(tiny_mixtral_dir, expert_workers=2, routers=2, comm={"backend": "sockets",
                            "timeout_s": TIMEOUT_S}, balancer={"enabled": False})
    deployment = deploy(config, name="wedged-worker")
    pid = ray.get(deployment.workers[1].info.remote())["pid"]
    try:
        names = {"router 0", "router 1", "worker 0", "worker 1"}
        wait_until(lambda: set(by_rank(rank_states(deployment))) == names, 60, "the watch sees every rank")
        assert deployment.generate(batch[:2], GREEDY)  # the group serves (short requests)
        states = by_rank(rank_states(deployment))
        assert all(row["state"] in ("serving", "alive") for row in states.values()), states

        result: dict = {}

        def run() -> None:
            try:
                result["outputs"] = deployment.generate(batch, LONG)
            except Exception as error:  # re-raised below
                result["error"] = error

        sent = sum(t["bytes_sent"] for t in deployment.telemetry())
        runner = threading.Thread(target=run)
        runner.start()
        wait_until(lambda: sum(t["bytes_sent"] for t in deployment.telemetry()) > sent or not runner.is_alive(), 60,
                 "the batch starts")
        assert runner.is_alive(), "the batch ended before the freeze"
        frozen_at = time.time()
        os.kill(pid, signal.SIGSTOP)
        report = wait_until(lambda: (lambda r: r if r["wedged"] else None)(rank_states(deployment)),
                          TIMEOUT_S + 30, "worker 1 reported wedged")
        (wedged,) = report["wedged"]
        detected_s = wedged["time"] - frozen_at
        print(f"worker 1 frozen: reported wedged and killed after {detected_s:.2f} s "
              f"(limit {WEDGE_FRACTION * TIMEOUT_S:.1f} s, comm.timeout_s {TIMEOUT_S:g} s); {wedged['reason']}")
        assert wedged["rank"] == "worker 1" and wedged["pid"] == pid, wedged
        assert "no answer" in wedged["reason"] and "killed" in wedged["reason"], wedged
        assert WEDGE_FRACTION * TIMEOUT_S - 0.5 < detected_s <= TIMEOUT_S + REPORT_SLACK_S, detected_s

        runner.join(timeout=300)
        assert not runner.is_alive(), "requests did not finish after the worker froze (a hang)"
        if "error" in result:
            raise result["error"]
        assert [o.output_token_ids for o in result["outputs"]] == want  # none lost, identical outputs
        recoveries = deployment.status()["recoveries"]
        assert recoveries and 1 in recoveries[-1]["lost_workers"], recoveries
        new_pid = ray.get(deployment.workers[1].info.remote(), timeout=60)["pid"]
        assert new_pid != pid  # the frozen process was killed, a new one serves
        # The restarted worker is seen again and serves; nothing else was declared wedged.
        again = deployment.generate(batch[:4], LONG)
        assert [o.output_token_ids for o in again] == want[:4]
        report = wait_until(lambda: (lambda r: r if by_rank(r)["worker 1"]["state"] in ("serving", "alive") else None)(
            rank_states(deployment)), 30, "worker 1 serving again")
        assert [w["rank"] for w in report["wedged"]] == ["worker 1"], report["wedged"]
    finally:
        try:
            os.kill(pid, signal.SIGCONT)  # if it was never killed
        except ProcessLookupError:
            pass
        deployment.shutdown()
