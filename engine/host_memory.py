"""Keep freed host memory in the process, so a decode step does not page-fault its buffers in.

A CPU decode step allocates and frees the same few megabytes every layer (the keys and values
gathered for attention are ~1 MB a layer at 32 sequences x 64 keys, more as sequences grow).
glibc's malloc serves blocks of 128 KiB and more from fresh ``mmap`` regions and hands them
back to the kernel on ``free``, and it trims the heap's top whenever more than 128 KiB lies
free there; so every step touches new pages, and each first touch is a page fault. On the
2-vCPU guest of docs/BENCHMARKS.md a fault costs ~2 us (a nested virtual machine), which made
the in-process engine's attention gather at 32 sequences x 140 keys cost 9.6 ms a step instead
of 1.9 ms: more than the whole rest of attention.

:func:`keep_freed_memory` sets glibc's thresholds once per process (``mallopt``): blocks up to
32 MiB come from the heap, and the heap keeps up to 1 GiB of freed memory instead of returning
it. A process's resident memory then stays at its peak transient use (tens of MB for a decode
step), as with tcmalloc or jemalloc, which vLLM's CPU build asks users to preload. It only
changes where malloc finds memory, never what a computation produces. Elsewhere than glibc
(musl, macOS) it does nothing; ``RAYMOE_KEEP_FREED_MEMORY=0`` turns it off.

A CPU deployment goes further by default (``cpu.allocator: jemalloc``): its router and worker
processes start with jemalloc preloaded (:func:`allocator_env`, Ray's ``runtime_env``), as
vLLM's CPU build and Intel's PyTorch guides advise. Each eager op of a decode step allocates
its output (a few hundred small tensors a step, through ``posix_memalign``), and glibc's
aligned allocation splits and coalesces chunks on every call: 7-8% of a two-process decode
chain's CPU here was glibc's malloc and free (``perf``). Preloading Ray's own copy of jemalloc
took 9-11% off that chain's step at one token (benchmarks/bench_exchange_chain.py under
``LD_PRELOAD``) and 1-7% off a served step (docs/BENCHMARKS.md). The
library is looked up where the deployment is made; a node that lacks it at that path runs
with its C library's malloc (the loader says so in the actor's log and goes on). Like the
thresholds above, it never changes what a computation produces.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
import threading

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameters (malloc.h)
M_TOP_PAD = -2
M_MMAP_THRESHOLD = -3

MMAP_THRESHOLD_BYTES = 32 << 20  # glibc's ceiling for this threshold on 64-bit machines
TRIM_THRESHOLD_BYTES = 1 << 30
TOP_PAD_BYTES = 16 << 20
ENV = "RAYMOE_KEEP_FREED_MEMORY"

_lock = threading.Lock()
_applied: bool | None = None


def keep_freed_memory() -> bool:
    """Tune this process's malloc once (see the module doc); returns whether it is tuned."""
    global _applied
    with _lock:
        if _applied is None:
            _applied = _apply()
        return _applied


def _apply() -> bool:
    if os.environ.get(ENV, "1").strip().lower() in ("0", "false", "no", "off"):
        return False
    if allocator_in_use() == "jemalloc":  # glibc's malloc is not the one in use: nothing to tune
        return False
    libc = _glibc()
    if libc is None:
        return False
    mallopt = libc.mallopt
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return all(mallopt(parameter, value) == 1 for parameter, value in (
        (M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES), (M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES), (M_TOP_PAD, TOP_PAD_BYTES)))


def _glibc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
    if not hasattr(libc, "gnu_get_libc_version") or not hasattr(libc, "mallopt"):
        return None  # not glibc: its mallopt parameters may mean something else, or nothing
    return libc


JEMALLOC_ENV = "RAYMOE_JEMALLOC"  # a jemalloc library to preload instead of the one found


def jemalloc_path() -> str | None:
    """A jemalloc shared library on this machine: ``$RAYMOE_JEMALLOC``, else the one Ray ships
    (``ray/core/libjemalloc.so``), else the system's; None if there is none (or off Linux)."""
    if not sys.platform.startswith("linux"):
        return None
    candidates = [os.environ.get(JEMALLOC_ENV, "")]
    try:
        import ray

        candidates.append(os.path.join(os.path.dirname(ray.__file__), "core", "libjemalloc.so"))
    except ImportError:
        pass
    candidates += ["/usr/lib/x86_64-linux-gnu/libjemalloc.so.2", "/usr/lib/aarch64-linux-gnu/libjemalloc.so.2",
                   "/usr/lib64/libjemalloc.so.2", "/usr/lib/libjemalloc.so.2"]
    return next((path for path in candidates if path and os.path.isfile(path)), None)


def allocator_env(allocator: str) -> dict[str, str]:
    """The environment a CPU actor process starts with for ``cpu.allocator`` (``jemalloc``:
    LD_PRELOAD of :func:`jemalloc_path` when there is one; ``system``: nothing)."""
    if allocator != "jemalloc":
        return {}
    path = jemalloc_path()
    return {"LD_PRELOAD": path} if path else {}


def allocator_in_use() -> str:
    """``jemalloc`` when this process has jemalloc loaded, else ``system``."""
    try:
        with open("/proc/self/maps") as maps:
            return "jemalloc" if any("jemalloc" in line for line in maps) else "system"
    except OSError:
        return "system"
