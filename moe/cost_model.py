"""Cost model: dispatch/combine payload and weight memory per rank.

Legend: T tokens, k experts per token, D hidden size, s bytes per value, W ranks (GPUs, the
expert workers), E routed experts per layer, L MoE layers, Xr redundant expert slots per layer.

- Dispatch payload is T x k x D x s; combine returns the same widths, so the same again.
  With expert owners independent of token sources and balanced over W ranks, a fraction
  (W - 1) / W of it crosses ranks. Logical payload only: no metadata, padding or timing.
- Weights per rank: replicated holds everything; expert-parallel holds the non-routed
  weights plus ceil(E / W) experts of every MoE layer; with Xr redundant slots per layer,
  ceil((E + Xr) / W). One redundant slot on a rank costs L expert weights.
Parameter counts come from config.json (or a named preset with the same fields), counting
linear weights and embeddings; norms, biases and FP8 block scales are left out (<0.1%).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from raymoe.moe.model_presets import model_presets

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float8": 1, "fp8": 1}


@dataclass(frozen=True)
class PayloadEstimate:
    dispatch_bytes: int
    combine_bytes: int
    remote_fraction: float
    remote_bytes: float  # (dispatch + combine) x remote fraction

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def payload_bytes(num_tokens: int, top_k: int, hidden_size: int, bytes_per_value: int, num_ranks: int) -> PayloadEstimate:
    """The seeds' bound for one MoE layer under independent balanced placement."""
    for name, value in (("tokens", num_tokens), ("top_k", top_k), ("hidden", hidden_size), ("bytes_per_value", bytes_per_value)):
        if value < 0:
            raise ValueError(f"{name} must be >= 0, got {value}")
    if num_ranks < 1:
        raise ValueError(f"ranks must be >= 1, got {num_ranks}")
    # Step 1: dispatch, T x k x D x s; combine is the same width back.
    dispatch = num_tokens * top_k * hidden_size * bytes_per_value
    # Step 2: the part that leaves its rank.
    remote_fraction = (num_ranks - 1) / num_ranks
    return PayloadEstimate(dispatch, dispatch, remote_fraction, 2 * dispatch * remote_fraction)


@dataclass(frozen=True)
class ModelShape:
    """The parameter budget of an MoE checkpoint."""

    name: str
    hidden_size: int
    num_experts: int
    top_k: int
    num_moe_layers: int
    expert_params: int  # one routed expert of one layer
    other_params: int  # everything not a routed expert: attention, dense/shared MLP, router, embeddings
    bytes_per_param: float

    @property
    def routed_params(self) -> int:
        return self.num_moe_layers * self.num_experts * self.expert_params

    @property
    def total_params(self) -> int:
        return self.routed_params + self.other_params


def _attention_params(config: dict[str, Any]) -> int:
    hidden = config["hidden_size"]
    heads = config["num_attention_heads"]
    if "kv_lora_rank" in config:  # multi-head latent attention (DeepSeek-V2/V3)
        qk_head = config["qk_nope_head_dim"] + config["qk_rope_head_dim"]
        q_rank = config.get("q_lora_rank")
        query = hidden * q_rank + q_rank * heads * qk_head if q_rank else hidden * heads * qk_head
        kv_down = hidden * (config["kv_lora_rank"] + config["qk_rope_head_dim"])
        kv_up = config["kv_lora_rank"] * heads * (config["qk_nope_head_dim"] + config["v_head_dim"])
        return query + kv_down + kv_up + heads * config["v_head_dim"] * hidden
    head_dim = config.get("head_dim") or hidden // heads
    kv_heads = config.get("num_key_value_heads", heads)
    return 2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim


def _bytes_per_param(config: dict[str, Any]) -> float:
    quantization = config.get("quantization_config") or {}
    if str(quantization.get("quant_method", "")).lower() == "fp8":
        return 1.0
    dtype = str(config.get("torch_dtype", "bfloat16")).lower()
    if dtype not in _DTYPE_BYTES:
        raise ValueError(f"unknown torch_dtype {dtype!r}; pass bytes_per_param explicitly")
    return float(_DTYPE_BYTES[dtype])


