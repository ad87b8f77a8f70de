"""Checkpoint tensor names per architecture, shape validation, and loading into stacks.

Legend: D hidden, H query heads, Hkv kv heads, d head size, I expert intermediate, S slots,
E routed experts, V vocabulary; MLA: C latent rank (``kv_lora_rank``), Dr roped dims, Dv value
head size, and the config's ``qk``, ``nope`` and ``q_lora`` dims by name.

Experts are stored one per tensor (``...experts.{j}.gate_proj.weight``; Mixtral's
``w1/w3/w2``). The engine stacks the experts it holds into ``w13: [S, 2I, D]`` (gate rows
then up rows) and ``w2: [S, D, I]``. Dense projections q/k/v are fused into one matrix.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from raymoe.engine.checkpoint import Checkpoint, CheckpointError
from raymoe.kernels.huge_pages import huge_page_empty
from raymoe.moe.model_config import Architecture, AttentionKind, ModelConfig, QKNorm, SharedExpertKind


@dataclass(frozen=True)
class MLPWeights:
    w13: torch.Tensor  # [2I, D]
    w2: torch.Tensor  # [D, I]


@dataclass(frozen=True)
class GQAWeights:
    qkv: torch.Tensor  # [(H + 2 Hkv) d, D]
    qkv_bias: torch.Tensor | None
    o_proj: torch.Tensor  # [D, H d]
    q_norm: torch.Tensor | None  # [d] per head or [H d] full
    k_norm: torch.Tensor | None


@dataclass(frozen=True)
class MLAWeights:
    q_proj: torch.Tensor | None  # [H qk, D] when q_lora_rank is None
    q_a_proj: torch.Tensor | None  # [q_lora, D]
    q_a_norm: torch.Tensor | None
    q_b_proj: torch.Tensor | None  # [H qk, q_lora]
    kv_a_proj: torch.Tensor  # [C + Dr, D]
    kv_a_norm: torch.Tensor  # [C]
    # kv_b_proj [H (nope + Dv), C] split per head, to be absorbed into the query and the
    # output (the cache keeps the latent, engine/model.py):
    w_uk: torch.Tensor  # [H, nope, C] latent -> each head's k_nope
    w_uv: torch.Tensor  # [H, Dv, C] latent -> each head's value
    o_proj: torch.Tensor  # [D, H Dv]


@dataclass(frozen=True)
class LayerWeights:
    input_norm: torch.Tensor
    post_attention_norm: torch.Tensor
    attention: GQAWeights | MLAWeights
    dense_mlp: MLPWeights | None  # layers without routed experts
    router: torch.Tensor | None  # [E, D]
    correction_bias: torch.Tensor | None  # [E] float32
    shared_mlp: MLPWeights | None
    shared_gate: torch.Tensor | None  # [1, D]


@dataclass(frozen=True)
class DenseWeights:
    """Everything but the routed experts: what a router holds."""

    embed: torch.Tensor  # [V, D]
    final_norm: torch.Tensor
    lm_head: torch.Tensor  # [V, D]
    layers: tuple[LayerWeights, ...]


def layer_prefix(layer: int) -> str:
    return f"model.layers.{layer}."


def moe_prefix(config: ModelConfig, layer: int) -> str:
    block = "block_sparse_moe" if config.architecture is Architecture.MIXTRAL else "mlp"
    return f"{layer_prefix(layer)}{block}."


def expert_names(config: ModelConfig, layer: int, expert: int) -> tuple[str, str, str]:
    """(gate, up, down) tensor names of one routed expert."""
    base = f"{moe_prefix(config, layer)}experts.{expert}."
    if config.architecture is Architecture.MIXTRAL:
        return base + "w1.weight", base + "w3.weight", base + "w2.weight"
    return base + "gate_proj.weight", base + "up_proj.weight", base + "down_proj.weight"


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the model needs, with its shape: validated before anything starts."""
    c, shapes = config, {}
    hidden, vocab = c.hidden_size, c.vocab_size
    shapes["model.embed_tokens.weight"] = (vocab, hidden)
    shapes["model.norm.weight"] = (hidden,)
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (vocab, hidden)
    for layer in range(c.num_layers):
        p = layer_prefix(layer)
        shapes[p + "input_layernorm.weight"] = (hidden,)
        shapes[p + "post_attention_layernorm.weight"] = (hidden,)
        shapes.update(_attention_shapes(c, p + "self_attn."))
        if not c.is_moe_layer(layer):
            shapes.update(_mlp_shapes(p + "mlp.", hidden, c.dense_intermediate_size))
            continue
        m = moe_prefix(c, layer)
        shapes[m + "gate.weight"] = (c.num_experts, hidden)
        if c.gate.has_correction_bias:
            shapes[m + "gate.e_score_correction_bias"] = (c.num_experts,)
        for expert in range(c.num_experts):
            gate, up, down = expert_names(c, layer, expert)
            inter = c.moe_intermediate_size
            shapes.update({gate: (inter, hidden), up: (inter, hidden), down: (hidden, inter)})
        if c.shared_expert is SharedExpertKind.SIGMOID_GATED:
            shapes.update(_mlp_shapes(m + "shared_expert.", hidden, c.shared_intermediate_size))
            shapes[m + "shared_expert_gate.weight"] = (1, hidden)
        elif c.shared_expert is SharedExpertKind.PLAIN:
            shapes.update(_mlp_shapes(m + "shared_experts.", hidden, c.shared_intermediate_size))
    return shapes


