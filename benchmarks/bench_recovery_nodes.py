"""Recovery measured on a real multi-node cluster (issue 30 item 5, the node cases): streams
under steady load while a whole node is killed or partitioned; what the streams saw, per case.

Runs on the network-namespace cluster of tests/netns (netns_cluster.py, imported by path): a
head and 2 nodes, each a Linux network namespace with its own address, a Ray node in each; raymoe
deployed with its router and controller on the head and 2 expert workers on the 2 nodes, every
expert on both workers (``redundant_slots_per_worker``), comm over sockets (TCP between the
namespaces' addresses) with ``comm.timeout_s`` ``--timeout-s``. Needs root (``ip netns``).

The load: ``--streams`` slots on router 0 (one subscription, from a driver process inside the
head's namespace), each running one request of ``--tokens`` tokens after another (as one ends the
next starts: steady load), half greedy and half seeded at temperature 0.9, every request's
tokens compared with the in-process engine's for its slot. Once every slot has tokens flowing
(``--warm-tokens`` in total per slot) and ``--before-s`` s more have passed, the fault:

  none  no fault for ``--baseline-s`` s: the baseline ITL
  h     node1's link cut (its bridge port down, a partition) for ``--partition-s`` s, then healed
  g     every process of node2 SIGKILLed (its raylet and its worker); ``--restart-after-s`` s
        later ``ray start`` again in its namespace (as tests/netns does)

The load goes on until the cluster is back at full size (the controller reports nothing degraded
and no router left out, a recovery recorded after the fault, and the lost node's worker answers
under a new pid) and at least ``--after-s`` s have passed since the fault; then no new request
starts and those running finish. Per case: requests lost (a failure, or not finished with all
its tokens), outputs that differ from the in-process engine's, the longest pause between two
token deltas any stream saw (a slot's requests one after the other, so a slow first token
counts), the p99 inter-token latency of the requests' tokens that arrived in the ``--after-s``
s after the fault, and the seconds from the fault (and from the heal or the
`ray start`) until back at full size. Everything is bounded in time (``--case-timeout-s``); the
namespaces and every process in them are removed at the end, also on failure or Ctrl-C.

    sudo python benchmarks/bench_recovery_nodes.py [--cases none,h,g] [--streams 16] [--tokens 300]
        [--out recovery_nodes.json] [--plot docs/figures/recovery_nodes.png]

Timings depend on the machine's load: on a shared machine they are noisy.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import threading
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
NETNS = os.path.join(HERE, "..", "tests", "netns")
for _path in (HERE, os.path.abspath(NETNS)):  # the driver's pool child gets this sys.path too
    if _path not in sys.path:
        sys.path.insert(0, _path)

# Only the standard library at import: the driver's child (spawned) imports this module before it
# enters the head's namespace, and nothing may import Ray (or start a thread) before that.
import netns_cluster  # noqa: E402
import netns_driver  # noqa: E402

CASES = {"none": "no fault (baseline)", "g": "a whole node killed (SIGKILL)",
         "h": "a node partitioned, then healed"}
ORDER = ("none", "h", "g")
FULL_SIZE_POLL_S = 1.0


# ---- pure parts (records: {"slot", "events": [(t, [ids])], "error", "finished"}) -------------

def _recovery():
    import bench_recovery  # lazily: it imports raymoe at its top

    return bench_recovery


def request_params(slot: int, tokens: int) -> dict[str, Any]:
    """Slot ``slot``'s sampling: greedy for even slots, seeded at temperature 0.9 for odd ones."""
    params = {"max_tokens": tokens, "temperature": 0.0, "ignore_eos": True}
    if slot % 2:
        params.update(temperature=0.9, seed=1000 + slot)
    return params


def slot_prompt(slot: int) -> list[int]:
    return [50 + slot, 60 + slot, 70 + slot, 80 + slot]


def slot_streams(records: list[dict]) -> list[dict]:
    """One timeline per slot: the token events of all its requests, in time order, so that a
    pause between one request's last token and the next one's first counts too."""
    merged: dict[int, list] = {}
    for record in records:
        merged.setdefault(record["slot"], []).extend(record["events"])
    return [{"events": sorted(merged[slot], key=lambda event: event[0])} for slot in sorted(merged)]


