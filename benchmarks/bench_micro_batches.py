"""Ping-pong micro-batches on and off, in one deployment and one run (issue 29 item 2).

Deploys ``--configs`` (``RxW``: R routers, W CPU expert workers) over ``--model`` (the toy f32
Mixtral of docs/BENCHMARKS.md, or a real model's per-layer shapes in bf16, built here and never
committed), then for each concurrency C runs C requests of ``--tokens`` greedy tokens at once,
``--rounds`` times, alternating ``engine.micro_batch_min_seqs`` between 0 (off) and 2 (every step
of 2+ sequences in two halves) on the same routers (``Router.set_micro_batch_min_seqs``). Prints
per C the output tokens/s of each (median of rounds), the ratio on/off, and whether the tokens of
both equal each other. What the ratio shows is the schedule's gain on its own: the same processes,
weights, cores and requests.

    python benchmarks/bench_micro_batches.py [--model toy|qwen3-30b-a3b-4l|mixtral-8x7b-2l]
        [--configs 1x1,1x2] [--concurrency 2,8,32] [--tokens 32] [--rounds 3] [--checkpoint DIR]
        [--plot PNG]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import ray

from common import REAL_SHAPES, build_mixtral, build_real_shape, machine_description, workload
from raymoe.cluster.config import parse_cluster_config
from raymoe.cluster.deploy import deploy, ensure_ray
from raymoe.engine.sampling_params import SamplingParams


def checkpoint(args: argparse.Namespace, scratch: str) -> tuple[str, str]:
    """(checkpoint directory, dtype): ``--checkpoint`` if it holds one, else built there (or in scratch)."""
    path = args.checkpoint or os.path.join(scratch, args.model)
    if not os.path.isfile(os.path.join(path, "config.json")):
        os.makedirs(path, exist_ok=True)
        print(f"building the {args.model} checkpoint in {path} ...", flush=True)
        if args.model == "toy":
            build_mixtral(path)
        else:
            build_real_shape(path, args.model)
    return path, "float32" if args.model == "toy" else "bfloat16"


def timed(deployment, prompts, params) -> tuple[float, list[list[int]]]:
    started = time.perf_counter()
    outputs = deployment.generate(prompts, params)
    return time.perf_counter() - started, [o.output_token_ids for o in outputs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="toy", choices=["toy", *REAL_SHAPES])
    parser.add_argument("--checkpoint", help="directory of the checkpoint (built there when empty)")
    parser.add_argument("--configs", default="1x1,1x2", help="RxW, comma-separated")
    parser.add_argument("--concurrency", default="2,8,32", help="requests at once, comma-separated")
    parser.add_argument("--tokens", type=int, default=32, help="output tokens per request")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--plot", help="write a bar plot of on/off per configuration and concurrency here")
    parser.add_argument("--no-pin", action="store_true", help="cpu.pin_threads: false (the OS places the threads)")
    args = parser.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]
    params = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
    results = []  # (config, C, off tok/s, on tok/s, same)
    with tempfile.TemporaryDirectory() as scratch:
        path, dtype = checkpoint(args, scratch)
        print(f"machine: {machine_description()}\nmodel: {args.model} ({dtype}), {args.tokens} tokens a request, "
              f"{args.rounds} rounds, off and on alternating", flush=True)
        ensure_ray()
        for label in args.configs.split(","):
            routers, workers = (int(n) for n in label.split("x"))
            config = parse_cluster_config({"model": path, "device": "cpu", "dtype": dtype, "routers": routers,
                                           "expert_workers": workers, "placement": {"strategy": "round_robin"},
                                           "engine": {"max_num_seqs": max(levels), "max_model_len": 512,
                                                      "kv_cache_bytes": 256 * 2**20},
                                           "cpu": {"pin_threads": not args.no_pin}})
            deployment = deploy(config, name=f"micro-{label}")
            try:
                prompts = [p for p, _ in workload(max(levels), prompt_range=(16, 32))]
                deployment.generate(prompts[:2], SamplingParams(max_tokens=2, temperature=0.0))  # warm
                for concurrency in levels:
                    walls: dict[int, list[float]] = {0: [], 2: []}
                    tokens: dict[int, list[list[int]]] = {}
                    for _ in range(args.rounds):
                        for least in (0, 2):
                            ray.get([r.set_micro_batch_min_seqs.remote(least) for r in deployment.routers])
                            wall, tokens[least] = timed(deployment, prompts[:concurrency], params)
                            walls[least].append(wall)
                    pongs = sum(ray.get(r.info.remote())["ping_pong_steps"] for r in deployment.routers)
                    off, on = (concurrency * args.tokens / statistics.median(walls[k]) for k in (0, 2))
                    same = tokens[0] == tokens[2]
                    results.append((label, concurrency, off, on, same))
                    print(f"{label:>5} C={concurrency:<3} off {off:9.1f} tok/s  on {on:9.1f} tok/s  on/off "
                          f"{on / off:5.2f}  (rounds off {[round(w, 2) for w in walls[0]]} s, on "
                          f"{[round(w, 2) for w in walls[2]]} s; ping-pong steps so far {pongs}; "
                          f"tokens equal: {same})", flush=True)
            finally:
                deployment.shutdown()
        ray.shutdown()
    if args.plot:
        write_plot(results, args.plot, f"{args.model}, {args.tokens} tokens a request")


def write_plot(results, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{config}\nC={c}" for config, c, *_ in results]
    ratios = [on / off for _, _, off, on, _ in results]
    figure, axis = plt.subplots(figsize=(max(5, 0.9 * len(results)), 3.5))
    axis.bar(range(len(results)), ratios, color=["tab:green" if r >= 1 else "tab:red" for r in ratios])
    axis.axhline(1.0, color="black", linewidth=0.8)
    axis.set_xticks(range(len(results)), labels, fontsize=8)
    axis.set_ylabel("tok/s, micro-batches on / off")
    axis.set_title(f"Ping-pong micro-batches: {title}", fontsize=9)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    print(f"plot: {path}")


if __name__ == "__main__":
    main()