def _mlp_shapes(prefix: str, hidden: int, inter: int) -> dict[str, tuple[int, ...]]:
    return {
        prefix + "gate_proj.weight": (inter, hidden),
        prefix + "up_proj.weight": (inter, hidden),
        prefix + "down_proj.weight": (hidden, inter),
    }


def _attention_shapes(c: ModelConfig, p: str) -> dict[str, tuple[int, ...]]:
    hidden = c.hidden_size
    if c.attention is AttentionKind.MLA:
        mla, heads = c.mla, c.num_heads
        shapes = {
            p + "kv_a_proj_with_mqa.weight": (mla.kv_lora_rank + mla.qk_rope_head_dim, hidden),
            p + "kv_a_layernorm.weight": (mla.kv_lora_rank,),
            p + "kv_b_proj.weight": (heads * (mla.qk_nope_head_dim + mla.v_head_dim), mla.kv_lora_rank),
            p + "o_proj.weight": (hidden, heads * mla.v_head_dim),
        }
        if mla.q_lora_rank is None:
            shapes[p + "q_proj.weight"] = (heads * mla.qk_head_dim, hidden)
        else:
            shapes[p + "q_a_proj.weight"] = (mla.q_lora_rank, hidden)
            shapes[p + "q_a_layernorm.weight"] = (mla.q_lora_rank,)
            shapes[p + "q_b_proj.weight"] = (heads * mla.qk_head_dim, mla.q_lora_rank)
        return shapes
    q_out, kv_out = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    shapes = {
        p + "q_proj.weight": (q_out, hidden),
        p + "k_proj.weight": (kv_out, hidden),
        p + "v_proj.weight": (kv_out, hidden),
        p + "o_proj.weight": (hidden, q_out),
    }
    if c.attention_bias:
        shapes.update({p + "q_proj.bias": (q_out,), p + "k_proj.bias": (kv_out,), p + "v_proj.bias": (kv_out,)})
    if c.qk_norm is QKNorm.PER_HEAD:
        shapes.update({p + "q_norm.weight": (c.head_dim,), p + "k_norm.weight": (c.head_dim,)})
    elif c.qk_norm is QKNorm.FULL:
        shapes.update({p + "q_norm.weight": (q_out,), p + "k_norm.weight": (kv_out,)})
    return shapes


