"""A layer's SwiGLU experts in one native call: CPU float32 on AVX-512F (kernels/csrc/swiglu_experts.c).

Legend: R stacked experts, D hidden, I expert intermediate, A rows (assignments) sorted by expert.

Why: at decode sizes a worker's experts are 1-16 rows each over weights that come from DRAM
every step. oneDNN's linear over prepacked weights (kernels/packed_linear.py) pays ~15 us a
call and streams them at ~15 GB/s at 8 rows; with a SwiGLU in eager torch between the two GEMMs
an expert costs ~5 calls from Python. This kernel runs every job of a layer (expert, first row,
end row) in one call, streams each expert's weights once per 32 rows with software prefetch
and fuses gate, up, SiLU and down: on the 2-vCPU EPYC of docs/BENCHMARKS.md, 32 experts x 8
rows (one decode step at 32 sequences of the bench model) 1.1-1.3 ms against oneDNN's 3.3 ms,
and at one row 1.0-1.2 against 2.3-3.0 (benchmarks/bench_cpu_floor.py (6)).

Contracts:
- **Row-invariant**, like oneDNN's packed path: every output element is one chain of fused
  multiply-adds over k from zero in a fixed order, so a row's result does not depend on how
  many rows share its call (placement, replicas and batching cannot change a bit).
- **One kernel per machine.** Its results differ from oneDNN's in the last bits; the
  in-process engine and the workers of one machine all take it where it applies, and
  :func:`kernel_name` says which ran (a worker's ``info()["expert_kernel"]``). A cluster whose
  nodes differ (one without AVX-512F, or without a C compiler) mixes kernels, as it mixed
  oneDNN's ISA-specific ones before.

Built once per source and compiler with the machine's C compiler (``$CC``, else ``cc``) into
``$RAYMOE_NATIVE_DIR`` (default ``~/.cache/raymoe/native``), a few tenths of a second; where
there is no compiler, the CPU lacks AVX-512F, the shapes do not fit (D a multiple of 32, I of
16) or ``RAYMOE_NATIVE_EXPERTS=0`` is set, experts run on oneDNN as before, and the reason is
logged once.
"""

from __future__ import annotations

import array
import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading

import torch

from raymoe.kernels import packed_linear

LOG = logging.getLogger("raymoe.kernels")

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc", "swiglu_experts.c")
CFLAGS = ["-O3", "-ffp-contract=off", "-fPIC", "-shared"]  # no contraction: only the source's own FMAs
CHUNK_ROWS = 32  # as in the source: rows per pass, the scratch's height
KERNEL = "native-avx512"

_lock = threading.Lock()
_library: ctypes.CDLL | None = None
_reason: str | None = None  # why the kernel is unavailable (None: not tried yet, or available)
_tried = False
_enabled = os.environ.get("RAYMOE_NATIVE_EXPERTS", "1") not in ("0", "false", "no", "off")


def set_enabled(enabled: bool) -> None:
    """Take the native kernel where it applies (the default), or oneDNN's packed path always."""
    global _enabled
    _enabled = bool(enabled)


def unavailable_reason() -> str | None:
    """None when the kernel is built, loaded and runs on this CPU; else why not (built on first call)."""
    global _library, _reason, _tried
    if not _enabled:
        return "turned off (RAYMOE_NATIVE_EXPERTS=0 or set_enabled(False))"
    if _tried:
        return _reason
    with _lock:
        if not _tried:
            try:
                library = ctypes.CDLL(_build())
                if not library.raymoe_swiglu_supported():
                    raise OSError("this CPU has no AVX-512F")
                function = library.raymoe_swiglu_experts
                function.restype = ctypes.c_int
                function.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 3 + [ctypes.c_void_p]
                _library = library
            except (OSError, subprocess.SubprocessError) as error:
                _reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
                LOG.warning("native expert kernel unavailable (%s): experts run on oneDNN", _reason)
            _tried = True
    return _reason