def shape_from_config(config: dict[str, Any], name: str = "model", bytes_per_param: float | None = None) -> ModelShape:
    """Count parameters from a Hugging Face MoE config.json (Mixtral, DeepSeek, Qwen-MoE)."""
    try:
        hidden = int(config["hidden_size"])
        num_layers = int(config["num_hidden_layers"])
        num_experts = int(config.get("n_routed_experts") or config.get("num_local_experts") or config["num_experts"])
        top_k = int(config["num_experts_per_tok"])
        vocab = int(config["vocab_size"])
    except KeyError as error:
        raise ValueError(f"config.json of {name} lacks {error.args[0]!r}, needed to size an MoE") from None
    # Step 1: which layers are MoE layers.
    first_dense = int(config.get("first_k_dense_replace", 0))
    sparse_step = int(config.get("decoder_sparse_step", 1) or 1)
    dense_only = set(config.get("mlp_only_layers") or [])
    moe_layers = [
        layer for layer in range(num_layers)
        if layer >= first_dense and layer not in dense_only and (layer + 1) % sparse_step == 0
    ]
    # Step 2: one routed expert (gate, up, down projections) and the rest.
    moe_intermediate = int(config.get("moe_intermediate_size") or config["intermediate_size"])
    expert_params = 3 * hidden * moe_intermediate
    shared = int(config.get("n_shared_experts") or 0) * expert_params
    shared += 3 * hidden * int(config.get("shared_expert_intermediate_size") or 0)
    dense_mlp = 3 * hidden * int(config.get("intermediate_size", 0))
    num_moe = len(moe_layers)
    other = num_layers * _attention_params(config)
    other += num_moe * (shared + num_experts * hidden) + (num_layers - num_moe) * dense_mlp
    other += vocab * hidden * (1 if config.get("tie_word_embeddings") else 2)
    return ModelShape(
        name=name,
        hidden_size=hidden,
        num_experts=num_experts,
        top_k=top_k,
        num_moe_layers=num_moe,
        expert_params=expert_params,
        other_params=other,
        bytes_per_param=float(bytes_per_param) if bytes_per_param else _bytes_per_param(config),
    )


def load_model_shape(model: str, bytes_per_param: float | None = None) -> ModelShape:
    """A preset name (case-insensitive) or a directory (or file) holding config.json."""
    presets = {name.lower(): (name, config) for name, config in model_presets().items()}
    if model.lower() in presets:
        name, config = presets[model.lower()]
        return shape_from_config(config, name, bytes_per_param)
    path = Path(model)
    path = path / "config.json" if path.is_dir() else path
    if not path.is_file():
        raise ValueError(f"{model!r} is neither a preset ({', '.join(model_presets())}) nor a config.json")
    return shape_from_config(json.loads(path.read_text()), path.parent.name, bytes_per_param)


@dataclass(frozen=True)
class MemoryEstimate:
    model: str
    num_gpus: int
    num_redundant: int
    gpu_memory_bytes: float
    total_params: int
    replicated_bytes: float
    expert_parallel_bytes: float
    redundant_bytes: float
    experts_per_rank: int
    slots_per_rank: int
    redundant_slot_bytes: float  # one extra expert slot on one rank, all MoE layers

    @property
    def fits(self) -> dict[str, bool]:
        return {
            "replicated": self.replicated_bytes <= self.gpu_memory_bytes,
            "expert_parallel": self.expert_parallel_bytes <= self.gpu_memory_bytes,
            "expert_parallel_redundant": self.redundant_bytes <= self.gpu_memory_bytes,
        }

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "fits": self.fits}


def memory_per_rank(
    shape: ModelShape, num_gpus: int, num_redundant: int = 0, gpu_memory_bytes: float = 141e9
) -> MemoryEstimate:
    """Weight bytes per GPU for the three placements; KV cache and workspace not included."""
    if num_gpus < 1 or num_redundant < 0:
        raise ValueError(f"need gpus >= 1 and redundant >= 0, got {num_gpus}, {num_redundant}")
    expert_bytes = shape.expert_params * shape.bytes_per_param * shape.num_moe_layers
    other_bytes = shape.other_params * shape.bytes_per_param
    experts_per_rank = math.ceil(shape.num_experts / num_gpus)
    slots_per_rank = math.ceil((shape.num_experts + num_redundant) / num_gpus)
    return MemoryEstimate(
        model=shape.name,
        num_gpus=num_gpus,
        num_redundant=num_redundant,
        gpu_memory_bytes=gpu_memory_bytes,
        total_params=shape.total_params,
        replicated_bytes=shape.total_params * shape.bytes_per_param,
        expert_parallel_bytes=other_bytes + experts_per_rank * expert_bytes,
        redundant_bytes=other_bytes + slots_per_rank * expert_bytes,
        experts_per_rank=experts_per_rank,
        slots_per_rank=slots_per_rank,
        redundant_slot_bytes=expert_bytes,
    )
