"""What a model is, as data: the frozen :class:`ModelConfig` every layer of raymoe reads.

The parser that builds it from a Hugging Face ``config.json`` lives beside the model code
(:mod:`raymoe.engine.hf_config`).

One frozen :class:`ModelConfig` describes every supported architecture; the differences
are data (enums and sizes), not subclasses, so the model code has one path per concept:

- attention: grouped-query (:attr:`AttentionKind.GQA`) or DeepSeek's latent attention (MLA);
- q/k norms: none, per head (Qwen3-MoE) or over the whole projection (OLMoE);
- gating: :class:`raymoe.moe.gating.GateConfig` (softmax or sigmoid scores, top-k
  renormalisation, grouped top-k, correction bias, routed scaling factor);
- shared experts: none, plain (DeepSeek-V3) or sigmoid-gated (Qwen2-MoE);
- which layers are MoE (``moe_layers``) and which keep a dense MLP.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

from raymoe.moe.gating import GateConfig


class Architecture(enum.Enum):
    MIXTRAL = "MixtralForCausalLM"
    QWEN2_MOE = "Qwen2MoeForCausalLM"
    QWEN3_MOE = "Qwen3MoeForCausalLM"
    OLMOE = "OlmoeForCausalLM"
    DEEPSEEK_V3 = "DeepseekV3ForCausalLM"




class AttentionKind(enum.Enum):
    GQA = "gqa"
    MLA = "mla"


class QKNorm(enum.Enum):
    NONE = "none"
    PER_HEAD = "per_head"  # RMSNorm over head_dim (Qwen3-MoE)
    FULL = "full"  # RMSNorm over the whole projection (OLMoE)


class SharedExpertKind(enum.Enum):
    NONE = "none"
    PLAIN = "plain"  # added as is (DeepSeek-V3)
    SIGMOID_GATED = "sigmoid_gated"  # scaled by sigmoid(x @ gate) (Qwen2-MoE)


class UnsupportedModelError(ValueError):
    """The checkpoint uses an architecture or a field value raymoe cannot serve."""


@dataclass(frozen=True)
class MLAConfig:
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


@dataclass(frozen=True)
class RopeConfig:
    theta: float
    rotary_dim: int  # dimensions rotated per head
    rope_type: str = "default"  # default | linear | yarn
    factor: float = 1.0
    original_max_position: int = 0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0


@dataclass(frozen=True)
class ModelConfig:
    architecture: Architecture
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int  # q/k/v head size for GQA; qk head size for MLA
    v_head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeConfig
    attention: AttentionKind
    attention_bias: bool
    qk_norm: QKNorm
    clip_qkv: float | None
    sliding_window: int | None
    mla: MLAConfig | None
    tie_word_embeddings: bool
    dense_intermediate_size: int
    moe_layers: tuple[int, ...]  # model layer indices with routed experts
    num_experts: int
    moe_intermediate_size: int
    gate: GateConfig
    shared_expert: SharedExpertKind
    shared_intermediate_size: int
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    dtype: str  # as written in the checkpoint: float32 | bfloat16 | float16

    @property
    def top_k(self) -> int:
        return self.gate.top_k

    @property
    def attention_scale(self) -> float:
        scale = self.head_dim ** -0.5
        if self.rope.rope_type == "yarn" and self.rope.mscale_all_dim:
            mscale = yarn_get_mscale(self.rope.factor, self.rope.mscale_all_dim)
            scale *= mscale * mscale
        return scale

    @property
    def kv_cache_values_per_token(self) -> int:
        """Values the KV cache keeps per token, all layers together: MLA's latent and roped key
        (``kv_lora_rank + qk_rope_head_dim`` per layer; the heads' keys and values are never
        stored), else every kv head's key and value. engine/kv_cache.py allocates this and
        ``raymoe plan memory`` reports it."""
        if self.mla is not None:
            per_layer = self.mla.kv_lora_rank + self.mla.qk_rope_head_dim
        else:
            per_layer = self.num_kv_heads * (self.head_dim + self.v_head_dim)
        return self.num_layers * per_layer

    def is_moe_layer(self, layer: int) -> bool:
        return layer in self.moe_layers

    def moe_index(self, layer: int) -> int:
        """Position of model layer ``layer`` among the MoE layers (placement tables index this)."""
        return self.moe_layers.index(layer)


def yarn_get_mscale(scale: float, mscale: float) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0
