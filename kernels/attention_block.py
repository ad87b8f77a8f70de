"""A decoder layer's attention block in one native call, for a float32 CPU step of decodes only.

engine/model.py runs a layer's attention as seven calls: the residual add and input norm, the
QKV projection, the rotary embedding, the two cache writes, decode attention and the output
projection, then the residual add and post-attention norm. On a float32 CPU with raymoe's native
kernels each is one C function, and at one decoding sequence their Python around them (the
checks, the wrappers, a dozen tensor views and allocations: ~60 us a layer, against ~13 us of C;
measured on the 2-vCPU Xeon) was most of the layer. ``raymoe_attention_block``
(kernels/csrc/cpu_f32.c) calls the same C functions in the same order on the same values, so its
outputs are the seven calls' bit for bit (tests/kernels/test_attention_block.py).

It takes a step where every row is a decode the native decode kernel serves (the attention
backend's plan put them all in one ``_DecodeBatch``: kernels/attention.py), a GQA model without
q/k norms or clipping, rotary over the whole head in the rotate_half layout, and float32 weights
whose packed layouts the native linear takes. :func:`plan` says whether a step is one.
"""

from __future__ import annotations

import array
from dataclasses import dataclass

import torch

from raymoe.kernels import native_cpu
from raymoe.kernels.native_library import STATE
from raymoe.moe.model_config import AttentionKind, ModelConfig, QKNorm


@dataclass(frozen=True)
class BlockStep:
    """What every layer's call of one step shares (host integers and tensors of the step)."""

    dims: array.array  # int64: T, D, H, Hkv, d, Kc
    scalars: array.array  # float32: eps, scale
    pointers: tuple[int, ...]  # cos, sin, slot_mapping, rows, slots, counts
    tokens: int
    hidden: int
    scratch: torch.Tensor
    keep: tuple  # the tensors those pointers point into, alive for the step


def plan(config: ModelConfig, step, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
         slot_mapping: torch.Tensor, cache: tuple[torch.Tensor, ...], layers) -> BlockStep | None:
    """The step's shared arguments if its layers' attention blocks go in one call each (``cache``:
    the first layer's; ``layers``: every layer's engine/weights.py ``LayerWeights``, each checked,
    since the C call takes their pointers as float32; GQA's weights have a fused ``qkv``), else None."""
    decodes = getattr(step, "decodes", None)
    tokens, hidden = x.shape
    if (decodes is None or getattr(step, "spans", None) or decodes.rows.shape[0] != tokens
            or config.attention is not AttentionKind.GQA or config.qk_norm is not QKNorm.NONE
            or config.clip_qkv is not None or native_cpu.unavailable_reason() is not None
            or x.dtype != torch.float32 or x.device.type != "cpu" or len(cache) != 2
            or any(t.dtype != torch.float32 or not t.is_contiguous() for t in cache)
            or not cos.is_contiguous() or not sin.is_contiguous() or cos.shape[-1] != config.head_dim):
        return None
    heads, kv_heads, size = config.num_heads, config.num_kv_heads, config.head_dim
    if hidden % 32 or size % 16 or ((heads + 2 * kv_heads) * size) % 32 or not all(map(_fits, layers)):
        return None
    rows = decodes.rows
    slots, counts = decodes.slots, decodes.counts
    slot_mapping = slot_mapping.contiguous()
    scratch = torch.empty(3 * tokens * hidden + tokens * (heads + 2 * kv_heads) * size
                          + tokens * (heads + kv_heads) * size + 2 * tokens * heads * size, dtype=torch.float32)
    keep = (cos, sin, slot_mapping, rows, slots, counts)
    return BlockStep(array.array("q", (tokens, hidden, heads, kv_heads, size, decodes.num_keys)),
                     array.array("f", (config.rms_norm_eps, step.spec.scale)),
                     tuple(t.data_ptr() for t in keep), tokens, hidden, scratch, keep)


def _fits(layer) -> bool:
    """Whether one layer's attention weights are what the C call reads: float32, a fused qkv."""
    weights = layer.attention
    qkv = getattr(weights, "qkv", None)
    return (qkv is not None and qkv.dtype == torch.float32 and weights.o_proj.dtype == torch.float32
            and (weights.qkv_bias is None or weights.qkv_bias.dtype == torch.float32))


def attention_block(block: BlockStep, x: torch.Tensor, delta: torch.Tensor | None, input_norm: torch.Tensor,
                    weights, post_norm: torch.Tensor, cache: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor,
                                                                                                 torch.Tensor]:
    """``(x + delta + attention, post_norm(...))`` of one layer, as engine/model.py's calls give them."""
    qkv = native_cpu._layout(weights.qkv, native_cpu._panels)
    o_proj = native_cpu._layout(weights.o_proj, native_cpu._panels)
    bias = None if weights.qkv_bias is None else weights.qkv_bias.contiguous()  # (locals: alive through the call)
    input_norm, post_norm = input_norm.contiguous(), post_norm.contiguous()
    total = torch.empty(block.tokens, block.hidden, dtype=torch.float32)
    h = torch.empty(block.tokens, block.hidden, dtype=torch.float32)
    x = x.contiguous()
    delta = None if delta is None else delta.contiguous()
    cos, sin, slot_mapping, rows, slots, counts = block.pointers
    status = STATE.library.raymoe_attention_block(
        x.data_ptr(), None if delta is None else delta.data_ptr(), input_norm.data_ptr(), qkv.data_ptr(),
        None if bias is None else bias.data_ptr(), o_proj.data_ptr(), post_norm.data_ptr(), cos, sin,
        cache[0].data_ptr(), cache[1].data_ptr(), slot_mapping, rows, slots, counts, total.data_ptr(), h.data_ptr(),
        block.scratch.data_ptr(), block.dims.buffer_info()[0], block.scalars.buffer_info()[0])
    if status != 0:
        raise ValueError(f"raymoe_attention_block refused its arguments (status {status}): a bug")
    return total, h
