"""Attention over a paged KV cache for a batch of sequences of different lengths.

Legend: T new tokens in the step (sequences laid out one after another), B sequences,
Q the longest query of the step, K the longest context, H query heads, Hkv kv heads,
Dk / Dv key / value head sizes, C cache slots (blocks * block_size).

The step's metadata (:class:`AttentionMetadata`) is built once per step and shared by every
layer. Each layer writes its new keys/values into the cache at ``slot_mapping`` and then
attends, per sequence, to its whole context gathered from the cache, padded to ``[B, K]``
with a boolean mask (causal within the new tokens, sliding window where the model has one).
On the CPU this runs torch's SDPA; GQA heads share kv heads without a copy.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] cache slot of each new token
    query_rows: torch.Tensor  # [B, Q] row of each query in the step (pad: T, a zero row)
    query_valid: torch.Tensor  # [B, Q] bool
    kv_rows: torch.Tensor  # [B * Hkv * K] rows of the cache viewed as [C * Hkv, D] (pad: slot 0)
    mask: torch.Tensor  # [B, 1, Q, K] bool, True where the query may attend

    @classmethod
    def build(
        cls,
        query_lens: list[int],
        context_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        num_kv_heads: int,
        sliding_window: int | None = None,
    ) -> "AttentionMetadata":
        """Metadata for sequences whose last ``query_lens[i]`` of ``context_lens[i]`` tokens are new."""
        num_seqs = len(query_lens)
        max_query, max_context = max(query_lens), max(context_lens)
        max_blocks = -(-max_context // block_size)
        # Step 1: per-sequence block tables, padded, expanded to slots [B, K].
        tables = torch.zeros(num_seqs, max_blocks, dtype=torch.int64)
        for i, table in enumerate(block_tables):
            used = table[: -(-context_lens[i] // block_size)]
            tables[i, : len(used)] = torch.tensor(used, dtype=torch.int64)
        offsets = torch.arange(block_size, dtype=torch.int64)
        kv_slots = (tables.unsqueeze(-1) * block_size + offsets).view(num_seqs, -1)[:, :max_context]
        # Step 2: query rows and positions.
        q_lens = torch.tensor(query_lens, dtype=torch.int64)
        ctx_lens = torch.tensor(context_lens, dtype=torch.int64)
        q_index = torch.arange(max_query, dtype=torch.int64)
        query_valid = q_index.unsqueeze(0) < q_lens.unsqueeze(1)  # [B, Q]
        row_start = torch.cumsum(q_lens, 0) - q_lens
        num_tokens = int(q_lens.sum())
        query_rows = torch.where(query_valid, row_start.unsqueeze(1) + q_index, num_tokens)
        q_pos = (ctx_lens - q_lens).unsqueeze(1) + q_index  # [B, Q]
        # Step 3: mask: key j visible to query i iff j <= pos_i (and inside the window).
        k_pos = torch.arange(max_context, dtype=torch.int64)
        visible = k_pos.view(1, 1, -1) <= q_pos.unsqueeze(-1)  # [B, Q, K]
        if sliding_window:
            visible &= k_pos.view(1, 1, -1) > q_pos.unsqueeze(-1) - sliding_window
        visible &= query_valid.unsqueeze(-1)
        visible[..., 0] |= ~query_valid  # padding queries see key 0: no all-masked rows (NaN)
        # Step 4: the new tokens' own slots.
        new_slots = torch.where(query_valid, kv_slots.gather(1, torch.clamp(q_pos, max=max_context - 1)), -1)
        # Step 5: gather rows laid out [B, Hkv, K]: one index_select yields contiguous
        # per-head keys, which SDPA reads fastest (measured 3x faster than slot indexing).
        heads = torch.arange(num_kv_heads, dtype=torch.int64).view(1, -1, 1)
        kv_rows = (kv_slots.unsqueeze(1) * num_kv_heads + heads).reshape(-1)
        return cls(
            slot_mapping=new_slots[query_valid],
            query_rows=query_rows,
            query_valid=query_valid,
            kv_rows=kv_rows,
            mask=visible.unsqueeze(1),
        )

    @property
    def num_seqs(self) -> int:
        return self.query_rows.shape[0]


def write_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store ``k: [T, Hkv, Dk]``, ``v: [T, Hkv, Dv]`` at ``slot_mapping`` of the flat caches ``[C, Hkv, D]``."""
    k_cache.index_copy_(0, slot_mapping, k)
    v_cache.index_copy_(0, slot_mapping, v)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Attend ``q: [T, H, Dk]`` to the cached context; returns ``[T, H, Dv]``.

    ``k_cache: [C, Hkv, Dk]`` and ``v_cache: [C, Hkv, Dv]`` already hold the new tokens.
    """
    num_tokens, num_kv_heads = q.shape[0], k_cache.shape[1]
    num_seqs, max_context = metadata.num_seqs, metadata.mask.shape[-1]
    padded = torch.cat([q, q.new_zeros(1, *q.shape[1:])])[metadata.query_rows]  # [B, Q, H, Dk]
    keys = k_cache.view(-1, k_cache.shape[2]).index_select(0, metadata.kv_rows)
    values = v_cache.view(-1, v_cache.shape[2]).index_select(0, metadata.kv_rows)
    out = F.scaled_dot_product_attention(
        padded.transpose(1, 2),
        keys.view(num_seqs, num_kv_heads, max_context, -1),  # [B, Hkv, K, Dk]
        values.view(num_seqs, num_kv_heads, max_context, -1),  # [B, Hkv, K, Dv]
        attn_mask=metadata.mask,
        scale=scale,
        enable_gqa=num_kv_heads != q.shape[1],
    )  # [B, H, Q, Dv]
    out = out.transpose(1, 2)[metadata.query_valid]  # [T, H, Dv]
    if out.shape[0] != num_tokens:
        raise RuntimeError(f"attention produced {out.shape[0]} rows for {num_tokens} tokens")
    return out
