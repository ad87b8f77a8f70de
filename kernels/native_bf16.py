"""raymoe's native CPU kernels in bfloat16 (kernels/csrc/cpu_bf16.c, AVX512_BF16), the compute wrappers.

Legend (docs/ARCHITECTURE.md's letters): Sp stacked experts, D hidden, I expert intermediate, No/Ni
a dense layer's out/in sizes, A rows sorted by slot.

Why: a bfloat16 checkpoint is how models are served, and torch's CPU kernels run its decode shapes
far below the machine: ``F.linear`` in bfloat16 streamed a [151936, 2048] LM head at 11.7 GB/s
(53 ms a token) and a [1536, 2048] expert at 15 GB/s; oneDNN's packed bfloat16 linear runs
faster but needs a packed copy of every weight beside the checkpoint's (twice the memory). These
kernels read each weight where it lies, in the checkpoint's ``[out, in]`` layout: no copy, no
packing, each weight held once. Every output is a dot product of two bfloat16 rows taken by
VDPBF16PS (exact products, float32 sums in a fixed order), rounded once to bfloat16, so a row's
result never depends on which rows share its call (the row-invariance kernels/native_cpu.py's
float32 kernels keep, and placement-independence needs). benchmarks/bench_bf16_kernels.py
measures them against torch's and oneDNN's at the real models' shapes.

- :func:`linear`: a dense layer (attention projections, the LM head with float32 logits); a layer
  of ``SPLIT_MIN_BYTES`` or more (a real model's projections and LM head) has its outputs split over :func:`split_threads`
  threads, one per core this process may use, up to ``MAX_SPLIT``: on a CPU router the expert
  workers idle while it runs, and one core alone does not saturate the memory bus (the threads
  are not pinned even where the caller is: actors/cpu_affinity.py).
- :func:`swiglu_jobs`: a layer's experts in one call (kernels/expert_mlp.py), gate, up, SiLU and
  down per expert over its rows, in chunks of ``CHUNK_ROWS``.
- :func:`decode_attention`: kernels/native_cpu.py's decode attention over bfloat16 queries and
  caches (the same float32 arithmetic: kernels/csrc/decode_attention.inc), each sequence on its
  own, so a sequence's bits do not depend on the step's other decodes (torch's padded SDPA's do).

Where the library or AVX512_BF16 is unavailable (kernels/native_library.py::bf16_unavailable_reason,
logged once), or a shape is not taken (K not a multiple of 32), torch's kernels run.
"""

from __future__ import annotations

import array
import logging
import os
from concurrent.futures import ThreadPoolExecutor

import torch

from raymoe.kernels.native_library import CHUNK_ROWS, STATE, bf16_unavailable_reason
from raymoe.kernels.native_library import check as _check

LOG = logging.getLogger("raymoe.kernels")
KERNEL = "native-bf16"  # kernel_name's family; which instructions run it: :func:`instructions`
# A dense layer is split over threads from this size on: the LM heads and, since a router's
# workers wait while it runs its dense layers, the attention projections of real models too.
# Measured on the 2-vCPU EPYC (benchmarks/bench_bf16_kernels.py --split, weights cold): 16-50 MB
# layers 1.20-1.51x faster over 2 threads at 1 row and 1.02-1.87x at 16; a 2 MB one 0.80-0.93x
# (the hand-off costs more than the second core saves). RAYMOE_BF16_SPLIT_MIN_MB overrides it.
SPLIT_MIN_BYTES = int(float(os.environ.get("RAYMOE_BF16_SPLIT_MIN_MB", "8")) * (1 << 20))
MAX_SPLIT = 4
_pool: ThreadPoolExecutor | None = None
_pool_threads = 0
_chosen: tuple | None = None  # (linear, swiglu, instructions), chosen once per process


def _kernels() -> tuple:
    """AMX's kernels where the CPU has AMX-BF16 and Linux grants this process the tiles, else the
    AVX512_BF16 dot-product kernels (logged once: far slower at many rows, e.g. a prefill)."""
    global _chosen
    if _chosen is None:
        library = STATE.library
        if os.environ.get("RAYMOE_AMX", "1").lower() not in ("0", "false", "no", "off") \
                and library.raymoe_amx_supported():
            _chosen = (library.raymoe_amx_linear, library.raymoe_amx_swiglu_experts, "amx")
        else:
            _chosen = (library.raymoe_bf16_linear, library.raymoe_bf16_swiglu_experts, "avx512-bf16")
            LOG.warning("bfloat16 kernels without AMX (no AMX-BF16 here, or RAYMOE_AMX=0): AVX512_BF16 dot "
                        "products, as fast at decode sizes, several times slower at prefill sizes")
    return _chosen


def instructions() -> str:
    """``amx`` or ``avx512-bf16``: which of the bfloat16 kernels this process runs (:func:`bf16_unavailable_reason`
    checked first). Outputs of the two differ in the last bits (their sums run in different orders):
    one machine always takes the same, so placement never changes an output on it."""
    return _kernels()[2]


def _takes(*tensors: torch.Tensor) -> bool:
    return STATE.enabled and all(t.device.type == "cpu" and t.dtype == torch.bfloat16 and not t.requires_grad
                                 for t in tensors)


