"""Peak memory and time of one attention layer's prefill on the CPU: the padded path before
issue 14 against the per-sequence path now.

A benchmark, not a timed test: it prints numbers and asserts nothing about them.

- **before**: ``kernels/attention.py`` as of ``--before-rev`` (default: the commit before the
  change), read with ``git show`` and loaded under another module name: metadata with the
  padded ``[B, Q, K]`` boolean mask and ``[B, Hkv, K]`` key rows, then one SDPA call over the
  padded batch with that mask.
- **after**: the working tree's ``raymoe.kernels.attention``: metadata, the generic backend's
  plan, then per-sequence SDPA (a whole prompt runs ``is_causal``, no mask).

Both run the same work: build the step's metadata for one prompt of ``--tokens`` tokens (all
new), write its keys/values into a paged cache, attend. Shapes default to one Mixtral-8x7B
layer (32 heads, 8 kv heads, head size 128) in float32.

Memory: each variant runs in its own fresh process (``--child``); it allocates its inputs,
reads ``resource.getrusage(RUSAGE_SELF).ru_maxrss`` (the peak so far: inputs, torch, imports),
runs the layer once and reads it again. The difference is the peak the layer added on top of
its inputs (kernel pages, so allocator reuse is included; torch's CPU allocator returns large
blocks to the OS, so every large temporary shows). ``tracemalloc`` would not see torch's
buffers. Time: the median of ``--repeats`` further calls in the same process, after one warm-up.

On a shared machine the times are noisy (the memory peak is not).

Run::

    python benchmarks/bench_attention_memory.py                 # 4,096 tokens
    python benchmarks/bench_attention_memory.py --tokens 8192 --json /tmp/attention_memory.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BEFORE_REV = "cc58241"  # the last commit with the padded path (kernels/attention.py before issue 14)


def load_before(rev: str):
    """The old kernels/attention.py as a module named ``raymoe_attention_before``."""
    source = subprocess.run(["git", "-C", str(REPO), "show", f"{rev}:kernels/attention.py"],
                            capture_output=True, text=True, check=True).stdout
    path = Path(tempfile.mkdtemp()) / "raymoe_attention_before.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("raymoe_attention_before", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def child(args: argparse.Namespace) -> dict:
    import torch

    torch.manual_seed(0)
    tokens, heads, kv_heads, dim, block = args.tokens, args.heads, args.kv_heads, args.head_dim, args.block_size
    num_blocks = -(-tokens // block)
    table = list(range(num_blocks))
    scale = dim ** -0.5
    q = torch.randn(tokens, heads, dim)
    k = torch.randn(tokens, kv_heads, dim)
    v = torch.randn(tokens, kv_heads, dim)
    if args.child == "before":
        old = load_before(args.before_rev)
        k_cache = torch.zeros(num_blocks * block, kv_heads, dim)  # the old flat [C, Hkv, D]
        v_cache = torch.zeros_like(k_cache)

        def layer():
            metadata = old.AttentionMetadata.build([tokens], [tokens], [table], block, kv_heads, None)
            old.write_kv(k_cache, v_cache, k, v, metadata.slot_mapping)
            return old.paged_attention(q, k_cache, v_cache, metadata, scale)
    else:
        from raymoe.kernels.attention import AttentionMetadata, AttentionSpec, SdpaAttention, write_cache
        from raymoe.moe.model_config import AttentionKind

        backend = SdpaAttention(AttentionSpec(AttentionKind.GQA, heads, kv_heads, dim, dim, scale, None))
        k_cache = torch.zeros(num_blocks, block, kv_heads, dim)  # paged [N, bs, Hkv, D]
        v_cache = torch.zeros_like(k_cache)

        def layer():
            metadata = AttentionMetadata.build([tokens], [tokens], [table], block)
            write_cache(k_cache, k, metadata.slot_mapping)
            write_cache(v_cache, v, metadata.slot_mapping)
            return backend.plan(metadata, block).attend(q, (k_cache, v_cache))

    with torch.inference_mode():
        before_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        out = layer()
        peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        checksum = float(out.double().sum())
        del out
        times = []
        for _ in range(args.repeats):
            started = time.perf_counter()
            layer()
            times.append(time.perf_counter() - started)
    return {"variant": args.child, "added_peak_mib": (peak_kib - before_kib) / 1024,
            "inputs_peak_mib": before_kib / 1024, "median_s": statistics.median(times),
            "times_s": times, "checksum": checksum, "threads": torch.get_num_threads()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--before-rev", default=BEFORE_REV)
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--child", choices=["before", "after"], help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(args)))
        return 0
    results = {}
    for variant in ("before", "after"):
        command = [sys.executable, __file__, "--child", variant, "--tokens", str(args.tokens), "--heads",
                   str(args.heads), "--kv-heads", str(args.kv_heads), "--head-dim", str(args.head_dim),
                   "--block-size", str(args.block_size), "--repeats", str(args.repeats),
                   "--before-rev", args.before_rev]
        run = subprocess.run(command, capture_output=True, text=True, timeout=1800)
        if run.returncode != 0:
            print(run.stderr, file=sys.stderr)
            return 1
        results[variant] = json.loads(run.stdout.strip().splitlines()[-1])
    before, after = results["before"], results["after"]
    shape = f"{args.tokens} tokens, H={args.heads}, Hkv={args.kv_heads}, d={args.head_dim}, float32, " \
            f"{after['threads']} threads"
    print(f"one attention layer, prefill of one prompt: {shape}")
    print(f"{'variant':<8} {'peak added (MiB)':>17} {'median time (s)':>16}")
    for name in ("before", "after"):
        print(f"{name:<8} {results[name]['added_peak_mib']:>17.1f} {results[name]['median_s']:>16.3f}")
    output_mib = args.tokens * args.heads * args.head_dim * 4 / 2**20
    print(f"(the layer's output alone is {output_mib:.1f} MiB; beyond it: before "
          f"{before['added_peak_mib'] - output_mib:.1f} MiB, after {after['added_peak_mib'] - output_mib:.1f} MiB)")
    memory_ratio = before["added_peak_mib"] / max(after["added_peak_mib"], 1e-9)
    time_ratio = before["median_s"] / after["median_s"]
    print(f"before/after: peak memory {memory_ratio:.2f}x, time {time_ratio:.2f}x")
    agreement = abs(before["checksum"] - after["checksum"]) / max(abs(before["checksum"]), 1e-9)
    print(f"outputs agree: relative checksum difference {agreement:.1e}")
    print("(shared, noisy machine: times vary run to run; the memory peak is stable)")
    if args.json is not None:
        args.json.write_text(json.dumps({"args": {k: v for k, v in vars(args).items() if k != "json"},
                                         "before": before, "after": after, "output_mib": output_mib,
                                         "memory_ratio": memory_ratio,
                                         "time_ratio": time_ratio}, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
