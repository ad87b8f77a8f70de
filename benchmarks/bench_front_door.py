"""The front door's responsiveness (issue 30 item 3): ``GET /v1/models`` latency with and
without six ~900 kB completion prompts in flight.

Starts `raymoe serve` (its own local Ray, loopback only) on a tiny random-weight Mixtral
(benchmarks/common.py; 1 router x 1 expert worker, CPU, float32, ``serve.max_body_bytes`` 4 MiB)
and polls ``/v1/models`` one call after another:

  idle    nothing else in flight (``--seconds`` s)
  loaded  ``--prompts`` concurrent completions, each a ~``--kib`` KiB prompt string, re-posted
          as each one answers, for ``--seconds`` s. The tiny model's context is 1,024 tokens, so
          each is parsed and tokenized in full and then refused with a 400
          (``context_length_exceeded``), as a real server refuses an over-long prompt.

Prints p50, p99 and max of each phase, the prompts' answers and their mean time. ``--burn N``
runs N busy-looping processes meanwhile (a loaded machine, reproducibly).

    python benchmarks/bench_front_door.py [--prompts 6] [--kib 900] [--seconds 20] [--burn 0]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import multiprocessing
import os
import statistics
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from raymoe.cluster.serve_process import ServeProcess  # noqa: E402

WORDS = "lorem ipsum dolor sit amet "


def big_prompt(kib: int) -> bytes:
    return json.dumps({"prompt": WORDS * (kib * 1024 // len(WORDS)), "max_tokens": 4}).encode()


def post(url: str, body: bytes) -> int:
    request = urllib.request.Request(f"{url}/v1/completions", data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=300) as response:
            response.read()
            return response.status
    except urllib.error.HTTPError as error:
        error.read()
        return error.code


def poll(url: str, seconds: float, stop: threading.Event | None = None) -> list[float]:
    latencies = []
    end = time.monotonic() + seconds
    while time.monotonic() < end and not (stop and stop.is_set()):
        started = time.perf_counter()
        with urllib.request.urlopen(f"{url}/v1/models", timeout=30) as response:
            response.read()
        latencies.append(time.perf_counter() - started)
    return latencies


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * (len(ordered) - 1)))]


def summary(name: str, latencies: list[float]) -> str:
    return (f"{name}: {len(latencies)} calls, p50 {1e3 * statistics.median(latencies):.1f} ms, "
            f"p99 {1e3 * percentile(latencies, 0.99):.1f} ms, max {1e3 * max(latencies):.1f} ms")


def loaded(url: str, prompts: int, kib: int, seconds: float) -> tuple[list[float], list[int], list[float]]:
    body = big_prompt(kib)
    stop = threading.Event()
    codes: list[int] = []
    times: list[float] = []

    def sender() -> None:
        while not stop.is_set():
            started = time.perf_counter()
            codes.append(post(url, body))
            times.append(time.perf_counter() - started)

    with concurrent.futures.ThreadPoolExecutor(prompts) as pool:
        senders = [pool.submit(sender) for _ in range(prompts)]
        time.sleep(0.5)  # every prompt on its way
        latencies = poll(url, seconds)
        stop.set()
        for sender_done in senders:
            sender_done.result()
    return latencies, codes, times


def burn(until: float) -> None:
    while time.monotonic() < until:
        pass


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--kib", type=int, default=900)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--burn", type=int, default=0, help="busy-looping processes during both phases")
    args = parser.parse_args(argv)
    from common import build_mixtral, machine_description

    folder = tempfile.mkdtemp(prefix="raymoe-front-door-")
    model = os.path.join(folder, "tiny-mixtral")
    build_mixtral(model, hidden=64, layers=2, experts=4, top_k=2, intermediate=96, vocab=320)
    config = os.path.join(folder, "cluster.yaml")
    with open(config, "w") as handle:
        handle.write(f"model: {model}\ndevice: cpu\ndtype: float32\nrouters: 1\nexpert_workers: 1\n"
                     f"serve:\n  served_model_name: tiny\n  max_body_bytes: 4194304\n")
    env = dict(os.environ, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0")
    print(f"machine: {machine_description()}; load average {os.getloadavg()[0]:.1f}; "
          f"{args.prompts} prompts of {len(big_prompt(args.kib)) / 1e3:.0f} kB; burn {args.burn}; logs in {folder}",
          flush=True)
    with ServeProcess.raymoe(config, log_path=os.path.join(folder, "serve.log"), env=env) as server:
        poll(server.url, 2.0)  # warm
        burners = [multiprocessing.Process(target=burn, args=(time.monotonic() + 3 * args.seconds + 60,))
                   for _ in range(args.burn)]
        for process in burners:
            process.start()
        try:
            print(summary("/v1/models idle", poll(server.url, args.seconds)), flush=True)
            latencies, codes, times = loaded(server.url, args.prompts, args.kib, args.seconds)
            print(summary(f"/v1/models with {args.prompts} x {args.kib} KiB prompts in flight", latencies))
            print(f"prompts answered: {len(codes)} ({', '.join(f'{c}: {codes.count(c)}' for c in sorted(set(codes)))}), "
                  f"mean {statistics.mean(times):.2f} s each", flush=True)
        finally:
            for process in burners:
                process.terminate()
                process.join()


if __name__ == "__main__":
    main()
