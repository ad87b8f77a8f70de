"""raymoe's bfloat16 CPU kernels (kernels/native_bf16.py) against torch's, at real models' shapes.

Per shape and row count: raymoe's kernel on AMX and on AVX512_BF16 dot products, torch's
``F.linear`` in bfloat16 (oneDNN, repacking the weight every call), and oneDNN's linear over a
weight packed once (kernels/packed_linear.py's float32 path, which for bfloat16 would need that
packed copy beside the checkpoint's: twice the weights' memory). Experts: a layer's top-k experts
(one job per expert) by raymoe's kernel against torch's per-expert loop (kernels/expert_mlp.py's
fall-back). Every variant of a case runs in turn, ``--repeats`` times, and the medians are
compared within the case (this machine's speed drifts by tens of percent between minutes).
One thread each (a router's and a worker's compute thread are pinned to one core).

    python benchmarks/bench_bf16_kernels.py            # Qwen3-30B-A3B's and Mixtral-8x7B's shapes
    python benchmarks/bench_bf16_kernels.py --quick    # fewer rows and repeats
    python benchmarks/bench_bf16_kernels.py --split --rows 1 16   # dense layers on 1 thread and on every core

``--split``: the dense layers only, raymoe's kernel on one thread and split over every core this
process may use (``native_bf16.split_threads``), beside torch's on as many threads: whether a
router (whose workers wait while it runs its dense layers) gains from the second core, and from
what size on (``native_bf16.SPLIT_MIN_BYTES``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from raymoe.kernels import native_bf16
from raymoe.kernels.native_library import STATE, bf16_unavailable_reason

HERE = os.path.dirname(os.path.abspath(__file__))

# (name, out features, in features) of the dense layers a token passes through
LINEARS = [
    ("qwen3 qkv", 5120, 2048), ("qwen3 o_proj", 2048, 4096), ("qwen3 lm_head", 151936, 2048),
    ("mixtral qkv", 6144, 4096), ("mixtral lm_head", 32000, 4096),
]
# --split's: the dense layers above, the attention projections apart, and a shared expert's
COLD_BYTES = 512 << 20
SPLIT_LINEARS = [("qwen3 q_proj", 4096, 2048), ("qwen3 k_proj", 512, 2048), *LINEARS[:2], ("mixtral o_proj", 4096, 4096),
                 LINEARS[3], ("qwen2-moe shared w13", 11264, 2048)]
# (name, experts in the layer, top-k, hidden, intermediate)
EXPERTS = [("qwen3 experts", 128, 8, 2048, 768), ("mixtral experts", 8, 2, 4096, 14336)]


def median_ms(samples: list[float]) -> float:
    return statistics.median(samples) * 1e3


def timed(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def measure(variants: dict, repeats: int, calls: int = 1) -> dict[str, float]:
    """Each variant warmed once, then ``repeats`` rounds of every variant in turn (``calls`` timed
    calls each): the median ms per variant."""
    samples = {label: [] for label in variants}
    for fn in variants.values():
        fn()  # warm
    for _ in range(repeats):
        for label, fn in variants.items():
            samples[label].extend(timed(fn) for _ in range(calls))
    return {label: median_ms(s) for label, s in samples.items()}


def kernels() -> dict[str, tuple]:
    library = STATE.library
    chosen = {"raymoe avx512-bf16": (library.raymoe_bf16_linear, library.raymoe_bf16_swiglu_experts, "avx512-bf16")}
    if library.raymoe_amx_supported():
        chosen["raymoe amx"] = (library.raymoe_amx_linear, library.raymoe_amx_swiglu_experts, "amx")
    return chosen


def bench_linear(name: str, out_features: int, in_features: int, rows: int, repeats: int) -> dict:
    weight = torch.randn(out_features, in_features, dtype=torch.bfloat16)
    x = torch.randn(rows, in_features, dtype=torch.bfloat16)
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, rows)
    onednn = torch.ops.mkldnn._linear_pointwise.default
    variants = {"torch F.linear": lambda: F.linear(x, weight),
                "oneDNN packed (a copy)": lambda: onednn(x, packed, None, "none", [], "")}
    for label, chosen in kernels().items():
        variants[label] = lambda chosen=chosen: (setattr(native_bf16, "_chosen", chosen),
                                                 native_bf16.linear(x, weight, threads=1))
    gigabytes = weight.numel() * 2 / 1e9
    return {"case": f"{name} [{out_features}, {in_features}]", "rows": rows,
            "ms": measure(variants, repeats), "weight_gb": gigabytes}


def bench_split(name: str, out_features: int, in_features: int, rows: int, repeats: int) -> dict:
    """One dense layer: raymoe's kernel (the one this machine runs) on 1 and on N threads, torch's on N."""
    threads = native_bf16.split_threads()
    # Copies of the weight, taken in turn, as many as fill COLD_BYTES: a served token reads each
    # layer's weight from memory (the other layers' pass between), not from the last-level cache.
    copies = max(1, -(-COLD_BYTES // (out_features * in_features * 2)))
    weights = [torch.randn(out_features, in_features, dtype=torch.bfloat16) for _ in range(copies)]
    x = torch.randn(rows, in_features, dtype=torch.bfloat16)
    packed = [torch.ops.mkldnn._reorder_linear_weight(weight, rows) for weight in weights]
    onednn = torch.ops.mkldnn._linear_pointwise.default
    turn = [0]

    def next_one(sequence):
        turn[0] = (turn[0] + 1) % copies
        return sequence[turn[0]]

    variants = {"raymoe 1 thread": lambda: native_bf16.linear(x, next_one(weights), threads=1),
                f"raymoe {threads} threads": lambda: native_bf16.linear(x, next_one(weights), threads=threads),
                f"torch F.linear {threads} threads": lambda: F.linear(x, next_one(weights)),
                f"oneDNN packed {threads} threads": lambda: onednn(x, next_one(packed), None, "none", [], "")}
    torch.set_num_threads(threads)
    try:
        ms = measure(variants, repeats, calls=copies)
    finally:
        torch.set_num_threads(1)
    return {"case": f"{name} [{out_features}, {in_features}]", "rows": rows, "ms": ms,
            "weight_gb": weights[0].numel() * 2 / 1e9, "threads": threads,
            "split_gain": ms["raymoe 1 thread"] / ms[f"raymoe {threads} threads"]}


def bench_experts(name: str, experts: int, top_k: int, hidden: int, intermediate: int, rows: int,
                  repeats: int) -> dict:
    w13 = torch.randn(experts, 2 * intermediate, hidden, dtype=torch.bfloat16) * hidden ** -0.5
    w2 = torch.randn(experts, hidden, intermediate, dtype=torch.bfloat16) * intermediate ** -0.5
    x = torch.randn(top_k * rows, hidden, dtype=torch.bfloat16)
    out = torch.empty_like(x)
    jobs = [((index * 37) % experts, index * rows, (index + 1) * rows) for index in range(top_k)]

    def torch_loop() -> None:
        for expert, begin, end in jobs:
            gate_up = F.linear(x[begin:end], w13[expert])
            h = F.silu(gate_up[:, :intermediate]) * gate_up[:, intermediate:]
            out[begin:end] = F.linear(h, w2[expert])

    variants = {"torch per-expert loop": torch_loop}
    for label, chosen in kernels().items():
        variants[label] = lambda chosen=chosen: (setattr(native_bf16, "_chosen", chosen),
                                                 native_bf16.swiglu_jobs(x, out, w13, w2, jobs))
    gigabytes = top_k * 3 * hidden * intermediate * 2 / 1e9
    return {"case": f"{name} (top-{top_k} of {experts}, D {hidden}, I {intermediate})", "rows": rows,
            "ms": measure(variants, repeats), "weight_gb": gigabytes}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 64, 256],
                        help="rows per call (decode: 1-16; a prefill chunk: 64-256)")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--quick", action="store_true", help="rows 1 16 64, 3 repeats")
    parser.add_argument("--split", action="store_true",
                        help="the dense layers on 1 thread and on every core (see above)")
    parser.add_argument("--out", default=os.path.join(HERE, "results", "bench_bf16_kernels.json"))
    args = parser.parse_args()
    if args.quick:
        args.rows, args.repeats = [1, 16, 64], 3
    reason = bf16_unavailable_reason()
    if reason is not None:
        raise SystemExit(f"raymoe's bfloat16 kernels do not run here: {reason}")
    torch.set_num_threads(1)
    saved = native_bf16._chosen
    results = []
    try:
        for rows in args.rows:
            if args.split:
                for case in SPLIT_LINEARS:
                    results.append(bench_split(*case, rows, args.repeats))
                    result = results[-1]
                    print(f"{result['case']:<40} {result['weight_gb'] * 1e3:6.1f} MB rows {rows:>4}: "
                          + "  ".join(f"{label} {value:.3f}" for label, value in result["ms"].items())
                          + f" ms | split {result['split_gain']:.2f}x", flush=True)
                continue
            for case in LINEARS:
                results.append(bench_linear(*case, rows, args.repeats))
                print_row(results[-1])
            for case in EXPERTS:
                results.append(bench_experts(*case, rows, args.repeats))
                print_row(results[-1])
    finally:
        native_bf16._chosen = saved
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as handle:
        json.dump({"machine": machine(), "loadavg": os.getloadavg(), "results": results}, handle, indent=2)
    print(f"wrote {args.out}", file=sys.stderr)


def print_row(result: dict) -> None:
    ms = result["ms"]
    best_torch = min(value for label, value in ms.items() if not label.startswith("raymoe"))
    ours = {label: value for label, value in ms.items() if label.startswith("raymoe")}
    parts = "  ".join(f"{label} {value:.3f}" for label, value in ms.items())
    mine = min(ours.values())
    print(f"{result['case']:<52} rows {result['rows']:>4}: {parts} ms | raymoe {best_torch / mine:.2f}x torch's best, "
          f"{result['weight_gb'] / mine * 1e3:.1f} GB/s of weights", flush=True)


def machine() -> str:
    sys.path.insert(0, HERE)
    from common import machine_description

    return machine_description()


if __name__ == "__main__":
    main()
