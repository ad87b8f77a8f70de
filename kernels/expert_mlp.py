"""Grouped SwiGLU expert MLP over rows sorted by expert slot.

Legend: A rows (assignments) sorted by slot, S local slots, D hidden, I expert intermediate,
Sx stacked experts (a worker's pool rows), Aj the rows of one job (one slot's block).

``y[a] = down_s( silu(gate_s(x[a])) * up_s(x[a]) )`` for the slot ``s`` that row ``a``
belongs to. Weights are stacked per slot: ``w13: [S, 2I, D]`` (gate rows, then up rows)
and ``w2: [S, D, I]``, in the checkpoint's ``[out, in]`` layout, so every matmul reads the
weights without a copy.

Three implementations behind one function:
- on a float32 CPU with AVX-512F and a C compiler, raymoe's native kernel: every slot's rows
  in one call, gate/up/SiLU/down fused over weights packed once (kernels/native_cpu.py); in
  bfloat16 with AVX512_BF16 its bfloat16 twin, over the weights as they lie (kernels/native_bf16.py);
- a loop over non-empty slots with one fused gate/up GEMM and one down GEMM each (CPU,
  and any device; on the CPU in float32 over oneDNN-prepacked weights,
  kernels/packed_linear.py);
- ``torch._grouped_mm`` (one kernel for all slots) where torch offers it on CUDA with
  bfloat16 weights and the layout it accepts (every row 16-byte aligned: D and I multiples
  of 8). Which one runs is decided up front from dtype, device and shapes; a failure of
  ``torch._grouped_mm`` on a layout chosen for it is a bug and raises, never a silent
  fall back to the (slower) loop. ``torch._grouped_mm`` needs torch 2.8 and an sm90 GPU
  (H100/H200): a bfloat16 CUDA run without them takes the loop, and the log says so once per
  process, with the reason (:func:`grouped_mm_unavailable`).
"""

from __future__ import annotations

import logging
from concurrent.futures import Executor

import torch
import torch.nn.functional as F

from raymoe.kernels import native_bf16, native_cpu, packed_linear

LOG = logging.getLogger("raymoe.kernels")
_fallback_logged = False