def validate_checkpoint(checkpoint: Checkpoint, config: ModelConfig) -> None:
    """Refuse a checkpoint whose tensors don't match its config (missing or misshapen)."""
    missing, wrong = [], []
    for name, shape in expected_shapes(config).items():
        if name not in checkpoint:
            missing.append(name)
        elif checkpoint.shape(name) != shape:
            wrong.append(f"{name}: {checkpoint.shape(name)} (config expects {shape})")
    if missing or wrong:
        lines = [f"checkpoint {checkpoint.model_dir} does not match its config.json:"]
        if missing:
            lines.append(f"  {len(missing)} tensors missing, e.g. {missing[:3]}")
        if wrong:
            lines.append(f"  {len(wrong)} tensors with wrong shapes, e.g. {wrong[:3]}")
        raise CheckpointError("\n".join(lines))


def load_dense_weights(checkpoint: Checkpoint, config: ModelConfig, dtype: torch.dtype, device: torch.device) -> DenseWeights:
    def get(*names: str) -> torch.Tensor:
        """The named tensors, stacked along their first dimension (one name: that tensor)."""
        if device.type == "cpu":
            return read_stacked(checkpoint, names, dtype)
        parts = [checkpoint.get(name, dtype) for name in names]
        return (parts[0] if len(parts) == 1 else torch.cat(parts)).to(device)

    layers = []
    for layer in range(config.num_layers):
        p = layer_prefix(layer)
        moe = config.is_moe_layer(layer)
        m = moe_prefix(config, layer)
        shared, shared_gate = None, None
        if moe and config.shared_expert is SharedExpertKind.SIGMOID_GATED:
            shared, shared_gate = _mlp(get, m + "shared_expert."), get(m + "shared_expert_gate.weight")
        elif moe and config.shared_expert is SharedExpertKind.PLAIN:
            shared = _mlp(get, m + "shared_experts.")
        bias_name = m + "gate.e_score_correction_bias"
        layers.append(
            LayerWeights(
                input_norm=get(p + "input_layernorm.weight"),
                post_attention_norm=get(p + "post_attention_layernorm.weight"),
                attention=_attention(get, config, p + "self_attn."),
                dense_mlp=None if moe else _mlp(get, p + "mlp."),
                router=get(m + "gate.weight") if moe else None,
                correction_bias=(
                    checkpoint.get(bias_name, torch.float32).to(device)
                    if moe and config.gate.has_correction_bias
                    else None
                ),
                shared_mlp=shared,
                shared_gate=shared_gate,
            )
        )
    if config.tie_word_embeddings:  # the LM head too: streamed every step
        embed = get("model.embed_tokens.weight")
    else:  # a step reads a few rows: the checkpoint's lazily paged mapping keeps the rest off RSS
        embed = checkpoint.get("model.embed_tokens.weight", dtype).to(device)
    return DenseWeights(
        embed=embed,
        final_norm=get("model.norm.weight"),
        lm_head=embed if config.tie_word_embeddings else get("lm_head.weight"),
        layers=tuple(layers),
    )


