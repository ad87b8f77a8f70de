"""Paged attention for one step's sequences, with no ``[B, H, Tq, Tk]`` buffer for the batch.

Legend: T new tokens in the step (sequences laid out one after another), B sequences,
H query heads, Hkv kv heads, d head size (Dk / Dv key / value sizes), Nb cache blocks of
``bs`` slots; for one sequence, Tq its new tokens (queries) and Tk the keys they see; Bd the
decodes batched into one call; C MLA's latent rank, Dr its roped key size.

Per step, :meth:`AttentionMetadata.build` says for every sequence how many of its tokens are
new (the last ones), how many it has in all and which cache blocks hold them. A chunk of a
prompt may start after cached context: its queries see that context and, causally, each other.
A backend turns the metadata into an :class:`AttentionStep` once per step (its plan), which
every layer then runs.

One layer's cache is a tuple of paged tensors (FlashInfer's NHD layout; engine/kv_cache.py):

- GQA: keys ``[Nb, bs, Hkv, Dk]`` and values ``[Nb, bs, Hkv, Dv]``;
- MLA: one latent ``[Nb, bs, C + Dr]`` (the normalised kv latent, then the roped key). Every
  head's key is the whole row and its value the first C columns; queries come absorbed into
  the latent space (``[T, H, C + Dr]``) and outputs leave it (``[T, H, C]``), see engine/model.py.

:class:`SdpaAttention` is the generic path (the CPU, or CUDA without FlashInfer): per
sequence, torch's SDPA over that sequence's own context, gathered from its blocks into one
contiguous ``[Tk, Hkv, d]`` (a view of the cache when its blocks are consecutive). A whole
prompt runs ``is_causal`` with no mask; a chunk after cached context, or a sliding window,
runs in blocks of at most ``QUERY_BLOCK`` queries, each with a mask of its own
``[<= QUERY_BLOCK, Tk]``; a decode query sees its (window of) context with no mask. GQA heads
share their kv head through SDPA's ``enable_gqa``, never a copy. Decodes with short contexts
(at most ``DECODE_BATCH_MAX_KEYS`` keys, bounded padding) go together instead: one gather of
their keys ``[Bd, Hkv, Tk, d]`` and one masked SDPA call in which each kv head's query heads are
its queries (so the scores are ``[Bd, Hkv, H / Hkv, Tk]``). On a float32 CPU with raymoe's native kernels
(kernels/native_cpu.py), or a bfloat16 one with AVX512_BF16 (kernels/native_bf16.py), GQA decodes
read their keys where they lie instead, and a lone decode goes that way too (the same bits as in
a batch, whatever the batch). On the CPU, SDPA's flash
kernel then runs in tiles (it needs 4-D inputs and Dk == Dv, which is why MLA's values are
the whole latent row and the output is cut to C).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
import torch.nn.functional as F

from raymoe.kernels import native_bf16, native_cpu
from raymoe.moe.model_config import AttentionKind, ModelConfig

QUERY_BLOCK = 256  # queries per masked SDPA call: the mask is at most QUERY_BLOCK x Tk
# Decodes are batched into one SDPA call when every one sees at most this many keys and
# padding them to the longest costs at most DECODE_BATCH_MAX_PADDING x their keys: a bounded
# [Bd, Hkv, Tk, d] gather instead of a call per sequence (which costs more than the math at
# short contexts: measured 1.7 ms of a 12.5 ms decode step at 32 sequences on 2 CPU cores).
DECODE_BATCH_MAX_KEYS = 2048
DECODE_BATCH_MAX_PADDING = 2.0


@dataclass(frozen=True)
class AttentionMetadata:
    """Where each sequence of the step stands; tensors only, so it moves with ``.to(device)``."""

    query_lens: torch.Tensor  # [B] new tokens (the last of the sequence's tokens)
    context_lens: torch.Tensor  # [B] all its tokens: cached context + new
    block_tables: torch.Tensor  # [B, max_blocks] cache blocks in order (pad: 0)
    slot_mapping: torch.Tensor  # [T] cache slot of each new token

    @classmethod
    def build(
        cls,
        query_lens: list[int],
        context_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
    ) -> "AttentionMetadata":
        """Metadata for sequences whose last ``query_lens[i]`` of ``context_lens[i]`` tokens are new
        (heads and sliding windows are the attention backend's, fixed at start-up)."""
        if not len(query_lens) == len(context_lens) == len(block_tables) or not query_lens:
            raise ValueError(
                f"need one query length, context length and block table per sequence, got "
                f"{len(query_lens)}, {len(context_lens)}, {len(block_tables)}"
            )
        num_blocks = [-(-total // block_size) for total in context_lens]
        for i, (new, total, table) in enumerate(zip(query_lens, context_lens, block_tables)):
            if not 1 <= new <= total or len(table) < num_blocks[i]:
                raise ValueError(
                    f"sequence {i}: {new} new of {total} tokens in {len(table)} blocks of {block_size}; "
                    f"need 1 <= new <= total <= blocks * block_size"
                )
        # Host integers in numpy (a few small arrays: torch's per-op cost was most of this), then
        # tensors sharing their memory.
        # Step 1: block tables, padded to the longest.
        width = max(num_blocks)
        tables = np.zeros((len(block_tables), width), dtype=np.int64)
        for row, table, n in zip(tables, block_tables, num_blocks):
            row[:n] = table[:n]
        # Step 2: each new token's sequence and position, then its slot.
        q_lens = np.array(query_lens, dtype=np.int64)
        ctx_lens = np.array(context_lens, dtype=np.int64)
        if len(query_lens) == int(q_lens.sum()):  # decodes only: token i is sequence i's last
            seq, positions = np.arange(len(query_lens)), ctx_lens - 1
        else:
            seq = np.repeat(np.arange(len(query_lens)), q_lens)  # [T]
            first_row = np.cumsum(q_lens) - q_lens
            positions = np.arange(seq.shape[0]) - first_row[seq] + (ctx_lens - q_lens)[seq]  # [T]
        slots = tables[seq, positions // block_size] * block_size + positions % block_size
        q_lens, ctx_lens, tables, slots = (torch.from_numpy(a) for a in (q_lens, ctx_lens, tables, slots))
        return cls(query_lens=q_lens, context_lens=ctx_lens, block_tables=tables, slot_mapping=slots)


@dataclass(frozen=True)
class AttentionSpec:
    """A model's attention as a backend sees it, fixed at start-up."""

    kind: AttentionKind
    num_heads: int
    num_kv_heads: int  # 1 for MLA: one latent shared by every head
    key_dim: int  # Dk; MLA: C + Dr
    value_dim: int  # Dv; MLA: C
    scale: float
    sliding_window: int | None

    @classmethod
    def from_config(cls, config: ModelConfig) -> "AttentionSpec":
        if config.attention is AttentionKind.MLA:
            rank, rope = config.mla.kv_lora_rank, config.mla.qk_rope_head_dim
            return cls(AttentionKind.MLA, config.num_heads, 1, rank + rope, rank, config.attention_scale, None)
        return cls(AttentionKind.GQA, config.num_heads, config.num_kv_heads, config.head_dim, config.v_head_dim,
                   config.attention_scale, config.sliding_window)


class AttentionStep(Protocol):
    """One step's plan, run by every layer."""

    def attend(self, q: torch.Tensor, cache: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """``q: [T, H, Dk]`` against one layer's cache (already holding the new tokens) -> ``[T, H, Dv]``."""


class AttentionBackend(Protocol):
    name: str

    def plan(self, metadata: AttentionMetadata, block_size: int) -> AttentionStep:
        """Once per step, before the first layer."""


def write_cache(cache: torch.Tensor, rows: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store ``rows: [T, ...]`` at ``slot_mapping`` of one paged cache tensor ``[Nb, bs, ...]``."""
    cache.view(-1, *cache.shape[2:]).index_copy_(0, slot_mapping, rows)


# ---- the generic backend -------------------------------------------------------------------
@dataclass(frozen=True)
class _Span:
    """One sequence of the step, in host integers."""

    first_row: int  # its first new token's row in the step
    num_new: int
    first_key: int  # the first position any of its queries sees (a window may hide the start)
    num_tokens: int
    seq: int  # its row of the block tables
    first_block: int  # index in its table of the block holding first_key
    run_start: int | None  # the physical block of first_block when its blocks are consecutive


class SdpaAttention:
    """The generic path: per-sequence SDPA over contiguous views (see the module docstring)."""

    name = "sdpa"

    def __init__(self, spec: AttentionSpec, dtype: torch.dtype | None = None, device: torch.device | None = None):
        self.spec = spec
        # A lone decode goes through the native decode kernel too where it will run (float32
        # GQA on the CPU): one call instead of SDPA's ~60 us, and the same bits as when the
        # sequence decodes in a batch. Elsewhere it keeps SDPA over a view of its context.
        native = {torch.float32: native_cpu.unavailable_reason, torch.bfloat16: native_bf16.bf16_unavailable_reason}
        self.single_decodes = (dtype in native and device is not None and device.type == "cpu"
                               and spec.kind is AttentionKind.GQA and spec.key_dim % 16 == 0
                               and spec.value_dim % 16 == 0 and native[dtype]() is None)

    def plan(self, metadata: AttentionMetadata, block_size: int) -> "SdpaStep":
        # Host integers in numpy: a few small arrays, where torch's per-op cost (~4 us each, some
        # 25 ops) was 0.12-0.2 ms of a decode step at 1-32 sequences.
        window = self.spec.sliding_window
        q_lens, ctx_lens = metadata.query_lens.cpu().numpy(), metadata.context_lens.cpu().numpy()
        first_key = np.maximum(ctx_lens - q_lens - window + 1, 0) if window else np.zeros_like(ctx_lens)
        first_block = first_key // block_size
        last_block = (ctx_lens - 1) // block_size
        # A sequence's visible blocks are one run when no step between them breaks the +1 chain.
        tables = metadata.block_tables.cpu().numpy()
        breaks = np.zeros(tables.shape, dtype=np.int64)  # [B, max_blocks]
        np.cumsum(tables[:, 1:] - tables[:, :-1] != 1, axis=1, out=breaks[:, 1:])
        rows = np.arange(tables.shape[0])
        consecutive = breaks[rows, last_block] == breaks[rows, first_block]
        starts = tables[rows, first_block]
        first_rows = np.cumsum(q_lens) - q_lens
        spans = [
            _Span(row, new, key, total, i, block, start if run else None)
            for i, (row, new, key, total, block, start, run) in enumerate(zip(
                first_rows.tolist(), q_lens.tolist(), first_key.tolist(), ctx_lens.tolist(),
                first_block.tolist(), starts.tolist(), consecutive.tolist()))
        ]
        decodes = _DecodeBatch.plan(spans, tables, block_size, metadata.block_tables.device,
                                    1 if self.single_decodes else 2)
        if decodes is not None:
            spans = [span for span in spans if span.num_new != 1]
        return SdpaStep(self.spec, spans, metadata.block_tables, block_size, decodes)


@dataclass(frozen=True)
class _DecodeBatch:
    """The step's decodes (one query each) as one padded SDPA call, planned once per step; on a
    CPU in float32 with AVX-512F, raymoe's native kernel reads their keys where they lie instead
    (kernels/native_cpu.py: no gathered copy, no padding; each sequence reduced on its own)."""

    rows: torch.Tensor  # [Bd] their query rows in the step
    slots: torch.Tensor  # [Bd * Tk] cache slot of each visible key, padded with a visible one
    num_keys: int  # Tk: the most keys any of them sees
    counts: torch.Tensor  # [Bd] int64: how many keys each sees (the first of its row of slots)

    @classmethod
    def plan(cls, spans: list[_Span], tables: np.ndarray, block_size: int,
             device: torch.device, least: int = 2) -> "_DecodeBatch | None":
        """The step's decodes as one batch, if there are at least ``least`` and their padding is
        bounded (``tables``: the block tables on the host)."""
        decodes = [span for span in spans if span.num_new == 1]
        if len(decodes) < least:
            return None
        counts = [span.num_tokens - span.first_key for span in decodes]
        num_keys = max(counts)
        if num_keys > DECODE_BATCH_MAX_KEYS or len(decodes) * num_keys > DECODE_BATCH_MAX_PADDING * sum(counts):
            return None
        first = np.array([span.first_key for span in decodes], dtype=np.int64)[:, None]  # [Bd, 1]
        count = np.array(counts, dtype=np.int64)
        offset = np.arange(num_keys, dtype=np.int64)[None, :]  # [1, Tk]
        position = first + np.where(offset < count[:, None], offset, 0)  # padding repeats the first key
        seqs = np.array([span.seq for span in decodes], dtype=np.int64)[:, None]
        slots = tables[seqs, position // block_size] * block_size + position % block_size  # [Bd, Tk]
        rows = np.array([span.first_row for span in decodes], dtype=np.int64)
        return cls(torch.from_numpy(rows).to(device), torch.from_numpy(slots.reshape(-1)).to(device), num_keys,
                   torch.from_numpy(count).to(device))

    def attend(self, q: torch.Tensor, cache: tuple[torch.Tensor, ...], spec: "AttentionSpec",
               out: torch.Tensor) -> None:
        """Write the decodes' outputs into their rows of ``out: [T, H, Dv]``."""
        batch, num_keys = self.rows.shape[0], self.num_keys
        for native in (native_cpu, native_bf16):  # float32, bfloat16
            if spec.kind is AttentionKind.GQA and native.attention_applies(q, cache[0], cache[1]):
                native.decode_attention(q, cache[0], cache[1], self.rows, self.slots.view(batch, num_keys),
                                        self.counts, spec.scale, out)
                return

        def gather(paged: torch.Tensor) -> torch.Tensor:  # [Nb, bs, ...] -> [Bd, heads, Tk, d]
            keys = paged.flatten(0, 1).index_select(0, self.slots)
            if keys.dim() == 2:  # MLA's latent rows: one shared "head"
                keys = keys.unsqueeze(1)
            return keys.view(batch, num_keys, *keys.shape[1:]).transpose(1, 2)

        if spec.kind is AttentionKind.MLA:
            keys = values = gather(cache[0])
        else:
            keys, values = gather(cache[0]), gather(cache[1])
        # A kv head's query heads go as that head's queries (H / Hkv of them): one SDPA tile per
        # (sequence, kv head) instead of one per query head, and no GQA mapping (measured 15-25%
        # faster at 32 sequences). Query head h reads kv head h // (H / Hkv), as enable_gqa would.
        kv_heads = keys.shape[1]
        queries = q.index_select(0, self.rows).view(batch, kv_heads, -1, q.shape[-1])  # [Bd, Hkv, H/Hkv, Dk]
        visible = torch.arange(num_keys, device=self.counts.device) < self.counts.unsqueeze(1)  # [Bd, Tk]
        result = F.scaled_dot_product_attention(queries, keys, values, attn_mask=visible[:, None, None, :],
                                                scale=spec.scale)
        out.index_copy_(0, self.rows, result.reshape(batch, spec.num_heads, -1)[..., : spec.value_dim])


class SdpaStep:
    def __init__(self, spec: AttentionSpec, spans: list[_Span], block_tables: torch.Tensor, block_size: int,
                 decodes: _DecodeBatch | None = None):
        self.spec = spec
        self.spans = spans  # the sequences attended one by one (all of them without `decodes`)
        self.block_tables = block_tables  # [B, max_blocks] on the cache's device
        self.block_size = block_size
        self.decodes = decodes

    def attend(self, q: torch.Tensor, cache: tuple[torch.Tensor, ...]) -> torch.Tensor:
        if len(self.spans) == 1 and self.decodes is None:  # SDPA's output is already [Tq, H, Dv]: no copy
            return self._attend_span(q, cache, self.spans[0])
        out = q.new_empty(q.shape[0], self.spec.num_heads, self.spec.value_dim)  # [T, H, Dv]
        if self.decodes is not None:
            self.decodes.attend(q, cache, self.spec, out)
        for span in self.spans:
            out[span.first_row: span.first_row + span.num_new] = self._attend_span(q, cache, span)
        return out

    def _attend_span(self, q: torch.Tensor, cache: tuple[torch.Tensor, ...], span: _Span) -> torch.Tensor:
        spec = self.spec
        q = q[span.first_row: span.first_row + span.num_new]
        first_query = span.num_tokens - span.num_new
        if spec.kind is AttentionKind.MLA:
            (latent,) = cache
            keys = self._context(latent, span).unsqueeze(1)  # [Tk, 1, C + Dr]: keys and values both
            out = attend_sequence(q, keys, keys, first_query, span.first_key, spec.scale, spec.sliding_window)
            return out[..., : spec.value_dim]  # the values were the whole row: keep C
        k_cache, v_cache = cache
        keys, values = self._context(k_cache, span), self._context(v_cache, span)
        return attend_sequence(q, keys, values, first_query, span.first_key, spec.scale, spec.sliding_window)

    def _context(self, cache: torch.Tensor, span: _Span) -> torch.Tensor:
        """The sequence's visible context ``[Tk, ...]`` from a paged ``[Nb, bs, ...]`` tensor:
        a view when its blocks are consecutive, else one gather of its blocks."""
        size = self.block_size
        last_block = (span.num_tokens - 1) // size + 1
        count = last_block - span.first_block
        if span.run_start is not None:
            blocks = cache[span.run_start: span.run_start + count]
        else:
            blocks = cache.index_select(0, self.block_tables[span.seq, span.first_block: last_block])
        offset = span.first_block * size
        return blocks.flatten(0, 1)[span.first_key - offset: span.num_tokens - offset]


def attend_sequence(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    first_query: int,
    first_key: int,
    scale: float,
    sliding_window: int | None,
) -> torch.Tensor:
    """One sequence: ``q: [Tq, H, Dk]`` at positions ``first_query + i`` against ``keys: [Tk, Hkv, Dk]``,
    ``values: [Tk, Hkv, Dv]`` at positions ``first_key + j`` (ending with the queries' own) -> ``[Tq, H, Dv]``.

    Query i sees key j when ``j <= i`` and, with a window w, ``j > i - w``; keys before
    ``first_key`` are hidden from every query (the caller trims them).
    """
    num_new = q.shape[0]
    if first_key + keys.shape[0] != first_query + num_new:
        raise ValueError(f"keys end at {first_key + keys.shape[0]}, queries at {first_query + num_new}")
    if first_key == first_query and (sliding_window is None or sliding_window >= num_new):
        return _sdpa(q, keys, values, scale, is_causal=True)  # a whole prompt: SDPA's own causal mask
    if num_new == 1:
        return _sdpa(q, keys, values, scale)  # a decode: every given key is visible
    outputs = []
    for start in range(0, num_new, QUERY_BLOCK):
        stop = min(start + QUERY_BLOCK, num_new)
        q_pos = torch.arange(first_query + start, first_query + stop, device=q.device).unsqueeze(1)  # [Tq', 1]
        lo = first_key if sliding_window is None else max(first_key, first_query + start - sliding_window + 1)
        hi = first_query + stop  # keys after the block's last query are hidden from all of it
        k_pos = torch.arange(lo, hi, device=q.device)  # [Tk']
        visible = k_pos <= q_pos
        if sliding_window is not None:
            visible &= k_pos > q_pos - sliding_window
        keys_block = slice(lo - first_key, hi - first_key)
        outputs.append(_sdpa(q[start:stop], keys[keys_block], values[keys_block], scale, mask=visible))
    return torch.cat(outputs)


def _sdpa(q, keys, values, scale: float, is_causal: bool = False, mask: torch.Tensor | None = None) -> torch.Tensor:
    """``q: [Tq, H, Dk]``, ``keys: [Tk, Hkv, Dk]``, ``values: [Tk, Hkv, Dv]`` -> ``[Tq, H, Dv]``, as 4-D views
    (SDPA's fused CPU kernel takes 4-D inputs only)."""
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0),  # [1, H, Tq, Dk]
        keys.transpose(0, 1).unsqueeze(0),  # [1, Hkv, Tk, Dk]
        values.transpose(0, 1).unsqueeze(0),
        attn_mask=mask,
        is_causal=is_causal,
        scale=scale,
        enable_gqa=q.shape[1] != keys.shape[1],
    )  # [1, H, Tq, Dv]
    return out[0].transpose(0, 1)