def kernel_name(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> str:
    """Which kernel runs these experts (``x: [A, D]`` rows like theirs): ``native-avx512``,
    ``native-avx512-bf16``, ``onednn`` or ``torch`` (a worker's ``info()["expert_kernel"]``)."""
    if native_bf16.experts_apply(x, w13, w2):
        return native_bf16.KERNEL
    if native_cpu.experts_apply(x, w13, w2):
        return native_cpu.KERNEL
    return "onednn" if packed_linear.applies(x, w13) and packed_linear.applies(x, w2) else "torch"


def grouped_swiglu(
    x: torch.Tensor,
    slot_counts: torch.Tensor | list[int],
    w13: torch.Tensor,
    w2: torch.Tensor,
    slot_rows: list[int] | None = None,
    executor: Executor | None = None,
) -> torch.Tensor:
    """Run each slot's expert over its contiguous block of rows.

    Args:
        x: ``[A, D]`` rows sorted by slot.
        slot_counts: ``[S]`` rows per slot (sums to A).
        w13: ``[Sx, 2I, D]``; w2: ``[Sx, D, I]``: stacked experts (Sx = S without ``slot_rows``).
        slot_rows: ``[S]`` which stacked expert serves each slot (a worker's weight pool is
            larger than its slots while a migration stages new experts).
        executor: on the CPU, threads that run some of the experts meanwhile (see
            :func:`_grouped_swiglu_loop`); every expert's GEMMs stay the same calls, so the
            result is bitwise the same with or without it.
    Returns:
        ``[A, D]`` in the same row order as ``x``.
    """
    counts = slot_counts.tolist() if isinstance(slot_counts, torch.Tensor) else list(slot_counts)
    stacked = w13.shape[0]
    identity = slot_rows is None or slot_rows == list(range(stacked))
    if slot_rows is None:
        slot_rows = range(stacked)
    if len(counts) != len(slot_rows):
        raise ValueError(f"{len(counts)} slot counts for {len(slot_rows)} slots")
    if not identity and slot_rows and (min(slot_rows) < 0 or max(slot_rows) >= stacked):
        raise ValueError(f"slot rows {slot_rows} fall outside the {stacked} stacked experts")
    if sum(counts) != x.shape[0]:
        raise ValueError(f"slot counts sum to {sum(counts)} but x has {x.shape[0]} rows")
    if identity and _use_grouped_mm(x, w13, w2):
        return _grouped_swiglu_cuda(x, counts, w13, w2)  # errors propagate: see the module doc
    return _grouped_swiglu_loop(x, counts, w13, w2, slot_rows, executor)


def _grouped_swiglu_loop(
    x: torch.Tensor, counts: list[int], w13: torch.Tensor, w2: torch.Tensor, slot_rows: list[int],
    executor: Executor | None = None,
) -> torch.Tensor:
    """One fused gate/up GEMM and one down GEMM per non-empty slot, each written in place.

    With an ``executor`` the slots are split in two runs of about equal rows, one run on the
    executor's thread while this thread does the other. At decode sizes an expert's GEMMs
    are small-row work that torch runs on one thread however many it has, so two threads on
    different experts are what uses a second core (measured on 2 CPU cores, 8 experts, sgemm:
    1 row each 3.7 -> 2.1 ms per 4 layers).
    """
    x = x.contiguous()
    out = torch.empty_like(x)
    jobs, start = [], 0
    for slot, count in enumerate(counts):
        if count:
            jobs.append((slot_rows[slot], start, start + count))
            start += count

    # Autograd and inference modes are per thread: the executor's thread runs in the caller's.
    inference, grad = torch.is_inference_mode_enabled(), torch.is_grad_enabled()

    def run(part: list[tuple[int, int, int]]) -> None:
        with torch.inference_mode(inference), torch.set_grad_enabled(grad):
            run_jobs(part)

    if native_cpu.experts_apply(x, w13, w2):  # CPU float32 on AVX-512F: the whole layer in one native call
        def run_jobs(part: list[tuple[int, int, int]]) -> None:
            native_cpu.swiglu_jobs(x, out, w13, w2, part)
    elif native_bf16.experts_apply(x, w13, w2):  # CPU bfloat16 on AVX512_BF16: likewise, over the weights as they lie
        def run_jobs(part: list[tuple[int, int, int]]) -> None:
            native_bf16.swiglu_jobs(x, out, w13, w2, part)
    else:
        run_jobs = _torch_jobs(x, out, w13, w2)
    if executor is None or len(jobs) < 2:
        run_jobs(jobs)  # on this thread, in its own modes
        return out
    split = 1  # the first job whose rows start past half of them (at least one job per side)
    while split < len(jobs) - 1 and jobs[split][1] < start // 2:
        split += 1
    other = executor.submit(run, jobs[split:])
    try:
        run(jobs[:split])
    finally:
        other.result()  # its error, if any, is this call's; and `out` is complete only now
    return out


def _torch_jobs(x: torch.Tensor, out: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor):
    """The per-expert loop in torch: one fused gate/up GEMM and one down GEMM per job."""
    intermediate = w2.shape[2]
    # CPU float32: oneDNN over prepacked weights, each stack's packed rows looked up once per call
    packed = packed_linear.applies(x, w13) and packed_linear.applies(x, w2)
    packed13 = packed_linear.PackedStack(w13) if packed else None
    packed2 = packed_linear.PackedStack(w2) if packed else None

    def run_jobs(part: list[tuple[int, int, int]]) -> None:
        for row, begin, end in part:
            if packed:
                gate_up = packed13.linear(x[begin:end], row)  # [Aj, 2I]
                hidden = F.silu(gate_up[:, :intermediate], inplace=True).mul_(gate_up[:, intermediate:])  # [Aj, I]
                out[begin:end] = packed2.linear(hidden.contiguous(), row)  # [Aj, D]
            else:
                gate_up = F.linear(x[begin:end], w13[row])
                hidden = F.silu(gate_up[:, :intermediate], inplace=True).mul_(gate_up[:, intermediate:])
                torch.mm(hidden, w2[row].t(), out=out[begin:end])  # [Aj, D], written in place

    return run_jobs


def _use_grouped_mm(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> bool:
    """Whether this call takes ``torch._grouped_mm``: a CUDA device that has it, bfloat16,
    and a layout it accepts."""
    return x.is_cuda and _can_grouped_mm(x, w13) and _grouped_mm_layout_ok(x, w13, w2)


def _can_grouped_mm(x: torch.Tensor, w13: torch.Tensor) -> bool:
    if x.dtype != torch.bfloat16 or w13.dtype != torch.bfloat16:
        return False
    reason = grouped_mm_unavailable(torch.__version__, hasattr(torch, "_grouped_mm"),
                                    torch.cuda.get_device_capability(x.device))
    if reason is not None:
        _log_fallback_once(reason)
    return reason is None


def grouped_mm_unavailable(torch_version: str, has_grouped_mm: bool, capability: tuple[int, int]) -> str | None:
    """Why bfloat16 experts on this CUDA device cannot take ``torch._grouped_mm``, or None."""
    if not has_grouped_mm:
        return f"torch {torch_version} has no torch._grouped_mm (torch 2.8 or later has it)"
    if capability[0] < 9:
        return (f"this GPU is sm{capability[0]}{capability[1]}; torch._grouped_mm needs sm90 (H100/H200) "
                f"or later")
    return None


def _log_fallback_once(reason: str) -> None:
    global _fallback_logged
    if not _fallback_logged:
        _fallback_logged = True
        LOG.warning("bfloat16 experts run one GEMM pair per slot, not torch._grouped_mm: %s", reason)


def _grouped_mm_layout_ok(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> bool:
    """``torch._grouped_mm`` needs every operand's rows 16-byte aligned (D and I multiples of 8
    in bfloat16), contiguous weights, and at least one row."""
    hidden, intermediate = x.shape[1], w2.shape[2]
    return (x.shape[0] > 0 and hidden % 8 == 0 and intermediate % 8 == 0 and x.is_contiguous()
            and w13.is_contiguous() and w2.is_contiguous())


def _grouped_swiglu_cuda(x: torch.Tensor, counts: list[int], w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    # One grouped GEMM per projection: offsets are the cumulative row counts (int32).
    # (built on the host, pinned, copied without blocking: no host sync before the GEMMs)
    offsets = torch.tensor(counts, dtype=torch.int32).pin_memory().to(x.device, non_blocking=True).cumsum(
        0, dtype=torch.int32)
    intermediate = w2.shape[2]
    gate_up = torch._grouped_mm(x, w13.transpose(1, 2), offs=offsets)  # [A, 2I]
    hidden = F.silu(gate_up[:, :intermediate]) * gate_up[:, intermediate:]
    return torch._grouped_mm(hidden.contiguous(), w2.transpose(1, 2), offs=offsets)  # [A, D]