def summarize_case(case: str, records: list[dict], reference: list[list[int]], max_tokens: int,
                   fault_t: float | None, after_s: float, full_size_s: float | None,
                   full_size_since_action_s: float | None = None) -> dict[str, Any]:
    """One case's row: requests lost, outputs differing from the reference of their slot, the
    longest pause any stream (slot) saw, over all its requests and between them (all slots, and
    those whose requests were never lost), p99 ITL after the fault over the requests (ms),
    seconds back at full size (from the fault; and from the heal or `ray start`)."""
    rec = _recovery()
    lost = [i for i, r in enumerate(records)
            if r.get("error") is not None or not r.get("finished") or len(rec.token_ids(r)) != max_tokens]
    differing = [i for i, r in enumerate(records) if i not in lost and rec.token_ids(r) != reference[r["slot"]]]
    lost_slots = {records[i]["slot"] for i in lost}
    streams = slot_streams(records)
    slots = sorted({r["slot"] for r in records})
    surviving = [stream for slot, stream in zip(slots, streams) if slot not in lost_slots]
    origin = fault_t if fault_t is not None else min(
        (t for r in records for t, ids in r["events"] if ids), default=0.0)
    itl = rec.itl_after(records, origin, after_s)
    return {
        "case": case, "what": CASES.get(case, case), "requests": len(records), "streams": len(streams),
        "lost": len(lost), "differing": len(differing),
        "longest_pause_surviving_s": round(rec.longest_pause(surviving), 3),
        "longest_pause_all_s": round(rec.longest_pause(streams), 3),
        "p99_itl_after_ms": round(1000 * rec.percentile(itl, 99), 1),
        "median_itl_after_ms": round(1000 * rec.percentile(itl, 50), 1), "itl_tokens_after": len(itl),
        "full_size_s": None if full_size_s is None else round(full_size_s, 2),
        "full_size_since_action_s": None if full_size_since_action_s is None else round(full_size_since_action_s, 2),
    }


def table(rows: list[dict]) -> str:
    def seconds(value):
        return "n/a" if value is None else f"{value:.2f}"

    lines = [f"{'case':4} {'what':32} {'lost':>11} {'differ':>6} {'longest pause s':>15} "
             f"{'p99 ITL after ms':>16} {'full size s (fault/action)':>26}"]
    for r in rows:
        lines.append(f"{r['case']:4} {r['what']:32} {r['lost']:>5}/{r['requests']:<5} {r['differing']:>6} "
                     f"{r['longest_pause_all_s']:>15.2f} {r['p99_itl_after_ms']:>16.1f} "
                     f"{seconds(r['full_size_s']):>14}/{seconds(r['full_size_since_action_s']):<11}")
    return "\n".join(lines)


def plot(results: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(results), 1, figsize=(7, 1.6 * len(results) + 0.6), sharex=True, squeeze=False)
    for ax, result in zip(axes[:, 0], results):
        row = result["row"]
        ax.plot(result["rate_t"], result["rate"], lw=1)
        if row["case"] != "none":
            ax.axvline(0.0, color="r", lw=1)
        if result.get("action_t") is not None:
            ax.axvline(result["action_t"], color="g", ls="--", lw=1)
        if row.get("full_size_s") is not None:
            ax.axvline(row["full_size_s"], color="k", ls=":", lw=1)
        ax.set_ylabel("tok/s", fontsize=7)
        ax.set_title(f"({row['case']}) {row['what']}", fontsize=8, loc="left")
        ax.tick_params(labelsize=7)
    axes[-1, 0].set_xlabel("seconds after the fault (red: fault; green dashed: heal (h) or `ray start` (g); "
                           "black dotted: full size)", fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=70)
    plt.close(fig)


# ---- what the driver runs, inside the head's namespace -----------------------------------

LOADS: dict[str, "SteadyLoad"] = {}


