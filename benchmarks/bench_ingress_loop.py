"""The ingress replica's CPU per streamed token: routes on Serve's own event loop vs on a loop of their own.

Serve runs a replica's user code on a second event loop in a thread of its own by default; raymoe's
ingress runs it on Serve's loop (actors/ingress.py, ``SAME_LOOP_ENV``). This runs
``bench_vs_vllm.py --skip-vllm`` (``raymoe serve`` 1x1 on the toy checkpoint, ``vllm bench serve`` at
C=32) ``--pairs`` times with each setting, alternating (``RAYMOE_INGRESS_SEPARATE_LOOP=1`` keeps Serve's
default), and reads from /proc the CPU seconds each process took while the client ran: the ingress
replica, the router, the expert worker and the client, over the output tokens (prompts x output length).

This machine's speed drifts by 10-20% between runs and moves every process alike, so besides
microseconds per token it prints the ingress' CPU over the router's within each run: that ratio is
what the setting changes (the router's work is the same either way).

    python benchmarks/bench_ingress_loop.py [--pairs 2] [--num-prompts 640]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time

from raymoe.cluster import procfs

PROCESSES = {"ingress": "ServeReplica", "router": "ray::Router", "worker": "ray::ExpertWorker",
             "client": "bench serve"}


def cpu_by_label() -> dict[str, float]:
    """CPU seconds so far of every process whose command line names one of PROCESSES."""
    seconds = dict.fromkeys(PROCESSES, 0.0)
    for pid in map(str, procfs.pids()):
        try:
            command = procfs.command_line(procfs.read_bytes(pid, "cmdline"))
            seconds_so_far = procfs.cpu_seconds(procfs.stat(pid))
        except (OSError, IndexError, ValueError):
            continue
        for label, needle in PROCESSES.items():
            if needle in command[:100]:
                seconds[label] += seconds_so_far
    return seconds


class ClientWindow(threading.Thread):
    """CPU seconds by process from the client's start to its end (sampled every 0.2 s)."""

    def __init__(self):
        super().__init__(daemon=True)
        self.first = self.last = None
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            sample = cpu_by_label()
            if sample["client"] > 0:
                self.first = self.first or sample
                self.last = sample
            elif self.first is not None:  # the client ended
                return
            time.sleep(0.2)


def one_run(separate: bool, args: argparse.Namespace, work: str, index: int) -> dict:
    window = ClientWindow()
    window.start()
    out = os.path.join(work, f"run{index}.json")
    env = dict(os.environ, RAYMOE_INGRESS_SEPARATE_LOOP="1" if separate else "0")
    subprocess.run([sys.executable, os.path.join(os.path.dirname(__file__), "bench_vs_vllm.py"), "--skip-vllm",
                    "--rounds", "1", "--configs", "1x1", "--concurrency", "32", "--num-prompts", str(args.num_prompts),
                    "--out", out], env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    window.done.set()
    window.join(30)
    with open(out) as handle:
        row = next(r for r in json.load(handle)["rows"] if r["concurrency"] == 32)
    tokens = row["raw"]["total_output_tokens"]
    cpu = {label: (window.last[label] - window.first[label]) / tokens * 1e6 for label in PROCESSES}
    return {"separate": separate, "tok_s": row["output_tok_s"], "us_per_token": cpu,
            "ingress_over_router": cpu["ingress"] / cpu["router"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=2)
    parser.add_argument("--num-prompts", type=int, default=640)
    args = parser.parse_args()
    runs = []
    with tempfile.TemporaryDirectory(prefix="bench_ingress_loop-") as work:
        for index in range(2 * args.pairs):
            separate = index % 2 == 1
            run = one_run(separate, args, work, index)
            runs.append(run)
            cpu = run["us_per_token"]
            print(f"{'own loop ' if separate else 'same loop'}: {run['tok_s']:7.1f} tok/s; CPU us a token: ingress "
                  f"{cpu['ingress']:.0f}, router {cpu['router']:.0f}, worker {cpu['worker']:.0f}, client "
                  f"{cpu['client']:.0f}; ingress/router {run['ingress_over_router']:.2f}", flush=True)
    same = [r["ingress_over_router"] for r in runs if not r["separate"]]
    own = [r["ingress_over_router"] for r in runs if r["separate"]]
    print(f"ingress CPU over the router's, median: same loop {statistics.median(same):.2f}, own loop "
          f"{statistics.median(own):.2f} -> same/own {statistics.median(same) / statistics.median(own):.2f}")


if __name__ == "__main__":
    main()
