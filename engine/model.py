"""The decoder forward pass over a flat batch of tokens from many sequences.

Legend: T tokens in the step, B sequences, D hidden, H query heads, Hkv kv heads, d head size,
V vocab, E experts, k experts per token; MLA: C latent rank, Dr roped dims, Dv value head size,
``nope`` the unroped query/key dims.

One path per concept, chosen by the config's enums: GQA or MLA attention, optional q/k
norms, dense MLP or routed experts (+ shared experts). Routed experts are reached only
through an :class:`~raymoe.engine.experts.ExpertBackend`, so the same model runs with all
experts local or spread over expert workers.

Attention runs on a backend chosen once, at start-up (:func:`attention_backend`): FlashInfer's
paged kernels on CUDA when it is installed and takes the model's shapes, else the generic
per-sequence SDPA (kernels/attention.py). It is planned once per step and run by every layer.

MLA keeps only the latent in the cache (C = kv_lora_rank, Dr = qk_rope_head_dim per token)
and absorbs ``kv_b_proj`` (DeepSeek's inference form): with ``W_UK [H, nope, C]`` and
``W_UV [H, Dv, C]`` its per-head halves, ``q_nope . (W_UK c) = (q_nope W_UK) . c``, so each head
attends over the latents ``c`` with the query ``[q_nope W_UK, q_rot]`` against ``[c, k_rot]``,
and its output over the latents is mapped by ``W_UV`` afterwards: the same scores and outputs
as the expanded form, up to float rounding.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from raymoe.engine.experts import ExpertBackend
from raymoe.engine.kv_cache import KVCache
from raymoe.engine.weights import DenseWeights, GQAWeights, LayerWeights, MLAWeights, MLPWeights
from raymoe.kernels import attention_block
from raymoe.kernels.attention import (
    AttentionBackend,
    AttentionMetadata,
    AttentionSpec,
    AttentionStep,
    SdpaAttention,
    write_cache,
)
from raymoe.kernels.attention_flashinfer import FlashInferAttention, flashinfer_unsupported
from raymoe.kernels.norm import add_rms_norm, rms_norm
from raymoe.kernels.packed_linear import linear, logits
from raymoe.kernels.rope import apply_rope, rope_rows, rope_tables
from raymoe.moe.gating import route
from raymoe.moe.model_config import AttentionKind, ModelConfig, QKNorm, SharedExpertKind

LOG = logging.getLogger("raymoe.engine")


def attention_backend(config: ModelConfig, dtype: torch.dtype, device: torch.device) -> AttentionBackend:
    """FlashInfer where it runs this model, else the generic SDPA path (the reason is logged on CUDA)."""
    spec = AttentionSpec.from_config(config)
    reason = flashinfer_unsupported(spec, dtype, device)
    backend = FlashInferAttention(spec, dtype, device) if reason is None else SdpaAttention(spec, dtype, device)
    if device.type == "cuda":
        LOG.info("attention backend: %s%s", backend.name, f" (not FlashInfer: {reason})" if reason else "")
    return backend


class MoEModel:
    # Each layer's attention block in one native call where a step allows it (kernels/
    # attention_block.py); False (on the class or an instance): always the calls one by one
    # (the same bits: tests/kernels/test_attention_block.py compares the two).
    one_call_attention = True

    def __init__(self, config: ModelConfig, weights: DenseWeights, experts: ExpertBackend):
        self.config = config
        self.weights = weights
        self.experts = experts
        device = weights.embed.device
        cos, sin = rope_tables(config.rope, config.max_position_embeddings)
        self.rope_cos, self.rope_sin = cos.to(device), sin.to(device)
        self.attention = attention_backend(config, weights.embed.dtype, device)
        self._second_attention: AttentionBackend | None = None  # the other micro-batch's (made on first use)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata, cache: KVCache
    ) -> torch.Tensor:
        """``input_ids, positions: [T]`` -> final hidden states ``[T, D]`` (after the last norm)."""
        layers = self._layers(input_ids, positions, metadata, cache, self.attention)
        routed = None
        while True:
            try:
                request = layers.send(routed)
            except StopIteration as done:
                return done.value
            routed = self.experts.forward(*request)

    def forward_micro_batches(self, first: tuple, second: tuple, cache: KVCache) -> list[torch.Tensor]:
        """Two micro-batches (each ``(input_ids, positions, metadata)`` of its own sequences)
        through every layer, ping-ponged at each MoE layer: one half's experts run on the
        workers (``experts.start`` returns once its rows are sent) while this thread runs the
        other half's attention; ``experts.finish`` takes the sums back (MegaScale-Infer's and
        Step-3's schedule). Each half's hidden states ``[T_i, D]`` are what :meth:`forward` gives
        for it alone. Only for an expert backend with ``micro_batches == 2`` this step
        (engine/exchange/remote_experts.py)."""
        if self._second_attention is None:  # (FlashInfer's wrappers hold one plan each)
            self._second_attention = attention_backend(self.config, self.weights.embed.dtype,
                                                       self.weights.embed.device)
        halves = [self._layers(*first, cache, self.attention), self._layers(*second, cache, self._second_attention)]
        handles: list = [None, None]
        hidden: list = [None, None]
        while halves[0] is not None or halves[1] is not None:
            for half, layers in enumerate(halves):
                if layers is None:
                    continue
                routed = None if handles[half] is None else self.experts.finish(handles[half])
                try:
                    moe_layer, h, topk_ids, topk_weights = layers.send(routed)
                except StopIteration as done:
                    hidden[half], halves[half], handles[half] = done.value, None, None
                    continue
                handles[half] = self.experts.start(moe_layer, half, h, topk_ids, topk_weights)
        return hidden

    def _layers(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata,
                cache: KVCache, attention: AttentionBackend):
        """The decoder over one batch, as a generator: at each MoE layer it yields ``(moe_layer,
        h, topk_ids, topk_weights)`` and is sent back the routed experts' output ``[T, D]``; it
        returns the final hidden states. Whoever drives it reaches the experts (:meth:`forward`
        at once, :meth:`forward_micro_batches` ping-ponged)."""
        config = self.config
        x = self.weights.embed.index_select(0, input_ids)  # [T, D]
        interleaved = config.attention is AttentionKind.MLA and config.mla.rope_interleave
        cos, sin = rope_rows(self.rope_cos, self.rope_sin, positions, x.dtype, interleaved)  # [T, 1, Dr]
        step = attention.plan(metadata, cache.block_size)
        attend = self._mla if config.attention is AttentionKind.MLA else self._gqa
        eps, feed_forward = config.rms_norm_eps, None  # each residual add goes with the norm after it
        # a step of decodes on a float32 CPU: each layer's attention block in one native call,
        # the same calls in C (kernels/attention_block.py), the same bits
        block = (attention_block.plan(config, step, x, cos, sin, metadata.slot_mapping, cache.layer(0),
                                      self.weights.layers) if self.one_call_attention else None)
        for index, layer in enumerate(self.weights.layers):
            if block is not None:
                x, h = attention_block.attention_block(block, x, feed_forward, layer.input_norm, layer.attention,
                                                       layer.post_attention_norm, cache.layer(index))
            else:
                x, h = add_rms_norm(x, feed_forward, layer.input_norm, eps)
                attended = attend(h, layer.attention, cos, sin, cache.layer(index), metadata.slot_mapping, step)
                x, h = add_rms_norm(x, attended, layer.post_attention_norm, eps)
            if layer.dense_mlp is not None:
                feed_forward = _mlp(h, layer.dense_mlp)
                continue
            topk_ids, topk_weights = self._route(layer, h)
            routed = yield config.moe_index(index), h, topk_ids, topk_weights
            feed_forward = self._add_shared(layer, h, routed)
        return add_rms_norm(x, feed_forward, self.weights.final_norm, eps)[1]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[B, D]`` -> ``[B, V]`` float32."""
        return logits(hidden, self.weights.lm_head)

    # ---- attention -----------------------------------------------------------------
    def _gqa(self, h, w: GQAWeights, cos, sin, cache, slot_mapping, step: AttentionStep) -> torch.Tensor:
        c = self.config
        num_tokens, d = h.shape[0], c.head_dim
        qkv = linear(h, w.qkv, w.qkv_bias)
        if c.qk_norm is QKNorm.NONE and c.clip_qkv is None:  # q and k side by side: rotated in one go
            qk = apply_rope(qkv[:, :(c.num_heads + c.num_kv_heads) * d].view(num_tokens, -1, d), cos, sin, False)
            q, k = qk[:, :c.num_heads], qk[:, c.num_heads:]  # [T, H, d], [T, Hkv, d]
            v = qkv[:, (c.num_heads + c.num_kv_heads) * d:].reshape(num_tokens, c.num_kv_heads, d)
            return self._attend(q, k, v, w, cache, slot_mapping, step)
        q, k, v = qkv.split([c.num_heads * d, c.num_kv_heads * d, c.num_kv_heads * d], dim=-1)
        if c.qk_norm is QKNorm.FULL:
            q, k = rms_norm(q, w.q_norm, c.rms_norm_eps), rms_norm(k, w.k_norm, c.rms_norm_eps)
        if c.clip_qkv is not None:
            q, k, v = (t.clamp(-c.clip_qkv, c.clip_qkv) for t in (q, k, v))
        q = q.reshape(num_tokens, c.num_heads, d)  # [T, H, d]
        k = k.reshape(num_tokens, c.num_kv_heads, d)  # [T, Hkv, d]
        v = v.reshape(num_tokens, c.num_kv_heads, d)
        if c.qk_norm is QKNorm.PER_HEAD:
            q, k = rms_norm(q, w.q_norm, c.rms_norm_eps), rms_norm(k, w.k_norm, c.rms_norm_eps)
        q, k = apply_rope(q, cos, sin, False), apply_rope(k, cos, sin, False)
        return self._attend(q, k, v, w, cache, slot_mapping, step)

    @staticmethod
    def _attend(q, k, v, w: GQAWeights, cache, slot_mapping, step: AttentionStep) -> torch.Tensor:
        k_cache, v_cache = cache
        write_cache(k_cache, k, slot_mapping)
        write_cache(v_cache, v, slot_mapping)
        out = step.attend(q, cache)  # [T, H, d]
        return linear(out.reshape(q.shape[0], -1), w.o_proj)

    def _mla(self, h, w: MLAWeights, cos, sin, cache, slot_mapping, step: AttentionStep) -> torch.Tensor:
        c, mla = self.config, self.config.mla
        num_tokens, heads = h.shape[0], c.num_heads
        if w.q_proj is not None:
            q = linear(h, w.q_proj)
        else:
            q = linear(rms_norm(linear(h, w.q_a_proj), w.q_a_norm, c.rms_norm_eps), w.q_b_proj)
        q = q.view(num_tokens, heads, mla.qk_head_dim)
        q_nope, q_rot = q.split([mla.qk_nope_head_dim, mla.qk_rope_head_dim], dim=-1)
        latent, k_rot = linear(h, w.kv_a_proj).split([mla.kv_lora_rank, mla.qk_rope_head_dim], dim=-1)
        latent = rms_norm(latent, w.kv_a_norm, c.rms_norm_eps)  # [T, C]
        q_rot = apply_rope(q_rot, cos, sin, mla.rope_interleave)  # [T, H, Dr]
        k_rot = apply_rope(k_rot.unsqueeze(1), cos, sin, mla.rope_interleave)  # [T, 1, Dr]
        (latent_cache,) = cache
        write_cache(latent_cache, torch.cat([latent, k_rot.squeeze(1)], dim=-1), slot_mapping)  # [T, C + Dr]
        # Absorb W_UK into the query: per head, q_nope [T, nope] @ W_UK [nope, C].
        q_latent = torch.bmm(q_nope.transpose(0, 1), w.w_uk).transpose(0, 1)  # [T, H, C]
        out = step.attend(torch.cat([q_latent, q_rot], dim=-1), cache)  # [T, H, C]: over the latents
        # Absorb W_UV into the output: per head, out [T, C] @ W_UV^T [C, Dv].
        out = torch.bmm(out.transpose(0, 1), w.w_uv.transpose(1, 2)).transpose(0, 1)  # [T, H, Dv]
        return linear(out.reshape(num_tokens, -1), w.o_proj)

    # ---- feed forward --------------------------------------------------------------
    def _route(self, layer: LayerWeights, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``topk_ids, topk_weights: [T, k]`` of a MoE layer."""
        c = self.config
        if c.gate.has_correction_bias:
            router_logits = F.linear(h.float(), layer.router.float())  # [T, E], float32 like the reference
        else:
            router_logits = F.linear(h, layer.router)
        return route(router_logits, c.gate, layer.correction_bias)

    def _add_shared(self, layer: LayerWeights, h: torch.Tensor, routed: torch.Tensor) -> torch.Tensor:
        """The routed output plus the shared experts' (where the model has them)."""
        if layer.shared_mlp is None:
            return routed
        shared = _mlp(h, layer.shared_mlp)
        if self.config.shared_expert is SharedExpertKind.SIGMOID_GATED:
            shared = torch.sigmoid(F.linear(h, layer.shared_gate)) * shared
        return routed + shared


def _mlp(h: torch.Tensor, w: MLPWeights) -> torch.Tensor:
    inter = w.w2.shape[1]
    gate_up = linear(h, w.w13)
    return linear(F.silu(gate_up[:, :inter]) * gate_up[:, inter:], w.w2)
