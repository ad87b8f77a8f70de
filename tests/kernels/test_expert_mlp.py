"""grouped_swiglu against a per-row reference, over a table of shapes and dtypes.

Legend: A rows sorted by slot, S slots, D hidden, I expert intermediate.

Reference: row ``a`` in slot ``s`` gives ``w2[s] @ (silu(w13[s][:I] @ x) * (w13[s][I:] @ x))``,
computed one row at a time in float64.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

from raymoe.kernels.expert_mlp import grouped_swiglu

# (slot_counts, hidden, intermediate)
SHAPES = [
    ([0], 8, 4),  # one slot, no rows
    ([5], 8, 4),  # single slot
    ([0, 0, 0], 16, 8),  # no rows at all
    ([7, 0, 0, 0], 8, 6),  # all rows in the first slot
    ([0, 0, 0, 7], 8, 6),  # all rows in the last slot
    ([3, 0, 2, 0, 1], 16, 12),  # empty slots in between
    ([1, 1, 1, 1], 32, 16),
    ([0, 9, 4, 0], 24, 40),  # I > D
    ([13, 2, 31, 6, 1, 0, 8, 3], 64, 32),
]

TOLERANCES = {
    torch.float32: dict(rtol=1e-5, atol=1e-5),
    torch.bfloat16: dict(rtol=2e-2, atol=2e-2),
}


def reference(x: torch.Tensor, counts: list[int], w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    intermediate = w2.shape[2]
    slot_of_row = [s for s, n in enumerate(counts) for _ in range(n)]
    out = torch.zeros(x.shape, dtype=torch.float64)
    for a, s in enumerate(slot_of_row):
        xa, w13s, w2s = x[a].double(), w13[s].double(), w2[s].double()
        gate = w13s[:intermediate] @ xa
        up = w13s[intermediate:] @ xa
        out[a] = w2s @ (F.silu(gate) * up)
    return out


def make_inputs(counts: list[int], hidden: int, intermediate: int, dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    num_slots = len(counts)
    x = torch.randn(sum(counts), hidden, generator=gen)
    w13 = torch.randn(num_slots, 2 * intermediate, hidden, generator=gen) / hidden**0.5
    w2 = torch.randn(num_slots, hidden, intermediate, generator=gen) / intermediate**0.5
    return x.to(dtype), w13.to(dtype), w2.to(dtype)


@pytest.mark.parametrize("as_tensor", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("counts,hidden,intermediate", SHAPES)
def test_grouped_swiglu_matches_per_row_reference(counts, hidden, intermediate, dtype, as_tensor) -> None:
    x, w13, w2 = make_inputs(counts, hidden, intermediate, dtype, seed=len(counts) * 100 + hidden)
    slot_counts = torch.tensor(counts, dtype=torch.int64) if as_tensor else counts
    out = grouped_swiglu(x, slot_counts, w13, w2)
    assert out.shape == x.shape
    assert out.dtype == dtype
    # The reference sees the same (rounded) inputs, so only the kernel's arithmetic differs.
    expected = reference(x, counts, w13, w2).to(dtype)
    torch.testing.assert_close(out, expected, **TOLERANCES[dtype])


def test_rows_of_one_slot_do_not_see_other_slots() -> None:
    """Swapping two slots' weights and their row blocks permutes the output the same way."""
    counts = [3, 5]
    x, w13, w2 = make_inputs(counts, 8, 4, torch.float32, seed=1)
    out = grouped_swiglu(x, counts, w13, w2)
    swapped = grouped_swiglu(torch.cat([x[3:], x[:3]]), [5, 3], w13.flip(0), w2.flip(0))
    torch.testing.assert_close(swapped, torch.cat([out[3:], out[:3]]), rtol=1e-6, atol=1e-6)


def test_empty_slot_weights_are_never_read() -> None:
    counts = [2, 0, 3]
    x, w13, w2 = make_inputs(counts, 8, 4, torch.float32, seed=2)
    w13[1] = float("nan")
    w2[1] = float("nan")
    out = grouped_swiglu(x, counts, w13, w2)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, reference(x, counts, w13, w2).float(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "counts,num_rows,num_slots",
    [
        ([2, 2], 5, 2),  # counts sum to fewer rows than x has
        ([3, 3], 5, 2),  # ... or more
        ([0, 0], 1, 2),
        ([5], 5, 2),  # too few counts for the stacked experts
        ([2, 2, 1], 5, 2),  # too many
        ([], 0, 1),
    ],
)
def test_bad_inputs_raise(counts, num_rows, num_slots) -> None:
    x = torch.randn(num_rows, 8)
    w13 = torch.randn(num_slots, 8, 8)
    w2 = torch.randn(num_slots, 8, 4)
    with pytest.raises(ValueError):
        grouped_swiglu(x, counts, w13, w2)
    with pytest.raises(ValueError):
        grouped_swiglu(x, torch.tensor(counts, dtype=torch.int64), w13, w2)