class SteadyLoad:
    """``slots`` requests always in flight on router 0: as one finishes its slot starts the next
    (same prompt, same sampling), until ``stop()``. Every delta's arrival time is recorded."""

    def __init__(self, slots: list[tuple[list[int], dict]], tag: str) -> None:
        from raymoe.engine.sampling_params import SamplingParams

        self.router = netns_driver.STATE["deployment"].routers[0]
        self.slots = [(prompt, SamplingParams(**params)) for prompt, params in slots]
        self.tag = tag
        self.records: dict[str, dict] = {}
        self.count = [0] * len(slots)
        self.stopping = threading.Event()
        self.lock = threading.Lock()
        self.subscriber = f"{netns_driver.SUBSCRIBER}-steady-{tag}"
        self.stream = self.router.subscribe.options(num_returns="streaming").remote(self.subscriber)
        self.stream_error: str | None = None
        for slot in range(len(slots)):
            self._submit(slot)
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _submit(self, slot: int) -> None:
        rid = f"{self.tag}-{slot}-{self.count[slot]}"
        self.count[slot] += 1
        with self.lock:
            self.records[rid] = {"slot": slot, "events": [], "error": None, "finished": False,
                                 "submitted": time.monotonic()}
        prompt, params = self.slots[slot]
        self.router.submit.remote(self.subscriber, rid, prompt, params)

    def _read(self) -> None:
        import ray

        try:
            for ref in self.stream:
                now = time.monotonic()
                batch = ray.get(ref)
                again = []
                with self.lock:
                    for delta in batch:
                        record = self.records.get(getattr(delta, "request_id", None))
                        if record is None:
                            continue
                        if not hasattr(delta, "token_ids"):  # a StepFailure: this request failed
                            record["error"] = getattr(delta, "message", repr(delta))[:500]
                            again.append(record["slot"])
                            continue
                        if delta.token_ids:
                            record["events"].append((now, list(delta.token_ids)))
                        if delta.finished:
                            record["finished"] = True
                            again.append(record["slot"])
                if not self.stopping.is_set():
                    for slot in again:
                        self._submit(slot)
                if self.stopping.is_set() and self.in_flight() == 0:
                    break
        except Exception as error:  # the stream itself failed
            self.stream_error = f"{type(error).__name__}: {error}"[:600]

    def in_flight(self) -> int:
        with self.lock:
            return sum(1 for r in self.records.values() if not r["finished"] and r["error"] is None)

    def progress(self) -> tuple[int, int]:
        """(tokens so far, the fewest tokens any slot has had)."""
        with self.lock:
            per_slot = [0] * len(self.slots)
            for r in self.records.values():
                per_slot[r["slot"]] += sum(len(ids) for _, ids in r["events"])
        return sum(per_slot), min(per_slot)

    def result(self, timeout_s: float) -> dict[str, Any]:
        self.stopping.set()
        deadline = time.monotonic() + timeout_s
        while self.in_flight() and time.monotonic() < deadline and self.reader.is_alive():
            time.sleep(0.1)
        with self.lock:
            records = [dict(r, id=rid) for rid, r in self.records.items()]
        return {"records": records, "stream_error": self.stream_error, "unfinished": self.in_flight()}


def start_steady(slots: list[tuple[list[int], dict]], tag: str) -> None:
    LOADS[tag] = SteadyLoad(slots, tag)


def steady_progress(tag: str) -> tuple[int, int]:
    return LOADS[tag].progress()


def finish_steady(tag: str, timeout_s: float) -> dict[str, Any]:
    return LOADS.pop(tag).result(timeout_s)


def worker_pids() -> dict[str, int]:
    """Each worker's node address -> its pid (a worker that does not answer is left out)."""
    import ray

    deployment = netns_driver.STATE["deployment"]
    address = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]}
    found = {}
    for worker in deployment.workers:
        try:
            info = ray.get(worker.info.remote(), timeout=5)
        except Exception:  # restarting, unreachable: not yet
            continue
        if info["node_id"] in address:
            found[address[info["node_id"]]] = info["pid"]
    return found


# ---- the run ------------------------------------------------------------------------------

def wait_for(predicate, timeout_s: float, interval_s: float = FULL_SIZE_POLL_S):
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            value = predicate()
        except Exception:  # a call to a restarting worker: not yet
            value = None
        if value or time.monotonic() >= deadline:
            return value
        time.sleep(interval_s)


