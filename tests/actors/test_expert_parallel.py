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
from raymoe.engine.engine import EngineConfig, LLMEngine
from raymoe.engine.host_memory import jemalloc_path
from raymoe.kernels import native_bf16
from raymoe.kernels.expert_mlp import kernel_name
from raymoe.engine.hf_config import load_model_config
from raymoe.moe.worker_threads import default_worker_threads
from timing import deadline_margin_s

CASES = {
    # strategy, redundant slots, expert workers, routers
    "contiguous-2w-1r-unpinned-system-malloc": dict(placement={"strategy": "contiguous"}, expert_workers=2,
                                                    routers=1, cpu={"pin_threads": False, "allocator": "system"}),
    "round_robin-3w-2r-redundant": dict(
        placement={"strategy": "round_robin", "redundant_slots_per_worker": 1}, expert_workers=3, routers=2),
    "explicit-4w-2r-redundant": dict(
        placement={"strategy": "explicit", "redundant_slots_per_worker": 1,
                   "experts": {0: [7, 0], 1: [1, 6], 2: [2, 5], 3: [3, 4]}},
        expert_workers=4, routers=2),
    "contiguous-4w-1r-redundant-2threads": dict(
        placement={"strategy": "contiguous", "redundant_slots_per_worker": 2}, expert_workers=4, routers=1,
        cpu={"worker_threads": 2}),
}


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
    batch, tokens, logits, score_calls = reference
    deployment = deploy(cluster_config(tiny_mixtral_dir, **CASES[case]), name=f"ep-{case}")
    try:
        outputs = deployment.generate(batch, GREEDY)  # several requests in flight on every router
        assert [o.output_token_ids for o in outputs] == tokens
        for router, handle in enumerate(deployment.routers):
            cursor, _ = ray.get(handle.expert_loads_since.remote(1 << 62))  # the steps so far
            for ours, expected in zip(deployment.score(batch, router=router), logits):
                assert (ours - expected).abs().max().item() < 1e-5
            # The load telemetry the controller balances by: the scoring step's tokens per logical
            # expert and layer are the gate's choices (the in-process engine's, same batch).
            _, loads = ray.get(handle.expert_loads_since.remote(cursor))  # [steps, L, E]
            chosen = torch.zeros(loads.shape[1:], dtype=torch.int64)
            for layer, topk_ids, _ in score_calls:
                chosen[layer] += torch.bincount(topk_ids.reshape(-1), minlength=chosen.shape[1])
            assert torch.equal(torch.tensor(loads).sum(0), chosen)  # a copy: the array from Ray is read-only
        # Every worker actually served experts.
        telemetry = deployment.telemetry()
        rows = torch.tensor([t["worker_rows"] for t in telemetry]).sum(0)
        assert (rows > 0).all()
        # cpu.worker_threads as configured (one case runs experts on 2 threads per worker
        # in the parity above); routers keep cpu.router_threads (1).
        workers = CASES[case].get("expert_workers", 1)
        infos = ray.get([w.info.remote() for w in deployment.workers])
        model = load_model_config(tiny_mixtral_dir)  # unset: the worker's choice by its experts' size (float32: 1)
        threads = CASES[case].get("cpu", {}).get("worker_threads") or default_worker_threads(
            model.hidden_size, model.moe_intermediate_size, 4)
        assert [i["compute_threads"] for i in infos] == [threads] * workers
        assert {ray.get(r.info.remote())["compute_threads"] for r in deployment.routers} == {1}
        # cpu.pin_threads (default on): router r's step thread and worker w's serving thread sit
        # on the r-th and w-th core; not where pinning is off, nor on a worker with 2 threads.
        cores = sorted(os.sched_getaffinity(0))
        pinned = CASES[case].get("cpu", {}).get("pin_threads", True)
        assert [i["pinned_core"] for i in infos] == [
            cores[w % len(cores)] if pinned and threads == 1 else None for w in range(workers)]
        assert [ray.get(r.info.remote())["pinned_core"] for r in deployment.routers] == [
            cores[r % len(cores)] if pinned else None for r in range(len(deployment.routers))]
        # cpu.allocator (default jemalloc, where a library is found): every actor process runs on it,
        # and the outputs above are the same either way.
        wanted = CASES[case].get("cpu", {}).get("allocator", "jemalloc")
        expected = "jemalloc" if wanted == "jemalloc" and jemalloc_path() else "system"
        assert {i["allocator"] for i in infos} | {ray.get(r.info.remote())["allocator"]
                                                  for r in deployment.routers} == {expected}
        # What loading built is out of the cyclic collector's reach in every actor (actors/heap_freeze.py):
        # torch, transformers and Ray alone leave far more than 100,000 tracked objects.
        assert min(i["frozen_objects"] for i in [*infos, *ray.get([r.info.remote() for r in deployment.routers])]) \
            > 100_000
        # Every worker runs its experts on the kernel the in-process reference takes here (so the
        # parity above compared like with like): the native one on an AVX-512F machine with a compiler.
        config = load_model_config(tiny_mixtral_dir)
        hidden, inter = config.hidden_size, config.moe_intermediate_size
        kernel = kernel_name(torch.empty(1, hidden), torch.empty(1, 2 * inter, hidden), torch.empty(1, hidden, inter))
        assert {i["expert_kernel"] for i in infos} == {kernel}
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


