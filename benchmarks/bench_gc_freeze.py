"""The router's garbage-collector pauses while serving, with and without freezing what loading
built (actors/heap_freeze.py, ``RAYMOE_GC_FREEZE``), alternating in one run.

Each configuration starts a local Ray whose worker processes run benchmarks/gc_pause_hook.py
(every collection's generation and duration), deploys 1 router x 1 CPU worker of the random toy
Mixtral (benchmarks/common.py, float32) and serves ``--rounds`` batches of 32 requests (32 prompt
tokens, 64 out, greedy, EOS ignored) back to back through ``generate()`` (no HTTP). Printed per
run: output tok/s, the router's and the worker's CPU microseconds per token (/proc), the router's
collections during serving by generation (count, total ms, longest ms), and the longest gap
between two step starts in the router's telemetry (a full collection stalls every stream).

    python benchmarks/bench_gc_freeze.py [--alternations 3] [--rounds 8]
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import tempfile
import time

import ray
import torch

from common import build_mixtral, machine_description
from raymoe.actors.heap_freeze import ENV
from raymoe.cluster import procfs
from raymoe.cluster.config import parse_cluster_config
from raymoe.cluster.deploy import deploy
from raymoe.engine.sampling_params import SamplingParams

HERE = os.path.dirname(os.path.abspath(__file__))
REQUESTS, PROMPT_TOKENS, OUTPUT_TOKENS = 32, 32, 64


def cpu_seconds(pid: int) -> float:
    return procfs.cpu_seconds(procfs.stat(pid))


def router_pauses(directory: str, pid: int, since: float) -> dict[int, tuple[int, float, float]]:
    """generation -> (collections, total ms, longest ms) of ``pid`` that ended after ``since``."""
    try:
        with open(os.path.join(directory, f"{pid}.json")) as f:
            pauses = json.load(f)["pauses"]
    except (OSError, ValueError):
        return {}
    out: dict[int, list[float]] = {}
    for generation, seconds, ended in pauses:
        if ended >= since:
            out.setdefault(generation, []).append(seconds * 1e3)
    return {g: (len(v), sum(v), max(v)) for g, v in sorted(out.items())}


def one_run(path: str, freeze: bool, rounds: int) -> dict:
    with tempfile.TemporaryDirectory() as pauses_dir:
        python_path = os.pathsep.join(p for p in (HERE, os.environ.get("PYTHONPATH", "")) if p)
        ray.init(address="local", include_dashboard=False, runtime_env={
            "worker_process_setup_hook": "gc_pause_hook.install",
            "env_vars": {"RAYMOE_GC_PAUSES_DIR": pauses_dir, "PYTHONPATH": python_path, ENV: "1" if freeze else "0"}})
        try:
            config = parse_cluster_config({"model": path, "device": "cpu", "dtype": "float32", "routers": 1,
                                           "expert_workers": 1})
            deployment = deploy(config, name="gc-freeze")
            try:
                router, worker = (ray.get(h.info.remote()) for h in (deployment.routers[0], deployment.workers[0]))
                generator = torch.Generator().manual_seed(1)
                params = SamplingParams(max_tokens=OUTPUT_TOKENS, temperature=0.0, ignore_eos=True)
                deployment.generate([[5] * PROMPT_TOKENS] * 2, SamplingParams(max_tokens=4, temperature=0.0))
                skip = len(deployment.telemetry()[0]["steps"])
                since, cpu = time.time(), (cpu_seconds(router["pid"]), cpu_seconds(worker["pid"]))
                started = time.perf_counter()
                for _ in range(rounds):
                    prompts = [torch.randint(4, 512, (PROMPT_TOKENS,), generator=generator).tolist()
                               for _ in range(REQUESTS)]
                    deployment.generate(prompts, params)
                seconds = time.perf_counter() - started
                tokens = rounds * REQUESTS * OUTPUT_TOKENS
                used = (cpu_seconds(router["pid"]) - cpu[0], cpu_seconds(worker["pid"]) - cpu[1])
                starts = [s["started"] for s in deployment.telemetry()[0]["steps"][skip:]]
                time.sleep(1.5)  # the hook's last dump
                return {"freeze": freeze, "tok_s": tokens / seconds, "router_us": 1e6 * used[0] / tokens,
                        "worker_us": 1e6 * used[1] / tokens, "frozen": router.get("frozen_objects", 0),
                        "pauses": router_pauses(pauses_dir, router["pid"], since),
                        "longest_gap_ms": 1e3 * max(b - a for a, b in zip(starts, starts[1:]))}
            finally:
                deployment.shutdown()
        finally:
            ray.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--alternations", type=int, default=3, help="frozen, then not, this many times")
    parser.add_argument("--rounds", type=int, default=8, help="batches of 32 requests per run")
    args = parser.parse_args()
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    with tempfile.TemporaryDirectory() as path:
        build_mixtral(path)
        print(f"machine: {machine_description()}; 1x1, toy Mixtral float32, {args.rounds} x {REQUESTS} requests "
              f"of {PROMPT_TOKENS} in / {OUTPUT_TOKENS} out per run")
        print(f"{'frozen':>6} {'objects':>8} {'tok/s':>7} {'router us/tok':>13} {'worker us/tok':>13} "
              f"{'longest step gap ms':>19}  router collections while serving: gen (count, total ms, longest ms)")
        for _ in range(args.alternations):
            for freeze in (True, False):
                r = one_run(path, freeze, args.rounds)
                pauses = "  ".join(f"{g}: ({n}, {total:.1f}, {most:.1f})" for g, (n, total, most) in r["pauses"].items())
                print(f"{'yes' if freeze else 'no':>6} {r['frozen']:>8} {r['tok_s']:7.0f} {r['router_us']:13.1f} "
                      f"{r['worker_us']:13.1f} {r['longest_gap_ms']:19.1f}  {pauses}", flush=True)


if __name__ == "__main__":
    main()