def applies(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> bool:
    """Whether :func:`swiglu_jobs` takes these rows and stacks (``[R, 2I, D]``, ``[R, D, I]``)."""
    if not (_enabled and packed_linear.applies(x, w13) and packed_linear.applies(x, w2)):
        return False
    hidden, intermediate = w13.shape[2], w2.shape[2]
    if hidden % 32 or intermediate % 16 or w13.shape[1] != 2 * intermediate or w2.shape[1] != hidden:
        return False
    return unavailable_reason() is None


def kernel_name(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> str:
    """Which kernel runs these experts: ``native-avx512``, ``onednn`` or ``torch``."""
    if applies(x, w13, w2):
        return KERNEL
    return "onednn" if packed_linear.applies(x, w13) and packed_linear.applies(x, w2) else "torch"


def swiglu_jobs(x: torch.Tensor, out: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                jobs: list[tuple[int, int, int]]) -> None:
    """``out[b:e] = swiglu_r(x[b:e])`` for each job ``(r, b, e)`` (``applies`` checked by the caller;
    ``x`` and ``out`` contiguous ``[A, D]``). Releases the GIL while it runs."""
    if not jobs:
        return
    packed13, packed2 = _packed(w13, w2)
    flat = array.array("q", [value for job in jobs for value in job])
    scratch = torch.empty(CHUNK_ROWS, w2.shape[2], dtype=torch.float32)
    status = _library.raymoe_swiglu_experts(x.data_ptr(), out.data_ptr(), packed13.data_ptr(), packed2.data_ptr(),
                                            flat.buffer_info()[0], len(jobs), w13.shape[2], w2.shape[2],
                                            scratch.data_ptr())
    if status != 0:
        raise ValueError(f"native SwiGLU kernel refused D={w13.shape[2]}, I={w2.shape[2]} (applies() said yes)")


def _packed(w13: torch.Tensor, w2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's layouts of both stacks, made once per stack version (packed_linear's cache):
    w13 ``[R, I/16, D, 2, 16]`` (gate and up columns of a panel side by side, k-major) and
    w2 ``[R, D/32, I, 32]``."""
    rows13, rows2 = packed_linear.cached_rows(w13), packed_linear.cached_rows(w2)
    packed13, packed2 = rows13.get(KERNEL), rows2.get(KERNEL)
    if packed13 is None:
        stacked, hidden = w13.shape[0], w13.shape[2]
        gate, up = w13.reshape(stacked, 2, -1, 16, hidden).unbind(1)  # [R, I/16, 16, D] each
        packed13 = rows13[KERNEL] = torch.stack([gate.transpose(2, 3), up.transpose(2, 3)], dim=3).contiguous()
    if packed2 is None:
        stacked, hidden, intermediate = w2.shape
        packed2 = rows2[KERNEL] = w2.reshape(stacked, hidden // 32, 32, intermediate).transpose(2, 3).contiguous()
    return packed13, packed2


def _build() -> str:
    """Path of the shared library for this source and compiler, compiled if not there yet."""
    compiler = os.environ.get("CC") or "cc"
    if shutil.which(compiler) is None:
        raise OSError(f"no C compiler ({compiler!r} not found; set CC)")
    with open(SOURCE, "rb") as handle:
        source = handle.read()
    version = subprocess.run([compiler, "--version"], capture_output=True, timeout=30).stdout
    digest = hashlib.sha256(source + version + " ".join(CFLAGS).encode()).hexdigest()[:16]
    directory = os.environ.get("RAYMOE_NATIVE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "raymoe", "native")
    path = os.path.join(directory, f"swiglu_experts-{digest}.so")
    if os.path.exists(path):
        return path
    os.makedirs(directory, exist_ok=True)
    handle, partial = tempfile.mkstemp(prefix=".swiglu_experts-", suffix=".so", dir=directory)
    os.close(handle)
    try:  # built under a name of its own, then renamed: processes building at once never see half a file
        result = subprocess.run([compiler, *CFLAGS, "-o", partial, SOURCE], capture_output=True, timeout=120)
        if result.returncode != 0:
            raise OSError(f"{compiler} failed on {SOURCE}: {result.stderr.decode(errors='replace').strip()[:500]}")
        os.replace(partial, path)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)
    return path
