"""The bfloat16 native kernels (kernels/native_bf16.py) against float64 references: exact rounding,
row invariance, no copy of any weight, and the fall-backs where they do not apply."""

from __future__ import annotations

import os
import shutil
import sys

import pytest
import torch
import torch.nn.functional as F

from raymoe.kernels import native_bf16, native_library, packed_linear, weight_cache
from raymoe.kernels.expert_mlp import grouped_swiglu, kernel_name


def _cpu_has(flag: str) -> bool:
    with open("/proc/cpuinfo") as handle:
        return f" {flag}" in handle.read()


CAN_RUN = sys.platform.startswith("linux") and shutil.which(os.environ.get("CC") or "cc") is not None \
    and os.path.exists("/proc/cpuinfo") and _cpu_has("avx512f") and _cpu_has("avx512_bf16")
needs_kernel = pytest.mark.skipif(not CAN_RUN, reason="needs Linux, a C compiler, AVX-512F and AVX512_BF16")


@pytest.fixture(autouse=True, params=["amx", "avx512-bf16"])
def instructions(request, monkeypatch):
    """Every test on both kernels: AMX's (where the CPU has it) and the AVX512_BF16 dot products."""
    native_library.set_enabled(True)
    if CAN_RUN:
        assert native_library.bf16_unavailable_reason() is None
        library = native_library.STATE.library
        if request.param == "amx":
            if not library.raymoe_amx_supported():
                pytest.skip("this CPU has no AMX-BF16 (or Linux refused this process the tiles)")
            chosen = (library.raymoe_amx_linear, library.raymoe_amx_swiglu_experts, "amx")
        else:
            chosen = (library.raymoe_bf16_linear, library.raymoe_bf16_swiglu_experts, "avx512-bf16")
        monkeypatch.setattr(native_bf16, "_chosen", chosen)
        assert native_bf16.instructions() == request.param
    yield request.param
    native_library.set_enabled(True)


def _bf16(*shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=generator, dtype=torch.float64) * scale).to(torch.bfloat16)


@needs_kernel
def test_the_bf16_kernels_run_where_the_cpu_has_avx512_bf16():
    assert native_library.bf16_unavailable_reason() is None
    x, w = _bf16(3, 64, seed=1), _bf16(40, 64, seed=2)
    assert native_bf16.linear_applies(x, w, None)
    assert not native_bf16.linear_applies(x.float(), w.float(), None)  # float32: the f32 kernels' business


