"""oneDNN-prepacked weights for CPU float32 linears at decode sizes (experts and dense layers).

At decode sizes an expert sees a handful of rows (``M`` = 1-32), and torch's default CPU
GEMM (MKL's sgemm) runs those shapes far below what the core can do: on the 2-core EPYC of
docs/BENCHMARKS.md, 32 expert GEMMs of 8 rows x [1024, 256] take 3.9 ms (8.7 GB/s of weights,
34 GFLOP/s) while a plain read of the same bytes runs at ~44 GB/s. oneDNN's linear over a
weight reordered once into its blocked layout (what torch's own CPU compiler uses) takes
1.75 ms for the same work (benchmarks/bench_cpu_floor.py). It is also row-invariant: a row's
output does not depend on how many other rows share the call (checked for M = 1..300 at the
bench shapes, and in tests/kernels/test_packed_linear.py), where sgemm's is not, so how a
placement batches rows on a worker cannot change a bit of the result.

Where raymoe's native CPU kernels run (AVX-512F and a C compiler, kernels/native_cpu.py), they
take the experts and the dense layers first, with layouts of their own kept in the same cache
(kernels/weight_cache.py); this path is what runs elsewhere, or with them turned off.

The packed copy costs the weights' size once more in memory (float32 on CPUs only;
`cpu.packed_experts: false` turns it off for expert workers; the dense layers of a router or
the in-process engine use it whenever it applies). Copies are made lazily per stacked expert,
cached by the stack tensor's identity, and made again when the stack is written in place
(a migration staging an expert bumps the tensor's version counter); an entry goes when its
stack does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from raymoe.kernels import native_bf16, native_cpu, weight_cache

PACK_ROWS_HINT = 16  # the batch size oneDNN's layout is chosen for (decode sizes)
# A dense layer's weight is packed from this size on. Below it oneDNN's fixed cost per call
# (~15 us) loses to sgemm on weights that stay in cache between steps (the bench model's
# [512, 256] layers: 22 vs 9 us at one row); a real model's layers and LM heads are far
# larger ([32000, 256]: 0.72 vs 2.17 ms at one row). Experts are always packed: a worker's
# experts do not stay in cache from one step to the next.
DENSE_MIN_BYTES = 4 << 20


def set_enabled(enabled: bool) -> None:
    """Use packed weights where they apply (the default), or torch's default GEMM everywhere
    (the native kernels' layouts too: kernels/weight_cache.py)."""
    weight_cache.set_enabled(enabled)


def available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def applies(x: torch.Tensor, stack: torch.Tensor) -> bool:
    """Whether ``linear_row(x, stack, row)`` takes the packed path."""
    return (weight_cache.enabled() and x.numel() > 0 and x.device.type == "cpu" and x.dtype == torch.float32 and stack.dtype == torch.float32
            and stack.device.type == "cpu" and not x.requires_grad and not stack.requires_grad and _AVAILABLE)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for a ``[out, in]`` weight (a dense layer's): bfloat16 by raymoe's
    native kernel over the weight as it lies (kernels/native_bf16.py); float32 packed once, by
    raymoe's native kernel where it runs (kernels/native_cpu.py, any size), else by oneDNN from
    ``DENSE_MIN_BYTES`` on; else torch's default GEMM."""
    if native_bf16.linear_applies(x, weight, bias):
        return native_bf16.linear(x, weight, bias)
    if native_cpu.linear_applies(x, weight, bias):
        return native_cpu.linear(x, weight, bias)
    if (not applies(x, weight) or (bias is not None and bias.dtype != torch.float32)
            or weight.numel() * weight.element_size() < DENSE_MIN_BYTES):
        return F.linear(x, weight, bias)
    shape = x.shape
    out = _LINEAR(x.reshape(-1, shape[-1]).contiguous(), _packed_row(weight, None), bias, "none", [], "")
    return out.reshape(*shape[:-1], weight.shape[0])


def logits(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``F.linear(x, weight).float()``, the LM head: in bfloat16 the native kernel writes float32
    logits straight from its float32 sums (no rounding to bfloat16 first)."""
    if native_bf16.linear_applies(x, weight, None):
        return native_bf16.linear(x, weight, out_dtype=torch.float32)
    return linear(x, weight).float()


def linear_row(x: torch.Tensor, stack: torch.Tensor, row: int) -> torch.Tensor:
    """``x @ stack[row].T`` (``x: [n, in]``, ``stack: [Sp, out, in]``) -> ``[n, out]``."""
    if not applies(x, stack):
        return F.linear(x, stack[row])
    return _LINEAR(x.contiguous(), _packed_row(stack, row), None, "none", [], "")


class PackedStack:
    """The packed rows of one stack, looked up once for a batch of calls (a layer's experts):
    ``stack.linear(x, row)`` is :func:`linear_row` without its per-call checks. Valid while
    the stack is not written (a migration writes between steps, never during a layer)."""

    __slots__ = ("stack", "rows")

    def __init__(self, stack: torch.Tensor):
        self.stack = stack
        self.rows = weight_cache.cached_rows(stack)

    def linear(self, x: torch.Tensor, row: int) -> torch.Tensor:
        """``x @ stack[row].T`` for a contiguous CPU float32 ``x`` (``applies`` checked by the caller)."""
        packed = self.rows.get(row)
        if packed is None:
            packed = _packed_row(self.stack, row)
        return _LINEAR(x, packed, None, "none", [], "")


def _packed_row(stack: torch.Tensor, row: int | None) -> torch.Tensor:
    """The packed copy of ``stack[row]`` (``row`` None: ``stack`` is the weight itself)."""
    rows = weight_cache.cached_rows(stack)
    packed = rows.get(row)
    if packed is None:
        weight = stack if row is None else stack[row]
        packed = rows[row] = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), PACK_ROWS_HINT)
    return packed


_AVAILABLE = available()
_LINEAR = torch.ops.mkldnn._linear_pointwise.default if _AVAILABLE else None  # the overload: no per-call resolution
