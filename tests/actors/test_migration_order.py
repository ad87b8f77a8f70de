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

from ep_helpers import cluster_config, prompts
from raymoe.actors.expert_worker import ExpertWorker, migration_mark
from raymoe.actors.router import Router
from raymoe.cluster.deploy import deploy
from raymoe.engine.engine import EngineConfig, LLMEngine
from raymoe.engine.exchange.native_sides import NativeWorkerExchange
from raymoe.engine.exchange.python_sides import PythonWorkerExchange
from raymoe.engine.hf_config import load_model_config
from raymoe.engine.sampling_params import SamplingParams
from raymoe.kernels.comm import CommBackend, new_rendezvous
from raymoe.moe.initial_placement import initial_placement
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


def joined(threads: list[threading.Thread]) -> None:
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
        assert not thread.is_alive(), "a join hung"


@pytest.mark.parametrize("backend,side", [("gloo", PythonWorkerExchange), ("sockets", NativeWorkerExchange)])
def test_a_copy_runs_right_after_the_first_tick_that_carries_its_mark(tiny_mixtral_dir, backend, side):
    """In one process, the real objects: 2 routers and 2 workers in one EP group, the workers in
    a migration group. A copy queued on both workers does not run before a router carries its
    mark (ticks go out meanwhile, carrying an older mark); once router 1 alone has it, both
    workers run it right after that tick, at the same EP position between two collectives, and
    the expert is staged. A mark is never reused. Both worker sides read the tick's marks:
    Python (gloo) and native (sockets)."""
    if side is NativeWorkerExchange:
        from raymoe.kernels import native_cpu
        if native_cpu.unavailable_reason() is not None:
            pytest.skip(f"native CPU kernels: {native_cpu.unavailable_reason()}")
    config = load_model_config(tiny_mixtral_dir)
    placement = initial_placement(num_layers=len(config.moe_layers), num_experts=config.num_experts, num_workers=2,
                                  strategy="round_robin")
    workers = [ExpertWorker(w, tiny_mixtral_dir, "float32", "cpu", placement.to_dict(), spare_rows=1)
               for w in range(2)]
    routers = [Router(f"router-{r}", tiny_mixtral_dir, EngineConfig(dtype="float32"), placement.to_dict(), workers,
                      backend, 20.0, r, 2) for r in range(2)]
    try:
        group = new_rendezvous(CommBackend(backend), host="127.0.0.1", group_name=f"order-ep-{backend}")
        joined([threading.Thread(target=r.join, args=(group, 0, [0, 1])) for r in routers]
               + [threading.Thread(target=w.join, args=(backend, group, 2 + w.worker, 2, [0, 1], 20.0))
                  for w in workers])
        assert all(type(w.exchange) is side for w in workers)
        # The migration group is joined as a copy runs: not beside the serving loop's collectives
        # (refused) but right after the tick that carries the join's mark, on both workers alike.
        migration = workers[0].migration_rendezvous(backend)
        with pytest.raises(RuntimeError, match="serves the EP group: it joins a migration group only between"):
            workers[0].join_migration(backend, migration, 2, 20.0)
        join_mark = migration_mark(2, 0)
        assert [w.queue_migration_join(join_mark, backend, migration, 2, 20.0) for w in workers] == ["step boundary"] * 2
        with pytest.raises(TimeoutError, match="its step boundary never came"):
            workers[0].wait_migration(join_mark, 0.3)  # no router carries the mark yet: nobody joined
        assert all(w.migration_comm is None for w in workers)
        routers[0].mark_migration(join_mark)
        assert [w.wait_migration(join_mark, 20.0) for w in workers] == [0, 0]
        joins = [[e for e in w.collectives()["log"] if e[0] == "migration join"] for w in workers]
        assert [len(j) for j in joins] == [1, 1], joins
        (first,), (second,) = joins
        assert first[4] == second[4] == "step boundary" and first[2] == second[2] and first[2] % 2 == 0, joins
        # Layer 0: worker 0's first expert, into worker 1's slot 0 (staged under epoch 7).
        expert = workers[0].experts[placement.epoch][0][0]
        mark = migration_mark(7, 0)
        assert workers[0].queue_migration(mark, placement.epoch, 0, 7, [(1, expert)], []) == "step boundary"
        assert workers[1].queue_migration(mark, placement.epoch, 0, 7, [], [(0, 0, expert)]) == "step boundary"

        older = migration_mark(3, 1)
        routers[0].mark_migration(older)  # a tick goes out at once, with a mark no copy is queued under
        deadline = time.monotonic() + 10
        while not all(w.exchange.tick_marks == [older, 0] for w in workers):
            assert time.monotonic() < deadline, [w.exchange.tick_marks for w in workers]
            time.sleep(0.01)
        for worker in workers:
            with pytest.raises(TimeoutError, match="its step boundary never came"):
                worker.wait_migration(mark, 0.3)

        routers[1].mark_migration(mark)
        sent = [w.wait_migration(mark, 10.0) for w in workers]
        assert all(w.exchange.tick_marks == [older, mark] for w in workers), [w.exchange.tick_marks for w in workers]
        assert sent[0] > 0 and sent[1] == 0, sent
        assert workers[1].staged == {(7, 0, 0): (workers[1].staged[(7, 0, 0)][0], expert)}
        copies = [[e for e in w.collectives()["log"] if e[0] == "copy"] for w in workers]
        assert [len(c) for c in copies] == [1, 1], copies
        (first,), (second,) = copies
        assert first[3] == second[3] == mark and first[6] == second[6] == "step boundary" and first[11] and second[11]
        assert first[8] == first[9] == second[8] == second[9] and first[8] % 2 == 0, (first, second)

        with pytest.raises(RuntimeError, match="is not above the last one queued"):
            workers[0].queue_migration(mark, placement.epoch, 0, 7, [], [])
        with pytest.raises(RuntimeError, match="serves the EP group"):
            workers[0].migrate(placement.epoch, 0, 8, [], [])
        # A copy queued but never marked fails at once when the migration group is aborted.
        later = migration_mark(9, 0)
        workers[0].queue_migration(later, placement.epoch, 0, 9, [], [])
        workers[0].abort_migration()
        with pytest.raises(RuntimeError, match="never ran: the migration group was aborted"):
            workers[0].wait_migration(later, 5.0)
    finally:
        for router in routers:
            router.shutdown()
        for worker in workers:
            worker.reset_comms()
            worker.shutdown()
