"""The router's per-layer exchange plan: torch ops (any device) vs numpy (activations on the CPU).

A benchmark, not a timed test: it prints numbers, it asserts nothing about speed. Per token
count and placement, both planners first build the same plan (checked field by field, bit for
bit, or the script exits non-zero), then rounds call each once in turn (interleaved, so load
from other processes hits both alike); the median per call is reported, with the ratio
device / host (above 1: the host planner is faster).

    python benchmarks/bench_exchange_plan.py [--rounds 400] [--experts 8] [--top-k 2]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from common import machine_description
from raymoe.moe.exchange_plan import plan_exchange, plan_exchange_on_host
from raymoe.moe.initial_placement import initial_placement


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=400)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"machine: {machine_description()}")
    print(f"{'tokens':>6} {'workers':>7} {'replicas':>8} | {'device us':>9} {'host us':>8} {'device/host':>11}")
    generator = torch.Generator().manual_seed(0)
    for workers, redundant in ((1, 0), (4, 0), (4, 1)):
        placement = initial_placement(num_layers=1, num_experts=args.experts, num_workers=workers,
                                      strategy="round_robin", redundant_slots_per_worker=redundant)
        log2phy, logcnt = placement.log2phy[0], placement.logcnt[0]
        device_tables = torch.tensor(log2phy), torch.tensor(logcnt)
        for tokens in (1, 8, 32, 128):
            logits = torch.randn(tokens, args.experts, generator=generator)
            weights, ids = torch.topk(torch.softmax(logits, dim=-1), args.top_k)

            def device():
                return plan_exchange(ids, weights, None, *device_tables, placement.slots_per_worker, workers)

            def host():
                return plan_exchange_on_host(ids, weights, None, log2phy, logcnt, placement.slots_per_worker, workers)

            a, b = device(), host()
            same = (a.send_counts, a.slot_counts) == (b.send_counts, b.slot_counts) and all(
                torch.equal(getattr(a, f), getattr(b, f)) for f in ("slot", "row_token", "row_slots", "row_weights"))
            if not same:
                print(f"the planners disagree at {tokens} tokens, {workers} workers: no timings", file=sys.stderr)
                sys.exit(1)
            times: dict[str, list[float]] = {"device": [], "host": []}
            with torch.inference_mode():
                for _ in range(args.rounds):
                    for name, plan in (("device", device), ("host", host)):
                        started = time.perf_counter()
                        plan()
                        times[name].append(time.perf_counter() - started)
            d, h = (statistics.median(times[n]) * 1e6 for n in ("device", "host"))
            print(f"{tokens:>6} {workers:>7} {redundant:>8} | {d:>9.1f} {h:>8.1f} {d / h:>11.2f}")


if __name__ == "__main__":
    main()
