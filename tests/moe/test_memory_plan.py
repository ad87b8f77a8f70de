"""moe/memory_plan.py: every byte of a small deployment counted by hand, and the counts
checked against what the engine and an expert worker really allocate."""

from __future__ import annotations

import inspect

import pytest

from raymoe.moe.memory_plan import (CUDA_RESERVE_BYTES, DeploymentShape, kv_cache_blocks, lower_what, plan_memory,
                                    worker_pool_rows)
from raymoe.engine.hf_config import parse_model_config

# hidden 64, expert intermediate 96, 2 MoE layers, 4 heads of 16, 2 kv heads, 8 experts, top-2, vocab 320
RAW = {"architectures": ["MixtralForCausalLM"], "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
       "num_attention_heads": 4, "num_key_value_heads": 2, "num_local_experts": 8, "num_experts_per_tok": 2,
       "vocab_size": 320, "max_position_embeddings": 256, "torch_dtype": "float32"}
DENSE_PARAMS = 66_560  # attention 2 x 12,288 + gates 2 x 8 x 64 + embeddings and lm_head 2 x 320 x 64


def small_shape(**overrides) -> DeploymentShape:
    values = dict(routers=2, expert_workers=2, slots_per_worker=4, balancer_enabled=True, max_copies_per_rebalance=3,
                  bytes_per_value=4, device="cpu", kv_cache_bytes=1_000_000, block_size=16, max_model_len=256,
                  max_num_seqs=4, max_num_batched_tokens=32, packed_experts=False)
    values.update(overrides)
    return DeploymentShape(**values)


def test_pool_rows_are_slots_plus_min_of_slots_and_copies_when_the_balancer_runs():
    assert worker_pool_rows(4, True, 8).total == 8  # all of them: spare = min(4, 8)
    assert worker_pool_rows(4, True, 1).spare == 1
    assert worker_pool_rows(4, False, 8).spare == 0
    # deploy gives its workers exactly these rows: the one function, not a copy of it
    from raymoe.cluster import deploy

    source = inspect.getsource(deploy.deploy)
    assert "worker_pool_rows(placement.slots_per_worker, balancer.enabled, balancer.max_copies_per_rebalance)" \
        in source and "min(placement.slots_per_worker" not in source


def test_a_small_cpu_deployment_counted_by_hand():
    plan = plan_memory(parse_model_config(RAW), DENSE_PARAMS, small_shape())
    assert [w.rank for w in plan.workers] == ["worker 0", "worker 1"]
    worker = plan.workers[0]
    row = 3 * 64 * 96 * 4  # gate, up, down of one expert in one layer, float32: 73,728
    assert worker.row_bytes == row == 73_728
    assert (worker.slots, worker.spare_rows) == (4, 3)  # min(4 slots, 3 copies)
    assert worker.pool_bytes == (4 + 3) * 2 * row == 1_032_192
    assert worker.packed_bytes == 0
    assert worker.staging_bytes == (2 * 3 + 3) * row == 663_552  # 3 sent (list + stack), 3 received
    # 2 routers x 32 tokens: 128 dispatched rows in and out of 64 values, and 64 tokens x 3 x 96
    assert worker.activation_bytes == (2 * 128 * 64 + 64 * 3 * 96) * 4 == 139_264
    assert worker.reserve_bytes == 0
    assert worker.serving_bytes == 1_032_192 + 663_552 + 139_264 == 1_835_008
    assert worker.reload_peak_bytes == 1_032_192 + row  # rewritten in place, one row aside
    assert worker.peak_bytes == 1_835_008  # serving needs more

    router = plan.routers[1]
    assert router.rank == "router 1"
    assert router.dense_bytes == DENSE_PARAMS * 4 == 266_240
    # 2 layers x 2 kv heads x (16 + 16) x 4 B = 512 B a token; 1,000,000 B is 122 blocks of 16
    # tokens, capped at 4 sequences x 256 tokens = 64 blocks
    assert (router.kv_cache_tokens, router.kv_cache_bytes, router.kv_cache_capped) == (1024, 524_288, True)
    per_token = (5 * 64 + (4 * 16 + 2 * 32) + 4 * 16 + 2 * 2 * 64) * 4 + 4 * 8 + 8 * 2  # 3,120
    context = 256 * 64 * 4  # one layer's K and V for a full-length sequence
    assert router.activation_bytes == 32 * per_token + context == 165_376
    assert router.score_logits_bytes == 32 * 320 * (4 + 8) == 122_880
    assert router.peak_bytes == 266_240 + 524_288 + 165_376 + 122_880 == 1_078_784
    assert plan.total_bytes == 2 * 1_078_784 + 2 * 1_835_008


