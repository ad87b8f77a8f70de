"""Autoscaling measured (issue 31 item 2, "Must show"): a bounded load ramp on a served
deployment whose expert pool *and* router pool are sized by the ``autoscale:`` policy alone,
on Ray's own autoscaler over simulated nodes; what the clients saw.

The cluster (``--ray autoscaling``, the default) is :class:`ray.cluster_utils.AutoscalingCluster`
(tests/actors/autoscaling_cluster.py: Ray's real autoscaler, ``fake_multinode`` provider, a
port, temp dir and process set of its own): a head with ``raymoe_router: 1`` and two node types,
``expert`` (``raymoe_expert: 1``, 1 to ``--max-workers`` nodes) and ``router`` (``raymoe_router:
1``, 0 to ``--max-routers`` - 1 nodes). The YAML asks ``placement.worker_resources:
{raymoe_expert: 1}`` and ``router_resources: {raymoe_router: 1}``, so each worker the policy adds
needs an expert node Ray's autoscaler launches, and the second router a router node; after a
shrink the idle nodes are removed after ``--idle-timeout-min``. ``--ray local``: a plain local
Ray started by `raymoe serve` (no node types), for comparison.

`raymoe serve` (joined to that cluster) on the random-weight Mixtral of benchmarks/common.py
(4 layers, 8 experts, top-2), CPU, float32, starting at 1 router and 1 expert worker (8 slots:
every expert, so every size fits) with ``autoscale: {min_workers: 1, max_workers: --max-workers,
target_rows_per_worker: --target, min_routers: 1, max_routers: --max-routers,
target_requests_per_router: --target-requests, ...}``. First each of ``--prompts`` requests runs
alone (the reference tokens; half greedy, half seeded at temperature 0.9), then the ramp:
``--phases`` (concurrency:seconds, default 1 -> 8 -> 16 -> 32 -> 16 -> 8 -> 1 over 240 s) of
streamed completions of ``--tokens`` tokens, each slot starting its next request when the last
one ends, while the controller's status is read every 0.3 s (``GET /admin/placement``) and the
cluster's nodes every second.

Printed: the timeline (concurrency, workers, routers, desired, nodes), failed requests,
requests whose tokens differ from the reference, and per resize the policy made: its pool and
direction, the seconds from the decision to serving at the new size (a worker resize: the
resize's own seconds, which end when the routers switch to the new placement; a router grow:
until the new router's first generated token; a router shrink: until the leaving router is out
of the group and ended), the group pause, the longest pause any stream saw while it ran, and
the expert bytes copied against copying every expert once. ``--out`` writes the JSON,
``--plot`` a figure of load, workers, routers and ITL over time.

    python benchmarks/bench_autoscale.py [--ray autoscaling|local] [--phases 1:20,8:20,...]
        [--max-workers 3] [--max-routers 2] [--target 8] [--target-requests 12]
        [--tokens 48] [--out autoscale.json] [--plot autoscale.png]

Timings depend on the machine's load: on a shared machine they are noisy.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_recovery import is_lost, request_body, run_stream, token_ids  # noqa: E402
from bench_resize import pause_during  # noqa: E402
from raymoe.cluster.serve_process import ServeProcess, serve_argv  # noqa: E402
from raymoe.kernels.comm.ports import free_port  # noqa: E402

ADMIN_TOKEN = "bench-autoscale-token"
EXPERT, ROUTER = "raymoe_expert", "raymoe_router"
DEFAULT_PHASES = "1:20,8:20,16:20,32:60,16:20,8:20,1:80"


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


def resizes_seen(samples: list[dict], key: str = "last_resize") -> list[dict]:
    """Each distinct resize the status samples' ``key`` show (by its ``time``), first sighting kept."""
    seen: dict[float, dict] = {}
    for sample in samples:
        last = sample.get(key)
        if last and last.get("resized") and last["time"] not in seen:
            seen[last["time"]] = last
    return sorted(seen.values(), key=lambda r: r["time"])


