"""Where a machine's cores go during a load run: CPU seconds per process and per thread over a window.

Waits until a process whose command line contains ``--match`` (default: ``vllm bench serve``'s
``bench serve``) runs, lets it warm up for ``--warmup`` seconds, then reads every thread's user +
system time from /proc at the start and the end of a ``--window``-second window and prints the
busiest processes and threads in cores (CPU seconds / wall seconds) with their voluntary context
switches a second. With ``--runs N`` it reports N such runs in a row (e.g. one per server of
``bench_vs_vllm.py``). Linux only; it reads /proc and changes nothing.

    python benchmarks/cpu_by_process.py --window 15 --runs 2 &
    python benchmarks/bench_vs_vllm.py --skip-vllm --configs 1x1 2x4 --concurrency 32 --num-prompts 192

Used for docs/BENCHMARKS.md's "Where the 2 cores go over HTTP at C=32". /proc's times tick at
USER_HZ (100 a second here): a window of 15 s resolves about 0.001 cores.
"""

from __future__ import annotations

import argparse
import collections
import os
import time

from raymoe.cluster import procfs


def snapshot() -> dict[tuple[str, str], tuple[str, str, float, int]]:
    """(pid, tid) -> (process label, thread name, CPU seconds, voluntary context switches)."""
    out = {}
    for pid in map(str, procfs.pids()):
        try:
            command = procfs.command_line(procfs.read_bytes(pid, "cmdline")).strip()
            label = f"{procfs.read_text(pid, 'comm').strip()} | {command[:60]}"
            for tid in procfs.threads(pid):
                name, fields = procfs.parse_stat(procfs.read_text(pid, f"task/{tid}/stat"))
                switches = int(procfs.status(pid, f"task/{tid}/status")["voluntary_ctxt_switches"])
                out[(pid, tid)] = (label, name, procfs.cpu_seconds(fields), switches)
        except (OSError, IndexError, ValueError, KeyError):  # a process or thread that ended meanwhile
            continue
    return out


def running(match: bytes) -> bool:
    for pid in procfs.pids():
        try:
            if match in procfs.read_bytes(pid, "cmdline") and pid != os.getpid():
                return True
        except OSError:
            continue
    return False


def report(window_s: float, top: int) -> None:
    before, started = snapshot(), time.monotonic()
    time.sleep(window_s)
    after, wall = snapshot(), time.monotonic() - started
    by_process, by_thread, switches = collections.Counter(), collections.Counter(), collections.Counter()
    for key, (label, name, seconds, count) in after.items():
        if key in before:  # threads that lived through the whole window
            by_process[label] += seconds - before[key][2]
            by_thread[(label, name)] += seconds - before[key][2]
            switches[(label, name)] += count - before[key][3]
    total = sum(by_process.values())
    print(f"window {wall:.1f} s: {total / wall:.2f} of {os.cpu_count()} cores busy")
    print("cores  process")
    for label, seconds in by_process.most_common(top):
        print(f"{seconds / wall:5.3f}  {label}")
    print("cores  switches/s  thread  (process)")
    for (label, name), seconds in by_thread.most_common(top):
        print(f"{seconds / wall:5.3f}  {switches[(label, name)] / wall:10.0f}  {name:<18} ({label})")
    print(flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--match", default="bench\0serve",
                        help="a run is on while a process's command line (arguments NUL-separated) contains this")
    parser.add_argument("--window", type=float, default=15.0, help="seconds measured per run")
    parser.add_argument("--warmup", type=float, default=6.0, help="seconds after the run starts before measuring")
    parser.add_argument("--runs", type=int, default=1, help="runs to report, one after the other")
    parser.add_argument("--top", type=int, default=12, help="processes and threads listed")
    parser.add_argument("--wait", type=float, default=3600.0, help="give up after this many seconds without a run")
    args = parser.parse_args()
    match = args.match.encode()
    for _ in range(args.runs):
        deadline = time.monotonic() + args.wait
        while not running(match):
            if time.monotonic() > deadline:
                raise SystemExit(f"no process matching {args.match!r} within {args.wait:.0f} s")
            time.sleep(0.3)
        time.sleep(args.warmup)
        report(args.window, args.top)
        while running(match):
            time.sleep(0.3)


if __name__ == "__main__":
    main()