def test_slot_rows_pick_experts_from_a_larger_pool() -> None:
    # A worker's pool holds more experts than slots while a migration stages new ones.
    torch.manual_seed(0)
    x, counts = torch.randn(9, 8), [4, 0, 5]
    pool_w13, pool_w2 = torch.randn(5, 12, 8), torch.randn(5, 8, 6)
    rows = [3, 0, 1]
    out = grouped_swiglu(x, counts, pool_w13, pool_w2, slot_rows=rows)
    expected = grouped_swiglu(x, counts, pool_w13[rows], pool_w2[rows])
    assert torch.allclose(out, expected, atol=1e-6)
    with pytest.raises(ValueError, match="outside"):
        grouped_swiglu(x, counts, pool_w13, pool_w2, slot_rows=[0, 1, 5])
    with pytest.raises(ValueError, match="slot counts for"):
        grouped_swiglu(x, counts, pool_w13, pool_w2, slot_rows=[0, 1])


# ---- which implementation runs, decided up front; a grouped-kernel failure is loud ------


@pytest.mark.parametrize("hidden, intermediate, rows, accepted", [
    (128, 64, 5, True), (8, 8, 1, True), (8, 4, 5, False), (12, 8, 5, False), (128, 64, 0, False)])
def test_grouped_mm_layout_rule(hidden, intermediate, rows, accepted) -> None:
    from raymoe.kernels.expert_mlp import _grouped_mm_layout_ok

    x = torch.zeros(rows, hidden, dtype=torch.bfloat16)
    w13 = torch.zeros(2, 2 * intermediate, hidden, dtype=torch.bfloat16)
    w2 = torch.zeros(2, hidden, intermediate, dtype=torch.bfloat16)
    assert _grouped_mm_layout_ok(x, w13, w2) is accepted
    assert not _grouped_mm_layout_ok(x, w13.transpose(1, 2).contiguous().transpose(1, 2), w2)  # strided weights


def test_a_grouped_mm_failure_raises_instead_of_falling_back(monkeypatch) -> None:
    """Where the grouped kernel is chosen, its failure reaches the caller (no warning and
    quiet loop): faked on the CPU by choosing it and making it fail."""
    import raymoe.kernels.expert_mlp as expert_mlp

    def failing(*args, **kwargs):
        raise RuntimeError("grouped_mm: simulated kernel failure")

    monkeypatch.setattr(expert_mlp, "_use_grouped_mm", lambda x, w13, w2: True)
    monkeypatch.setattr(expert_mlp, "_grouped_swiglu_cuda", failing)
    x, w13, w2 = make_inputs([3, 2], 8, 8, torch.float32, seed=4)
    with pytest.raises(RuntimeError, match="simulated kernel failure"):
        grouped_swiglu(x, [3, 2], w13, w2)
    # Not chosen (e.g. a slot-row mapping): the loop runs and the kernel is never called.
    out = grouped_swiglu(x, [3, 2], w13, w2, slot_rows=[1, 0])
    torch.testing.assert_close(out, reference(x, [3, 2], w13.flip(0), w2.flip(0)).float(), rtol=1e-5, atol=1e-5)


# ---- CUDA: the same contract on the GPU, and torch._grouped_mm against the loop ----------
# Skipped without CUDA (tests/conftest.py). On Hopper and later with bfloat16, grouped_swiglu
# takes torch._grouped_mm; elsewhere, and for layouts that kernel refuses, the loop.


def on_cuda(*tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t.to("cuda") for t in tensors]


def grouped_mm_available() -> bool:
    from raymoe.kernels.expert_mlp import _can_grouped_mm

    probe = torch.zeros(1, 8, dtype=torch.bfloat16, device="cuda")
    return _can_grouped_mm(probe, probe)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("counts,hidden,intermediate", SHAPES)
