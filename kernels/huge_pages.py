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
import math
import mmap
import os

import torch

HUGE_PAGE = 2 << 20  # a transparent huge page on x86-64
ENV = "RAYMOE_HUGE_PAGES"


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
    # frombuffer holds a reference to the mapping: it is unmapped when the last tensor on it goes.
    return torch.frombuffer(region, dtype=dtype, count=count, offset=(-start) % HUGE_PAGE).view(shape)
