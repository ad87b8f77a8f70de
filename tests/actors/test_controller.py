"""The controller: telemetry-driven replication and migration of hot experts while serving."""

from __future__ import annotations

import time

import pytest

from ep_helpers import cluster_config, prompts
from raymoe.cluster.deploy import deploy
from raymoe.engine.engine import EngineConfig, LLMEngine
from raymoe.engine.sampling_params import SamplingParams
from tiny_models import build_skewed_model, write_checkpoint

PARAMS = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
# All of experts 0 and 1 (the hot ones) start on worker 0; workers 1-3 hold cold replicas.
SKEWED_PLACEMENT = {"strategy": "explicit",
                    "experts": {0: [0, 1, 2, 3], 1: [4, 5, 6, 7], 2: [4, 5, 6, 7], 3: [4, 5, 6, 7]}}
BALANCER = {"enabled": True, "window_steps": 40, "interval_steps": 4, "threshold": 0.8, "poll_interval_s": 0.2}


@pytest.fixture(scope="module")
def skewed_dir(tmp_path_factory):
    return write_checkpoint(build_skewed_model(), str(tmp_path_factory.mktemp("skewed")))


def wait_for(condition, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


def test_skewed_load_is_rebalanced_and_balanced_load_is_left_alone(ray_session, skewed_dir):
    config = cluster_config(skewed_dir, expert_workers=4, routers=1, placement=SKEWED_PLACEMENT, balancer=BALANCER)
    deployment = deploy(config, name="ctl-skew")
    try:
        # Serve; the controller must rebalance within a bounded number of steps.
        for round_ in range(10):
            deployment.generate(prompts(8, seed=10 + round_), PARAMS)
            if deployment.status()["rebalances"] >= 1:
                break
        status = deployment.status()
        if status["rebalances"] < 1 and (status["last_decision"] or {}).get("rebalance"):
            # Decided within those rounds and migrating: its copies run at the routers' marked
            # ticks (actors/expert_worker.py), so it may end after the last round (seen once
            # in CI: decided, 0 rebalances yet). It must still end, within a bounded time.
            status = wait_for(lambda: (s := deployment.status())["rebalances"] >= 1 and s, 60,
                              "the rebalance decided on to finish")
        assert status["rebalances"] >= 1, (status["last_rebalance"], status["last_decision"])
        last = status["last_rebalance"]
        assert last["balancedness_before"] < 0.5  # measured on the window that triggered it
        assert last["copies"] > 0 and last["bytes_moved"] > 0 and last["epoch"] > 0
        # Fresh traffic under the new placement is balanced.
        deployment.generate(prompts(8, seed=40), PARAMS)
        after = wait_for(lambda: (s := deployment.status())["window_steps"] >= 4 and s, 30, "fresh telemetry")
        assert after["balancedness"] >= 0.9, after
        # Balanced load causes no migration: more of the same traffic, and the controller must
        # be seen deciding on it, not merely idle. Every decision before the rebalance saw the
        # skewed window, so a "balanced:" decision is one taken after it.
        rebalances, decisions = after["rebalances"], after["counters"]
        assert decisions["rebalance_decisions_taken"] >= 1, decisions
        for round_ in range(3):
            deployment.generate(prompts(8, seed=50 + round_), PARAMS)
        decided = wait_for(lambda: (s := deployment.status())["counters"]["rebalance_decisions_skipped"]
                           > decisions["rebalance_decisions_skipped"] and s, 30, "a decision on the balanced window")
        assert decided["last_decision"]["rebalance"] is False, decided["last_decision"]
        assert decided["last_decision"]["reason"].startswith("balanced:"), decided["last_decision"]
        assert decided["last_decision"]["balancedness"] >= BALANCER["threshold"]
        assert decided["rebalances"] == rebalances and decided["epoch"] == after["epoch"]
        # the counter proves decisions were taken on the balanced window, and none migrated
        assert decided["counters"]["rebalance_decisions_taken"] == decisions["rebalance_decisions_taken"]
        report = deployment.rebalance()  # an explicit request re-plans but finds nothing to gain
        assert report["rebalanced"] is False or report["copies"] == 0, report
    finally:
        deployment.shutdown()


def test_200_requests_while_rebalancing_all_succeed_with_unchanged_outputs(ray_session, skewed_dir):
    batch = prompts(200, seed=3)
    reference = LLMEngine.from_pretrained(skewed_dir, EngineConfig(dtype="float32"))
    expected = [o.output_token_ids for o in reference.generate(batch, PARAMS)]
    config = cluster_config(skewed_dir, expert_workers=4, routers=2, placement=SKEWED_PLACEMENT,
                            balancer=dict(BALANCER, interval_steps=2),
                            engine={"max_num_seqs": 8})  # many steps, so rebalancing lands mid-run
    deployment = deploy(config, name="ctl-live")
    try:
        outputs = deployment.generate(batch, PARAMS)
        status = deployment.status()
        assert status["rebalances"] >= 1, (status["last_rebalance"], status["last_decision"], status["window_steps"])
        assert [o.output_token_ids for o in outputs] == expected
        epochs = {step["epoch"] for t in deployment.telemetry() for step in t["steps"]}
        assert len(epochs) > 1  # steps really ran under more than one placement
    finally:
        deployment.shutdown()
