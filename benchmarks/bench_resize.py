"""Resizing measured (issue 31 item 1): the expert pool grown and shrunk under streaming load
through ``POST /admin/scale``; what the clients saw, per resize.

Starts `raymoe serve` (its own local Ray, loopback only) on the random-weight Mixtral of
benchmarks/common.py (4 layers, 8 experts, top-2, hidden 256, expert intermediate 512), CPU,
float32, 1 router, ``--start`` expert workers placed round robin (4 slots each with the
default 2: every expert once; ``--redundant`` adds replica slots), the balancer's spare rows on
but its decisions off. Then, for
each size in ``--sizes`` (default 3, 4, 2, then 1, which the experts do not fit and must be
refused), ``--streams`` streamed completions of ``--tokens`` tokens (half greedy, half seeded at
temperature 0.9) run; once each has ``--warm-tokens`` tokens the resize is asked for and every
token's arrival is recorded. A first load without a resize gives the reference tokens.

Per resize: how many streams still ran when the resize answered (all of them, or the pause
below did not see the whole resize), the seconds from the call to its answer (the deployment then serves at the new
size: the answer comes after the routers switched), the controller's own count of it, how long
routers waited for the group rebuild, the longest pause between two token events of any stream
while the resize ran (and without one: the baseline), streams lost and streams whose tokens
differ from the reference, and the expert bytes copied against copying every expert once.

    python benchmarks/bench_resize.py [--start 2] [--sizes 3,4,2,1] [--redundant 0] [--streams 8]
        [--tokens 800] [--out resize.json]
    python benchmarks/bench_resize.py --start 3 --redundant 1 --sizes 2,3   # a shrink that copies

Timings depend on the machine's load: on a shared machine they are noisy.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_recovery import is_lost, request_body, run_stream, token_ids  # noqa: E402
from raymoe.cluster.serve_process import ServeProcess  # noqa: E402

ADMIN_TOKEN = "bench-resize-token"
STREAM_TIMEOUT_S = 300


def pause_during(streams: list[dict], start: float, end: float) -> float:
    """The longest gap between two consecutive token events of any stream that overlaps
    [start, end] (a stream paused by the resize has a gap spanning part of it)."""
    longest = 0.0
    for stream in streams:
        times = [t for t, ids in stream["events"] if ids]
        for a, b in zip(times, times[1:]):
            if b >= start and a <= end:
                longest = max(longest, b - a)
    return longest


def longest_gap(streams: list[dict]) -> float:
    """The longest gap between two consecutive token events of any stream, the whole load."""
    return pause_during(streams, float("-inf"), float("inf"))


def scale(url: str, workers: int, timeout_s: float = 600) -> tuple[int, dict]:
    request = urllib.request.Request(f"{url}/admin/scale", data=json.dumps({"workers": workers}).encode(),
                                     headers={"Authorization": f"Bearer {ADMIN_TOKEN}",
                                              "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def load(server, args, workers: int | None) -> dict[str, Any]:
    """One load; ``workers``: resize to that many once every stream is warm (None: no resize)."""
    records = [{"events": [], "error": None, "end": None} for _ in range(args.streams)]
    threads = []
    for i in range(args.streams):
        first = threading.Event()
        thread = threading.Thread(target=run_stream, daemon=True,
                                  args=(server.port, request_body(i, args.tokens), records[i], first))
        thread.start()
        threads.append(thread)
        first.wait(60)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not all(
            len(token_ids(r)) >= args.warm_tokens or r["end"] is not None for r in records):
        time.sleep(0.02)
    result: dict[str, Any] = {"workers": workers}
    if workers is not None:
        called = time.monotonic()
        code, report = scale(server.url, workers)
        answered = time.monotonic()
    for thread in threads:
        thread.join(STREAM_TIMEOUT_S)
    if workers is not None:  # (a stream that ended before the answer did not see all of the resize)
        result.update(code=code, call_s=answered - called, report=report,
                      pause_s=pause_during(records, called, answered),
                      spanned=sum(any(t > answered for t, ids in r["events"] if ids) for r in records))
    result.update(tokens=[token_ids(r) for r in records], lost=sum(is_lost(r, args.tokens) for r in records),
                  longest_gap_s=longest_gap(records))
    return result


def row(result: dict, reference: list[list[int]]) -> dict[str, Any]:
    report = result.get("report") or {}
    error = report.get("error", {}) if isinstance(report.get("error"), dict) else {}
    return {
        "to": result["workers"], "http": result.get("code"),
        "from": report.get("workers_before"),
        "call_s": round(result["call_s"], 2) if "call_s" in result else None,
        "controller_s": round(report["seconds"], 2) if "seconds" in report else None,
        "group_pause_s": round(report["pause_s"], 3) if "pause_s" in report else None,
        "stream_pause_s": round(result["pause_s"], 3) if "pause_s" in result else None,
        "streams_past_answer": result.get("spanned"),
        "longest_gap_s": round(result["longest_gap_s"], 3),
        "lost": result["lost"], "differing": sum(t != r for t, r in zip(result["tokens"], reference)),
        "reserve_s": _round(report.get("reserve_s")), "start_s": _round(report.get("start_s")),
        "copy_s": _round(report.get("copy_s")),
        "copies": report.get("copies"), "bytes_copied": report.get("bytes_copied"),
        "bytes_all_experts": report.get("bytes_all_experts"),
        "refused": error.get("message") if error else None,
    }


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--start", type=int, default=2, help="expert workers at start")
    parser.add_argument("--sizes", default="3,4,2,1", help="comma-separated sizes to resize to, in order")
    parser.add_argument("--redundant", type=int, default=0,
                        help="placement.redundant_slots_per_worker (slots beyond ceil(8 / start))")
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=800, help="tokens per stream: enough to outlast a resize")
    parser.add_argument("--warm-tokens", type=int, default=20)
    parser.add_argument("--out", default=None, help="write the rows and series as JSON here")
    args = parser.parse_args(argv)
    from common import build_mixtral, machine_description

    folder = tempfile.mkdtemp(prefix="bench-resize-")
    model = os.path.join(folder, "mixtral")
    build_mixtral(model)
    config = os.path.join(folder, "cluster.yaml")
    with open(config, "w") as handle:
        handle.write(f"model: {model}\ndevice: cpu\ndtype: float32\nrouters: 1\nexpert_workers: {args.start}\n"
                     f"placement:\n  strategy: round_robin\n  redundant_slots_per_worker: {args.redundant}\n"
                     "balancer:\n  interval_steps: 1000000000\n  poll_interval_s: 0.2\n")
    env = dict(os.environ, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", RAYMOE_ADMIN_TOKEN=ADMIN_TOKEN)
    server = ServeProcess.raymoe(config, log_path=os.path.join(folder, "serve.log"), env=env)
    server.start()
    rows = []
    try:
        server.wait_ready(300, interval_s=1)
        print(f"machine: {machine_description()}", flush=True)
        base = load(server, args, None)
        reference = base["tokens"]
        rows.append(dict(row(base, reference), to=None))
        print(f"no resize: {rows[-1]}", flush=True)
        for size in [int(s) for s in args.sizes.split(",") if s]:
            rows.append(row(load(server, args, size), reference))
            print(f"resize to {size}: {rows[-1]}", flush=True)
    finally:
        server.stop(90)
    if args.out:
        with open(args.out, "w") as handle:
            json.dump({"machine": machine_description(), "args": vars(args), "rows": rows}, handle, indent=2)


if __name__ == "__main__":
    main()
