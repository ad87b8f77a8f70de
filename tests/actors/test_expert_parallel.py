"""Expert parallelism on a real local Ray cluster: same outputs as the in-process engine."""

from __future__ import annotations

import os
import signal
import time

import pytest
import ray
import torch

from ep_helpers import GREEDY, cluster_config, prompts, reference_engine
from raymoe.cluster.deploy import deploy
from raymoe.engine.experts import plan_layer
from raymoe.moe.capacity import CapacityConfig

CASES = {
    # strategy, redundant slots, expert workers, routers
    "contiguous-2w-1r": dict(placement={"strategy": "contiguous"}, expert_workers=2, routers=1),
    "round_robin-3w-2r-redundant": dict(
        placement={"strategy": "round_robin", "redundant_slots_per_worker": 1}, expert_workers=3, routers=2),
    "explicit-4w-2r-redundant": dict(
        placement={"strategy": "explicit", "redundant_slots_per_worker": 1,
                   "experts": {0: [7, 0], 1: [1, 6], 2: [2, 5], 3: [3, 4]}},
        expert_workers=4, routers=2),
    "contiguous-4w-1r-redundant": dict(
        placement={"strategy": "contiguous", "redundant_slots_per_worker": 2}, expert_workers=4, routers=1),
}


@pytest.fixture(scope="module")
def ray_session():
    ray.init(num_cpus=4, include_dashboard=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def reference(tiny_mixtral_dir):
    engine = reference_engine(tiny_mixtral_dir)
    batch = prompts(6)
    tokens = [o.output_token_ids for o in engine.generate(batch, GREEDY)]
    engine.model.experts.calls.clear()
    logits = engine.score(batch)
    return batch, tokens, logits, list(engine.model.experts.calls)


@pytest.mark.parametrize("case", sorted(CASES))
def test_outputs_equal_the_in_process_engine(case, ray_session, reference, tiny_mixtral_dir):
    batch, tokens, logits, _ = reference
    deployment = deploy(cluster_config(tiny_mixtral_dir, **CASES[case]), name=f"ep-{case}")
    try:
        outputs = deployment.generate(batch, GREEDY)  # several requests in flight on every router
        assert [o.output_token_ids for o in outputs] == tokens
        for router in range(len(deployment.routers)):
            for ours, expected in zip(deployment.score(batch, router=router), logits):
                assert (ours - expected).abs().max().item() < 1e-5
        # Every worker actually served experts.
        telemetry = deployment.telemetry()
        rows = torch.tensor([t["worker_rows"] for t in telemetry]).sum(0)
        assert (rows > 0).all()
        # Replicas share their expert's tokens: every replica slot of a replicated expert served.
        slot_tokens = torch.tensor([t["slot_tokens"] for t in telemetry]).sum(0)  # [L, P]
        placement = deployment.placement
        replicated = [(layer, e) for layer in range(placement.num_layers)
                      for e in range(placement.num_experts) if placement.logcnt[layer, e] > 1]
        assert bool(replicated) == (CASES[case]["placement"].get("redundant_slots_per_worker", 0) > 0)
        for layer, expert in replicated:
            if slot_tokens[layer, placement.replicas(layer, expert)].sum() >= 2 * placement.logcnt[layer, expert]:
                assert (slot_tokens[layer, placement.replicas(layer, expert)] > 0).all()
    finally:
        deployment.shutdown()


def test_bytes_on_the_wire_are_the_dedup_minimum(ray_session, reference, tiny_mixtral_dir):
    batch, _, _, calls = reference
    config = cluster_config(tiny_mixtral_dir, **CASES["round_robin-3w-2r-redundant"], )
    deployment = deploy(config, name="ep-bytes")
    try:
        before = deployment.telemetry()[0]["worker_bytes_sent"]
        deployment.score(batch, router=0)
        after = deployment.telemetry()[0]["worker_bytes_sent"]
        sent = sum(after) - sum(before)
        hidden = deployment.model_config.hidden_size
        row_bytes = hidden * 4
        # The plan's dedup minimum, computed here from the in-process engine's own gate output.
        minimum = sum(
            int(plan_layer(deployment.placement, layer, ids, weights, CapacityConfig()).send_counts.sum()) * row_bytes
            for layer, ids, weights in calls
        )
        naive = sum(ids.numel() for _, ids, _ in calls) * row_bytes  # tokens x k x hidden x bytes
        assert sent == minimum
        assert sent < naive
    finally:
        deployment.shutdown()


def test_a_worker_that_stops_answering_fails_the_step_within_the_deadline(ray_session, tiny_mixtral_dir):
    # The step fails with the deadline error naming the peer and the layer; then the
    # controller recovers (tests/actors/test_recovery.py) and the requests still complete.
    timeout_s = 2.0
    config = cluster_config(tiny_mixtral_dir, comm={"backend": "gloo", "timeout_s": timeout_s},
                            balancer={"enabled": False})
    deployment = deploy(config, name="ep-stall")
    pid = ray.get(deployment.workers[1].info.remote())["pid"]
    try:
        os.kill(pid, signal.SIGSTOP)
        started = time.monotonic()
        outputs = deployment.generate(prompts(2), GREEDY)
        assert len(outputs) == 2 and time.monotonic() - started < 120  # nothing hangs
        failure = ray.get(deployment.routers[0].info.remote())["last_failure"]
        assert "CollectiveTimeout" in failure["error"] and "rank 2" in failure["error"] and "layer 0" in failure["error"]
        assert failure["after_s"] < timeout_s + 3  # within the deadline (plus scheduling slack)
    finally:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass  # recovery killed the frozen process
        deployment.shutdown()