def linear_applies(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether :func:`linear` takes it: bfloat16 on the CPU, a contiguous ``[No, Ni]`` weight with Ni
    a multiple of 32, and AVX512_BF16."""
    return (_takes(x, weight) and x.numel() > 0 and weight.dim() == 2 and weight.shape[1] % 32 == 0
            and weight.is_contiguous() and x.shape[-1] == weight.shape[1]
            and (bias is None or _takes(bias)) and bf16_unavailable_reason() is None)


def split_threads() -> int:
    """Threads a layer of ``SPLIT_MIN_BYTES`` or more is split over: the cores this process may use
    (its main thread's affinity, not a pinned caller's), at most ``MAX_SPLIT``."""
    if not hasattr(os, "sched_getaffinity"):
        return 1
    return max(1, min(MAX_SPLIT, len(os.sched_getaffinity(os.getpid()))))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
           out_dtype: torch.dtype = torch.bfloat16, threads: int | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` (:func:`linear_applies` checked) in ``out_dtype`` (bfloat16, or
    float32 for logits). Its outputs are split over ``threads`` threads; by default
    :func:`split_threads` for a weight of ``SPLIT_MIN_BYTES`` or more, else one: the same bits
    either way, each output is computed alike."""
    if out_dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"out_dtype must be float32 or bfloat16, not {out_dtype}")
    shape = x.shape
    flat = x.reshape(-1, shape[-1]).contiguous()
    rows, features = flat.shape[0], weight.shape[0]
    out = torch.empty(rows, features, dtype=out_dtype)
    bias = bias.contiguous() if bias is not None else None
    f32 = 1 if out_dtype == torch.float32 else 0

    def run(first: int, end: int) -> None:
        _check(_kernels()[0](
            flat.data_ptr(), flat.shape[1], out.data_ptr(), features, f32, weight.data_ptr(),
            bias.data_ptr() if bias is not None else None, rows, flat.shape[1], first, end), "raymoe_bf16_linear")

    if threads is None:
        threads = split_threads() if weight.numel() * 2 >= SPLIT_MIN_BYTES else 1
    if threads > 1:
        bounds = [features * part // threads // 16 * 16 for part in range(threads)] + [features]
        pool = _executor(threads - 1)
        others = [pool.submit(run, bounds[part], bounds[part + 1]) for part in range(1, threads)]
        try:
            run(bounds[0], bounds[1])
        finally:
            for other in others:
                other.result()
    else:
        run(0, features)
    return out.view(*shape[:-1], features)


def _executor(workers: int) -> ThreadPoolExecutor:
    """The process's threads for split layers (made once; ctypes releases the GIL in the call), free to
    run on every core the process may use even when the thread that made them is pinned to one."""
    global _pool, _pool_threads
    if _pool is None or _pool_threads < workers:
        _pool, _pool_threads = ThreadPoolExecutor(workers, thread_name_prefix="raymoe-bf16",
                                                  initializer=_unpin), workers
    return _pool


def _unpin() -> None:
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, os.sched_getaffinity(os.getpid()))


def experts_fit(hidden_size: int, intermediate_size: int) -> bool:
    """Whether the experts kernels take these sizes: D and I multiples of 32."""
    return hidden_size % 32 == 0 and intermediate_size % 32 == 0


def experts_apply(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> bool:
    """Whether :func:`swiglu_jobs` takes these rows and stacks (``[Sp, 2I, D]``, ``[Sp, D, I]``):
    bfloat16 on the CPU, contiguous stacks, sizes :func:`experts_fit` takes, AVX512_BF16."""
    if not (_takes(x, w13, w2) and x.numel() > 0 and w13.is_contiguous() and w2.is_contiguous()):
        return False
    hidden, intermediate = w13.shape[2], w2.shape[2]
    if not experts_fit(hidden, intermediate) or w13.shape[1] != 2 * intermediate or w2.shape[1] != hidden:
        return False
    return bf16_unavailable_reason() is None


def swiglu_jobs(x: torch.Tensor, out: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                jobs: list[tuple[int, int, int]]) -> None:
    """``out[b:e] = swiglu_r(x[b:e])`` for each job ``(r, b, e)`` (:func:`experts_apply` checked by the
    caller; ``x`` and ``out`` contiguous bfloat16 ``[A, D]``). Releases the GIL while it runs."""
    if not jobs:
        return
    flat = array.array("q", [value for job in jobs for value in job])
    scratch = torch.empty(CHUNK_ROWS, w2.shape[2], dtype=torch.bfloat16)
    _check(_kernels()[1](x.data_ptr(), out.data_ptr(), w13.data_ptr(), w2.data_ptr(),
                                                     flat.buffer_info()[0], len(jobs), w13.shape[2], w2.shape[2],
                                                     scratch.data_ptr()), "raymoe_bf16_swiglu_experts")


def attention_applies(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor) -> bool:
    """Whether :func:`decode_attention` takes these: bfloat16 on the CPU, contiguous caches, key and
    value sizes multiples of 16, AVX512_BF16."""
    return (_takes(q, key_cache, value_cache) and key_cache.is_contiguous() and value_cache.is_contiguous()
            and q.shape[-1] % 16 == 0 and value_cache.shape[-1] % 16 == 0 and bf16_unavailable_reason() is None)


def decode_attention(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, rows: torch.Tensor,
                     slots: torch.Tensor, counts: torch.Tensor, scale: float, out: torch.Tensor) -> None:
    """kernels/native_cpu.py::decode_attention in bfloat16 (:func:`attention_applies` checked)."""
    q = q.contiguous()
    heads, kv_heads = q.shape[1], key_cache.shape[-2]
    _check(STATE.library.raymoe_bf16_decode_attention(
        q.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(), rows.data_ptr(), slots.data_ptr(),
        counts.data_ptr(), out.data_ptr(), rows.shape[0], heads, kv_heads, q.shape[-1], value_cache.shape[-1],
        slots.shape[1], scale), "raymoe_bf16_decode_attention")
