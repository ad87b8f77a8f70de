"""config.json parsing: each architecture's semantics, and clear errors for what isn't supported."""

from __future__ import annotations

import pytest

from raymoe.moe.gating import ScoringFunction
from raymoe.moe.model_config import AttentionKind, QKNorm, SharedExpertKind, UnsupportedModelError
from raymoe.engine.hf_config import parse_model_config
from tiny_models import ARCHITECTURES, hf_config


def raw(arch: str, **overrides) -> dict:
    return hf_config(arch, **overrides).to_dict()


def test_every_architecture_parses_with_its_semantics():
    configs = {arch: parse_model_config(raw(arch)) for arch in ARCHITECTURES}
    mixtral, qwen2, qwen3, olmoe, deepseek = (configs[a] for a in ARCHITECTURES)
    assert mixtral.gate.norm_topk_prob and mixtral.moe_layers == (0, 1, 2)
    assert qwen2.shared_expert is SharedExpertKind.SIGMOID_GATED and qwen2.attention_bias
    assert qwen2.moe_layers == (0, 2)  # mlp_only_layers=[1] keeps a dense MLP
    assert qwen3.qk_norm is QKNorm.PER_HEAD and qwen3.gate.norm_topk_prob and qwen3.head_dim == 24
    assert olmoe.qk_norm is QKNorm.FULL and not olmoe.gate.norm_topk_prob
    assert deepseek.attention is AttentionKind.MLA and deepseek.moe_layers == (1, 2)
    assert deepseek.gate.scoring is ScoringFunction.SIGMOID and deepseek.gate.has_correction_bias
    assert (deepseek.gate.num_groups, deepseek.gate.topk_groups) == (4, 2)
    assert deepseek.gate.routed_scaling_factor == 2.5
    assert deepseek.shared_expert is SharedExpertKind.PLAIN and deepseek.shared_intermediate_size == 32


def test_legacy_rope_theta_field_is_read():
    config = raw("mixtral")
    config.pop("rope_parameters", None)
    config["rope_theta"] = 1234.0
    assert parse_model_config(config).rope.theta == 1234.0


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(architectures=["LlamaForCausalLM"]), "unsupported architecture"),
        (dict(hidden_act="gelu"), "hidden_act='gelu'"),
        (dict(rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}), "rope type 'dynamic'"),
        (dict(num_key_value_heads=3), "not a multiple"),
        (dict(num_local_experts=None), "num_local_experts"),
    ],
)
def test_unsupported_values_are_named(change, message):
    config = raw("mixtral")
    config.update(change)
    with pytest.raises(UnsupportedModelError, match=message):
        parse_model_config(config)


def test_deepseek_unsupported_scoring_is_named():
    config = raw("deepseek_v3")
    config["scoring_func"] = "softmax"
    with pytest.raises(UnsupportedModelError, match="scoring_func='softmax'"):
        parse_model_config(config)
