"""Expert-parallel step breakdown vs the in-process engine, on the same workload.

Deploys 1 router with 2 and then 4 expert workers (gloo on CPU, a local Ray) and runs the
same batch as the in-process engine. Prints, per configuration, wall time and the mean
per-step split the router's telemetry records: dense part, dispatch, expert compute
(slowest worker) and combine (which includes waiting for the workers), and the ratio of
wall time to the in-process engine's.

    python benchmarks/bench_ep_step.py [--requests 32] [--tokens 16]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import ray

from common import build_mixtral, machine_description, workload
from raymoe.cluster.config import parse_cluster_config
from raymoe.cluster.deploy import deploy
from raymoe.engine.engine import EngineConfig, LLMEngine
from raymoe.engine.sampling_params import SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=16, help="output tokens per request")
    parser.add_argument("--workers", default="2,4")
    args = parser.parse_args()
    requests = [(prompt, args.tokens) for prompt, _ in workload(args.requests)]
    params = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
    prompts = [p for p, _ in requests]
    with tempfile.TemporaryDirectory() as path:
        build_mixtral(path)
        engine = LLMEngine.from_pretrained(path, EngineConfig(dtype="float32"))
        engine.generate(prompts[:2], SamplingParams(max_tokens=2, temperature=0.0))
        started = time.perf_counter()
        reference = engine.generate(prompts, params)
        local_s = time.perf_counter() - started
        steps = engine.num_steps
        print(f"machine: {machine_description()}")
        print(f"in-process engine: {local_s:.3f} s for {args.requests} requests x {args.tokens} tokens")
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
        ray.init(include_dashboard=False)
        print(f"{'workers':>7} | {'wall s':>7} {'vs local':>8} | per step ms: {'dense':>7} {'dispatch':>8} "
              f"{'experts':>8} {'combine':>8} | {'steps':>5} same")
        for workers in [int(w) for w in args.workers.split(",")]:
            config = parse_cluster_config({"model": path, "device": "cpu", "dtype": "float32", "routers": 1,
                                           "expert_workers": workers, "placement": {"strategy": "round_robin"}})
            deployment = deploy(config, name=f"bench-{workers}")
            try:
                deployment.generate(prompts[:2], SamplingParams(max_tokens=2, temperature=0.0))
                skip = len(deployment.telemetry()[0]["steps"])
                started = time.perf_counter()
                outputs = deployment.generate(prompts, params)
                wall = time.perf_counter() - started
                records = deployment.telemetry()[0]["steps"][skip:]
                mean = {k: 1e3 * sum(r[k] for r in records) / len(records)
                        for k in ("dense_s", "dispatch_s", "expert_s", "combine_s")}
                same = sum(a.output_token_ids == b.output_token_ids for a, b in zip(outputs, reference))
                print(f"{workers:>7} | {wall:7.3f} {wall / local_s:7.2f}x | {'':13}{mean['dense_s']:7.2f} "
                      f"{mean['dispatch_s']:8.2f} {mean['expert_s']:8.2f} {mean['combine_s']:8.2f} | "
                      f"{len(records):>5} {same}/{len(prompts)}")
            finally:
                deployment.shutdown()
        print(f"(in-process engine: {steps} steps in total, including warm-up)")
        ray.shutdown()


if __name__ == "__main__":
    main()