@needs_kernel
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 17, 70])
@pytest.mark.parametrize("outputs", [4, 37])
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_is_the_float64_result_rounded_once_and_row_invariant(rows, outputs, with_bias):
    x, w = _bf16(rows, 96, seed=rows), _bf16(outputs, 96, seed=outputs)
    bias = _bf16(outputs, seed=7) if with_bias else None
    expected = F.linear(x.double(), w.double(), bias.double() if with_bias else None)
    logits = native_bf16.linear(x, w, bias, out_dtype=torch.float32)
    # float32 sums of exact products: within a few float32 ulps of the float64 result's scale
    assert (logits.double() - expected).abs().max().item() <= 1e-5 * expected.abs().max().item()
    rounded = native_bf16.linear(x, w, bias)
    assert rounded.dtype == torch.bfloat16
    assert torch.equal(rounded, logits.to(torch.bfloat16))  # one rounding, to nearest even, as torch's
    for row in {0, rows // 2, rows - 1}:  # a row alone gets the bits it has among the others
        assert torch.equal(native_bf16.linear(x[row:row + 1], w, bias), rounded[row:row + 1])


@needs_kernel
def test_a_split_over_threads_gives_the_same_bits(monkeypatch):
    x, w = _bf16(5, 64, seed=3), _bf16(203, 64, seed=4)
    one = native_bf16.linear(x, w, out_dtype=torch.float32, threads=1)
    assert torch.equal(native_bf16.linear(x, w, out_dtype=torch.float32, threads=3), one)
    monkeypatch.setattr(native_bf16, "SPLIT_MIN_BYTES", 0)  # the default: split over every core
    assert torch.equal(native_bf16.linear(x, w, out_dtype=torch.float32), one)


@needs_kernel
def test_dense_layers_and_the_lm_head_take_it_and_copy_no_weight():
    x, w = _bf16(2, 64, seed=5), _bf16(96, 64, seed=6)
    out = packed_linear.linear(x, w)
    assert torch.equal(out, native_bf16.linear(x, w))
    logits = packed_linear.logits(x, w)
    assert logits.dtype == torch.float32 and torch.equal(logits, native_bf16.linear(x, w, out_dtype=torch.float32))
    assert not weight_cache.cached_rows(w)  # nothing packed beside the weight


def _experts(experts: int, hidden: int, intermediate: int, seed: int):
    w13 = _bf16(experts, 2 * intermediate, hidden, seed=seed, scale=hidden ** -0.5)
    w2 = _bf16(experts, hidden, intermediate, seed=seed + 1, scale=intermediate ** -0.5)
    return w13, w2


def _expert_reference(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, expert: int) -> torch.Tensor:
    """float64 gate and up, SiLU, the product rounded to bfloat16 (as the kernel keeps it), float64 down."""
    intermediate = w2.shape[2]
    gate_up = F.linear(x.double(), w13[expert].double())
    hidden = (F.silu(gate_up[:, :intermediate]) * gate_up[:, intermediate:]).to(torch.bfloat16)
    return F.linear(hidden.double(), w2[expert].double())


@needs_kernel
@pytest.mark.parametrize("counts", [[1, 0, 2], [5, 40, 3], [33, 1, 0]])
def test_experts_match_float64_and_a_rows_bits_do_not_depend_on_its_neighbours(counts):
    hidden, intermediate = 64, 96
    w13, w2 = _experts(len(counts), hidden, intermediate, seed=sum(counts))
    x = _bf16(sum(counts), hidden, seed=11)
    assert kernel_name(x, w13, w2) == native_bf16.KERNEL
    out = grouped_swiglu(x, counts, w13, w2)
    assert out.dtype == torch.bfloat16
    start = 0
    for expert, count in enumerate(counts):
        if count:
            expected = _expert_reference(x[start:start + count], w13, w2, expert)
            # bfloat16 output (8 bits of mantissa) and a SiLU polynomial: a bfloat16 step or two
            torch.testing.assert_close(out[start:start + count].double(), expected, rtol=1.6e-2, atol=1e-2)
            for row in range(start, start + count, max(1, count // 3)):  # alone, the same bits
                lone = [0] * len(counts)
                lone[expert] = 1
                assert torch.equal(grouped_swiglu(x[row:row + 1], lone, w13, w2), out[row:row + 1])
        start += count
    assert not weight_cache.cached_rows(w13) and not weight_cache.cached_rows(w2)  # no packed copy


@needs_kernel
def test_shapes_it_does_not_take_and_the_switch_go_to_torch():
    x = _bf16(3, 48, seed=1)  # D = 48: not a multiple of 32
    w13, w2 = _experts(2, 48, 64, seed=2)
    assert not native_bf16.experts_apply(x, w13, w2) and kernel_name(x, w13, w2) == "torch"
    x, w = _bf16(3, 40, seed=3), _bf16(16, 40, seed=4)
    assert not native_bf16.linear_applies(x, w, None)
    torch.testing.assert_close(packed_linear.linear(x, w), F.linear(x, w))  # torch's, as before
    x, w = _bf16(3, 64, seed=3), _bf16(16, 64, seed=4)
    native_library.set_enabled(False)
    assert not native_bf16.linear_applies(x, w, None)
    assert torch.equal(packed_linear.linear(x, w), F.linear(x, w))


@needs_kernel
@pytest.mark.parametrize("heads,kv_heads", [(8, 2), (4, 4)])
def test_decode_attention_matches_float64_and_a_sequence_keeps_its_bits_in_any_batch(heads, kv_heads):
    from raymoe.kernels.attention import AttentionMetadata, AttentionSpec, SdpaAttention
    from raymoe.moe.model_config import AttentionKind

    block_size, head_dim = 16, 32
    spec = AttentionSpec(AttentionKind.GQA, heads, kv_heads, head_dim, head_dim, head_dim ** -0.5, None)
    caches = (_bf16(8, block_size, kv_heads, head_dim, seed=1), _bf16(8, block_size, kv_heads, head_dim, seed=2))
    q = _bf16(3, heads, head_dim, seed=3)
    backend = SdpaAttention(spec, torch.bfloat16, torch.device("cpu"))
    assert backend.single_decodes
    tables = [[3, 1, 6], [2, 5], [7]]
    lengths = [37, 20, 9]
    batch = backend.plan(AttentionMetadata.build([1, 1, 1], lengths, tables, block_size), block_size).attend(q, caches)
    assert batch.dtype == torch.bfloat16
    for index, (table, length) in enumerate(zip(tables, lengths)):
        alone = backend.plan(AttentionMetadata.build([1], [length], [table], block_size), block_size)
        assert torch.equal(alone.attend(q[index:index + 1], caches)[0], batch[index])  # the same bits alone
        slots = torch.tensor([table[p // block_size] * block_size + p % block_size for p in range(length)])
        keys = caches[0].flatten(0, 1)[slots].double().repeat_interleave(heads // kv_heads, dim=1)  # [Tk, H, d]
        values = caches[1].flatten(0, 1)[slots].double().repeat_interleave(heads // kv_heads, dim=1)
        scores = torch.einsum("hd,thd->ht", q[index].double(), keys) * spec.scale
        expected = torch.einsum("ht,thd->hd", scores.softmax(dim=-1), values)
        torch.testing.assert_close(batch[index].double(), expected, rtol=1.6e-2, atol=1e-2)
