"""Autoscaling measured (issue 31 item 2): a bounded load ramp on a served deployment whose
expert pool is sized by the ``autoscale:`` policy alone; what the clients saw.

Starts `raymoe serve` (its own local Ray, loopback only) on the random-weight Mixtral of
benchmarks/common.py (4 layers, 8 experts, top-2), CPU, float32, 1 router, 1 expert worker
(8 slots: every expert, so every size fits) and ``autoscale: {min_workers: 1, max_workers:
--max-workers, target_rows_per_worker: --target, ...}``. First each of ``--prompts`` requests
runs alone (the reference tokens; half greedy, half seeded at temperature 0.9), then the ramp:
``--phases`` (concurrency:seconds, default 1 -> 16 -> 1) of streamed completions of ``--tokens``
tokens, each slot starting its next request when the last one ends, while the controller's
status is read every 0.2 s (``GET /admin/placement``).

Printed: the timeline (concurrency, workers, desired), failed requests, requests whose tokens
differ from the reference, and per resize the policy made: its direction, the seconds from
the decision to serving at the new size (the autoscaler calls the resize at once; the resize's
own seconds run to the routers' switch), the group pause, the longest pause any stream saw
while it ran, and the expert bytes copied against copying every expert once.

    python benchmarks/bench_autoscale.py [--phases 1:15,16:30,1:30] [--max-workers 3] [--target 8]
        [--tokens 48] [--out autoscale.json]

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
import urllib.request
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_recovery import is_lost, request_body, run_stream, token_ids  # noqa: E402
from bench_resize import pause_during  # noqa: E402
from raymoe.cluster.serve_process import ServeProcess  # noqa: E402

ADMIN_TOKEN = "bench-autoscale-token"


def parse_phases(text: str) -> list[tuple[int, float]]:
    """``"1:15,16:30,1:30"`` -> [(1, 15.0), (16, 30.0), (1, 30.0)]: concurrency, seconds."""
    phases = []
    for part in text.split(","):
        concurrency, _, seconds = part.partition(":")
        phases.append((int(concurrency), float(seconds)))
    if not phases or any(c < 1 or s <= 0 for c, s in phases):
        raise ValueError(f"--phases: expected concurrency:seconds pairs (each >= 1 and > 0), got {text!r}")
    return phases


def concurrency_at(phases: list[tuple[int, float]], elapsed: float) -> int:
    """The ramp's concurrency ``elapsed`` seconds in (0 after its end)."""
    for concurrency, seconds in phases:
        if elapsed < seconds:
            return concurrency
        elapsed -= seconds
    return 0


def resizes_seen(samples: list[dict]) -> list[dict]:
    """Each distinct resize the status samples show (by its ``time``), first sighting kept."""
    seen: dict[float, dict] = {}
    for sample in samples:
        last = sample.get("last_resize")
        if last and last.get("resized") and last["time"] not in seen:
            seen[last["time"]] = last
    return sorted(seen.values(), key=lambda r: r["time"])


