"""End to end over HTTP: `raymoe serve` under `raymoe bench`'s load generator vs transformers
``generate()`` in static batches, at concurrency 1, 8 and 32, on the same checkpoint and prompts.

The checkpoint is benchmarks/common.py's random Mixtral (hidden 256, 4 layers, 8 experts,
top-2). At concurrency C, both sides get the same ``max(16, 2C)`` requests (prompt 4-64
tokens, output 8-64 tokens, greedy, EOS ignored): raymoe serves them to C closed-loop
streaming clients (1 router, 2 expert workers, gloo, after 2 warm-up requests);
transformers runs them in static batches of C (left-padded, each batch to its longest
output, after a warm-up call). At each concurrency generate() runs first, with the server
idle, then the served run.
Prints output tokens/s of both, the ratio, and raymoe's TTFT and ITL at P50 and P99.

    python benchmarks/bench_e2e_concurrency.py [--concurrency 1 8 32] [--output OUT.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import torch

from bench_e2e import run_transformers
from common import build_mixtral, machine_description, workload
from raymoe.cluster import bench_report, loadgen
from raymoe.cluster.serve_process import ServeProcess

CLUSTER_YAML = """\
model: {model}
device: cpu
dtype: float32
routers: 1
expert_workers: 2
placement:
  strategy: round_robin
comm:
  backend: gloo
engine:
  max_num_seqs: 64
"""


def num_requests(concurrency: int) -> int:
    return max(16, 2 * concurrency)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--output", help="write the figures as JSON, and the latency plot beside it")
    args = parser.parse_args()
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # loopback-only Ray for the server
    requests = workload(num_requests(max(args.concurrency)))
    rows: dict[int, dict] = {}
    with tempfile.TemporaryDirectory() as folder:
        model = build_mixtral(os.path.join(folder, "model"))
        config = os.path.join(folder, "cluster.yaml")
        with open(config, "w") as handle:
            handle.write(CLUSTER_YAML.format(model=os.path.join(folder, "model")))
        runs = []
        server = ServeProcess.raymoe(config, host="127.0.0.1", ready_timeout_s=600)
        print(f"serving {config} at {server.url}", file=sys.stderr)
        with server:
            name = loadgen.served_model(server.url)
            # Each concurrency runs both sides back to back (the server idles while generate()
            # runs), so that background load on a shared machine hits both alike.
            for concurrency in args.concurrency:
                batch = requests[: num_requests(concurrency)]
                elapsed, tokens, _ = run_transformers(model, batch, concurrency)
                rows[concurrency] = {"requests": len(batch), "generate_tokens_per_s": tokens / elapsed}
                bench = [loadgen.BenchRequest(p, n) for p, n in batch]
                results, not_sent = loadgen.run_load(server.url, name, bench, concurrency=concurrency, warmup=2,
                                                     max_seconds=300)
                summary = bench_report.summarize(results, slo_ttft_ms=2000, slo_itl_ms=200, num_not_sent=not_sent)
                if summary["requests_failed"] or not_sent:
                    raise SystemExit(f"concurrency {concurrency}: {summary['requests_failed']} failed, "
                                     f"{not_sent} not sent: {summary['errors']}")
                rows[concurrency].update(summary=summary, raymoe_tokens_per_s=summary["output_tokens_per_s"])
                runs.append((f"concurrency {concurrency}", results, summary))
                print(f"concurrency {concurrency}: generate {tokens / elapsed:.1f} tok/s, "
                      f"raymoe {summary['output_tokens_per_s']:.1f} tok/s", file=sys.stderr)
    print(f"machine: {machine_description()}")
    print(f"{'conc.':>5} {'reqs':>5} {'raymoe tok/s':>13} {'generate tok/s':>15} {'ratio':>6} "
          f"{'TTFT P50':>9} {'TTFT P99':>9} {'ITL P50':>8} {'ITL P99':>8}  (ms)")
    for concurrency, row in rows.items():
        ttft, itl = row["summary"]["ttft_ms"], row["summary"]["itl_ms"]
        row["ratio"] = row["raymoe_tokens_per_s"] / row["generate_tokens_per_s"]
        print(f"{concurrency:>5} {row['requests']:>5} {row['raymoe_tokens_per_s']:>13.1f} "
              f"{row['generate_tokens_per_s']:>15.1f} {row['ratio']:>5.2f}x {ttft['p50']:>9.1f} {ttft['p99']:>9.1f} "
              f"{itl['p50']:>8.1f} {itl['p99']:>8.1f}")
    if args.output:
        with open(args.output, "w") as handle:
            json.dump({"machine": machine_description(), "torch_threads": torch.get_num_threads(),
                       "rows": {str(c): {k: v for k, v in row.items() if k != "summary"} | {
                           "ttft_ms": row["summary"]["ttft_ms"], "itl_ms": row["summary"]["itl_ms"]}
                           for c, row in rows.items()}}, handle, indent=2)
        bench_report.write_plot(runs, os.path.splitext(args.output)[0] + ".png")


if __name__ == "__main__":
    main()
