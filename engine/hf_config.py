"""The Hugging Face ``config.json`` parser: builds :class:`raymoe.moe.model_config.ModelConfig`.

Unsupported architectures or values raise :class:`UnsupportedModelError` naming the field.
"""

from __future__ import annotations

import json
import os
from typing import Any

from raymoe.moe.gating import GateConfig, ScoringFunction
from raymoe.moe.model_config import (
    MLAConfig,
    Architecture,
    AttentionKind,
    ModelConfig,
    QKNorm,
    RopeConfig,
    SharedExpertKind,
    UnsupportedModelError,
)

_MODEL_TYPES = {
    "mixtral": Architecture.MIXTRAL,
    "qwen2_moe": Architecture.QWEN2_MOE,
    "qwen3_moe": Architecture.QWEN3_MOE,
    "olmoe": Architecture.OLMOE,
    "deepseek_v3": Architecture.DEEPSEEK_V3,
}


def load_model_config(model_dir: str) -> ModelConfig:
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"{path} not found: a model directory needs a Hugging Face config.json "
            "(write a demo one with `raymoe demo-model DIR`)"
        )
    with open(path, encoding="utf-8") as handle:
        return parse_model_config(json.load(handle))


def parse_model_config(raw: dict[str, Any]) -> ModelConfig:
    """Parse a ``config.json`` dict; unsupported architectures or values raise clearly."""
    names = raw.get("architectures") or []
    supported = {a.value: a for a in Architecture}
    matches = [supported[n] for n in names if n in supported]
    if not names and raw.get("model_type") in _MODEL_TYPES:  # configs written without `architectures`
        matches = [_MODEL_TYPES[raw["model_type"]]]
    if not matches:
        raise UnsupportedModelError(
            f"unsupported architecture {names or raw.get('model_type')!r}; raymoe serves "
            f"{sorted(supported)}"
        )
    arch = matches[0]
    reader = _FieldReader(raw, arch)
    act = reader.optional("hidden_act", "silu")
    if act != "silu":
        raise UnsupportedModelError(f"{arch.value}: hidden_act={act!r} is not supported (only 'silu')")
    num_layers = reader.required("num_hidden_layers")
    hidden = reader.required("hidden_size")
    num_heads = reader.required("num_attention_heads")
    num_kv_heads = reader.optional("num_key_value_heads", num_heads) or num_heads
    if num_heads % num_kv_heads:
        raise UnsupportedModelError(
            f"num_attention_heads={num_heads} is not a multiple of num_key_value_heads={num_kv_heads}"
        )
    head_dim = reader.optional("head_dim", None) or hidden // num_heads
    eos = raw.get("eos_token_id")
    eos_ids = tuple(int(e) for e in (eos if isinstance(eos, list) else [eos] if eos is not None else []))
    common: dict[str, Any] = dict(
        architecture=arch,
        vocab_size=reader.required("vocab_size"),
        hidden_size=hidden,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        rms_norm_eps=float(reader.optional("rms_norm_eps", 1e-6)),
        max_position_embeddings=reader.required("max_position_embeddings"),
        attention_bias=bool(reader.optional("attention_bias", False)),
        qk_norm=QKNorm.NONE,
        clip_qkv=None,
        sliding_window=None,
        mla=None,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        dense_intermediate_size=int(raw.get("intermediate_size") or 0),
        eos_token_ids=tuple(e for e in eos_ids if 0 <= e < int(raw["vocab_size"])),
        bos_token_id=raw.get("bos_token_id"),
        dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "float32"),
        shared_expert=SharedExpertKind.NONE,
        shared_intermediate_size=0,
        attention=AttentionKind.GQA,
        head_dim=head_dim,
        v_head_dim=head_dim,
    )
    if arch is Architecture.MIXTRAL:
        num_experts = reader.required("num_local_experts")
        common.update(
            num_experts=num_experts,
            moe_intermediate_size=reader.required("intermediate_size"),
            moe_layers=tuple(range(num_layers)),
            gate=GateConfig(ScoringFunction.SOFTMAX, num_experts, reader.required("num_experts_per_tok"), True),
            sliding_window=raw.get("sliding_window") or None,
        )
    elif arch in (Architecture.QWEN2_MOE, Architecture.QWEN3_MOE):
        num_experts = raw.get("num_experts") or reader.required("num_local_experts")
        step = int(raw.get("decoder_sparse_step", 1) or 1)
        dense_only = set(raw.get("mlp_only_layers") or [])
        common.update(
            num_experts=num_experts,
            moe_intermediate_size=reader.required("moe_intermediate_size"),
            moe_layers=tuple(
                i for i in range(num_layers) if i not in dense_only and (i + 1) % step == 0
            ),
            gate=GateConfig(
                ScoringFunction.SOFTMAX, num_experts, reader.required("num_experts_per_tok"),
                bool(raw.get("norm_topk_prob", False)),
            ),
        )
        if raw.get("use_sliding_window"):
            raise UnsupportedModelError(f"{arch.value}: use_sliding_window=true is not supported")
        if arch is Architecture.QWEN2_MOE:
            common.update(attention_bias=bool(raw.get("qkv_bias", True)))
            shared = int(raw.get("shared_expert_intermediate_size") or 0)
            if shared:
                common.update(shared_expert=SharedExpertKind.SIGMOID_GATED, shared_intermediate_size=shared)
        else:
            common.update(qk_norm=QKNorm.PER_HEAD)
    elif arch is Architecture.OLMOE:
        num_experts = reader.required("num_experts")
        common.update(
            num_experts=num_experts,
            moe_intermediate_size=reader.required("intermediate_size"),
            moe_layers=tuple(range(num_layers)),
            gate=GateConfig(
                ScoringFunction.SOFTMAX, num_experts, reader.required("num_experts_per_tok"),
                bool(raw.get("norm_topk_prob", False)),
            ),
            qk_norm=QKNorm.FULL,
            clip_qkv=raw.get("clip_qkv"),
        )
    else:  # DeepSeek-V3
        common.update(_deepseek_fields(raw, reader, num_layers))
    common["rope"] = _rope_config(raw, arch, common)
    return ModelConfig(**common)


