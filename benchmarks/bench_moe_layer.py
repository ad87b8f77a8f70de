"""MoE-layer throughput: raymoe's routed layer vs transformers' MixtralSparseMoeBlock vs a dense GEMM.

A benchmark, not a timed test: it prints numbers, it asserts nothing about speed.

What is measured (one process, same weights, same inputs, same run):

- **ours**: ``F.linear(x, gate_w)`` -> :func:`raymoe.moe.gating.route` (softmax, top-k,
  renormalised) -> :meth:`raymoe.engine.experts.LocalExperts.forward` (capacity mask, dispatch
  plan, row gather, grouped SwiGLU over expert slots, weighted combine). ``w13`` is
  transformers' ``experts.gate_up_proj [E, 2I, D]`` (gate rows then up rows) and ``w2`` is
  ``experts.down_proj [E, D, I]``: the same tensors, not copies.
- **hf**: ``transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock`` (router
  included), in eval mode, with its default ("eager", per-expert loop) experts implementation
  unless ``--hf-impl`` picks another of transformers' registered ones.
- **gemm**: the dense GEMM bound: one ``F.linear(x_rep [T*k, D], W [3I, D])``, i.e.
  ``x_rep @ W.T`` with ``W.T`` of shape ``[D, 3I]``. That is exactly the routed expert FLOPs,
  ``2 * T*k * (2I*D + D*I) = 2 * T*k * D * 3I``, run as a single matmul over a single
  (L2-resident, for the default sizes) weight. It excludes the router GEMM
  (``2*T*E*D``, < 1% of the total at the defaults), the SiLU/multiply, and all gather/scatter,
  and it touches one expert's worth of weight instead of up to E experts', so it is an upper
  bound on what any MoE layer of these shapes could reach on this machine, not a target.

Before any timing the script checks, at every token count, that ours and hf agree
(max abs diff below ``--atol``; default 1e-4 in float32, scaled to the output's size in
half precision). If they do not, it exits non-zero and prints no speed numbers.

Timing: all under ``torch.inference_mode()``, default ``torch.get_num_threads()``. Per token
count: a few warm-up calls, then rounds in which ours, hf and gemm are each called once in
turn (interleaved, so load from other processes on a shared machine hits all three alike);
each call is timed with ``time.perf_counter`` and the median is reported. The number of rounds
is chosen from the warm-up time so that each token count takes about ``--seconds-per-size``
seconds (bounded by ``--min-repeats``/``--max-repeats``); the default run takes well under two
minutes. ``tokens/s = T / median seconds``; the ratios are ours' tokens/s over the other's
(> 1 means ours is faster).

Run::

    python benchmarks/bench_moe_layer.py
    python benchmarks/bench_moe_layer.py --hidden 1024 --intermediate 2048 --experts 16 --top-k 2
    python benchmarks/bench_moe_layer.py --json /tmp/moe_layer.json
    python benchmarks/bench_moe_layer.py --profile 16,1024   # where our forward spends its time
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import platform
import pstats
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from raymoe.engine.experts import LocalExperts
from raymoe.moe.capacity import CapacityConfig
from raymoe.moe.gating import GateConfig, ScoringFunction, route

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=256, help="D (hidden_size)")
    p.add_argument("--intermediate", type=int, default=512, help="I (expert intermediate_size)")
    p.add_argument("--experts", type=int, default=8, help="E (num_local_experts)")
    p.add_argument("--top-k", type=int, default=2, help="k (num_experts_per_tok)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument("--tokens", default="1,16,256,1024", help="comma-separated token counts T")
    p.add_argument("--hf-impl", default="eager",
                   help="transformers experts implementation: eager (its per-expert loop, default), "
                        "batched_mm, grouped_mm")
    p.add_argument("--atol", type=float, default=None, help="max abs diff allowed between ours and hf")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--min-repeats", type=int, default=15)
    p.add_argument("--max-repeats", type=int, default=300)
    p.add_argument("--seconds-per-size", type=float, default=5.0,
                   help="time box for the timed rounds of one token count (all three together); "
                        "at least --min-repeats rounds run even past it")
    p.add_argument("--threads", type=int, default=None,
                   help="torch.set_num_threads(N) first (default: leave torch's default alone)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="PATH", default=None, help="also write the results as JSON here")
    p.add_argument("--profile", metavar="T[,T...]", default=None,
                   help="after the benchmark, profile our forward at these token counts")
    return p.parse_args(argv)


def build_hf_block(args: argparse.Namespace, dtype: torch.dtype) -> torch.nn.Module:
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    config = MixtralConfig(
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_local_experts=args.experts,
        num_experts_per_tok=args.top_k,
    )
    # "eager" is transformers' own per-expert loop (MixtralExperts.forward); setting it
    # explicitly picks the same code as None without the standalone-module warning.
    config._experts_implementation = args.hf_impl
    block = MixtralSparseMoeBlock(config)
    # The block's parameters are torch.empty: fill them so outputs are O(1) and routing is
    # not degenerate (logits with spread, weights ~ 1/sqrt(fan_in)).
    gen = torch.Generator().manual_seed(args.seed)
    with torch.no_grad():
        for name, param in block.named_parameters():
            fan_in = param.shape[-1]
            param.copy_(torch.randn(param.shape, generator=gen) / fan_in**0.5)
    block = block.to(dtype).eval()
    names = {name: tuple(p.shape) for name, p in block.named_parameters()}
    expected = {
        "gate.weight": (args.experts, args.hidden),
        "experts.gate_up_proj": (args.experts, 2 * args.intermediate, args.hidden),
        "experts.down_proj": (args.experts, args.hidden, args.intermediate),
    }
    if names != expected:
        raise SystemExit(f"unexpected MixtralSparseMoeBlock parameters {names}; expected {expected}")
    return block


class OurLayer:
    """Router GEMM + raymoe gating + LocalExperts over the hf block's own weight tensors."""

    def __init__(self, block: torch.nn.Module, num_experts: int, top_k: int):
        self.gate_w = block.gate.weight.detach()
        w13 = block.experts.gate_up_proj.detach()  # [E, 2I, D], gate rows then up rows
        w2 = block.experts.down_proj.detach()  # [E, D, I]
        self.gate_config = GateConfig(ScoringFunction.SOFTMAX, num_experts, top_k, True)
        self.experts = LocalExperts([w13], [w2], CapacityConfig())

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        router_logits = F.linear(x, self.gate_w)
        ids, w = route(router_logits, self.gate_config)
        return self.experts.forward(0, x, ids, w)


