"""`raymoe bench`: load-test an OpenAI-compatible endpoint, or compare two deployments.

    raymoe bench --url http://127.0.0.1:8000 --num-requests 100 --concurrency 8 [--output OUT.json]
    raymoe bench --url URL --request-rate 4 --num-requests 200          # open loop, Poisson arrivals
    raymoe bench --compare A.yaml B.yaml --num-requests 64 --concurrency 8 --output cmp.json

Prompt and output lengths come from ``--prompt-len`` / ``--output-len`` (``N``, ``LO:HI``,
``uniform:LO:HI``, ``normal:MEAN:STD``; prompts are random token ids) or from
``--dataset FILE.jsonl``. It prints TTFT, ITL, TPOT and end-to-end latency at P50/P95/P99,
output tokens/s, requests/s and SLO goodput (bench_report.py defines each); ``--output``
writes them as JSON with a PNG plot beside it (same name, ``.png``). ``--compare`` serves
each config in turn with `raymoe serve` on a free loopback port, runs the same workload
(same seed) against it, stops it, and prints the runs side by side.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from raymoe.cluster import bench_report, loadgen
from raymoe.cluster.serve_process import ServeProcess

SERVE_READY_TIMEOUT_S = 600


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("bench", help="load-test an endpoint: latency percentiles, throughput, goodput")
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument("--url", help="endpoint base URL, e.g. http://127.0.0.1:8000 (a trailing /v1 is fine)")
    target.add_argument("--compare", nargs=2, metavar=("CONFIG_A", "CONFIG_B"),
                        help="serve each cluster config in turn and run the same workload against both")
    parser.add_argument("--model", help="model name to send (default: the first one at URL/v1/models)")
    parser.add_argument("--num-requests", type=int, default=100, help="requests to send (default 100)")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--concurrency", type=int, help="closed loop: requests in flight (the default, 8)")
    mode.add_argument("--request-rate", type=float, help="open loop: Poisson arrivals per second")
    parser.add_argument("--prompt-len", default="16:64", help="prompt tokens: N, LO:HI, normal:MEAN:STD (16:64)")
    parser.add_argument("--output-len", default="16:64", help="output tokens, same forms (16:64)")
    parser.add_argument("--dataset", help="JSONL of {\"prompt\": text | [ids], \"max_tokens\": N} instead")
    parser.add_argument("--vocab-size", type=int, default=256, help="random prompt ids lie in [4, this) (256)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--warmup", type=int, default=1, help="requests sent first and left out (1)")
    parser.add_argument("--max-seconds", type=float, default=600.0, help="stop the run after this long (600)")
    parser.add_argument("--slo-ttft-ms", type=float, default=2000.0, help="goodput's TTFT target (2000)")
    parser.add_argument("--slo-itl-ms", type=float, default=200.0, help="goodput's target for a request's P99 ITL (200)")
    parser.add_argument("--output", help="write the JSON here, and the plot beside it as .png")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    parser.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    try:
        requests = _workload(args)
    except (ValueError, OSError) as error:
        print(f"raymoe bench: {error}", file=sys.stderr)
        return 2
    if args.compare:
        runs = []
        for config in args.compare:
            try:
                server = ServeProcess.raymoe(config, host="127.0.0.1", name=f"raymoe serve {config}",
                                             ready_timeout_s=SERVE_READY_TIMEOUT_S)
                print(f"raymoe bench: serving {config} at {server.url}", file=sys.stderr)
                with server:  # its output to our stderr; ready once /health answers; SIGINT on leaving
                    runs.append((config, *_bench(args, server.url, requests, label=config)))
            except (RuntimeError, OSError) as error:
                print(f"raymoe bench: {error}", file=sys.stderr)
                return 1
        print(bench_report.comparison_table([(label, summary) for label, _, summary in runs]))
        body: dict[str, Any] = {"runs": [dict(summary, label=label) for label, _, summary in runs]}
    else:
        try:
            results, summary = _bench(args, args.url, requests)
        except OSError as error:
            print(f"raymoe bench: cannot reach {args.url}: {error}", file=sys.stderr)
            return 1
        runs = [(args.url, results, summary)]
        body = summary
    if args.output:
        body["workload"] = _describe(args, requests)
        with open(args.output, "w") as handle:
            json.dump(body, handle, indent=2)
        plot = os.path.splitext(args.output)[0] + ".png"
        bench_report.write_plot(runs, plot)
        print(f"wrote {args.output} and {plot}")
    return 0 if all(summary["requests_ok"] for _, _, summary in runs) else 1


def _workload(args: argparse.Namespace) -> list[loadgen.BenchRequest]:
    if args.num_requests < 1:
        raise ValueError(f"--num-requests must be >= 1, got {args.num_requests}")
    if args.dataset:
        output = loadgen.LengthDistribution.parse(args.output_len)
        return loadgen.read_workload(args.dataset, args.num_requests, int(output.a))
    return loadgen.synthetic_workload(args.num_requests, loadgen.LengthDistribution.parse(args.prompt_len),
                                      loadgen.LengthDistribution.parse(args.output_len), args.vocab_size, args.seed)


def _bench(args: argparse.Namespace, url: str, requests, label: str | None = None) -> tuple[list, dict[str, Any]]:
    model = args.model or loadgen.served_model(url)
    concurrency = None if args.request_rate else (args.concurrency or 8)
    loop = f"open loop, {args.request_rate:g} req/s" if args.request_rate else f"closed loop, concurrency {concurrency}"
    print(f"raymoe bench: {len(requests)} requests to {url} ({model}), {loop}", file=sys.stderr)
    progress = loadgen.ProgressBar(len(requests), enabled=not args.no_progress)
    results, num_not_sent = loadgen.run_load(
        url, model, requests, concurrency=concurrency, request_rate=args.request_rate,
        max_seconds=args.max_seconds, seed=args.seed, warmup=args.warmup, progress=progress)
    progress.close()
    summary = bench_report.summarize(results, args.slo_ttft_ms, args.slo_itl_ms, num_not_sent)
    summary["loop"] = loop
    print(f"== {label or url}: {loop}")
    print(bench_report.format_summary(summary), flush=True)
    return results, summary


def _describe(args: argparse.Namespace, requests) -> dict[str, Any]:
    return {"num_requests": len(requests), "concurrency": None if args.request_rate else (args.concurrency or 8),
            "request_rate": args.request_rate, "prompt_len": None if args.dataset else args.prompt_len,
            "output_len": None if args.dataset else args.output_len, "dataset": args.dataset, "seed": args.seed,
            "warmup": args.warmup, "max_seconds": args.max_seconds}