def test_cuda_reserve_packed_copy_and_no_balancer():
    model = parse_model_config(RAW)
    cuda = plan_memory(model, DENSE_PARAMS, small_shape(device="cuda", bytes_per_value=2))
    assert cuda.workers[0].reserve_bytes == cuda.routers[0].reserve_bytes == CUDA_RESERVE_BYTES
    assert cuda.workers[0].pool_bytes == 7 * 2 * 3 * 64 * 96 * 2
    assert cuda.workers[0].reload_peak_bytes == cuda.workers[0].pool_bytes + 3 * 64 * 96 * 2 + CUDA_RESERVE_BYTES
    packed = plan_memory(model, DENSE_PARAMS, small_shape(packed_experts=True)).workers[0]
    row = 3 * 64 * 96 * 4
    assert packed.packed_bytes == packed.pool_bytes  # one layer's packed layout remade at a time:
    assert packed.reload_peak_bytes == 2 * packed.pool_bytes + row + 7 * row
    off = plan_memory(model, DENSE_PARAMS, small_shape(balancer_enabled=False)).workers[0]
    assert (off.spare_rows, off.staging_bytes, off.pool_bytes) == (0, 0, 4 * 2 * 3 * 64 * 96 * 4)
    uncapped = plan_memory(model, DENSE_PARAMS, small_shape(max_num_seqs=1000)).routers[0]
    assert (uncapped.kv_cache_bytes, uncapped.kv_cache_capped) == (122 * 16 * 512, False)


def test_the_setting_to_lower_follows_the_largest_part():
    model = parse_model_config(RAW)
    router = plan_memory(model, DENSE_PARAMS, small_shape(kv_cache_bytes=10**13, max_num_seqs=10**9)).routers[0]
    assert lower_what(router) == "engine.kv_cache_bytes"
    assert "expert_workers" in lower_what(plan_memory(model, DENSE_PARAMS, small_shape()).workers[0])


def test_kv_cache_is_what_the_engine_allocates(tmp_path):
    """The plan's KV cache is the bytes LLMEngine allocates, capped or not."""
    from raymoe.engine.demo_model import write_demo_model
    from raymoe.engine.engine import EngineConfig, LLMEngine
    from raymoe.engine.scheduler import SchedulerConfig
    from raymoe.engine.hf_config import load_model_config

    model_dir = write_demo_model(str(tmp_path / "demo"))
    model = load_model_config(model_dir)
    for kv_bytes, seqs in ((3_000_000, 256), (10**12, 2)):
        engine = LLMEngine.from_pretrained(model_dir, EngineConfig(
            dtype="float32", kv_cache_bytes=kv_bytes, max_model_len=512, scheduler=SchedulerConfig(max_num_seqs=seqs)))
        allocated = sum(t.numel() * t.element_size() for t in engine.cache.tensors)
        planned = plan_memory(model, 0, small_shape(kv_cache_bytes=kv_bytes, max_num_seqs=seqs,
                                                    max_model_len=512)).routers[0]
        assert allocated == planned.kv_cache_bytes
        assert engine.blocks.num_blocks * engine.blocks.block_size == planned.kv_cache_tokens
        assert planned.kv_cache_capped == (seqs == 2)
        assert kv_cache_blocks(kv_bytes, 16 * model.kv_cache_values_per_token * 4, 512, 16, seqs) == \
            engine.blocks.num_blocks


@pytest.mark.parametrize("balancer", [True, False])
def test_pool_bytes_are_what_an_expert_worker_allocates(tmp_path, balancer):
    """ExpertWorker (constructed here, without Ray) holds exactly the planned rows."""
    from raymoe.actors.expert_worker import ExpertWorker
    from raymoe.engine.demo_model import write_demo_model
    from raymoe.moe.initial_placement import initial_placement
    from raymoe.engine.hf_config import load_model_config

    model_dir = write_demo_model(str(tmp_path / "demo"))
    model = load_model_config(model_dir)
    table = initial_placement(len(model.moe_layers), model.num_experts, 2, "contiguous", redundant_slots_per_worker=1)
    rows = worker_pool_rows(table.slots_per_worker, balancer, 2)
    worker = ExpertWorker(0, model_dir, "float32", "cpu", table.to_dict(), rows.spare, packed_experts=False)
    held = sum(t.numel() * t.element_size() for t in [*worker.w13, *worker.w2])
    planned = plan_memory(model, 0, small_shape(slots_per_worker=table.slots_per_worker, balancer_enabled=balancer,
                                                max_copies_per_rebalance=2)).workers[0]
    assert held == planned.pool_bytes