def whole(cluster, victim_address: str | None, victim_pid: int | None, recoveries_before: int) -> bool:
    """Back at full size: nothing degraded, no router left out, a recovery recorded since the
    fault, and the lost node's worker answering under a new pid."""
    status = cluster.call(netns_driver.status, timeout=60)
    if status["degraded"] is not None or status["routers_left_out"]:
        return False
    if victim_address is None:
        return True
    if len(status["recoveries"]) <= recoveries_before:
        return False
    pids = cluster.call(worker_pids, timeout=60)
    return victim_address in pids and pids[victim_address] != victim_pid and len(pids) == 2


def run_case(cluster, case: str, args, slots, reference) -> dict[str, Any]:
    victim = {"g": "node2", "h": "node1"}.get(case)
    victim_address = cluster.members[victim].address if victim else None
    victim_pid = cluster.call(worker_pids, timeout=60).get(victim_address) if victim else None
    recoveries_before = len(cluster.call(netns_driver.status, timeout=60)["recoveries"])
    tag = f"{case}{int(time.monotonic())}"
    cluster.call(start_steady, slots, tag, timeout=60)
    case_deadline = time.monotonic() + args.case_timeout_s
    wait_for(lambda: cluster.call(steady_progress, tag, timeout=30)[1] >= args.warm_tokens, 60, 0.1)
    time.sleep(args.before_s)
    fault_t = time.monotonic()
    action_t = full_s = since_action_s = None
    notes: dict[str, Any] = {"victim_pid": victim_pid}
    try:
        if case == "none":
            time.sleep(args.baseline_s)
        elif case == "h":
            cluster.cut(victim)
            try:
                time.sleep(args.partition_s)
            finally:
                cluster.heal(victim)
            action_t = time.monotonic()
        elif case == "g":
            notes["killed_processes"] = len(cluster.kill(victim))
            time.sleep(max(0.0, fault_t + args.restart_after_s - time.monotonic()))
            action_t = time.monotonic()
            cluster.restart_node(victim)
        if case != "none":
            done = wait_for(lambda: whole(cluster, victim_address, victim_pid, recoveries_before),
                            max(1.0, case_deadline - time.monotonic()))
            if done:
                full_s = time.monotonic() - fault_t
                since_action_s = time.monotonic() - action_t
        remaining = fault_t + args.after_s - time.monotonic()
        if remaining > 0:
            time.sleep(min(remaining, max(0.0, case_deadline - time.monotonic())))
    finally:
        loaded = cluster.call(finish_steady, tag, args.finish_timeout_s, timeout=args.finish_timeout_s + 60)
    records = loaded["records"]
    row = summarize_case(case, records, reference, args.tokens, fault_t if case != "none" else None,
                         args.after_s, full_s, since_action_s)
    status = cluster.call(netns_driver.status, timeout=60)
    notes.update(stream_error=loaded["stream_error"], unfinished=loaded["unfinished"],
                 recoveries=[(r["mode"], r.get("lost_workers", r.get("reincluded_workers")), round(r["seconds"], 2))
                             for r in status["recoveries"][recoveries_before:]],
                 errors=sorted({r["error"][:160] for r in records if r["error"]})[:3])
    rec = _recovery()
    rate_t, rate = rec.rate_series(records, fault_t)
    return {"row": row, "notes": notes, "rate_t": [round(t, 2) for t in rate_t], "rate": rate,
            "action_t": None if action_t is None else round(action_t - fault_t, 2)}


def reference_outputs(model: str, slots) -> list[list[int]]:
    from raymoe.engine.engine import EngineConfig, LLMEngine
    from raymoe.engine.sampling_params import SamplingParams

    engine = LLMEngine.from_pretrained(model, EngineConfig(dtype="float32"))
    outputs = engine.generate([p for p, _ in slots], [SamplingParams(**params) for _, params in slots])
    return [o.output_token_ids for o in outputs]


