"""Expert copies and the EP exchange are ordered the same way on every rank (issue 34 item 3).

A worker drives two communicators: the EP group (dispatch/combine, from its serving loop) and
the migration group (expert copies). On NCCL two communicators on one GPU may deadlock unless
every rank issues their collectives in the same order; nothing on CPU would show that, so each
worker keeps a log of the order it met them in (``ExpertWorker.collectives``): every copy with
its position among the EP collectives (steps and idle ticks) of its group generation when it
started and when it ended (2n: right after the n-th; 2n + 1: inside the next, waiting for it).

Under load, with two routers (the mark has to be agreed between them), rebalances on two
workers, a grow to three (the new worker copies before it serves any EP group) and a rebalance
on three workers: every worker that serves the EP group runs each copy between the same two EP
collectives as every other (no EP collective in flight when it starts, none during it, the same
position on every rank), copies come in the same order on every rank, and outputs are the
in-process engine's.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict

import pytest
import ray

from ep_helpers import GREEDY, cluster_config, prompts
from raymoe.cluster.deploy import deploy
from raymoe.engine.engine import EngineConfig, LLMEngine
from raymoe.engine.sampling_params import SamplingParams
from tiny_models import build_skewed_model, write_checkpoint

SKEWED = {"strategy": "explicit", "experts": {0: [0, 1, 2, 3], 1: [4, 5, 6, 7]}}
LONG = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def skewed(tmp_path_factory):
    path = write_checkpoint(build_skewed_model(), str(tmp_path_factory.mktemp("skewed-order")))
    batch = prompts(40, seed=11)
    engine = LLMEngine.from_pretrained(path, EngineConfig(dtype="float32"))
    return path, batch, [o.output_token_ids for o in engine.generate(batch, LONG)]


def copies_by_generation(log: list[list]) -> dict[int, list[tuple]]:
    """A worker's copies that ran at an EP step boundary, per EP generation, in the order it ran
    them: (mark, EP position when it started, when it ended, ok)."""
    out: dict[int, list[tuple]] = defaultdict(list)
    for entry in log:
        if entry[0] == "copy" and entry[6] == "step boundary":
            mark, generation, before, after, ok = entry[3], entry[7], entry[8], entry[9], entry[11]
            out[generation].append((mark, before, after, ok))
    return out


def test_every_rank_sees_copies_and_ep_steps_in_the_same_order(ray_session, skewed):
    path, batch, want = skewed
    config = cluster_config(path, expert_workers=2, routers=2, placement=SKEWED,
                            comm={"backend": "sockets", "timeout_s": 10.0},
                            balancer={"enabled": True, "interval_steps": 10**9},  # by hand only
                            engine={"max_num_seqs": 4})  # many steps: the copies land among them
    deployment = deploy(config, name="migorder")
    try:
        assert [o.output_token_ids for o in deployment.generate(batch[:4], LONG)] == want[:4]  # the window
        result: dict = {"outputs": []}
        stop = threading.Event()

        def run() -> None:  # the batch again and again until the operations are done (at most 20 times)
            try:
                for _ in range(20):
                    result["outputs"].append([o.output_token_ids for o in deployment.generate(batch, LONG)])
                    if stop.is_set():
                        return
            except Exception as error:  # re-raised below
                result["error"] = error

        def tokens() -> int:
            return sum(t["generated_tokens"] for t in deployment.telemetry())

        def wait_for_tokens(count: int) -> None:  # (the window's traffic, under the batch's load)
            target, deadline = tokens() + count, time.monotonic() + 60
            while tokens() < target and runner.is_alive():
                assert time.monotonic() < deadline, "the batch made no progress"
                time.sleep(0.01)

        runner = threading.Thread(target=run)
        runner.start()
        wait_for_tokens(1)
        reports = [deployment.rebalance(), deployment.resize(3)]
        wait_for_tokens(8)  # a resize clears the window
        reports.append(deployment.rebalance())
        busy = runner.is_alive()  # the last operation ended with requests still in flight
        stop.set()
        runner.join(timeout=300)
        assert not runner.is_alive(), "requests did not finish (a hang)"
        if "error" in result:
            raise result["error"]
        assert result["outputs"] and all(outputs == want for outputs in result["outputs"])  # none failed, unchanged
        assert reports[0]["rebalanced"] and reports[0]["copies"] > 0, reports[0]
        assert reports[1]["resized"] and reports[1]["copies"] > 0, reports[1]
        assert reports[2]["rebalanced"], reports[2]
        assert busy, "the batch ended before the last copy: nothing was under load"

        logs = ray.get([w.collectives.remote() for w in deployment.workers])
        per_worker = [copies_by_generation(entry["log"]) for entry in logs]
        # The grow's new worker served no EP group yet: its first copies ran at once.
        new_copies = [e for e in logs[2]["log"] if e[0] == "copy"]
        assert new_copies and new_copies[0][6] == "now", new_copies
        generations = sorted({g for copies in per_worker for g in copies})
        assert len(generations) >= 2, per_worker  # before and after the grow's rebuild
        total = 0
        for generation in generations:
            sequences = {w: copies[generation] for w, copies in enumerate(per_worker) if generation in copies}
            # every worker of the generation took part in its copies (the migration group is all of them)
            members = [w for w, entry in enumerate(logs) if any(e[0] == "join" and e[1] == generation
                                                                 for e in entry["log"])]
            assert sorted(sequences) == members, (generation, sequences, members)
            for worker, sequence in sequences.items():
                for mark, start, end, ok in sequence:
                    assert ok, (worker, mark)
                    # no EP collective in flight on this rank when it started, none while it copied
                    assert start % 2 == 0 and start == end, (
                        f"worker {worker}: copy {mark} ran from EP position {start} to {end} of generation "
                        f"{generation} (odd: inside an EP collective)")
            # every rank: the same copies, in the same order, between the same EP collectives
            first = next(iter(sequences.values()))
            assert all(sequence == first for sequence in sequences.values()), (generation, sequences)
            total += len(first)
        assert total >= 3, per_worker  # the first rebalance's, the grow's (old workers), the second rebalance's
    finally:
        deployment.shutdown()