def status(url: str) -> dict[str, Any]:
    request = urllib.request.Request(f"{url}/admin/placement", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--phases", default="1:15,16:30,1:30", help="concurrency:seconds, comma-separated")
    parser.add_argument("--max-workers", type=int, default=3)
    parser.add_argument("--target", type=float, default=8.0, help="autoscale.target_rows_per_worker")
    parser.add_argument("--cooldown", type=float, default=3.0)
    parser.add_argument("--window", type=float, default=2.0)
    parser.add_argument("--interval", type=float, default=0.5)
    parser.add_argument("--tokens", type=int, default=48, help="tokens per request")
    parser.add_argument("--prompts", type=int, default=16, help="distinct requests (reference run first)")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args(argv)
    phases = parse_phases(args.phases)
    from common import build_mixtral, machine_description

    folder = tempfile.mkdtemp(prefix="bench-autoscale-")
    model = os.path.join(folder, "mixtral")
    build_mixtral(model)
    config = os.path.join(folder, "cluster.yaml")
    with open(config, "w") as handle:
        handle.write(f"model: {model}\ndevice: cpu\ndtype: float32\nrouters: 1\nexpert_workers: 1\n"
                     "balancer:\n  interval_steps: 1000000000\n  poll_interval_s: 0.2\n"
                     f"autoscale:\n  min_workers: 1\n  max_workers: {args.max_workers}\n"
                     f"  target_rows_per_worker: {args.target}\n  band: 0.25\n  cooldown_s: {args.cooldown}\n"
                     f"  window_s: {args.window}\n  interval_s: {args.interval}\n")
    env = dict(os.environ, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", RAYMOE_ADMIN_TOKEN=ADMIN_TOKEN)
    server = ServeProcess.raymoe(config, log_path=os.path.join(folder, "serve.log"), env=env)
    server.start()
    try:
        server.wait_ready(300, interval_s=1)
        print(f"machine: {machine_description()}", flush=True)
        reference = []
        for i in range(args.prompts):
            record = {"events": [], "error": None, "end": None}
            run_stream(server.port, request_body(i, args.tokens), record, threading.Event())
            reference.append(token_ids(record))
        records: list[tuple[int, dict]] = []
        samples: list[dict] = []
        started = time.monotonic()
        total = sum(s for _, s in phases)
        done = threading.Event()

        def slot(k: int) -> None:
            n = 0
            while not done.is_set():
                if concurrency_at(phases, time.monotonic() - started) <= k:
                    time.sleep(0.05)
                    continue
                i = (k + n * 7) % args.prompts
                n += 1
                record = {"events": [], "error": None, "end": None}
                records.append((i, record))
                run_stream(server.port, request_body(i, args.tokens), record, threading.Event())

        def monitor() -> None:
            while not done.is_set():
                try:
                    s = status(server.url)
                    auto = s.get("autoscale") or {}
                    samples.append({"t": time.monotonic() - started, "workers": s["workers"],
                                    "desired": auto.get("desired_workers"), "reason": auto.get("reason"),
                                    "last_resize": auto.get("last_resize"), "resizing": s.get("resizing")})
                except Exception as error:  # noqa: BLE001 - shown, and the ramp goes on
                    samples.append({"t": time.monotonic() - started, "error": str(error)})
                time.sleep(0.2)

        threads = [threading.Thread(target=slot, args=(k,), daemon=True)
                   for k in range(max(c for c, _ in phases))]
        threads.append(threading.Thread(target=monitor, daemon=True))
        for thread in threads:
            thread.start()
        time.sleep(total)
        done.set()
        for thread in threads:
            thread.join(120)
    finally:
        server.stop(90)
    # (a monotonic origin: the streams' event times are time.monotonic() too)
    origin = started
    failed = sum(is_lost(r, args.tokens) for _, r in records)
    differing = sum(token_ids(r) != reference[i] for i, r in records if not is_lost(r, args.tokens))
    print(f"\nrequests: {len(records)}, failed {failed}, tokens differing from the reference {differing}")
    print("\ntimeline (s, concurrency, workers, desired):")
    last_line = None
    for sample in samples:
        if "error" in sample:
            continue
        line = (concurrency_at(phases, sample["t"]), sample["workers"], sample["desired"])
        if line != last_line:
            print(f"  {sample['t']:6.1f}  {line[0]:>3}  {line[1]}  {line[2]}   {sample['reason']}")
            last_line = line
    rows = []
    streams = [r for _, r in records]
    wall_origin = time.time() - (time.monotonic() - origin)  # a resize's time is wall-clock
    for resize in resizes_seen(samples):
        end = resize["time"] - wall_origin + origin
        begin = end - resize["seconds"]
        row = {"direction": "grow" if resize["workers"] > resize["workers_before"] else "shrink",
               "from": resize["workers_before"], "to": resize["workers"],
               "decision_to_serving_s": round(resize["seconds"], 2), "group_pause_s": round(resize["pause_s"], 3),
               "longest_stream_pause_s": round(pause_during(streams, begin, end), 3),
               "copies": resize["copies"], "bytes_copied": resize["bytes_copied"],
               "bytes_all_experts": resize.get("bytes_all_experts")}
        rows.append(row)
        print(f"resize: {row}")
    print(f"\nlongest stream pause over the whole ramp: {pause_during(streams, float('-inf'), float('inf')):.3f} s")
    if args.out:
        with open(args.out, "w") as handle:
            json.dump({"machine": machine_description(), "args": vars(args), "requests": len(records),
                       "failed": failed, "differing": differing, "resizes": rows,
                       "samples": [{k: v for k, v in s.items() if k != "last_resize"} for s in samples]},
                      handle, indent=2)


if __name__ == "__main__":
    main()
