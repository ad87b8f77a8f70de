"""Paged attention (kernels/attention.py) against a plain reference, over a table of cases.

The reference is dense float64 attention per sequence over its whole context written out
by hand (kv heads repeated, an explicit causal/window mask), never through the cache or SDPA.
The cases cover whole prompts, prompt chunks after cached context (also longer than one
query block), decodes, sliding windows, MHA/GQA/MQA, consecutive and scattered blocks, and
MLA's latent cache with the absorbed query against the expanded form. The `gpu` tests run
FlashInfer's kernels against the generic path on the same cache.
"""

from __future__ import annotations

import random

import pytest
import torch

from raymoe.kernels.attention import QUERY_BLOCK, AttentionMetadata, AttentionSpec, SdpaAttention, write_cache
from raymoe.moe.model_config import AttentionKind

# (name, heads, kv heads, head size, window, [(new tokens, all tokens) per sequence])
CASES = [
    ("prompts-gqa", 4, 2, 16, None, [(5, 5), (17, 17), (1, 1), (33, 33)]),
    ("chunks-after-context-gqa", 4, 2, 16, None, [(16, 40), (7, 7), (3, 50), (1, 9)]),
    ("long-chunk-over-query-blocks", 4, 2, 16, None, [(QUERY_BLOCK + 45, QUERY_BLOCK + 160)]),
    ("decodes-mha", 4, 4, 8, None, [(1, 3), (1, 30), (1, 64), (1, 1)]),
    ("mqa-mixed", 6, 1, 8, None, [(1, 20), (12, 12), (5, 29)]),
    ("window-prompts", 4, 2, 16, 6, [(21, 21), (3, 3), (40, 40)]),
    ("window-chunks-and-decodes", 4, 2, 16, 6, [(9, 30), (1, 25), (1, 4), (16, 16)]),
    ("window-long-chunk", 2, 1, 8, 37, [(2 * QUERY_BLOCK + 3, 2 * QUERY_BLOCK + 50)]),
    # decodes of similar lengths go through one padded call (kernels/attention.py::_DecodeBatch)
    ("decodes-batched-gqa", 4, 2, 16, None, [(1, 20), (1, 23), (3, 12), (1, 17), (1, 9)]),
    ("window-decodes-batched", 4, 2, 16, 6, [(1, 30), (1, 12), (5, 20), (1, 7)]),
]
BATCHED_DECODES = {"decodes-batched-gqa": 4, "window-decodes-batched": 3, "window-chunks-and-decodes": 2}
BLOCK_SIZE = 8


