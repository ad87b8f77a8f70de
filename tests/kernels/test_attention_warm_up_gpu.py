"""FlashInfer warmed before a router joins its group (issue 34, item 5), on a GPU.

``warm_up_attention`` plans and runs every kind of step (a prompt, a chunk after cached
context, a decode batch) on the real backend and cache, so FlashInfer's modules are compiled
or loaded before the group's first step. Here: FlashInfer's GQA (with and without a sliding
window) and MLA backends warm up on CUDA in bfloat16 without touching the cache, and a step
right after the warm-up matches the generic path. Skipped without CUDA or flashinfer, the
reason naming what is missing (the CPU side: tests/actors/test_router_warm_start.py).
"""

from __future__ import annotations

import pytest
import torch

from raymoe.kernels.attention import AttentionMetadata, AttentionSpec, SdpaAttention
from raymoe.kernels.attention_flashinfer import warm_up_attention
from raymoe.moe.model_config import AttentionKind

BLOCK = 16


@pytest.fixture(scope="module")
def flashinfer_attention():
    try:
        import flashinfer  # noqa: F401
    except Exception as error:
        pytest.skip(f"needs flashinfer: cannot import it ({type(error).__name__}: {error}); "
                    "pip install flashinfer-python")
    from raymoe.kernels.attention_flashinfer import FlashInferAttention

    return FlashInferAttention


SPECS = [
    AttentionSpec(AttentionKind.GQA, 8, 2, 128, 128, 128 ** -0.5, None),
    AttentionSpec(AttentionKind.GQA, 8, 2, 128, 128, 128 ** -0.5, 64),
    AttentionSpec(AttentionKind.MLA, 16, 1, 576, 512, 192 ** -0.5, None),
]


@pytest.mark.gpu
@pytest.mark.parametrize("spec", SPECS, ids=["gqa", "gqa-window", "mla"])
def test_flashinfer_warms_up_and_then_serves_a_step(flashinfer_attention, spec):
    device, dtype = torch.device("cuda", 0), torch.bfloat16
    rows = (spec.key_dim,) if spec.kind is AttentionKind.MLA else (spec.num_kv_heads, spec.key_dim)
    count = 1 if spec.kind is AttentionKind.MLA else 2
    generator = torch.Generator().manual_seed(0)
    cache = tuple(torch.randn(8, BLOCK, *rows, generator=generator).mul_(0.5).to(dtype).to(device)
                  for _ in range(count))
    before = [t.clone() for t in cache]
    backend = flashinfer_attention(spec, dtype, device)
    report = warm_up_attention(backend, cache, BLOCK, dtype, device)
    assert report["backend"] == "flashinfer" and len(report["steps"]) == 3
    assert all(torch.equal(a, b) for a, b in zip(cache, before))
    # The first real step after the warm-up: a prompt chunk after context and a decode.
    metadata = AttentionMetadata.build([5, 1], [40, 30], [[3, 4, 5], [6, 7]], BLOCK)
    metadata = AttentionMetadata(**{key: value.to(device) for key, value in vars(metadata).items()})
    q = torch.randn(6, spec.num_heads, spec.key_dim, generator=generator).mul_(0.5).to(dtype).to(device)
    out = backend.plan(metadata, BLOCK).attend(q, cache)
    expected = SdpaAttention(spec).plan(metadata, BLOCK).attend(q, cache)
    assert torch.isfinite(out).all()
    assert (out.float() - expected.float()).abs().max().item() < 2e-2