def itl_series(streams: list[dict], origin: float, bin_s: float = 5.0) -> tuple[list[float], list[float], list[float]]:
    """Median and p90 inter-token latency (ms) of the token gaps ending in each ``bin_s`` bin,
    times (bin centres) relative to ``origin``."""
    bins: dict[int, list[float]] = {}
    for stream in streams:
        times = [t for t, ids in stream["events"] if ids]
        for a, b in zip(times, times[1:]):
            bins.setdefault(int((b - origin) // bin_s), []).append((b - a) * 1000)
    keys = sorted(bins)
    return ([(k + 0.5) * bin_s for k in keys], [statistics.median(bins[k]) for k in keys],
            [sorted(bins[k])[int(0.9 * (len(bins[k]) - 1))] for k in keys])


def status(url: str) -> dict[str, Any]:
    request = urllib.request.Request(f"{url}/admin/placement", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read())


def start_autoscaling_cluster(args: argparse.Namespace):
    """Ray's AutoscalingCluster (tests/actors/autoscaling_cluster.py) with expert and router node types."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "actors"))
    from autoscaling_cluster import ScopedAutoscalingCluster

    node_types = {"expert": {"resources": {"CPU": 1, EXPERT: 1}, "node_config": {}, "min_workers": 1,
                             "max_workers": args.max_workers}}
    if args.max_routers > 1:
        node_types["router"] = {"resources": {"CPU": 1, ROUTER: 1}, "node_config": {}, "min_workers": 0,
                                "max_workers": args.max_routers - 1}
    cluster = ScopedAutoscalingCluster(head_resources={"CPU": 4, ROUTER: 1}, worker_node_types=node_types,
                                       idle_timeout_minutes=args.idle_timeout_min)
    cluster.start()
    return cluster


def node_counts(address: str) -> dict[str, int]:
    """Live expert and router nodes, read from the GCS directly (this process is no Ray driver)."""
    from ray._raylet import GcsClient

    alive = [info for info in GcsClient(address=address).get_all_node_info(timeout=10).values()
             if info.state == 0]  # GcsNodeInfo.ALIVE
    return {"expert_nodes": sum(1 for n in alive if n.resources_total.get(EXPERT)),
            "router_nodes": sum(1 for n in alive if n.resources_total.get(ROUTER)) - 1}  # (the head has one too)


def write_config(folder: str, model: str, args: argparse.Namespace) -> str:
    config = os.path.join(folder, "cluster.yaml")
    placement = (f"placement:\n  worker_resources: {{{EXPERT}: 1}}\n  router_resources: {{{ROUTER}: 1}}\n"
                 if args.ray == "autoscaling" else "")
    with open(config, "w") as handle:
        handle.write(f"model: {model}\ndevice: cpu\ndtype: float32\nrouters: 1\nexpert_workers: 1\n{placement}"
                     "balancer:\n  interval_steps: 1000000000\n  poll_interval_s: 0.2\n"
                     f"autoscale:\n  min_workers: 1\n  max_workers: {args.max_workers}\n"
                     f"  target_rows_per_worker: {args.target}\n  band: 0.25\n  cooldown_s: {args.cooldown}\n"
                     f"  window_s: {args.window}\n  interval_s: {args.interval}\n"
                     f"  min_routers: 1\n  max_routers: {args.max_routers}\n"
                     f"  target_requests_per_router: {args.target_requests}\n")
    return config


def run_ramp(server: ServeProcess, args: argparse.Namespace, phases: list[tuple[int, float]], address: str | None):
    """The reference run, then the ramp; returns (reference, records, samples, started)."""
    reference = []
    for i in range(args.prompts):
        record = {"events": [], "error": None, "end": None}
        run_stream(server.port, request_body(i, args.tokens), record, threading.Event())
        reference.append(token_ids(record))
    records: list[tuple[int, dict]] = []
    samples: list[dict] = []
    nodes: list[dict] = []
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
            t = time.monotonic() - started
            try:
                s = status(server.url)
                auto = s.get("autoscale") or {}
                routers = auto.get("routers") or {}
                samples.append({"t": t, "wall": time.time(), "workers": s["workers"], "routers": s["num_routers"],
                                "desired": auto.get("desired_workers"), "reason": auto.get("reason"),
                                "desired_routers": routers.get("desired_routers"),
                                "router_reason": routers.get("reason"), "requests": routers.get("requests"),
                                "last_resize": auto.get("last_resize"),
                                "last_router_resize": routers.get("last_resize"), "resizing": s.get("resizing"),
                                "router_tokens": {r.get("router"): r.get("generated_tokens") for r in s["routers"]}})
            except Exception as error:  # noqa: BLE001 - shown, and the ramp goes on
                samples.append({"t": t, "error": str(error)})
            time.sleep(0.3)

    def watch_nodes() -> None:
        while not done.is_set():
            try:
                nodes.append({"t": time.monotonic() - started, **node_counts(address)})
            except Exception as error:  # noqa: BLE001
                nodes.append({"t": time.monotonic() - started, "error": str(error)})
            time.sleep(1.0)

    threads = [threading.Thread(target=slot, args=(k,), daemon=True) for k in range(max(c for c, _ in phases))]
    threads.append(threading.Thread(target=monitor, daemon=True))
    if address:
        threads.append(threading.Thread(target=watch_nodes, daemon=True))
    for thread in threads:
        thread.start()
    time.sleep(total)
    done.set()
    for thread in threads:
        thread.join(120)
    return reference, records, samples, nodes, started


def resize_rows(samples: list[dict], streams: list[dict], origin: float) -> list[dict]:
    """One row per resize the policy made, both pools, in time order (module docstring)."""
    ok = [s for s in samples if "error" not in s]
    wall_origin = time.time() - (time.monotonic() - origin)  # a resize's time is wall-clock
    rows = []
    for resize in resizes_seen(ok, "last_resize"):
        end = resize["time"] - wall_origin
        begin = end - resize["seconds"]
        rows.append({"pool": "workers", "direction": "grow" if resize["workers"] > resize["workers_before"] else "shrink",
                     "from": resize["workers_before"], "to": resize["workers"], "decision_t": round(begin, 1),
                     "decision_to_serving_s": round(resize["seconds"], 2), "group_pause_s": round(resize["pause_s"], 3),
                     "longest_stream_pause_s": round(pause_during(streams, begin + origin, end + origin), 3),
                     "copies": resize["copies"], "bytes_copied": resize["bytes_copied"],
                     "bytes_all_experts": resize.get("bytes_all_experts")})
    for resize in resizes_seen(ok, "last_router_resize"):
        end = resize["time"] - wall_origin
        begin = end - resize["seconds"]
        grow = resize["routers"] > resize["routers_before"]
        serving_s = resize["seconds"]
        if grow:  # until the new router's first token (the relays pick it up within a second)
            name = f"router-{resize['routers'] - 1}"
            first = next((s["t"] for s in ok if s["t"] >= begin and (s["router_tokens"].get(name) or 0) > 0), None)
            serving_s = None if first is None else first - begin
        rows.append({"pool": "routers", "direction": "grow" if grow else "shrink", "from": resize["routers_before"],
                     "to": resize["routers"], "decision_t": round(begin, 1),
                     "decision_to_serving_s": None if serving_s is None else round(serving_s, 2),
                     "resize_call_s": round(resize["seconds"], 2), "group_pause_s": round(resize["pause_s"], 3),
                     "drain_s": None if resize.get("drain_s") is None else round(resize["drain_s"], 2),
                     "longest_stream_pause_s": round(pause_during(streams, begin + origin, end + origin), 3),
                     "copies": 0, "bytes_copied": 0, "bytes_all_experts": None})
    return sorted(rows, key=lambda r: r["decision_t"])


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [s for s in result["samples"] if "error" not in s]
    fig, axes = plt.subplots(4, 1, figsize=(8, 7), sharex=True)
    t = [s["t"] for s in ok]
    axes[0].step([p[0] for p in result["load"]], [p[1] for p in result["load"]], where="post", lw=1.2, label="clients")
    held = [s for s in ok if s.get("requests") is not None]
    axes[0].plot([s["t"] for s in held], [s["requests"] for s in held], lw=0.8,
                 label="requests the routers hold (window mean at the last router decision)")
    axes[0].set_ylabel("concurrency", fontsize=8)
    axes[0].legend(fontsize=7, loc="upper right")
    nodes = [n for n in result["nodes"] if "error" not in n]

    def pool_panel(ax, size: str, desired: str, label: str, node_key: str, node_label: str, ylabel: str) -> None:
        """A pool's size, what the policy wanted, and (on an AutoscalingCluster) its nodes."""
        ax.step(t, [s[size] for s in ok], where="post", lw=1.2, label=label)
        ax.step(t, [s[desired] for s in ok], where="post", lw=0.8, ls="--", label="desired")
        if result["nodes"]:
            ax.step([n["t"] for n in nodes], [n[node_key] for n in nodes], where="post", lw=0.8, ls=":",
                    label=node_label)
        ax.set_ylabel(ylabel, fontsize=8)
        ax.legend(fontsize=7, loc="upper right")

    pool_panel(axes[1], "workers", "desired", "expert workers", "expert_nodes", "expert nodes (Ray's autoscaler)",
               "workers")
    pool_panel(axes[2], "routers", "desired_routers", "routers", "router_nodes", "router nodes", "routers")
    itl_t, itl_p50, itl_p90 = result["itl"]
    axes[3].plot(itl_t, itl_p50, lw=1.0, label="ITL p50")
    axes[3].plot(itl_t, itl_p90, lw=0.8, label="ITL p90")
    axes[3].set_ylabel("ms", fontsize=8)
    axes[3].legend(fontsize=7, loc="upper right")
    for row in result["resizes"]:
        for ax in axes:
            ax.axvline(row["decision_t"], color="r" if row["pool"] == "workers" else "g", lw=0.6, alpha=0.6)
    axes[3].set_xlabel("seconds into the ramp (red: worker resize decided, green: router resize decided)", fontsize=8)
    for ax in axes:
        ax.tick_params(labelsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=70)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ray", choices=("autoscaling", "local"), default="autoscaling",
                        help="Ray's AutoscalingCluster over simulated nodes, or a plain local Ray")
    parser.add_argument("--phases", default=DEFAULT_PHASES, help="concurrency:seconds, comma-separated")
    parser.add_argument("--max-workers", type=int, default=3)
    parser.add_argument("--max-routers", type=int, default=2)
    parser.add_argument("--target", type=float, default=8.0, help="autoscale.target_rows_per_worker")
    parser.add_argument("--target-requests", type=float, default=12.0, help="autoscale.target_requests_per_router")
    parser.add_argument("--cooldown", type=float, default=5.0)
    parser.add_argument("--window", type=float, default=3.0)
    parser.add_argument("--interval", type=float, default=0.5)
    parser.add_argument("--idle-timeout-min", type=float, default=1.0, help="Ray's autoscaler: idle node removal")
    parser.add_argument("--tokens", type=int, default=48, help="tokens per request")
    parser.add_argument("--prompts", type=int, default=16, help="distinct requests (reference run first)")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    parser.add_argument("--plot", default=None, help="write a plot of load, workers, routers and ITL here (PNG)")
    args = parser.parse_args(argv)
    phases = parse_phases(args.phases)
    from common import build_mixtral, machine_description

    folder = tempfile.mkdtemp(prefix="bench-autoscale-")
    model = os.path.join(folder, "mixtral")
    build_mixtral(model)
    config = write_config(folder, model, args)
    env = dict(os.environ, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", RAYMOE_ADMIN_TOKEN=ADMIN_TOKEN)
    cluster = start_autoscaling_cluster(args) if args.ray == "autoscaling" else None
    try:
        argv_serve = serve_argv(config, free_port())
        if cluster is not None:
            # The deploy's worker bundle waits for the first expert node (min_workers 1). The
            # cluster runs without Ray's token authentication (autoscaling_cluster.py); `raymoe
            # serve` would turn it on where ~/.ray/auth_token exists (cluster/ray_connect.py),
            # and then the GCS took the driver for dead and cancelled its first actor at creation.
            argv_serve += ["--address", cluster.address]
            env["RAY_AUTH_MODE"] = "disabled"
        server = ServeProcess(argv_serve, int(argv_serve[argv_serve.index("--port") + 1]),
                              log_path=os.path.join(folder, "serve.log"), env=env)
        server.start()
        try:
            server.wait_ready(300, interval_s=1)
            print(f"machine: {machine_description()}; Ray: {args.ray}; log: {folder}/serve.log", flush=True)
            reference, records, samples, nodes, started = run_ramp(server, args, phases,
                                                                   cluster.address if cluster else None)
        finally:
            server.stop(90)
    finally:
        if cluster is not None:
            cluster.shutdown()
    origin = started  # a monotonic origin: the streams' event times are time.monotonic() too
    failed = sum(is_lost(r, args.tokens) for _, r in records)
    differing = sum(token_ids(r) != reference[i] for i, r in records if not is_lost(r, args.tokens))
    streams = [r for _, r in records]
    print(f"\nrequests: {len(records)}, failed {failed}, tokens differing from the reference {differing}")
    print("\ntimeline (s, concurrency, workers (desired), routers (desired), expert/router nodes):")
    last_line = None
    for sample in samples:
        if "error" in sample:
            continue
        node = next((n for n in reversed(nodes) if n["t"] <= sample["t"] and "error" not in n), None)
        line = (concurrency_at(phases, sample["t"]), sample["workers"], sample["desired"], sample["routers"],
                sample["desired_routers"], node and node["expert_nodes"], node and node["router_nodes"])
        if line != last_line:
            print(f"  {sample['t']:6.1f}  c={line[0]:>2}  workers {line[1]} ({line[2]})  routers {line[3]} ({line[4]})"
                  f"  nodes {line[5]}/{line[6]}   {sample['reason']} | {sample['router_reason']}")
            last_line = line
    rows = resize_rows(samples, streams, origin)
    for row in rows:
        print(f"resize: {row}")
    print(f"\nlongest stream pause over the whole ramp: {pause_during(streams, float('-inf'), float('inf')):.3f} s")
    itl = itl_series(streams, origin)
    ends, t = [], 0.0
    for concurrency, seconds in phases:
        ends.append((t, concurrency))
        t += seconds
    ends.append((t, 0))
    result = {"machine": machine_description(), "args": vars(args), "requests": len(records), "failed": failed,
              "differing": differing, "resizes": rows, "load": ends, "itl": itl, "nodes": nodes,
              "longest_pause_s": pause_during(streams, float("-inf"), float("inf")),
              "samples": [{k: v for k, v in s.items() if k not in ("last_resize", "last_router_resize")}
                          for s in samples]}
    if args.out:
        with open(args.out, "w") as handle:
            json.dump(result, handle, indent=2)
    if args.plot:
        plot(result, args.plot)


if __name__ == "__main__":
    main()
