"""A router scores (echo, prompt logprobs) within its token budget (issue 34, item 6): one
forward of at most ``max_num_batched_tokens`` per group step through the expert workers,
taking turns with the steps of requests in flight, and the same numbers as the in-process
engine's one forward; a worker lost part-way costs a recovery, not the scoring."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import ray

from ep_helpers import GREEDY, cluster_config, prompts
from raymoe.cluster.deploy import deploy
from raymoe.engine.engine import EngineConfig, LLMEngine
from raymoe.engine.prompt_logprobs import prompt_logprobs
from raymoe.engine.scheduler import SchedulerConfig

BUDGET = 16
TOP = 3
TOLERANCE = 1e-5
LONG = [list(range(4, 4 + 150)), list(range(40, 40 + 37)), [7], [9, 10]]  # over 9 budgets, over 2, 1 token, 2


@pytest.fixture(scope="module")
def reference(tiny_mixtral_dir):
    """Every prompt in one forward (the old score), reduced afterwards; and greedy outputs."""
    engine = LLMEngine.from_pretrained(tiny_mixtral_dir, EngineConfig(
        dtype="float32", scheduler=SchedulerConfig(max_num_batched_tokens=100_000)))
    scored = [prompt_logprobs(row, prompt, TOP) for row, prompt in zip(engine.score(LONG), LONG)]
    batch = prompts(8, seed=5)
    return scored, engine.score(LONG), batch, [o.output_token_ids for o in engine.generate(batch, GREEDY)]


def steps(router) -> int:
    """Group steps in which this router ran tokens, since start."""
    return ray.get(router.expert_loads_since.remote(1 << 62))[0]


def assert_same_scores(ours, expected):
    for a, b in zip(ours, expected, strict=True):
        assert a.ranks == b.ranks and a.top[0] is None and a.token_logprobs[0] is None
        assert a.token_logprobs[1:] == pytest.approx(b.token_logprobs[1:], abs=TOLERANCE)
        assert [[t for t, _ in x] for x in a.top[1:]] == [[t for t, _ in x] for x in b.top[1:]]


def test_a_router_scores_in_forwards_of_its_budget(ray_session, tiny_mixtral_dir, reference):
    expected, logits, batch, tokens = reference
    config = cluster_config(tiny_mixtral_dir, routers=2, expert_workers=2,
                            engine={"max_num_batched_tokens": BUDGET, "enable_prefix_caching": False})
    deployment = deploy(config, name="score-budget")
    try:
        router = deployment.routers[0]
        before = steps(router)
        assert_same_scores(ray.get(router.score_prompts.remote(LONG, TOP)), expected)
        assert steps(router) - before >= -(-sum(map(len, LONG)) // BUDGET)  # <= BUDGET tokens a group step
        for ours, want in zip(deployment.score(LONG, router=1), logits, strict=True):  # full logits, for tests
            assert (ours - want).abs().max().item() < TOLERANCE
        # Scoring beside requests in flight on the same router: they take turns, both come out right.
        result = {}
        runner = threading.Thread(target=lambda: result.update(outputs=deployment.generate(batch, GREEDY)))
        runner.start()
        assert_same_scores(ray.get(router.score_prompts.remote(LONG * 2, TOP)), expected * 2)
        runner.join(timeout=120)
        assert [o.output_token_ids for o in result["outputs"]] == tokens
    finally:
        deployment.shutdown()


def test_scoring_goes_on_after_a_worker_is_lost(ray_session, tiny_mixtral_dir, reference):
    """A worker killed while a long scoring job runs: the router keeps the job and its state,
    the group is rebuilt, and the job finishes with the numbers of a clean run."""
    expected = reference[0]
    config = cluster_config(tiny_mixtral_dir, routers=1, expert_workers=2,
                            engine={"max_num_batched_tokens": 4, "enable_prefix_caching": False},
                            comm={"backend": "sockets", "timeout_s": 3.0}, balancer={"enabled": False})
    deployment = deploy(config, name="score-budget-fault")
    try:
        pid = ray.get(deployment.workers[1].info.remote())["pid"]
        router = deployment.routers[0]
        job = router.score_prompts.remote(LONG * 4, TOP)  # ~200 group steps
        start = steps(router)
        deadline = time.monotonic() + 60
        while steps(router) < start + 20:  # part-way through
            assert time.monotonic() < deadline, "the scoring never started"
            time.sleep(0.01)
        os.kill(pid, signal.SIGKILL)
        assert_same_scores(ray.get(job, timeout=240), expected * 4)
        assert deployment.status()["recoveries"], "no recovery: the job finished before the fault"
    finally:
        deployment.shutdown()
