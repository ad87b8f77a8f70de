"""Where a served decode step's CPU goes, phase by phase, against the in-process engine's step.

The same random Mixtral as the other benchmarks (benchmarks/common.py) and the same workload
for both sides: ``--requests`` sequences of 16 prompt tokens decoding ``--tokens`` tokens.

1. The in-process engine (the reference) on one pinned core, torch on one thread: its decode
   step (median) and the part of it spent in the experts.
2. A deployment (``--config 1xW``, default ``1x1``: 1 router, W expert workers, CPU defaults) on a
   local Ray whose worker processes run benchmarks/served_phases_hook.py: thread-CPU timers
   around the router's and the worker's phases. Prints CPU ms per step for each phase, their
   sum, the telemetry's median step interval (wall), and the ratio of the served sum to the
   in-process step.

A sum near the interval says the step is CPU-bound (the router and the worker take turns on
one core with the CPU defaults). The router's "dense + sampling" is its engine step minus the
plan, exchange and telemetry; its "exchange" includes packing rows, posting the messages,
reading the sums and combining them (not the time spent waiting for the worker, which is not
CPU). The worker's "transport" is its headers and layer work outside the experts.

    python benchmarks/bench_served_phases.py [--requests 1,32] [--tokens 64] [--config 1x1]
    python benchmarks/bench_served_phases.py --checkpoint DIR --dtype bfloat16 --requests 1 --config 1x2

``--checkpoint`` takes an existing checkpoint instead of the random toy Mixtral: the real-shape
ones bench_vs_vllm.py builds (``~/.cache/raymoe/real-qwen3-30b-a3b-4l``), in ``--dtype``.

With several workers, a worker phase is the sum over the workers (CPU per step on any core).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import tempfile
import time

import ray
import torch

from common import build_mixtral, machine_description
from raymoe.cluster.config import parse_cluster_config
from raymoe.cluster.deploy import deploy
from raymoe.engine import engine as engine_module
from raymoe.engine import experts as local_experts
from raymoe.engine import model as model_module
from raymoe.engine.engine import EngineConfig, LLMEngine
from raymoe.engine.sampling_params import SamplingParams

HERE = os.path.dirname(os.path.abspath(__file__))
PROMPT_TOKENS = 16


def prompts_for(count: int, seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(4, 512, (PROMPT_TOKENS,), generator=generator).tolist() for _ in range(count)]


def in_process_steps(path: str, counts: list[int], tokens: int,
                     dtype: str = "float32") -> tuple[dict[int, tuple[float, float]], dict]:
    """Per request count: (median decode step ms, median experts ms), on one pinned core; and
    per count the medians of the step's parts (``forward``, ``sample``, ``postprocess``, ms)."""
    affinity = os.sched_getaffinity(0)
    threads = torch.get_num_threads()
    os.sched_setaffinity(0, {min(affinity)})
    torch.set_num_threads(1)
    spent = [0.0]
    parts: dict[str, float] = {}
    original = local_experts.LocalExperts.forward

    def timed(self, *args, **kwargs):
        started = time.perf_counter()
        try:
            return original(self, *args, **kwargs)
        finally:
            spent[0] += time.perf_counter() - started

    def part(name, function):
        def wrapper(*args, **kwargs):
            started = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                parts[name] = parts.get(name, 0.0) + time.perf_counter() - started
        return wrapper

    originals = (model_module.MoEModel.forward, engine_module.sample, engine_module.LLMEngine._postprocess)
    local_experts.LocalExperts.forward = timed
    model_module.MoEModel.forward = part("forward", originals[0])
    engine_module.sample = part("sample", originals[1])
    engine_module.LLMEngine._postprocess = part("postprocess", originals[2])
    details: dict[int, dict[str, float]] = {}
    try:
        engine = LLMEngine.from_pretrained(path, EngineConfig(dtype=dtype))
        results = {}
        for count in counts:
            steps, expert_parts, step_parts = [], [], []
            for round_ in range(2):
                for index, prompt in enumerate(prompts_for(count, seed=round_)):
                    engine.add_request(f"r{round_}-{count}-{index}", prompt,
                                       SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True))
                engine.step()  # the prefill
                while engine.has_unfinished():
                    decoding = len(engine.scheduler.running) == count
                    spent[0] = 0.0
                    parts.clear()
                    started = time.perf_counter()
                    engine.step()
                    if decoding and round_:  # the first round warms up
                        steps.append(time.perf_counter() - started)
                        expert_parts.append(spent[0])
                        step_parts.append(dict(parts))
            results[count] = (1e3 * statistics.median(steps), 1e3 * statistics.median(expert_parts))
            details[count] = {name: 1e3 * statistics.median(p.get(name, 0.0) for p in step_parts)
                              for name in ("forward", "sample", "postprocess")}
        del engine  # (its weights, before the deployment loads its own)
        return results, details
    finally:
        local_experts.LocalExperts.forward = original
        model_module.MoEModel.forward, engine_module.sample, engine_module.LLMEngine._postprocess = originals
        torch.set_num_threads(threads)
        os.sched_setaffinity(0, affinity)


