"""Weights on 2 MiB pages against 4 KiB pages, for raymoe's bfloat16 kernels (kernels/huge_pages.py).

The same weights in two places, a ``MADV_HUGEPAGE`` mapping (what a CPU deployment loads its
weights into) and a plain anonymous mapping of 4 KiB pages, read in turn by the same kernel at
one row (a decode step at one sequence): a Qwen3-30B-A3B-shaped LM head ([151936, 2048], 622 MB)
over one thread and split over every core (native_bf16.split_threads), and 8 of its experts
(a token's top-k of one layer) out of a stack of 128 on one thread. Both copies are far larger
than the last-level cache, so every read comes from DRAM. Variants alternate ``--repeats``
times; the medians are compared (this machine's speed drifts between minutes). Prints GB/s and
the ratio huge / plain.

    python benchmarks/bench_huge_pages.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import math
import mmap
import statistics
import sys
import time

import torch

from raymoe.kernels import native_bf16
from raymoe.kernels.huge_pages import enabled, huge_page_empty
from raymoe.kernels.native_library import bf16_unavailable_reason


def plain_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """The same kind of mapping as huge_page_empty's, without asking for huge pages."""
    count = math.prod(shape)
    region = mmap.mmap(-1, count * torch.empty((), dtype=dtype).element_size(),
                       flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_NOHUGEPAGE"):
        region.madvise(mmap.MADV_NOHUGEPAGE)  # (THP in "always" mode would give them anyway)
    return torch.frombuffer(region, dtype=dtype, count=count).view(shape)


def timed(function, calls: int = 3) -> float:
    best = math.inf
    for _ in range(calls):
        started = time.perf_counter()
        function()
        best = min(best, time.perf_counter() - started)
    return best


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5, help="alternations of the two copies")
    args = parser.parse_args()
    if bf16_unavailable_reason() is not None:
        print(f"no bfloat16 kernels here: {bf16_unavailable_reason()}")
        return 1
    if not enabled():
        print("huge pages are off here (no MADV_HUGEPAGE, or RAYMOE_HUGE_PAGES=0): nothing to compare")
        return 1
    torch.manual_seed(0)
    torch.set_num_threads(1)
    hidden, vocab, experts, inter, top_k = 2048, 151936, 128, 768, 8
    head = torch.randn(vocab, hidden, dtype=torch.bfloat16)
    w13 = torch.randn(experts, 2 * inter, hidden, dtype=torch.bfloat16) * 0.02
    w2 = torch.randn(experts, hidden, inter, dtype=torch.bfloat16) * 0.02
    copies = {}
    for name, empty in (("huge", huge_page_empty), ("plain", plain_empty)):
        copies[name] = [empty(tuple(t.shape), torch.bfloat16).copy_(t) for t in (head, w13, w2)]
    del head, w13, w2
    x = torch.randn(1, hidden, dtype=torch.bfloat16)
    out = torch.empty(top_k, hidden, dtype=torch.bfloat16)
    chosen = torch.randperm(experts)[:top_k].tolist()
    rows = x.expand(top_k, hidden).contiguous()
    jobs = [(expert, row, row + 1) for row, expert in enumerate(chosen)]
    threads = native_bf16.split_threads()
    cases = {
        "LM head, 1 thread": (lambda w: native_bf16.linear(x, w[0], out_dtype=torch.float32, threads=1),
                              vocab * hidden * 2),
        f"LM head, {threads} threads": (lambda w: native_bf16.linear(x, w[0], out_dtype=torch.float32,
                                                                     threads=threads), vocab * hidden * 2),
        f"{top_k} of {experts} experts, 1 thread": (lambda w: native_bf16.swiglu_jobs(rows, out, w[1], w[2], jobs),
                                                    top_k * 3 * inter * hidden * 2),
    }
    print(f"bfloat16 kernels: {native_bf16.instructions()}; {args.repeats} alternations, median of each")
    print(f"{'case':<28} {'huge GB/s':>10} {'plain GB/s':>11} {'huge / plain':>13}")
    for label, (run, nbytes) in cases.items():
        seconds = {"huge": [], "plain": []}
        for _ in range(args.repeats):
            for name, weights in copies.items():
                seconds[name].append(timed(lambda: run(weights)))
        rate = {name: nbytes / statistics.median(values) / 1e9 for name, values in seconds.items()}
        print(f"{label:<28} {rate['huge']:10.1f} {rate['plain']:11.1f} {rate['huge'] / rate['plain']:13.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