def test_cuda_matches_per_row_reference(counts, hidden, intermediate, dtype) -> None:
    x, w13, w2 = make_inputs(counts, hidden, intermediate, dtype, seed=len(counts) * 100 + hidden)
    out = grouped_swiglu(*on_cuda(x), counts, *on_cuda(w13, w2))
    assert out.device.type == "cuda" and out.shape == x.shape and out.dtype == dtype
    expected = reference(x, counts, w13, w2).to(dtype)
    torch.testing.assert_close(out.cpu(), expected, **TOLERANCES[dtype])


# Shapes the grouped kernel accepts (rows 16-byte aligned): empty slots first, between, last.
ALIGNED = [
    ([5, 0, 11, 3], 128, 64),
    ([0, 17, 1, 0, 30, 2, 0, 9], 256, 128),
    ([64, 64], 512, 1024),
]


@pytest.mark.gpu
@pytest.mark.parametrize("counts,hidden,intermediate", ALIGNED)
def test_grouped_mm_path_runs_and_matches_the_loop(counts, hidden, intermediate) -> None:
    from raymoe.kernels.expert_mlp import _grouped_swiglu_loop, _use_grouped_mm

    if not grouped_mm_available():
        pytest.skip("torch._grouped_mm path not used here (needs compute capability >= 9 and torch._grouped_mm)")
    x, w13, w2 = on_cuda(*make_inputs(counts, hidden, intermediate, torch.bfloat16, seed=hidden))
    assert _use_grouped_mm(x, w13, w2)  # chosen for these shapes; a kernel failure would raise here
    grouped = grouped_swiglu(x, counts, w13, w2)
    loop = _grouped_swiglu_loop(x, counts, w13, w2, list(range(len(counts))))
    torch.testing.assert_close(grouped, loop, rtol=2e-2, atol=2e-2)
    expected = reference(x.cpu(), counts, w13.cpu(), w2.cpu()).to(torch.bfloat16)
    torch.testing.assert_close(grouped.cpu(), expected, **TOLERANCES[torch.bfloat16])


@pytest.mark.gpu
def test_cuda_slot_rows_and_no_rows() -> None:
    torch.manual_seed(0)
    x = torch.randn(9, 64, dtype=torch.bfloat16, device="cuda")
    pool_w13 = torch.randn(5, 64, 64, dtype=torch.bfloat16, device="cuda") / 8
    pool_w2 = torch.randn(5, 64, 32, dtype=torch.bfloat16, device="cuda") / 8
    rows, counts = [3, 0, 1], [4, 0, 5]
    out = grouped_swiglu(x, counts, pool_w13, pool_w2, slot_rows=rows)
    expected = grouped_swiglu(x, counts, pool_w13[rows], pool_w2[rows])
    torch.testing.assert_close(out, expected, rtol=2e-2, atol=2e-2)
    empty = grouped_swiglu(x[:0], [0, 0, 0, 0, 0], pool_w13, pool_w2)
    assert empty.shape == (0, 64) and empty.device.type == "cuda"


def test_experts_on_a_second_thread_give_bitwise_the_same_rows():
    """cpu.worker_threads > 1 runs some experts on another thread: same GEMM calls, same bits
    (also under inference mode, which is per thread)."""
    from concurrent.futures import ThreadPoolExecutor

    generator = torch.Generator().manual_seed(3)
    w13, w2 = torch.randn(6, 32, 8, generator=generator), torch.randn(6, 8, 16, generator=generator)
    with ThreadPoolExecutor(1) as executor, torch.inference_mode():
        for counts in ([4] * 6, [1, 0, 3, 5, 0, 2], [0, 0, 0, 0, 0, 3], [9, 1, 0, 0, 0, 0]):
            x = torch.randn(sum(counts), 8, generator=generator)
            alone = grouped_swiglu(x, counts, w13, w2)
            threaded = grouped_swiglu(x, counts, w13, w2, executor=executor)
            assert torch.equal(alone, threaded), counts
            expected = torch.cat([F.silu(x[s:s + c] @ w13[e, :16].T) * (x[s:s + c] @ w13[e, 16:].T) @ w2[e].T
                                  for e, (s, c) in enumerate(zip([0, *itertools.accumulate(counts)], counts)) if c])
            assert torch.allclose(threaded, expected, atol=1e-4)