def deployment_config(model: str, timeout_s: float) -> dict[str, Any]:
    return {"model": model, "device": "cpu", "dtype": "float32", "routers": 1, "expert_workers": 2,
            "placement": {"strategy": "round_robin", "node_strategy": "STRICT_SPREAD",
                          "redundant_slots_per_worker": 4},  # 8 experts: all of them on each worker
            "comm": {"backend": "sockets", "timeout_s": timeout_s}, "balancer": {"enabled": False}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default="none,h,g", help="comma-separated, of none h g (run in that order)")
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=300, help="tokens per request (ignore_eos)")
    parser.add_argument("--warm-tokens", type=int, default=20, help="tokens every slot has before the fault")
    parser.add_argument("--before-s", type=float, default=5.0, help="seconds of load between warm and the fault")
    parser.add_argument("--baseline-s", type=float, default=15.0, help="case none: seconds of load")
    parser.add_argument("--partition-s", type=float, default=20.0, help="case h: seconds the link is down")
    parser.add_argument("--restart-after-s", type=float, default=15.0,
                        help="case g: seconds from the kill to `ray start` on the node again")
    parser.add_argument("--after-s", type=float, default=30.0, help="window after the fault for the p99 ITL")
    parser.add_argument("--timeout-s", type=float, default=3.0, help="comm.timeout_s of the deployment")
    parser.add_argument("--case-timeout-s", type=float, default=150.0, help="most seconds a case runs")
    parser.add_argument("--finish-timeout-s", type=float, default=60.0,
                        help="most seconds the running requests get to finish once the load stops")
    parser.add_argument("--out", help="write the rows (and tokens/s series) as JSON here")
    parser.add_argument("--plot", help="write the tokens/s timeline plot (PNG) here")
    args = parser.parse_args(argv)
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = sorted(set(cases) - set(CASES))
    if unknown:
        parser.error(f"unknown cases {unknown}; choose from {sorted(CASES)}")
    reason = netns_cluster.why_unavailable()
    if reason is not None:
        print(f"network-namespace cluster unavailable: {reason}", file=sys.stderr)
        return 2
    from common import build_mixtral, machine_description

    folder = tempfile.mkdtemp(prefix="raymoe-recovery-nodes-")
    model = os.path.join(folder, "tiny-mixtral")
    build_mixtral(model, hidden=64, layers=3, experts=8, top_k=2, intermediate=96, vocab=320)
    slots = [(slot_prompt(i), request_params(i, args.tokens)) for i in range(args.streams)]
    reference = reference_outputs(model, slots)
    print(f"machine: {machine_description()}; namespace cluster: head + 2 nodes, comm sockets, timeout_s "
          f"{args.timeout_s:g}; load average {os.getloadavg()[0]:.1f}; {args.streams} streams x {args.tokens} tokens",
          flush=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the cluster's clean-up runs
    began = time.monotonic()
    results = []
    netns_cluster.cleanup_stale()
    cluster = netns_cluster.NetnsCluster(nodes=2, cpus_per_node=2)
    with cluster:
        layout = cluster.call(netns_driver.deploy_on_nodes, deployment_config(model, args.timeout_s), "recnodes",
                              timeout=240)
        print(f"deployed in {time.monotonic() - began:.0f} s: workers {layout['workers']}, "
              f"routers {layout['routers']}", flush=True)
        for case in [c for c in ORDER if c in cases]:
            if not wait_for(lambda: whole(cluster, None, None, 0), 120):
                print(f"case {case}: the cluster is not at full size; not measured", flush=True)
                continue
            try:
                result = run_case(cluster, case, args, slots, reference)
            except Exception as error:  # report what was measured
                print(f"case {case} failed, not measured: {type(error).__name__}: {error}"[:800], flush=True)
                continue
            print(f"  {result['row']}\n  {result['notes']}", flush=True)
            results.append(result)
        try:
            cluster.call(netns_driver.shutdown, timeout=60)
        except Exception as error:  # the clean-up ends everything anyway
            print(f"deployment shutdown: {error}", flush=True)
    rows = [r["row"] for r in results]
    print()
    print(table(rows))
    print(f"\nwhole run {time.monotonic() - began:.0f} s; load average {os.getloadavg()[0]:.1f}")
    if args.out:
        with open(args.out, "w") as handle:
            json.dump({"machine": machine_description(), "args": vars(args), "rows": rows,
                       "notes": [[r["row"]["case"], r["notes"]] for r in results],
                       "series": [{"case": r["row"]["case"], "t": r["rate_t"], "tok_s": r["rate"],
                                   "action_t": r["action_t"]} for r in results]}, handle, indent=1, default=str)
    if args.plot and results:
        plot([r for r in results if r["row"]["case"] != "none"] or results, args.plot)
    return 0 if results else 1


if __name__ == "__main__":
    sys.exit(main())
