"""CPU per streamed token by process, one serving setting on and off: the ingress' event loop, or the delta channel.

Runs ``bench_vs_vllm.py --skip-vllm`` (``raymoe serve`` 1x1 on the toy checkpoint, ``vllm bench serve`` at
C=32) ``--pairs`` times with each side of ``--setting``, alternating, and reads from /proc the CPU seconds
each process took while the client ran: the ingress replica, the router, the expert worker and the
client, over the client's output tokens.

- ``--setting loop``: the ingress' routes on Serve's own event loop (actors/ingress.py, ``SAME_LOOP_ENV``)
  against a loop of their own (``RAYMOE_INGRESS_SEPARATE_LOOP=1``, Serve's default). The router's work is
  the same either way, so the ratio printed is the ingress' CPU over the router's within each run.
- ``--setting delta_channel``: the routers' deltas over a socket of their own (``serve.delta_channel:
  true``, actors/delta_channel.py) against Ray's streaming call (``false``). Both the ingress and the
  router change, the worker's and the client's work does not, so the ratio printed is the ingress' and
  the router's CPU together over the worker's.

This machine's speed drifts by 10-20% between runs and moves every process alike: the ratios within
one run are what to compare, besides microseconds per token.

    python benchmarks/bench_ingress_loop.py [--setting loop|delta_channel] [--pairs 2] [--num-prompts 640]
                                            [--plot docs/figures/NAME.png]
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


# setting -> (label when off, label when on)
SETTINGS = {"loop": ("own loop ", "same loop"), "delta_channel": ("Ray stream", "channel  ")}


def cluster_yaml(work: str, channel: bool) -> str:
    """A 1x1 cluster config on the toy checkpoint with ``serve.delta_channel`` set (bench_vs_vllm's
    command line gives the port: the one here is a placeholder)."""
    from bench_vs_vllm import CLUSTER_YAML, DEFAULT_CKPT  # noqa: PLC0415 (beside this file)
    path = os.path.join(work, f"channel-{'on' if channel else 'off'}.yaml")
    text = CLUSTER_YAML.format(model=DEFAULT_CKPT, routers=1, workers=1, port=8000, dtype="float32")
    with open(path, "w") as handle:
        handle.write(text + f"  delta_channel: {'true' if channel else 'false'}\n")
    return path


def one_run(setting: str, on: bool, args: argparse.Namespace, work: str, index: int) -> dict:
    window = ClientWindow()
    window.start()
    out = os.path.join(work, f"run{index}.json")
    env, config = dict(os.environ), "1x1"
    if setting == "loop":
        env["RAYMOE_INGRESS_SEPARATE_LOOP"] = "0" if on else "1"
    else:
        config = cluster_yaml(work, on)
    subprocess.run([sys.executable, os.path.join(os.path.dirname(__file__), "bench_vs_vllm.py"), "--skip-vllm",
                    "--rounds", "1", "--configs", config, "--concurrency", "32", "--num-prompts", str(args.num_prompts),
                    "--out", out], env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    window.done.set()
    window.join(30)
    with open(out) as handle:
        row = next(r for r in json.load(handle)["rows"] if r["concurrency"] == 32)
    tokens = row["raw"]["total_output_tokens"]
    cpu = {label: (window.last[label] - window.first[label]) / tokens * 1e6 for label in PROCESSES}
    ratio = (cpu["ingress"] / cpu["router"] if setting == "loop"
             else (cpu["ingress"] + cpu["router"]) / cpu["worker"])
    return {"on": on, "tok_s": row["output_tok_s"], "us_per_token": cpu, "ratio": ratio}


def plot(runs: list[dict], setting: str, path: str) -> None:
    """Each run's CPU per token by process, stacked, the runs side by side in the order they ran."""
    import matplotlib  # noqa: PLC0415 (only when asked)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    figure, axes = plt.subplots(figsize=(8, 4.2))
    bottoms = [0.0] * len(runs)
    for label in PROCESSES:
        heights = [run["us_per_token"][label] for run in runs]
        axes.bar(range(len(runs)), heights, bottom=bottoms, label=label)
        bottoms = [b + h for b, h in zip(bottoms, heights)]
    axes.set_xticks(range(len(runs)), [f"{SETTINGS[setting][r['on']].strip()}\n{r['tok_s']:,.0f} tok/s" for r in runs],
                    fontsize=8)
    axes.set_ylabel("CPU us per streamed token")
    axes.set_title(f"raymoe serve 1x1, toy checkpoint, C=32: --setting {setting}, alternating runs")
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--setting", choices=sorted(SETTINGS), default="loop")
    parser.add_argument("--pairs", type=int, default=2)
    parser.add_argument("--num-prompts", type=int, default=640)
    parser.add_argument("--plot", help="write a PNG of each run's CPU per token by process here")
    args = parser.parse_args()
    ratio_name = "ingress/router" if args.setting == "loop" else "(ingress+router)/worker"
    runs = []
    with tempfile.TemporaryDirectory(prefix="bench_ingress_loop-") as work:
        for index in range(2 * args.pairs):
            on = index % 2 == 0
            run = one_run(args.setting, on, args, work, index)
            runs.append(run)
            cpu = run["us_per_token"]
            print(f"{SETTINGS[args.setting][on]}: {run['tok_s']:7.1f} tok/s; CPU us a token: ingress "
                  f"{cpu['ingress']:.0f}, router {cpu['router']:.0f}, worker {cpu['worker']:.0f}, client "
                  f"{cpu['client']:.0f}; {ratio_name} {run['ratio']:.2f}", flush=True)
    on = statistics.median(r["ratio"] for r in runs if r["on"])
    off = statistics.median(r["ratio"] for r in runs if not r["on"])
    tok_on = statistics.median(r["tok_s"] for r in runs if r["on"])
    tok_off = statistics.median(r["tok_s"] for r in runs if not r["on"])
    print(f"{ratio_name}, median: {SETTINGS[args.setting][1].strip()} {on:.2f}, {SETTINGS[args.setting][0].strip()} "
          f"{off:.2f} -> on/off {on / off:.2f}; tok/s median {tok_on:.0f} against {tok_off:.0f} ({tok_on / tok_off:.2f}x)")
    if args.plot:
        plot(runs, args.setting, args.plot)
        print(f"plot: {args.plot}")


if __name__ == "__main__":
    main()
