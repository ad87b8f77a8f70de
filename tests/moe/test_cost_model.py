"""The seeds' worked numbers and the memory model."""

from __future__ import annotations

import json

import pytest

from raymoe.moe.cost_model import load_model_shape, memory_per_rank, payload_bytes
from raymoe.moe.model_presets import model_presets

MIB = 1 << 20


def test_seed_worked_payload_numbers():
    estimate = payload_bytes(num_tokens=1024, top_k=2, hidden_size=4096, bytes_per_value=2, num_ranks=8)
    assert estimate.dispatch_bytes == 16_777_216 == 16 * MIB
    assert estimate.dispatch_bytes + estimate.combine_bytes == 32 * MIB
    assert estimate.remote_fraction == 7 / 8
    assert estimate.remote_bytes == 28 * MIB


def test_one_rank_has_nothing_remote():
    assert payload_bytes(10, 2, 8, 2, 1).remote_bytes == 0


@pytest.mark.parametrize(
    "preset, published_billions",
    [("Mixtral-8x7B", 46.7), ("DeepSeek-V3", 671.0), ("Qwen3-235B-A22B", 235.0)],
)
def test_presets_match_published_parameter_counts(preset, published_billions):
    shape = load_model_shape(preset)
    assert shape.total_params / 1e9 == pytest.approx(published_billions, rel=0.01)


def test_deepseek_v3_on_eight_h200():
    shape = load_model_shape("deepseek-v3")
    estimate = memory_per_rank(shape, num_gpus=8, num_redundant=32, gpu_memory_bytes=141e9)
    assert shape.bytes_per_param == 1.0  # FP8 checkpoint
    assert estimate.fits == {"replicated": False, "expert_parallel": True, "expert_parallel_redundant": True}
    # One redundant slot: one routed expert (3 x 7168 x 2048 weights) in each of 58 MoE layers.
    assert estimate.redundant_slot_bytes == 58 * 3 * 7168 * 2048
    assert estimate.redundant_bytes - estimate.expert_parallel_bytes == 4 * estimate.redundant_slot_bytes
    assert (estimate.experts_per_rank, estimate.slots_per_rank) == (32, 36)


def test_expert_parallel_divides_the_experts_only():
    shape = load_model_shape("Qwen3-235B-A22B")
    one = memory_per_rank(shape, 1)
    eight = memory_per_rank(shape, 8)
    assert one.expert_parallel_bytes == one.replicated_bytes
    other = shape.other_params * shape.bytes_per_param
    assert eight.expert_parallel_bytes - other == pytest.approx((one.expert_parallel_bytes - other) / 8)


def test_config_directory_equals_preset(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(model_presets()["Mixtral-8x7B"]))
    from_dir = load_model_shape(str(tmp_path))
    assert from_dir.total_params == load_model_shape("Mixtral-8x7B").total_params
    assert from_dir.num_experts == 8 and from_dir.top_k == 2 and from_dir.num_moe_layers == 32


def test_unknown_model_and_bad_config_raise(tmp_path):
    with pytest.raises(ValueError, match="neither a preset"):
        load_model_shape("no-such-model")
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 8}))
    with pytest.raises(ValueError, match="lacks"):
        load_model_shape(str(tmp_path))
