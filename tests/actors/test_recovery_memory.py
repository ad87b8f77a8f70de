"""Recovery without a second copy of the experts (issue 34 item 2): a worker killed under load
is restarted and reloaded, and its peak resident memory over its whole new life (constructor,
reload, serving again) stays within 10% of a steady-state worker's, on a checkpoint whose
experts dominate a worker's memory. Greedy tokens after recovery are the in-process engine's."""

from __future__ import annotations

import os
import signal

import pytest
import ray

from ep_helpers import GREEDY, cluster_config, prompts
from raymoe.cluster.deploy import deploy
from raymoe.cluster.procfs import memory_kib
from test_recovery import TIMEOUT_S, run_with_fault

PEAK_OVER_STEADY = 1.1


@pytest.fixture(scope="module")
def big_experts(tmp_path_factory):
    """A Mixtral-style checkpoint whose experts are ~200 MB of float32 (of ~205 MB), and the
    in-process engine's greedy outputs on a batch."""
    from raymoe.engine.engine import EngineConfig, LLMEngine
    from tiny_models import build_reference_model, write_checkpoint

    model = build_reference_model("mixtral", hidden_size=256, intermediate_size=2048, num_hidden_layers=4)
    path = write_checkpoint(model, str(tmp_path_factory.mktemp("big-experts")))
    del model
    batch = prompts(16, seed=34)
    engine = LLMEngine.from_pretrained(path, EngineConfig(dtype="float32"))
    want = [o.output_token_ids for o in engine.generate(batch, GREEDY)]
    del engine
    return path, batch, want


def test_a_restarted_worker_never_holds_its_experts_twice(ray_session, big_experts):
    path, batch, want = big_experts
    config = cluster_config(path, expert_workers=2, routers=1, placement={"strategy": "round_robin"},
                            comm={"backend": "sockets", "timeout_s": TIMEOUT_S},
                            balancer={"enabled": True, "interval_steps": 10**6})  # spare rows, no rebalance
    deployment = deploy(config, name="rec-memory")
    try:
        infos = ray.get([w.info.remote() for w in deployment.workers])
        pool = infos[1]["pool_bytes"]
        assert pool > 90 * 2**20  # the experts dominate: ~100 MB a worker, and as much again packed
        pid = infos[1]["pid"]
        outputs, _ = run_with_fault(deployment, batch, lambda: os.kill(pid, signal.SIGKILL))
        assert [o.output_token_ids for o in outputs] == want
        recoveries = deployment.status()["recoveries"]
        assert recoveries and 1 in recoveries[0]["lost_workers"] and recoveries[0]["mode"] == "restart", recoveries
        again = deployment.generate(batch, GREEDY)  # the restarted worker serves again
        assert [o.output_token_ids for o in again] == want
        infos = ray.get([w.info.remote() for w in deployment.workers])
        assert infos[1]["pid"] != pid
        survivor, restarted = memory_kib(infos[0]["pid"]), memory_kib(infos[1]["pid"])
        steady = survivor["VmRSS"]
        print(f"pool {pool / 2**20:.0f} MiB a worker; steady worker RSS {steady / 1024:.0f} MiB (peak "
              f"{survivor['VmHWM'] / 1024:.0f}); restarted worker peak {restarted['VmHWM'] / 1024:.0f} MiB "
              f"(now {restarted['VmRSS'] / 1024:.0f}): {restarted['VmHWM'] / steady:.3f}x steady")
        assert restarted["VmHWM"] <= PEAK_OVER_STEADY * steady, (restarted, survivor)
        assert deployment.status()["counters"]["reload_timeouts"] == 0
    finally:
        deployment.shutdown()
