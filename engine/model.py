"""The decoder forward pass over a flat batch of tokens from many sequences.

Legend: T tokens in the step, D hidden, H heads, Hkv kv heads, d head size, V vocab,
E experts, k experts per token.

One path per concept, chosen by the config's enums: GQA or MLA attention, optional q/k
norms, dense MLP or routed experts (+ shared experts). Routed experts are reached only
through an :class:`~raymoe.engine.experts.ExpertBackend`, so the same model runs with all
experts local or spread over expert workers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from raymoe.engine.experts import ExpertBackend
from raymoe.engine.kv_cache import KVCache
from raymoe.engine.weights import DenseWeights, GQAWeights, LayerWeights, MLAWeights, MLPWeights
from raymoe.kernels.attention import AttentionMetadata, paged_attention, write_kv
from raymoe.kernels.norm import rms_norm
from raymoe.kernels.rope import apply_rope, rope_tables
from raymoe.moe.gating import route
from raymoe.moe.model_config import AttentionKind, ModelConfig, QKNorm, SharedExpertKind


class MoEModel:
    def __init__(self, config: ModelConfig, weights: DenseWeights, experts: ExpertBackend):
        self.config = config
        self.weights = weights
        self.experts = experts
        device = weights.embed.device
        cos, sin = rope_tables(config.rope, config.max_position_embeddings)
        self.rope_cos, self.rope_sin = cos.to(device), sin.to(device)
        self.scale = config.attention_scale

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata, cache: KVCache
    ) -> torch.Tensor:
        """``input_ids, positions: [T]`` -> final hidden states ``[T, D]`` (after the last norm)."""
        config = self.config
        x = self.weights.embed.index_select(0, input_ids)  # [T, D]
        cos, sin = self.rope_cos.index_select(0, positions), self.rope_sin.index_select(0, positions)
        for index, layer in enumerate(self.weights.layers):
            h = rms_norm(x, layer.input_norm, config.rms_norm_eps)
            k_cache, v_cache = cache.layer(index)
            if config.attention is AttentionKind.MLA:
                h = self._mla(h, layer.attention, cos, sin, k_cache, v_cache, metadata)
            else:
                h = self._gqa(h, layer.attention, cos, sin, k_cache, v_cache, metadata)
            x = x + h
            h = rms_norm(x, layer.post_attention_norm, config.rms_norm_eps)
            x = x + self._feed_forward(index, layer, h)
        return rms_norm(x, self.weights.final_norm, config.rms_norm_eps)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[B, D]`` -> ``[B, V]`` float32."""
        return F.linear(hidden, self.weights.lm_head).float()

    # ---- attention -----------------------------------------------------------------
    def _gqa(self, h, w: GQAWeights, cos, sin, k_cache, v_cache, metadata) -> torch.Tensor:
        c = self.config
        num_tokens, d = h.shape[0], c.head_dim
        qkv = F.linear(h, w.qkv, w.qkv_bias)
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
        write_kv(k_cache, v_cache, k, v, metadata.slot_mapping)
        out = paged_attention(q, k_cache, v_cache, metadata, self.scale)  # [T, H, d]
        return F.linear(out.reshape(num_tokens, -1), w.o_proj)

    def _mla(self, h, w: MLAWeights, cos, sin, k_cache, v_cache, metadata) -> torch.Tensor:
        c, mla = self.config, self.config.mla
        num_tokens, heads = h.shape[0], c.num_heads
        if w.q_proj is not None:
            q = F.linear(h, w.q_proj)
        else:
            q = F.linear(rms_norm(F.linear(h, w.q_a_proj), w.q_a_norm, c.rms_norm_eps), w.q_b_proj)
        q = q.view(num_tokens, heads, mla.qk_head_dim)
        q_nope, q_rot = q.split([mla.qk_nope_head_dim, mla.qk_rope_head_dim], dim=-1)
        latent, k_rot = F.linear(h, w.kv_a_proj).split([mla.kv_lora_rank, mla.qk_rope_head_dim], dim=-1)
        latent = rms_norm(latent, w.kv_a_norm, c.rms_norm_eps)  # [T, kv_lora]
        q_rot = apply_rope(q_rot, cos, sin, mla.rope_interleave)  # [T, H, rope]
        k_rot = apply_rope(k_rot.unsqueeze(1), cos, sin, mla.rope_interleave)  # [T, 1, rope]
        kv = F.linear(latent, w.kv_b_proj).view(num_tokens, heads, mla.qk_nope_head_dim + mla.v_head_dim)
        k_nope, v = kv.split([mla.qk_nope_head_dim, mla.v_head_dim], dim=-1)
        # The cache keeps expanded per-head keys and values (simple; the latent form is smaller).
        k = torch.cat([k_nope, k_rot.expand(-1, heads, -1)], dim=-1)  # [T, H, qk]
        q = torch.cat([q_nope, q_rot], dim=-1)
        write_kv(k_cache, v_cache, k, v.contiguous(), metadata.slot_mapping)
        out = paged_attention(q, k_cache, v_cache, metadata, self.scale)  # [T, H, v]
        return F.linear(out.reshape(num_tokens, -1), w.o_proj)

    # ---- feed forward --------------------------------------------------------------
    def _feed_forward(self, index: int, layer: LayerWeights, h: torch.Tensor) -> torch.Tensor:
        c = self.config
        if layer.dense_mlp is not None:
            return _mlp(h, layer.dense_mlp)
        if c.gate.has_correction_bias:
            router_logits = F.linear(h.float(), layer.router.float())  # [T, E], float32 like the reference
        else:
            router_logits = F.linear(h, layer.router)
        topk_ids, topk_weights = route(router_logits, c.gate, layer.correction_bias)  # [T, k]
        out = self.experts.forward(c.moe_index(index), h, topk_ids, topk_weights)
        if layer.shared_mlp is not None:
            shared = _mlp(h, layer.shared_mlp)
            if c.shared_expert is SharedExpertKind.SIGMOID_GATED:
                shared = torch.sigmoid(F.linear(h, layer.shared_gate)) * shared
            out = out + shared
        return out


def _mlp(h: torch.Tensor, w: MLPWeights) -> torch.Tensor:
    inter = w.w2.shape[1]
    gate_up = F.linear(h, w.w13)
    return F.linear(F.silu(gate_up[:, :inter]) * gate_up[:, inter:], w.w2)
