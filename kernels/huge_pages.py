"""Host tensors on 2 MiB pages: where a CPU deployment keeps the weights it streams every step.

A decode step reads each weight it uses once, from DRAM (a Qwen3-30B-A3B-shaped router's LM head
is 622 MB a token). Through 4 KiB pages such a read also walks the page tables for every 4 KiB,
and on a virtual machine each walk is two-dimensional (guest and host tables). Linux's
transparent huge pages cover a private anonymous mapping in 2 MiB pages when it is asked to
(``madvise(MADV_HUGEPAGE)``, which works where THP is in its ``madvise`` mode as well as
``always``). Measured on the 2-vCPU EPYC of docs/BENCHMARKS.md: the LM head's bfloat16 GEMV at one
row read 1.03-1.05x faster on one thread and 1.04-1.13x over both cores (benchmarks/bench_huge_pages.py,
two runs); a served decode step of the Qwen3-shaped checkpoint (1 router x 2 workers, one
sequence), three alternations of each setting: 54.3 / 61.6 / 59.5 ms against 57.3 / 65.3 / 65.6 ms
on 4 KiB pages, the workers' experts 15.2 against 16.9 ms a step.

It changes where the bytes lie, never what a kernel computes from them. Pages nobody writes are
never made resident (a worker's spare expert rows stay free until a migration stages an expert
there). Where ``MADV_HUGEPAGE`` does not exist (not Linux), for tensors under one huge page, or
with ``RAYMOE_HUGE_PAGES=0`` in a process's environment (a host whose THP compaction stalls),
:func:`huge_page_empty` is ``torch.empty``.
"""

from __future__ import annotations

import ctypes
import logging
import math
import mmap
import os

import torch

HUGE_PAGE = 2 << 20  # a transparent huge page on x86-64
ENV = "RAYMOE_HUGE_PAGES"
LOG = logging.getLogger("raymoe.kernels")
_regions: set[int] = set()  # start addresses of this process' huge_page_empty mappings (see coverage)


def enabled() -> bool:
    """Whether :func:`huge_page_empty` asks for huge pages here (``RAYMOE_HUGE_PAGES``, default on)."""
    return hasattr(mmap, "MADV_HUGEPAGE") and os.environ.get(ENV, "1").lower() not in ("0", "false", "no", "off")


def huge_page_empty(shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """An empty contiguous CPU tensor starting on a 2 MiB boundary of a ``MADV_HUGEPAGE`` mapping
    (see the module doc); ``torch.empty`` for tensors under one huge page or where not :func:`enabled`."""
    count = math.prod(shape)
    size = count * torch.empty((), dtype=dtype).element_size()
    if size < HUGE_PAGE or not enabled():
        return torch.empty(shape, dtype=dtype)
    # Private and anonymous (THP covers those; a shared mapping would need shmem's setting), one
    # page more than needed so the tensor can start on a huge-page boundary.
    region = mmap.mmap(-1, size + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    region.madvise(mmap.MADV_HUGEPAGE)
    start = ctypes.addressof(ctypes.c_char.from_buffer(region))
    _regions.add(start)
    # frombuffer holds a reference to the mapping: it is unmapped when the last tensor on it goes.
    return torch.frombuffer(region, dtype=dtype, count=count, offset=(-start) % HUGE_PAGE).view(shape)


def coverage() -> tuple[int, int]:
    """``(resident bytes, of them on 2 MiB pages)`` of this process' :func:`huge_page_empty`
    mappings still mapped (/proc/self/smaps; (0, 0) where it cannot be read). Where free memory is
    fragmented the kernel hands out fewer huge pages than asked, silently, and every step reads the
    weights on 4 KiB pages (5-10% slower here): routers and workers report it after loading
    (:func:`report`, ``info()["huge_pages"]``)."""
    if not _regions:
        return 0, 0
    resident = huge = 0
    try:
        with open("/proc/self/smaps") as handle:
            inside = False
            for line in handle:
                head = line.split(maxsplit=1)[0]
                if "-" in head and not head.endswith(":"):
                    inside = int(head.split("-")[0], 16) in _regions
                elif inside and line.startswith("Rss:"):
                    resident += int(line.split()[1]) << 10
                elif inside and line.startswith("AnonHugePages:"):
                    huge += int(line.split()[1]) << 10
    except (OSError, ValueError):
        return 0, 0
    return resident, huge


def report(what: str) -> dict[str, int]:
    """:func:`coverage` after loading, as ``info()`` reports it; where under half of the resident
    weights lie on 2 MiB pages, a warning in the log naming ``what`` and what to do about it."""
    resident, huge = coverage()
    if resident and huge * 2 < resident:
        LOG.warning("%s: %.2f of %.2f GB of resident weights on 2 MiB pages (%.0f%%): the kernel gave fewer huge "
                    "pages than asked (transparent huge pages off, or this host's free memory fragmented: `echo 1 > "
                    "/proc/sys/vm/compact_memory` as root before starting, or a reboot); each decode step reads the "
                    "weights on 4 KiB pages, ~5-10%% slower", what, huge / 1e9, resident / 1e9, 100 * huge / resident)
    return {"resident_bytes": resident, "huge_bytes": huge}