def read_phases(directory: str) -> dict[int, dict]:
    out = {}
    for name in glob.glob(os.path.join(directory, "*.json")):
        try:
            with open(name) as f:
                data = json.load(f)
        except (OSError, ValueError):
            continue
        out[data["pid"]] = data
    return out


def difference(before: dict[int, dict], after: dict[int, dict]) -> tuple[dict[str, float], dict[str, float]]:
    """(router phases, worker phases) in ms per step between two readings."""
    router, worker = {}, {}
    for pid, now in after.items():
        then = before.get(pid, {"steps": 0, "seconds": {}})
        steps = now["steps"] - then["steps"]
        if steps <= 0:
            continue
        per_step = {name: 1e3 * (value - then["seconds"].get(name, 0.0)) / steps for name, value in now["seconds"].items()}
        target = router if "group_step" in per_step else worker if "serve" in per_step else None
        if target is not None:
            for name, value in per_step.items():
                target[name] = target.get(name, 0.0) + value
    return router, worker


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", default="1,32", help="sequences decoding together, comma-separated")
    parser.add_argument("--tokens", type=int, default=64, help="output tokens per request")
    parser.add_argument("--config", default="1x1", help="1xW: one router, W expert workers")
    parser.add_argument("--actor-env", action="append", default=[], metavar="KEY=VALUE",
                        help="an environment variable for the router and worker processes (repeatable), for A/B runs")
    parser.add_argument("--checkpoint", default=None, metavar="DIR",
                        help="an existing checkpoint instead of the random toy Mixtral (e.g. a real-shape one)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                        help="the dtype both sides serve in (default float32)")
    args = parser.parse_args()
    counts = [int(n) for n in args.requests.split(",")]
    routers, workers = (int(n) for n in args.config.split("x"))
    if routers != 1:
        # With several routers a step's phases are spread over routers that each hold part of
        # the batch (or none of it): "per step" has no single meaning. One router, any workers.
        parser.error(f"--config {args.config}: one router only (1xW); the workers' phases are summed over them")
    with tempfile.TemporaryDirectory() as path, tempfile.TemporaryDirectory() as phases_dir:
        if args.checkpoint:
            path = args.checkpoint
        else:
            build_mixtral(path)
        print(f"machine: {machine_description()}; checkpoint {path}, {args.dtype}")
        local, local_parts = in_process_steps(path, counts, args.tokens, args.dtype)
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
        os.environ.setdefault("RAY_worker_niceness", "0")
        python_path = os.pathsep.join(p for p in (HERE, os.environ.get("PYTHONPATH", "")) if p)
        ray.init(address="local", include_dashboard=False, runtime_env={
            "worker_process_setup_hook": "served_phases_hook.install",
            "env_vars": {"RAYMOE_PHASES_DIR": phases_dir, "PYTHONPATH": python_path,
                         **dict(item.split("=", 1) for item in args.actor_env)}})
        config = parse_cluster_config({"model": path, "device": "cpu", "dtype": args.dtype, "routers": routers,
                                       "expert_workers": workers})
        deployment = deploy(config, name=f"phases-{args.config}")
        rows = []
        try:
            deployment.generate(prompts_for(2), SamplingParams(max_tokens=4, temperature=0.0))
            for count in counts:
                params = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
                time.sleep(0.5)  # the last dumps of the previous run land
                before = read_phases(phases_dir)
                skip = len(deployment.telemetry()[0]["steps"])
                deployment.generate(prompts_for(count, seed=1), params)
                time.sleep(0.5)
                router, worker = difference(before, read_phases(phases_dir))
                records = deployment.telemetry()[0]["steps"][skip:]
                starts = [r["started"] for r in records if r["tokens"] == count]  # its decode steps
                interval = 1e3 * statistics.median(b - a for a, b in zip(starts, starts[1:])) if len(starts) > 2 else float("nan")
                rows.append((count, router, worker, interval))
        finally:
            deployment.shutdown()
            ray.shutdown()
    print(f"per decode step, CPU ms ({args.config}: the router's step thread and the workers' serving threads, "
          f"summed over the workers; in-process: the whole step on one pinned core)")
    header = (f"{'seqs':>4} | {'in-proc':>7} {'(experts)':>9} | {'dense+samp':>10} {'plan':>6} {'exchange':>8} "
              f"{'record':>6} {'outside':>7} {'loop':>6} | {'experts':>7} {'transport':>9} | {'sum':>6} "
              f"{'interval':>8} {'sum/in-proc':>11}")
    print(header)
    for count, router, worker, interval in rows:
        step, experts = local[count]
        engine_step = router.get("engine_step", 0.0)
        inner = router.get("plan", 0.0) + router.get("exchange", 0.0) + router.get("record", 0.0)
        dense = engine_step - inner
        outside = router.get("group_step", 0.0) - engine_step  # complete_step: trailers, telemetry's step end
        transport = worker.get("headers", 0.0) + worker.get("serve", 0.0) - worker.get("experts", 0.0)
        total = router.get("group_step", 0.0) + router.get("loop", 0.0) + worker.get("headers", 0.0) + worker.get("serve", 0.0)
        print(f"{count:>4} | {step:7.2f} {experts:9.2f} | {dense:10.2f} {router.get('plan', 0.0):6.2f} "
              f"{router.get('exchange', 0.0):8.2f} {router.get('record', 0.0):6.2f} {outside:7.2f} "
              f"{router.get('loop', 0.0):6.2f} | {worker.get('experts', 0.0):7.2f} {transport:9.2f} | {total:6.2f} "
              f"{interval:8.2f} {total / step:11.2f}")
    print("\nthe router's dense + sampling, split (CPU ms a step), beside the in-process engine's same parts "
          "(wall ms, experts taken out of its forward)")
    print(f"{'seqs':>4} | {'forward w/o MoE':>15} {'sample':>7} {'postproc':>8} {'rest':>6} | "
          f"{'in-proc fwd w/o experts':>23} {'sample':>7} {'postproc':>8} {'rest':>6}")
    for count, router, _, _ in rows:
        inner = router.get("plan", 0.0) + router.get("exchange", 0.0) + router.get("record", 0.0)
        forward = router.get("forward", 0.0) - inner
        sample, post = router.get("sample", 0.0), router.get("postprocess", 0.0)
        rest = router.get("engine_step", 0.0) - router.get("forward", 0.0) - sample - post
        step, experts = local[count]
        mine = local_parts[count]
        local_rest = step - mine["forward"] - mine["sample"] - mine["postprocess"]
        print(f"{count:>4} | {forward:15.2f} {sample:7.2f} {post:8.2f} {rest:6.2f} | "
              f"{mine['forward'] - experts:23.2f} {mine['sample']:7.2f} {mine['postprocess']:8.2f} {local_rest:6.2f}")


if __name__ == "__main__":
    main()