def load_expert_stack(
    checkpoint: Checkpoint, config: ModelConfig, layer: int, experts: list[int], dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack the given logical experts of model layer ``layer``: ``w13 [S, 2I, D]``, ``w2 [S, D, I]``.

    Each expert is read straight into its row (:func:`read_expert_into`): no second copy of the
    stack is ever held. An empty slot (expert -1: a worker's spare rows, for experts a migration
    will stage there) is left unwritten, whatever the allocator gave: no token is routed to it
    before an expert is written there, and on a CPU its memory does not become resident until
    then (a Mixtral-8x7B-shaped worker's 4 spare rows a layer are 1.4 GB a layer; zeroed, they
    were resident from the start).
    """
    inter, hidden = config.moe_intermediate_size, config.hidden_size
    if device.type == "cpu":  # streamed every step: on 2 MiB pages (kernels/huge_pages.py)
        w13 = huge_page_empty((len(experts), 2 * inter, hidden), dtype)
        w2 = huge_page_empty((len(experts), hidden, inter), dtype)
    else:
        w13 = torch.empty(len(experts), 2 * inter, hidden, dtype=dtype, device=device)
        w2 = torch.empty(len(experts), hidden, inter, dtype=dtype, device=device)
    for slot, expert in enumerate(experts):
        if expert >= 0:
            read_expert_into(checkpoint, config, layer, expert, w13[slot], w2[slot])
    return w13, w2


def read_expert_into(checkpoint: Checkpoint, config: ModelConfig, layer: int, expert: int, w13_row: torch.Tensor,
                     w2_row: torch.Tensor) -> None:
    """Read routed expert ``expert`` of model layer ``layer`` into one pool row: ``w13_row
    [2I, D]`` (gate rows, then up rows) and ``w2_row [D, I]``, in place (Checkpoint.read_into).

    Written through the file's bytes, not through torch: the rows' version counter does not
    move, so a caller that caches derived copies of the stack (kernels/packed_linear.py) bumps it."""
    if not 0 <= expert < config.num_experts:
        raise CheckpointError(f"layer {layer} has no expert {expert} (num_experts={config.num_experts})")
    inter = config.moe_intermediate_size
    gate, up, down = expert_names(config, layer, expert)
    checkpoint.read_into(gate, w13_row[:inter])
    checkpoint.read_into(up, w13_row[inter:])
    checkpoint.read_into(down, w2_row)


def read_stacked(checkpoint: Checkpoint, names: tuple[str, ...], dtype: torch.dtype) -> torch.Tensor:
    """The named tensors stacked along their first dimension (one name: that tensor) in one CPU
    tensor of ``dtype``, each read straight into its rows (Checkpoint.read_into): no second copy
    of a weight is held. From 2 MiB on the tensor lies on huge pages (kernels/huge_pages.py): a
    decode step streams these weights from DRAM."""
    for name in names:
        if name not in checkpoint:
            raise CheckpointError(f"tensor {name!r} is missing from the checkpoint in {checkpoint.model_dir}")
    shapes = [checkpoint.shape(name) for name in names]
    if len(names) == 1:
        out = huge_page_empty(shapes[0], dtype)
        checkpoint.read_into(names[0], out)
        return out
    if any(len(shape) == 0 or shape[1:] != shapes[0][1:] for shape in shapes):
        raise CheckpointError(f"{', '.join(names)}: shapes {shapes} do not stack along their first dimension")
    out = huge_page_empty((sum(shape[0] for shape in shapes), *shapes[0][1:]), dtype)
    row = 0
    for name, shape in zip(names, shapes):
        checkpoint.read_into(name, out[row:row + shape[0]])
        row += shape[0]
    return out


def _mlp(get, prefix: str) -> MLPWeights:
    w13 = get(prefix + "gate_proj.weight", prefix + "up_proj.weight")
    return MLPWeights(w13=w13, w2=get(prefix + "down_proj.weight"))


def _attention(get, config: ModelConfig, p: str) -> GQAWeights | MLAWeights:
    if config.attention is AttentionKind.MLA:
        mla = config.mla
        lora = mla.q_lora_rank is not None
        kv_b = get(p + "kv_b_proj.weight").view(config.num_heads, mla.qk_nope_head_dim + mla.v_head_dim, -1)
        return MLAWeights(
            q_proj=None if lora else get(p + "q_proj.weight"),
            q_a_proj=get(p + "q_a_proj.weight") if lora else None,
            q_a_norm=get(p + "q_a_layernorm.weight") if lora else None,
            q_b_proj=get(p + "q_b_proj.weight") if lora else None,
            kv_a_proj=get(p + "kv_a_proj_with_mqa.weight"),
            kv_a_norm=get(p + "kv_a_layernorm.weight"),
            w_uk=kv_b[:, : mla.qk_nope_head_dim].contiguous(),
            w_uv=kv_b[:, mla.qk_nope_head_dim:].contiguous(),
            o_proj=get(p + "o_proj.weight"),
        )
    qkv = get(p + "q_proj.weight", p + "k_proj.weight", p + "v_proj.weight")
    bias = None
    if config.attention_bias:
        bias = get(p + "q_proj.bias", p + "k_proj.bias", p + "v_proj.bias")
    has_norm = config.qk_norm is not QKNorm.NONE
    return GQAWeights(
        qkv=qkv,
        qkv_bias=bias,
        o_proj=get(p + "o_proj.weight"),
        q_norm=get(p + "q_norm.weight") if has_norm else None,
        k_norm=get(p + "k_norm.weight") if has_norm else None,
    )
