"""Decode attention over the paged KV cache: raymoe's native kernel against torch's SDPA path.

One decode step's attention for one layer (kernels/attention.py, ``SdpaAttention``): B sequences
of one query each against ``--contexts`` keys, GQA, on one thread. The native kernel
(kernels/csrc/decode_attention.inc, float32 and bfloat16) reads the keys where they lie in
the cache; with it switched off, the same call gathers every sequence's keys into a padded copy
and runs torch's ``scaled_dot_product_attention`` (the fallback where the kernel does not run).
Shapes: the toy Mixtral's (8 query / 4 KV heads of 32, float32) and Qwen3-30B-A3B's (32 / 4 of
128, bfloat16). Prints ms per call and the SDPA / native ratio (> 1: the kernel is faster).

    python benchmarks/bench_decode_attention.py [--sequences 1 32] [--contexts 64 400]
"""

from __future__ import annotations

import argparse
import time

import torch

from common import machine_description
from raymoe.kernels import native_library
from raymoe.kernels.attention import AttentionMetadata, AttentionSpec, SdpaAttention
from raymoe.moe.model_config import AttentionKind

SHAPES = {"toy f32 (8/4 x 32)": (torch.float32, 8, 4, 32), "qwen3 bf16 (32/4 x 128)": (torch.bfloat16, 32, 4, 128)}
BLOCK = 16


def time_call(function, repeats: int) -> float:
    for _ in range(3):
        function()
    started = time.perf_counter()
    for _ in range(repeats):
        function()
    return (time.perf_counter() - started) / repeats * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sequences", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--contexts", type=int, nargs="+", default=[64, 400])
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"machine: {machine_description()}; one thread, ms per call (one layer's decode attention)")
    print(f"{'shape':<26} {'B':>3} {'keys':>5} | {'native':>8} {'SDPA':>8} {'SDPA/native':>11}")
    for name, (dtype, heads, kv_heads, head_dim) in SHAPES.items():
        for batch in args.sequences:
            for context in args.contexts:
                per = -(-context // BLOCK)
                blocks = batch * per + 1
                generator = torch.Generator().manual_seed(0)
                order = (torch.randperm(blocks - 1, generator=generator) + 1).tolist()  # scattered blocks
                tables = [order[i * per:(i + 1) * per] for i in range(batch)]
                metadata = AttentionMetadata.build([1] * batch, [context] * batch, tables, BLOCK)
                caches = tuple(torch.randn(blocks, BLOCK, kv_heads, head_dim, generator=generator).to(dtype)
                               for _ in range(2))
                q = torch.randn(batch, heads, head_dim, generator=generator).to(dtype)
                spec = AttentionSpec(AttentionKind.GQA, heads, kv_heads, head_dim, head_dim, head_dim ** -0.5, None)
                backend = SdpaAttention(spec, dtype, torch.device("cpu"))
                step = backend.plan(metadata, BLOCK)
                native = time_call(lambda: step.attend(q, caches), args.repeats)
                native_library.set_enabled(False)  # both kernels' switch (float32 and bfloat16)
                try:
                    fallback = SdpaAttention(spec).plan(metadata, BLOCK)
                    sdpa = time_call(lambda: fallback.attend(q, caches), args.repeats)
                finally:
                    native_library.set_enabled(True)
                print(f"{name:<26} {batch:>3} {context:>5} | {native:8.3f} {sdpa:8.3f} {sdpa / native:11.2f}")


if __name__ == "__main__":
    main()