def reference_attention(q, keys, values, first_query, scale, window):
    """Dense float64: ``q [n, H, D]`` at positions ``first_query + i`` over ``keys, values [k, Hkv, D]``."""
    heads, kv_heads = q.shape[1], keys.shape[1]
    keys = keys.double().repeat_interleave(heads // kv_heads, dim=1)
    values = values.double().repeat_interleave(heads // kv_heads, dim=1)
    scores = torch.einsum("nhd,khd->hnk", q.double(), keys) * scale
    q_pos = torch.arange(q.shape[0]).unsqueeze(1) + first_query
    k_pos = torch.arange(keys.shape[0]).unsqueeze(0)
    visible = k_pos <= q_pos
    if window is not None:
        visible &= k_pos > q_pos - window
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.einsum("hnk,khd->nhd", scores.softmax(-1), values)


def block_tables(lengths: list[int], num_blocks: int, scattered: bool, seed: int) -> list[list[int]]:
    """Tables for sequences of ``lengths`` tokens: consecutive blocks in order, or shuffled ones."""
    ids = list(range(num_blocks))
    if scattered:
        random.Random(seed).shuffle(ids)
    tables, used = [], 0
    for length in lengths:
        needed = -(-length // BLOCK_SIZE)
        tables.append(ids[used: used + needed])
        used += needed
    return tables


def paged_case(heads, kv_heads, dim, lengths, scattered, seed=0, dtype=torch.float32):
    """Random q/k/v for the case, the cache holding every sequence's context, and the metadata."""
    generator = torch.Generator().manual_seed(seed)
    totals = [total for _, total in lengths]
    num_blocks = sum(-(-t // BLOCK_SIZE) for t in totals) + 3
    tables = block_tables(totals, num_blocks, scattered, seed)
    metadata = AttentionMetadata.build([n for n, _ in lengths], totals, tables, BLOCK_SIZE)
    k_cache = torch.zeros(num_blocks, BLOCK_SIZE, kv_heads, dim, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    contexts, queries = [], []
    for (new, total), table in zip(lengths, tables):
        keys = torch.randn(total, kv_heads, dim, generator=generator).to(dtype)
        values = torch.randn(total, kv_heads, dim, generator=generator).to(dtype)
        slots = torch.tensor([table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(total)])
        write_cache(k_cache, keys, slots)
        write_cache(v_cache, values, slots)
        contexts.append((keys, values))
        queries.append(torch.randn(new, heads, dim, generator=generator).to(dtype))
    return torch.cat(queries), (k_cache, v_cache), metadata, contexts


@pytest.mark.parametrize("scattered", [False, True], ids=["consecutive-blocks", "scattered-blocks"])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_sdpa_path_matches_dense_reference(case, scattered):
    _, heads, kv_heads, dim, window, lengths = case
    q, cache, metadata, contexts = paged_case(heads, kv_heads, dim, lengths, scattered)
    scale = dim ** -0.5
    spec = AttentionSpec(AttentionKind.GQA, heads, kv_heads, dim, dim, scale, window)
    step = SdpaAttention(spec).plan(metadata, BLOCK_SIZE)
    batched = 0 if step.decodes is None else step.decodes.rows.numel()
    assert batched == BATCHED_DECODES.get(case[0], 0)  # which path ran is part of the case
    out = step.attend(q, cache)
    assert out.shape == (q.shape[0], heads, dim)
    row = 0
    for (new, total), (keys, values) in zip(lengths, contexts):
        expected = reference_attention(q[row: row + new], keys, values, total - new, scale, window)
        diff = (out[row: row + new].double() - expected).abs().max().item()
        assert diff < 1e-5, f"sequence of {new} new / {total} tokens differs by {diff}"
        row += new


def test_bfloat16_tracks_the_float64_reference():
    lengths = [(9, 30), (1, 25), (16, 16)]
    q, cache, metadata, contexts = paged_case(4, 2, 16, lengths, scattered=True, dtype=torch.bfloat16)
    spec = AttentionSpec(AttentionKind.GQA, 4, 2, 16, 16, 0.25, None)
    out = SdpaAttention(spec).plan(metadata, BLOCK_SIZE).attend(q, cache)
    assert out.dtype == torch.bfloat16
    expected = torch.cat([reference_attention(q[r: r + n], k, v, t - n, 0.25, None)
                          for r, (n, t), (k, v) in zip((0, 9, 10), lengths, contexts)])
    assert (out.double() - expected).abs().max().item() < 2e-2  # bfloat16 rounding of inputs and output


def test_mla_latent_with_absorbed_query_matches_the_expanded_form():
    # DeepSeek-V3's layout at small sizes: R latent, P roped key, per head nope/v sizes.
    heads, rank, rope, nope, v_dim = 4, 16, 8, 12, 10
    lengths = [(6, 6), (5, 23), (1, 17)]
    generator = torch.Generator().manual_seed(1)
    w_uk = torch.randn(heads, nope, rank, generator=generator) * 0.3
    w_uv = torch.randn(heads, v_dim, rank, generator=generator) * 0.3
    scale = (nope + rope) ** -0.5
    totals = [t for _, t in lengths]
    tables = block_tables(totals, 12, scattered=True, seed=1)
    metadata = AttentionMetadata.build([n for n, _ in lengths], totals, tables, BLOCK_SIZE)
    latent_cache = torch.zeros(12, BLOCK_SIZE, rank + rope)
    step = SdpaAttention(AttentionSpec(AttentionKind.MLA, heads, 1, rank + rope, rank, scale, None)).plan(
        metadata, BLOCK_SIZE)
    queries, expected = [], []
    for (new, total), table in zip(lengths, tables):
        latent = torch.randn(total, rank, generator=generator)
        k_rot = torch.randn(total, rope, generator=generator)
        slots = torch.tensor([table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(total)])
        write_cache(latent_cache, torch.cat([latent, k_rot], -1), slots)
        q_nope = torch.randn(new, heads, nope, generator=generator)
        q_rot = torch.randn(new, heads, rope, generator=generator)
        # Expanded: every head's key [W_UK c, k_rot] and value W_UV c, as transformers computes them.
        keys = torch.cat([torch.einsum("hnr,tr->thn", w_uk, latent), k_rot.unsqueeze(1).expand(-1, heads, -1)], -1)
        values = torch.einsum("hvr,tr->thv", w_uv, latent)
        expected.append(reference_attention(torch.cat([q_nope, q_rot], -1), keys, values, total - new, scale, None))
        queries.append(torch.cat([torch.einsum("thn,hnr->thr", q_nope, w_uk), q_rot], -1))  # absorbed
    out_latent = step.attend(torch.cat(queries), (latent_cache,))  # [T, H, R]
    assert out_latent.shape == (sum(n for n, _ in lengths), heads, rank)
    out = torch.einsum("thr,hvr->thv", out_latent, w_uv)
    assert (out.double() - torch.cat(expected)).abs().max().item() < 1e-5


def test_metadata_slots_for_a_chunk_after_cached_context():
    # 3 new tokens of 11 (positions 8, 9, 10) in blocks [7, 2] of 8, and a fresh 2-token prompt in [5].
    metadata = AttentionMetadata.build([3, 2], [11, 2], [[7, 2, 9], [5]], 8)
    assert metadata.slot_mapping.tolist() == [2 * 8 + 0, 2 * 8 + 1, 2 * 8 + 2, 5 * 8 + 0, 5 * 8 + 1]
    assert metadata.query_lens.tolist() == [3, 2] and metadata.context_lens.tolist() == [11, 2]
    assert metadata.block_tables.tolist() == [[7, 2], [5, 0]]  # only the blocks the context uses


def test_metadata_slots_for_a_batch_of_decodes():
    # one new token each (the decode path): positions 10, 0, 15 and 16 of their sequences
    metadata = AttentionMetadata.build([1, 1, 1, 1], [11, 1, 16, 17], [[7, 2], [5], [3, 4], [6, 1, 9]], 8)
    assert metadata.slot_mapping.tolist() == [2 * 8 + 2, 5 * 8 + 0, 4 * 8 + 7, 9 * 8 + 0]
    mixed = AttentionMetadata.build([1, 2, 1], [11, 2, 16], [[7, 2], [5], [3, 4]], 8)  # the general path
    assert mixed.slot_mapping.tolist() == [2 * 8 + 2, 5 * 8 + 0, 5 * 8 + 1, 4 * 8 + 7]


@pytest.mark.parametrize("query_lens, context_lens, tables, words", [
    ([0], [4], [[0]], "1 <= new <= total"),
    ([5], [4], [[0]], "1 <= new <= total"),
    ([2], [20], [[0, 1]], "blocks"),
    ([1, 1], [1], [[0]], "one query length"),
])
def test_metadata_refuses_inconsistent_sequences(query_lens, context_lens, tables, words):
    with pytest.raises(ValueError, match=words):
        AttentionMetadata.build(query_lens, context_lens, tables, 8)


def test_a_long_prompt_allocates_no_scores_buffer():
    # 2,048 tokens, 8 heads: one [H, Q, K] float32 buffer alone would be 128 MiB. Every op the
    # generic path runs allocates at most a few MiB (the output, the context views).
    heads, dim, length = 8, 32, 2048
    q, cache, metadata, _ = paged_case(heads, 2, dim, [(length, length)], scattered=True)
    step = SdpaAttention(AttentionSpec(AttentionKind.GQA, heads, 2, dim, dim, dim ** -0.5, None)).plan(
        metadata, BLOCK_SIZE)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as profile:
        step.attend(q, cache)
    largest = max(event.cpu_memory_usage for event in profile.events())
    scores_bytes = heads * length * length * 4
    assert 0 < largest < scores_bytes / 16, (largest, scores_bytes)


# ---- FlashInfer (CUDA) against the generic path ---------------------------------------------
@pytest.fixture(scope="module")
def flashinfer_attention():
    """The FlashInfer backend class, or a skip naming what is missing."""
    try:
        import flashinfer  # noqa: F401
    except Exception as error:
        pytest.skip(f"needs flashinfer: cannot import it ({type(error).__name__}: {error}); "
                    "pip install flashinfer-python")
    from raymoe.kernels.attention_flashinfer import FlashInferAttention

    return FlashInferAttention


GPU_CASES = [
    ("prompts", 8, 2, 128, None, [(5, 5), (300, 300), (1, 1), (77, 77)]),
    ("chunks-after-context", 8, 2, 128, None, [(16, 400), (7, 7), (200, 900), (1, 33)]),
    ("decodes", 8, 8, 64, None, [(1, 3), (1, 300), (1, 1000), (1, 1)]),
    ("window", 8, 2, 128, 64, [(150, 150), (30, 500), (1, 90)]),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=[c[0] for c in GPU_CASES])
def test_flashinfer_matches_the_generic_path(flashinfer_attention, case):
    _, heads, kv_heads, dim, window, lengths = case
    device = torch.device("cuda")
    q, cache, metadata, _ = paged_case(heads, kv_heads, dim, lengths, scattered=True, dtype=torch.bfloat16)
    q, cache, metadata = q.to(device), tuple(t.to(device) for t in cache), _to(metadata, device)
    spec = AttentionSpec(AttentionKind.GQA, heads, kv_heads, dim, dim, dim ** -0.5, window)
    fused = flashinfer_attention(spec, torch.bfloat16, device).plan(metadata, BLOCK_SIZE).attend(q, cache)
    generic = SdpaAttention(spec).plan(metadata, BLOCK_SIZE).attend(q, cache)
    assert fused.shape == generic.shape
    assert (fused.float() - generic.float()).abs().max().item() < 2e-2


@pytest.mark.gpu
def test_flashinfer_mla_matches_the_generic_path(flashinfer_attention):
    heads, rank, rope = 16, 512, 64
    lengths = [(40, 40), (9, 300), (1, 700), (1, 5)]
    device = torch.device("cuda")
    generator = torch.Generator().manual_seed(2)
    totals = [t for _, t in lengths]
    num_blocks = sum(-(-t // BLOCK_SIZE) for t in totals) + 3
    tables = block_tables(totals, num_blocks, scattered=True, seed=2)
    metadata = _to(AttentionMetadata.build([n for n, _ in lengths], totals, tables, BLOCK_SIZE), device)
    latent = (torch.randn(num_blocks, BLOCK_SIZE, rank + rope, generator=generator) * 0.5).to(torch.bfloat16)
    q = (torch.randn(sum(n for n, _ in lengths), heads, rank + rope, generator=generator) * 0.5).to(torch.bfloat16)
    latent, q = latent.to(device), q.to(device)
    spec = AttentionSpec(AttentionKind.MLA, heads, 1, rank + rope, rank, 192 ** -0.5, None)
    fused = flashinfer_attention(spec, torch.bfloat16, device).plan(metadata, BLOCK_SIZE).attend(q, (latent,))
    generic = SdpaAttention(spec).plan(metadata, BLOCK_SIZE).attend(q, (latent,))
    assert fused.shape == generic.shape == (q.shape[0], heads, rank)
    assert (fused.float() - generic.float()).abs().max().item() < 2e-2


@pytest.mark.gpu
def test_the_engine_runs_flashinfer_where_it_can_and_tracks_the_generic_path(flashinfer_attention, tmp_path):
    from raymoe.engine.engine import EngineConfig, LLMEngine
    from raymoe.engine.sampling_params import SamplingParams
    from tiny_models import VOCAB, build_reference_model, write_checkpoint

    # Head size 64 in bfloat16: shapes FlashInfer's kernels take, so the engine picks it.
    model = build_reference_model("mixtral", hidden_size=128, num_attention_heads=2, num_key_value_heads=1)
    engine = LLMEngine.from_pretrained(write_checkpoint(model, str(tmp_path)),
                                       EngineConfig(dtype="bfloat16", device="cuda", block_size=16, keep_logits=True))
    assert isinstance(engine.model.attention, flashinfer_attention)
    generator = torch.Generator().manual_seed(3)
    prompts = [torch.randint(4, VOCAB, (n,), generator=generator).tolist() for n in (3, 21, 40)]

    def run() -> tuple[torch.Tensor, list[list[int]], list[list[torch.Tensor]]]:
        prefill = torch.cat(engine.score(prompts))
        for i, prompt in enumerate(prompts):
            engine.add_request(f"r{i}-{id(engine.model.attention)}", prompt,
                               SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
        tokens, logits = [[] for _ in prompts], [[] for _ in prompts]
        while engine.has_unfinished():
            for output in engine.step():
                index = int(output.request_id[1:].split("-")[0])
                tokens[index].append(output.new_token_ids[0])
                logits[index].append(output.logits)
        return prefill, tokens, logits

    fused_prefill, fused_tokens, fused_logits = run()
    engine.model.attention = SdpaAttention(AttentionSpec.from_config(engine.config))
    generic_prefill, generic_tokens, generic_logits = run()
    spread = generic_prefill.std().item()
    assert torch.isfinite(fused_prefill).all()
    assert (fused_prefill - generic_prefill).abs().mean().item() / spread < 0.02
    assert (fused_prefill.argmax(-1) == generic_prefill.argmax(-1)).float().mean().item() >= 0.9
    compared = 0
    for ours, theirs, our_logits, their_logits in zip(fused_tokens, generic_tokens, fused_logits, generic_logits):
        for step, (a, b) in enumerate(zip(our_logits, their_logits)):  # decode steps while the histories agree
            assert (a - b).abs().mean().item() / spread < 0.02
            compared += 1
            if ours[step] != theirs[step]:
                break
    assert compared > len(prompts)  # at least one decode step (the decode kernel) was compared


def _to(metadata: AttentionMetadata, device: torch.device) -> AttentionMetadata:
    return AttentionMetadata(**{name: value.to(device) for name, value in vars(metadata).items()})
