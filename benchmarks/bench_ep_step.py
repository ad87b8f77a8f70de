"""Expert-parallel step breakdown vs the in-process engine, on the same workload.

Deploys each ``--configs`` entry (``RxW``: R routers, W expert workers; gloo on CPU, a local
Ray) and runs the same batch as the in-process engine. Prints, per configuration, wall time
(and its ratio to the in-process engine's), whether the greedy outputs are identical, and
the per-step split router 0's telemetry records, as medians over the decode steps (the
prefill step is left out): dense part (attention, gates, sampling), dispatch (planning and
packing rows), expert compute (the slowest worker) and combine (moving rows and sums, and
waiting for the other routers of the step).

    python benchmarks/bench_ep_step.py [--requests 32] [--tokens 32] [--configs 1x1,1x4,2x4]
        [--worker-threads 1,2] [--backends gloo,sockets]

``--worker-threads`` runs each configuration once per value of ``cpu.worker_threads`` (threads
running a layer's experts side by side in a worker), so a run shows what they buy. The
"interval" column is the median time from one step's start to the next (what the step loop
spends outside the step shows as interval minus total).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import ray

from common import build_mixtral, machine_description, workload
from raymoe.cluster.config import parse_cluster_config
from raymoe.cluster.deploy import deploy, ensure_ray
from raymoe.engine.engine import EngineConfig, LLMEngine
from raymoe.engine.sampling_params import SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=32, help="output tokens per request")
    parser.add_argument("--configs", default="1x1,1x4,2x4", help="RxW: routers x expert workers, comma-separated")
    parser.add_argument("--worker-threads", default="1", help="cpu.worker_threads values, comma-separated")
    parser.add_argument("--backends", default="auto", help="comm.backend values, comma-separated (e.g. gloo,sockets)")
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
        print(f"machine: {machine_description()}")
        print(f"in-process engine: {local_s:.3f} s for {args.requests} requests x {args.tokens} tokens")
        ensure_ray()  # a Ray of its own on loopback, actors at normal priority, as `raymoe serve` runs
        print(f"{'RxW':>5} {'backend':>7} {'threads':>7} | {'wall s':>7} {'vs local':>8} | decode step ms (median): {'dense':>6} "
              f"{'dispatch':>8} {'experts':>8} {'combine':>8} {'total':>6} {'interval':>8} | same")
        runs = [(label, backend, threads) for label in args.configs.split(",") for backend in args.backends.split(",")
                for threads in args.worker_threads.split(",")]
        for label, backend, threads in runs:
            routers, workers = (int(n) for n in label.split("x"))
            config = parse_cluster_config({"model": path, "device": "cpu", "dtype": "float32", "routers": routers,
                                           "expert_workers": workers, "placement": {"strategy": "round_robin"},
                                           "cpu": {"worker_threads": int(threads)}, "comm": {"backend": backend}})
            deployment = deploy(config, name=f"bench-{label}-{backend}-{threads}")
            used = sorted({info["compute_threads"] for info in ray.get([w.info.remote() for w in deployment.workers])})
            try:
                deployment.generate(prompts[:2], SamplingParams(max_tokens=2, temperature=0.0))
                skip = len(deployment.telemetry()[0]["steps"])
                started = time.perf_counter()
                outputs = deployment.generate(prompts, params)
                wall = time.perf_counter() - started
                records = [r for r in deployment.telemetry()[0]["steps"][skip:] if r["tokens"] <= args.requests]
                split = {k: 1e3 * statistics.median(r[k] for r in records)
                         for k in ("dense_s", "dispatch_s", "expert_s", "combine_s")}
                starts = [r["started"] for r in records]
                interval = 1e3 * statistics.median(b - a for a, b in zip(starts, starts[1:]))
                same = sum(a.output_token_ids == b.output_token_ids for a, b in zip(outputs, reference))
                print(f"{label:>5} {backend:>7} {','.join(map(str, used)):>7} | {wall:7.3f} {wall / local_s:7.2f}x | {'':24}"
                      f"{split['dense_s']:6.2f} {split['dispatch_s']:8.2f} {split['expert_s']:8.2f} "
                      f"{split['combine_s']:8.2f} {sum(split.values()):6.2f} {interval:8.2f} | {same}/{len(prompts)}")
            finally:
                deployment.shutdown()
        ray.shutdown()


if __name__ == "__main__":
    main()
