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
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from typing import Any

from raymoe.cluster import bench_report, loadgen

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
                with ServedConfig(config) as server:
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


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ServedConfig:
    """`raymoe serve CONFIG` as a child process on a free loopback port, for ``--compare``.

    Its output goes to our stderr; it is ready once ``/health`` answers 200. Leaving the block sends SIGINT (what `raymoe serve` shuts down
    on) and kills its process group if it does not exit within a minute.
    """

    def __init__(self, config: str):
        self.config = config
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> "ServedConfig":
        print(f"raymoe bench: serving {self.config} at {self.url}", file=sys.stderr)
        self.process = subprocess.Popen(
            [sys.executable, "-m", "raymoe.cluster.cli", "serve", self.config, "--host", "127.0.0.1",
             "--port", str(self.port)],
            stdout=sys.stderr, stderr=sys.stderr, start_new_session=True)
        try:
            self._wait_ready()
        except BaseException:
            self.__exit__()
            raise
        return self

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + SERVE_READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"raymoe serve {self.config} exited with {self.process.returncode}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=5) as response:
                    if response.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"raymoe serve {self.config} was not healthy within {SERVE_READY_TIMEOUT_S} s")

    def __exit__(self, *_: Any) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(10)