def _deepseek_fields(raw: dict[str, Any], reader: "_FieldReader", num_layers: int) -> dict[str, Any]:
    num_experts = raw.get("n_routed_experts") or reader.required("num_local_experts")
    scoring = raw.get("scoring_func", "sigmoid")
    if scoring != "sigmoid":
        raise UnsupportedModelError(f"DeepseekV3ForCausalLM: scoring_func={scoring!r} is not supported")
    topk_method = raw.get("topk_method", "noaux_tc")
    if topk_method != "noaux_tc":
        raise UnsupportedModelError(f"DeepseekV3ForCausalLM: topk_method={topk_method!r} is not supported")
    mla = MLAConfig(
        q_lora_rank=raw.get("q_lora_rank"),
        kv_lora_rank=reader.required("kv_lora_rank"),
        qk_nope_head_dim=reader.required("qk_nope_head_dim"),
        qk_rope_head_dim=reader.required("qk_rope_head_dim"),
        v_head_dim=reader.required("v_head_dim"),
        rope_interleave=bool(raw.get("rope_interleave", True)),
    )
    first_dense = int(raw.get("first_k_dense_replace", 0) or 0)
    step = int(raw.get("moe_layer_freq", 1) or 1)
    num_shared = int(raw.get("n_shared_experts") or 0)
    moe_size = reader.required("moe_intermediate_size")
    gate = GateConfig(
        ScoringFunction.SIGMOID,
        num_experts,
        reader.required("num_experts_per_tok"),
        bool(raw.get("norm_topk_prob", True)),
        num_groups=int(raw.get("n_group") or 1),
        topk_groups=int(raw.get("topk_group") or 1),
        routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.0)),
        has_correction_bias=True,
    )
    return dict(
        attention=AttentionKind.MLA,
        num_kv_heads=raw["num_attention_heads"],  # MLA expands the latent to every head
        mla=mla,
        head_dim=mla.qk_head_dim,
        v_head_dim=mla.v_head_dim,
        num_experts=num_experts,
        moe_intermediate_size=moe_size,
        moe_layers=tuple(i for i in range(first_dense, num_layers) if i % step == 0),
        gate=gate,
        shared_expert=SharedExpertKind.PLAIN if num_shared else SharedExpertKind.NONE,
        shared_intermediate_size=moe_size * num_shared,
    )


def _rope_config(raw: dict[str, Any], arch: Architecture, fields: dict[str, Any]) -> RopeConfig:
    params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    rotary_dim = fields["mla"].qk_rope_head_dim if fields["mla"] else fields["head_dim"]
    if raw.get("partial_rotary_factor", 1.0) != 1.0:
        raise UnsupportedModelError(f"{arch.value}: partial_rotary_factor != 1 is not supported")
    if rope_type not in ("default", "linear", "yarn"):
        raise UnsupportedModelError(
            f"{arch.value}: rope type {rope_type!r} is not supported (default, linear, yarn)"
        )
    return RopeConfig(
        theta=theta,
        rotary_dim=rotary_dim,
        rope_type=rope_type,
        factor=float(params.get("factor", 1.0)),
        original_max_position=int(
            params.get("original_max_position_embeddings") or raw["max_position_embeddings"]
        ),
        beta_fast=float(params.get("beta_fast", 32.0)),
        beta_slow=float(params.get("beta_slow", 1.0)),
        mscale=float(params.get("mscale", 1.0)),
        mscale_all_dim=float(params.get("mscale_all_dim", 0.0) or 0.0),
    )


class _FieldReader:
    def __init__(self, raw: dict[str, Any], arch: Architecture):
        self.raw = raw
        self.arch = arch

    def required(self, name: str) -> Any:
        if self.raw.get(name) is None:
            raise UnsupportedModelError(f"{self.arch.value}: config.json lacks required field {name!r}")
        return self.raw[name]

    def optional(self, name: str, default: Any) -> Any:
        value = self.raw.get(name)
        return default if value is None else value