# bfloat16 through the exchange against the in-process engine in bfloat16: bit for bit. The
# experts' kernels are row-invariant, the workers send each assignment's output back unrounded by
# any sum of theirs (kernels/comm/wire.py::RowFormat.per_assignment), and every router combines
# them in position order in float32 exactly as the in-process engine does
# (engine/experts.py::combine_assignments): so no placement, replica or router count can move a
# bit, with top-2 (mixtral) or top-3 (qwen3_moe, where the association of three sums would).
BF16_CASES = {
    "mixtral": ({}, "round_robin-3w-2r-redundant"),
    "qwen3_moe": ({"moe_intermediate_size": 64}, "explicit-4w-2r-redundant"),
}


@pytest.mark.parametrize("arch", sorted(BF16_CASES))
def test_bfloat16_outputs_equal_the_in_process_engine_bit_for_bit(arch, ray_session, tmp_path_factory):
    from tiny_models import build_reference_model, write_checkpoint

    reason = native_bf16.bf16_unavailable_reason()
    if reason is not None:  # torch's bf16 GEMMs give a row other bits in another batch: no such promise there
        pytest.skip(f"raymoe's bf16 kernels do not run here ({reason}); placement-independence in bf16 rests on them")

    overrides, case = BF16_CASES[arch]
    model_dir = write_checkpoint(build_reference_model(arch, **overrides), str(tmp_path_factory.mktemp(f"bf16-{arch}")),
                                 dtype=torch.bfloat16)
    engine = LLMEngine.from_pretrained(model_dir, EngineConfig(dtype="bfloat16"))
    batch = prompts(6)
    tokens = [o.output_token_ids for o in engine.generate(batch, GREEDY)]
    logits = engine.score(batch)
    fields = dict(CASES[case])
    if arch != "mixtral":  # the explicit placement names mixtral's 8 experts; qwen3_moe's 8 alike
        fields["placement"] = dict(fields["placement"])
    config = cluster_config(model_dir, dtype="bfloat16", **fields)
    deployment = deploy(config, name=f"ep-bf16-{arch}")
    try:
        infos = ray.get([worker.info.remote() for worker in deployment.workers])
        assert {i["expert_kernel"] for i in infos} == {native_bf16.KERNEL}  # the row-invariant kernels ran
        assert {i["exchange_side"] for i in infos} == {"NativeWorkerExchange"}  # in one C call a layer
        for router in range(len(deployment.routers)):
            for ours, want in zip(deployment.score(batch, router=router), logits):
                assert torch.equal(ours, want), (router, (ours - want).abs().max().item())
        assert [o.output_token_ids for o in deployment.generate(batch, GREEDY)] == tokens
    finally:
        deployment.shutdown()