def flops_routed(tokens: int, top_k: int, hidden: int, intermediate: int) -> int:
    """Expert FLOPs of one layer: T*k rows through gate_up [2I x D] and down [D x I]."""
    return 2 * tokens * top_k * (2 * intermediate * hidden + hidden * intermediate)


def check_match(ours, hf, xs: dict[int, torch.Tensor], atol: float | None, dtype: torch.dtype) -> dict[int, float]:
    diffs = {}
    ok = True
    for t, x in xs.items():
        a = ours(x).float()
        b = hf(x.view(1, t, -1)).view(t, -1).float()
        diff = (a - b).abs().max().item() if t else 0.0
        tol = atol if atol is not None else (1e-4 if dtype == torch.float32 else 2e-2 * max(1.0, b.abs().max().item()))
        diffs[t] = diff
        status = "ok" if diff < tol else "MISMATCH"
        print(f"  T={t:5d}  max|ours - hf| = {diff:.3e}  (tol {tol:.1e})  {status}")
        ok &= diff < tol and bool(torch.isfinite(a).all())
    if not ok:
        print("ours and transformers disagree: refusing to report speed numbers", file=sys.stderr)
        raise SystemExit(1)
    return diffs


def time_interleaved(fns: dict[str, callable], args: argparse.Namespace) -> dict[str, dict]:
    """Rounds of one call of each fn in turn, time-boxed; per-fn medians and per-round ratios."""
    for _ in range(args.warmup):
        for fn in fns.values():
            fn()
    samples = {name: [] for name in fns}
    box_start = time.perf_counter()
    rounds = 0
    while rounds < args.max_repeats and (
        rounds < args.min_repeats or time.perf_counter() - box_start < args.seconds_per_size
    ):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            samples[name].append(time.perf_counter() - start)
        rounds += 1
    out = {}
    for name, s in samples.items():
        q = sorted(s)
        out[name] = {
            "median_s": statistics.median(q),
            "p10_s": q[len(q) // 10],
            "p90_s": q[(9 * len(q)) // 10],
            "repeats": len(q),
        }
    # Paired per-round ratios (ours' time / the other's, same round): less sensitive to
    # load from other processes than a ratio of medians on a shared machine.
    for other in (n for n in fns if n != "ours"):
        out[f"paired_ours_over_{other}"] = statistics.median(
            t_other / t_ours for t_ours, t_other in zip(samples["ours"], samples[other])
        )
    return out


def print_table(rows: list[dict]) -> None:
    header = (
        f"{'T':>5} | {'ours ms':>9} {'hf ms':>9} {'gemm ms':>9} | {'ours tok/s':>11} {'hf tok/s':>11} "
        f"{'gemm tok/s':>11} | {'ours GF/s':>9} | {'ours/hf':>7} {'ours/gemm':>9} | {'paired':>6} {'paired':>9} | {'n':>4}"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        print(
            f"{r['tokens']:>5} | {r['ours']['median_s'] * 1e3:9.3f} {r['hf']['median_s'] * 1e3:9.3f} "
            f"{r['gemm']['median_s'] * 1e3:9.3f} | {r['ours']['tokens_per_s']:11.0f} {r['hf']['tokens_per_s']:11.0f} "
            f"{r['gemm']['tokens_per_s']:11.0f} | {r['ours']['gflops']:9.2f} | {r['ours_over_hf']:7.2f} "
            f"{r['ours_over_gemm']:9.3f} | {r['paired_ours_over_hf']:6.2f} {r['paired_ours_over_gemm']:9.3f} "
            f"| {r['ours']['repeats']:>4}"
        )


def profile_ours(ours: OurLayer, x: torch.Tensor, calls: int = 50) -> None:
    t = x.shape[0]
    print(f"\n=== profile of our forward, T={t}, {calls} calls ===")
    for _ in range(5):
        ours(x)
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(calls):
            ours(x)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(calls):
        ours(x)
    pr.disable()
    buf = io.StringIO()
    pstats.Stats(pr, stream=buf).sort_stats("cumulative").print_stats(25)
    print(buf.getvalue())


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    dtype = DTYPES[args.dtype]
    token_counts = [int(t) for t in args.tokens.split(",") if t]
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)

    with torch.inference_mode():
        block = build_hf_block(args, dtype)
        ours = OurLayer(block, args.experts, args.top_k)
        gen = torch.Generator().manual_seed(args.seed + 1)
        xs = {t: torch.randn(t, args.hidden, generator=gen).to(dtype) for t in token_counts}
        # Dense bound operands: T*k rows through one [3I, D] weight (F.linear = x @ W.T).
        w_dense = torch.randn(3 * args.intermediate, args.hidden, generator=gen).to(dtype) / args.hidden**0.5
        xs_rep = {t: x.repeat_interleave(args.top_k, dim=0) for t, x in xs.items()}

        print(
            f"MoE layer: D={args.hidden} I={args.intermediate} E={args.experts} k={args.top_k} "
            f"dtype={args.dtype}  torch {torch.__version__}  threads={torch.get_num_threads()}  "
            f"hf experts impl={args.hf_impl}"
        )
        print("correctness (ours vs transformers, same weights):")
        diffs = check_match(ours, block, xs, args.atol, dtype)

        rows = []
        for t in token_counts:
            x, x3, xr = xs[t], xs[t].view(1, t, -1), xs_rep[t]
            fns = {
                "ours": lambda x=x: ours(x),
                "hf": lambda x3=x3: block(x3),
                "gemm": lambda xr=xr: F.linear(xr, w_dense),
            }
            timing = time_interleaved(fns, args)
            flops = flops_routed(t, args.top_k, args.hidden, args.intermediate)
            for name in ("ours", "hf", "gemm"):
                v = timing[name]
                v["tokens_per_s"] = t / v["median_s"]
                v["gflops"] = flops / v["median_s"] / 1e9
            rows.append({
                "tokens": t,
                "routed_flops": flops,
                "max_abs_diff": diffs[t],
                **{name: timing[name] for name in ("ours", "hf", "gemm")},
                "paired_ours_over_hf": timing["paired_ours_over_hf"],
                "paired_ours_over_gemm": timing["paired_ours_over_gemm"],
                "ours_over_hf": timing["ours"]["tokens_per_s"] / timing["hf"]["tokens_per_s"],
                "ours_over_gemm": timing["ours"]["tokens_per_s"] / timing["gemm"]["tokens_per_s"],
            })
        print()
        print_table(rows)
        best_gemm = max(r["gemm"]["gflops"] for r in rows)
        for r in rows:
            if r["gemm"]["gflops"] < best_gemm / 50:
                print(f"warning: T={r['tokens']}: the dense GEMM ran at {r['gemm']['gflops']:.2f} GF/s, under 2% of "
                      f"its best ({best_gemm:.1f}): threads were waiting for a core (oversubscribed machine); "
                      "rerun, or compare with --threads 1")
            noisy = [n for n in ("ours", "hf", "gemm") if r[n]["p90_s"] > 3 * r[n]["p10_s"]]
            if noisy:
                print(f"warning: T={r['tokens']}: p90 > 3x p10 for {', '.join(noisy)}: the machine was busy; "
                      "trust the paired ratios, or rerun")
        print("ours/hf, ours/gemm: ours tokens/s divided by the other's, from the medians (> 1: ours faster);\n"
              "paired: the same ratio as the median over rounds of (other's time / ours' time) in one round;\n"
              "gemm = one x[T*k, D] @ W[D, 3I] matmul, the same FLOPs as the routed experts")

        result = {
            "config": {
                "hidden": args.hidden, "intermediate": args.intermediate, "experts": args.experts,
                "top_k": args.top_k, "dtype": args.dtype, "hf_impl": args.hf_impl,
            },
            "machine": {
                "torch": torch.__version__, "threads": torch.get_num_threads(),
                "processor": platform.processor() or platform.machine(), "python": platform.python_version(),
            },
            "dense_bound": "F.linear(x_rep[T*k, D], W[3I, D]) = x_rep @ W.T, FLOPs 2*T*k*D*3I",
            "rows": rows,
        }
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=2)
            print(f"wrote {args.json}")

        if args.profile:
            for t in (int(v) for v in args.profile.split(",") if v):
                x = xs[t] if t in xs else torch.randn(t, args.hidden, generator=gen).to(dtype)
                profile_ours(ours, x)
    return result


if __name__ == "__main__":
    main()
