"""Balancers on Zipf loads: our global vs DeepSeek EPLB, and churn of EPLB vs migration-aware.

    python benchmarks/bench_balancers.py [--layers 8] [--experts 64] [--workers 8] [--slots 10]

For each Zipf exponent: one popularity per layer (hot experts shuffled per layer), three
token samples: A (the placement in service is EPLB on A), B (a resample of the same
popularity) and C (a new hot set). Prints max/mean worker load (mean over layers) and
expert copies, and the ratios the planning docs quote.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from raymoe.moe.balance_global import balance_global
from raymoe.moe.balance_metrics import count_copies, imbalance, worker_load
from raymoe.moe.balance_migration import balance_migration
from raymoe.moe.eplb_reference import eplb_reference
from raymoe.moe.placement import PlacementTable
from raymoe.moe.traffic import TrafficKind, TrafficSpec, popularity, sample_load


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--slots", type=int, default=10, help="slots per worker")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = np.random.default_rng(args.seed)
    slots = args.slots

    def eplb(load):
        return PlacementTable.from_phy2log(eplb_reference(load, args.workers, slots), slots, args.experts)

    def ratio(load, table):
        return imbalance(worker_load(load, table.phy2log, slots))

    total_slots = args.layers * args.workers * slots
    print(
        f"{args.layers} layers, {args.experts} experts, {args.workers} workers x {slots} slots, "
        f"{args.tokens} tokens x top-{args.top_k} per sample"
    )
    header = (
        f"{'s':>4} | {'EPLB m/m':>8} {'ours m/m':>8} | {'resample: EPLB copies':>21} {'ours':>5} {'ratio':>6} "
        f"{'EPLB m/m':>8} {'ours m/m':>8} | {'moved: EPLB copies':>18} {'ours':>5} {'ratio':>6} "
        f"{'fresh m/m':>9} {'ours m/m':>8}"
    )
    print(header)
    print("-" * len(header))
    started = time.perf_counter()
    for exponent in (0.6, 0.9, 1.2, 1.5):
        spec = TrafficSpec(TrafficKind.ZIPF, zipf_s=exponent)
        probabilities = popularity(spec, args.layers, args.experts, rng)
        first = sample_load(probabilities, args.tokens, args.top_k, rng).astype(float)
        again = sample_load(probabilities, args.tokens, args.top_k, rng).astype(float)
        moved = sample_load(popularity(spec, args.layers, args.experts, rng), args.tokens, args.top_k, rng).astype(float)
        # Step 1: balance quality on the first sample.
        current = eplb(first)
        ours_first = balance_global(first, args.workers, slots)
        # Step 2: a resample: EPLB from scratch vs migration-aware from the EPLB placement.
        eplb_again, migrated = eplb(again), balance_migration(again, current)
        eplb_copies, our_copies = count_copies(current, eplb_again), count_copies(current, migrated)
        # Step 3: the hot set moves.
        eplb_moved, followed = eplb(moved), balance_migration(moved, current)
        fresh_moved = balance_global(moved, args.workers, slots)
        moved_eplb_copies, moved_copies = count_copies(current, eplb_moved), count_copies(current, followed)
        print(
            f"{exponent:>4} | {ratio(first, current):>8.4f} {ratio(first, ours_first):>8.4f} | "
            f"{eplb_copies:>21} {our_copies:>5} {our_copies / eplb_copies:>6.3f} "
            f"{ratio(again, eplb_again):>8.4f} {ratio(again, migrated):>8.4f} | "
            f"{moved_eplb_copies:>18} {moved_copies:>5} {moved_copies / moved_eplb_copies:>6.3f} "
            f"{ratio(moved, fresh_moved):>9.4f} {ratio(moved, followed):>8.4f}"
        )
        print(
            f"{'':>4}   EPLB from scratch moves {eplb_copies / total_slots:.0%} of slots to another GPU on a resample"
        )
    print(f"took {time.perf_counter() - started:.1f} s")


if __name__ == "__main__":
    main()