def reference_rows(placement, layer: int, ids: torch.Tensor) -> list[int]:
    """Rows each worker must receive for one layer's gate output, by a plain loop over the
    documented rules (ARCHITECTURE.md section 4): the i-th assignment of expert e in token
    order runs on replica ``i % replicas(e)``, and a token goes once to each worker that runs
    any of its assignments (DeepEP's dedup)."""
    seen: dict[int, int] = {}
    pairs = set()
    for token, row in enumerate(ids.tolist()):
        for expert in row:
            replicas = [s for s, e in enumerate(placement.phy2log[layer].tolist()) if e == expert]
            slot = replicas[seen.get(expert, 0) % len(replicas)]
            seen[expert] = seen.get(expert, 0) + 1
            pairs.add((token, slot // placement.slots_per_worker))
    return [sum(1 for _, w in pairs if w == worker) for worker in range(placement.num_workers)]


def test_bytes_on_the_wire_are_the_dedup_minimum(ray_session, reference, tiny_mixtral_dir):
    """The bytes the router's messages really had (telemetry's bytes_sent/bytes_received, summed
    over the tensors handed to the communicator) against a plain loop over unique (token,
    worker) pairs of the in-process engine's own gate output."""
    batch, _, _, calls = reference
    config = cluster_config(tiny_mixtral_dir, **CASES["round_robin-3w-2r-redundant"])
    deployment = deploy(config, name="ep-bytes")
    try:
        before = deployment.telemetry()[0]
        deployment.score(batch, router=0)  # one prefill step of every prompt on router 0
        after = deployment.telemetry()[0]
        placement = deployment.placement
        workers, slots = placement.num_workers, placement.slots_per_worker
        hidden, top_k = deployment.model_config.hidden_size, deployment.model_config.top_k
        assert len(calls) == placement.num_layers  # one gate output per MoE layer
        rows = [reference_rows(placement, layer, ids) for layer, ids, _ in calls]
        total_rows = sum(map(sum, rows))
        # The wire format, written out: per worker and layer a header of 4 + S int64 (rows,
        # tag checksum, epoch, kind, assignments per local slot); per row D float32
        # activations, k int32 slots, k float32 weights; back, D float32 per row and a
        # 16-byte trailer per worker and layer.
        headers = placement.num_layers * workers * (4 + slots) * 8
        expected_sent = headers + total_rows * (hidden * 4 + top_k * 8)
        expected_received = total_rows * hidden * 4 + placement.num_layers * workers * 16
        assert after["bytes_sent"] - before["bytes_sent"] == expected_sent
        assert after["bytes_received"] - before["bytes_received"] == expected_received
        assert [a - b for a, b in zip(after["worker_rows"], before["worker_rows"])] == [
            sum(layer_rows[w] for layer_rows in rows) for w in range(workers)]
        # The dedup matters here: without it a token goes once per assignment.
        assignments = sum(ids.numel() for _, ids, _ in calls)
        assert total_rows < assignments
    finally:
        deployment.shutdown()


def test_a_worker_that_stops_answering_fails_the_step_within_the_deadline(ray_session, tiny_mixtral_dir):
    # The step fails with the deadline error naming the peer and the layer; then the
    # controller recovers (tests/actors/test_recovery.py) and the requests still complete.
    timeout_s = 2.0
    # (the rank watch's limit well past the deadline: at its default, 1.6 s, the watch kills the
    # frozen worker first, and the step fails on the closed connection instead of the deadline)
    config = cluster_config(tiny_mixtral_dir, comm={"backend": "gloo", "timeout_s": timeout_s, "wedge_after_s": 60},
                            balancer={"enabled": False})
    deployment = deploy(config, name="ep-stall")
    pid = ray.get(deployment.workers[1].info.remote())["pid"]
    try:
        wall_started = time.time()
        os.kill(pid, signal.SIGSTOP)
        started = time.monotonic()
        outputs = deployment.generate(prompts(2), GREEDY)
        assert len(outputs) == 2 and time.monotonic() - started < 120  # nothing hangs
        # The first failure after the freeze (the recovery's retry may fail again while the
        # replacement worker warms up on a loaded machine; last_failure is then that one).
        failures = ray.get(deployment.routers[0].info.remote())["recent_failures"]
        assert failures, "the step never failed"
        failure = failures[0]
        assert failure["time"] >= wall_started, failures
        assert "CollectiveTimeout" in failure["error"] and "rank 2" in failure["error"] and "layer 0" in failure["error"]
        # Not before the deadline; after it by no more than a margin scaled to this machine's load.
        margin = deadline_margin_s(2.0)
        assert timeout_s - 0.1 <= failure["after_s"] <= timeout_s + margin, (failure["after_s"], margin)
    finally:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass  # recovery killed the frozen process
        deployment.shutdown()
