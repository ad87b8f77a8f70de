"""`raymoe status` and `raymoe rebalance`: look at and steer a running deployment's controller."""

from __future__ import annotations

import argparse
import json
import socket
import sys
import time
from typing import Any

CONTROLLER_NAME = "raymoe-controller"
NAMESPACE = "raymoe"  # cluster/deploy.py names every actor there


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    for name, help_text, func in (
        ("status", "placement, per-worker load, balancedness and the last rebalance", _status),
        ("rebalance", "ask the controller to re-plan and migrate now", _rebalance),
    ):
        parser = subparsers.add_parser(name, help=help_text)
        parser.add_argument("--address", default=None,
                            help="Ray cluster, HOST:PORT (default: RAY_ADDRESS, else auto: the cluster this machine "
                                 "started last; name it on a shared host)")
        parser.add_argument("--namespace", default=NAMESPACE, help="Ray namespace of the deployment")
        parser.add_argument("--json", action="store_true", help="machine-readable output")
        parser.set_defaults(func=func)


DEPLOYMENT_PREFIX = CONTROLLER_NAME.rsplit("-", 1)[0]  # raymoe-router-{r}, raymoe-worker-{w}
ACTOR_TIMEOUT_S = 10.0
START_HINT = ("start one with `raymoe serve [CONFIG.yaml]` (it prints the address to give here: "
              "raymoe status --address HOST:PORT), or name a running cluster with --address or RAY_ADDRESS")


def _controller(args: argparse.Namespace):
    import ray

    from raymoe.cluster.ray_connect import AuthenticationFailed, ClusterUnreachable, connect, requested_address

    command = getattr(args, "command", "status")
    address = requested_address(args.address) or "auto"
    if _nothing_listens(address):  # at once, not after Ray's 45 s of retries
        print(f"raymoe {command}: no Ray cluster at {address} (nothing listens there); {START_HINT}", file=sys.stderr)
        return None
    try:
        connect(address, namespace=args.namespace, logging_level="ERROR", log_to_driver=False)
    except AuthenticationFailed as error:  # "authentication failed: ...": a cluster is there
        print(f"raymoe {command}: {error}", file=sys.stderr)
        return None
    except ClusterUnreachable as error:
        print(f"raymoe {command}: {error}; {START_HINT}", file=sys.stderr)
        return None
    try:
        return ray.get_actor(CONTROLLER_NAME)
    except ValueError:
        print(f"raymoe {command}: no running raymoe deployment found at {address} (no actor {CONTROLLER_NAME} "
              f"in namespace {args.namespace}); {START_HINT}", file=sys.stderr)
        return None


def _nothing_listens(address: str) -> bool:
    """True when HOST:PORT refuses a TCP connection (no GCS there); False when anything else
    happens (it answers, or the address is ``auto`` or not HOST:PORT: Ray decides)."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        return False
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=3).close()
    except ConnectionRefusedError:
        return True
    except OSError:
        return False
    return False


def _status(args: argparse.Namespace) -> int:
    import ray

    controller = _controller(args)
    if controller is None:
        return 1
    status = ray.get(controller.status.remote(), timeout=60)
    status["actors"] = actor_rows(len(status.get("routers", [])), len(status["worker2node"]), args.namespace)
    try:  # each rank's state from the controller's watch (actors/rank_watch.py)
        status["rank_states"] = ray.get(controller.rank_states.remote(), timeout=ACTOR_TIMEOUT_S)
    except Exception as error:
        status["rank_states"] = {"error": f"{type(error).__name__}: {str(error).strip()[:200]}", "ranks": []}
    merge_rank_states(status["actors"], status["rank_states"])
    print(json.dumps(status, indent=2) if args.json else format_status(status))
    return 0


def actor_rows(num_routers: int, num_workers: int, namespace: str = NAMESPACE,
               timeout_s: float = ACTOR_TIMEOUT_S) -> list[dict[str, Any]]:
    """One row per router and expert worker, each asked directly (all at once, one deadline):
    pid, node, whether it answered, requests in flight (routers) and its last failure."""
    import ray

    nodes = {node["NodeID"]: node.get("NodeManagerAddress") for node in ray.nodes()}
    rows, calls = [], []
    for kind, count in (("router", num_routers), ("worker", num_workers)):
        for index in range(count):
            row: dict[str, Any] = {"actor": f"{kind} {index}", "pid": None, "node": None, "alive": False,
                                   "in_flight": None, "last_failure": None}
            rows.append(row)
            try:
                actor = ray.get_actor(f"{DEPLOYMENT_PREFIX}-{kind}-{index}", namespace=namespace)
            except ValueError:
                row["state"] = "gone (no such actor)"
                continue
            calls.append((row, "info", actor.info.remote()))
            if kind == "router":
                calls.append((row, "telemetry", actor.get_telemetry.remote()))
    refs = [ref for _, _, ref in calls]
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s) if refs else ([], [])
    ready_set = set(ready)
    for row, what, ref in calls:
        if ref not in ready_set:
            if what == "info":
                row["state"] = f"no answer within {timeout_s:g} s"
            continue
        try:
            answer = ray.get(ref)
        except ray.exceptions.RayError as error:
            if what == "telemetry":
                continue
            row["state"] = f"{type(error).__name__}: {(str(error).strip() or 'no detail').splitlines()[0]}"
            continue
        if what == "telemetry":
            row["in_flight"] = answer.get("requests_running", 0) + answer.get("requests_waiting", 0)
            continue
        failure = answer.get("last_failure") if "router" in answer else answer.get("last_error")
        row.update(pid=answer.get("pid"), node=nodes.get(answer.get("node_id")) or answer.get("node_id"),
                   node_id=answer.get("node_id"), alive=True,
                   last_failure=failure.get("error") if isinstance(failure, dict) else failure)
    for row in rows:
        if "state" in row:
            row["alive"] = False
    return rows


def merge_rank_states(rows: list[dict[str, Any]], report: dict[str, Any]) -> None:
    """Each row gains the watch's ``rank_state`` (serving, alive, stalled, busy, wedged, dead), its
    reason and the seconds since its last progress (None where the watch has no row)."""
    watched = {rank["rank"]: rank for rank in report.get("ranks", [])}
    for row in rows:
        rank = watched.get(row["actor"], {})
        row.update(rank_state=rank.get("state"), rank_reason=rank.get("reason") or None,
                   since_progress_s=rank.get("since_progress_s"))


def format_actors(rows: list[dict[str, Any]]) -> list[str]:
    lines = [f"{'actor':<10} {'pid':>8} {'node':<16} {'alive':<6} {'in-flight':>9} {'state':<12} {'progress':>8}"
             f"   last failure"]
    for row in rows:
        alive = "yes" if row["alive"] else "NO"
        failure = row.get("rank_reason") or row.get("state") or row["last_failure"] or "-"
        since = row.get("since_progress_s")  # seconds since its counter last advanced
        lines.append(f"{row['actor']:<10} {row['pid'] or '-':>8} {row['node'] or '-':<16} {alive:<6} "
                     f"{'-' if row['in_flight'] is None else row['in_flight']:>9} {row.get('rank_state') or '-':<12} "
                     f"{'-' if since is None else f'{since:.1f}s':>8}   {failure}"[:240])
    return lines


def _rebalance(args: argparse.Namespace) -> int:
    import ray

    controller = _controller(args)
    if controller is None:
        return 1
    report = ray.get(controller.rebalance.remote(True), timeout=600)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        moved = f", {report['copies']} expert copies, {report['bytes_moved']} bytes in {report['seconds']:.2f} s" \
            if report.get("rebalanced") else ""
        print(f"rebalanced: {report['rebalanced']} ({report['reason']}){moved}")
    return 0


def _resizing(resizing: dict[str, Any]) -> str:
    """``status()["resizing"]``: a worker resize's ``workers`` or a router resize's ``routers``."""
    return f"{resizing['workers']} workers" if "workers" in resizing else f"{resizing.get('routers')} routers"


def format_status(status: dict[str, Any]) -> str:
    slots = status["slots_per_worker"]
    lines = [
        f"epoch {status['epoch']}   balancedness {status['balancedness']:.3f} (min layer "
        f"{status['balancedness_min']:.3f}) over {status['window_steps']} steps   rebalances {status['rebalances']}",
        "",
        f"live size: {status.get('workers', len(status['worker2node']))} expert workers, "
        f"{status.get('num_routers', len(status.get('routers', [])))} routers"
        + (f"   (resizing to {_resizing(status['resizing'])})" if status.get("resizing") else ""),
        "",
        f"{'worker':>6} {'node':>4} {'load':>10}   experts per MoE layer",
    ]
    for worker, load in enumerate(status["worker_load"]):
        experts = " | ".join(
            ",".join(str(e) for e in layer[worker * slots:(worker + 1) * slots]) for layer in status["placement"])
        lines.append(f"{worker:>6} {status['worker2node'][worker]:>4} {load:>10.0f}   {experts}")
    if status.get("actors"):
        lines += ["", *format_actors(status["actors"])]
    auto = status.get("autoscale")
    if auto:
        when = auto.get("last_decision_time")
        ago = f", {time.time() - when:.0f} s ago" if when else ""
        lines.append(f"\nautoscale: {auto['actual_workers']} workers, desired {auto['desired_workers']} "
                     f"(limits {auto['min_workers']}..{auto['max_workers']}, target {auto['target_rows_per_worker']:g} "
                     f"rows per worker; decisions up {auto['decisions']['up']}, down {auto['decisions']['down']})")
        lines.append(f"  last decision{ago}: {auto['reason']}")
        routers = auto.get("routers")
        if routers:
            when = routers.get("last_decision_time")
            ago = f", {time.time() - when:.0f} s ago" if when else ""
            queue = (f", queue target {routers['target_queue_s']:g} s" if routers.get("target_queue_s") is not None
                     else "")
            lines.append(f"autoscale: {routers['actual_routers']} routers, desired {routers['desired_routers']} "
                         f"(limits {routers['min_routers']}..{routers['max_routers']}, target "
                         f"{routers['target_requests_per_router']:g} requests per router{queue}; decisions up "
                         f"{routers['decisions']['up']}, down {routers['decisions']['down']})")
            lines.append(f"  last router decision{ago}: {routers['reason']}")
    resize = status.get("last_resize")
    if resize:
        if resize.get("resized") and "routers_before" in resize:  # a router resize (actors/router_resize.py)
            lines.append(f"\nlast resize: {resize['routers_before']} -> {resize['routers']} routers in "
                         f"{resize['seconds']:.2f} s (paused {resize['pause_s']:.3f} s)")
        elif resize.get("resized"):
            lines.append(f"\nlast resize: {resize['workers_before']} -> {resize['workers']} workers in "
                         f"{resize['seconds']:.2f} s (paused {resize['pause_s']:.3f} s, {resize['copies']} expert copies)")
        elif "error" in resize:
            lines.append(f"\nlast resize {'refused' if resize.get('refused') else 'failed'}: {resize['error']}")
    last = status.get("last_rebalance")
    if last:
        if "error" in last:
            lines.append(f"\nlast controller error: {last['error']}")
        else:
            lines.append(f"\nlast rebalance: {last['reason']}; balancedness {last['balancedness_before']:.3f} -> "
                         f"{last['balancedness_predicted']:.3f} predicted")
            for copy in last.get("moved", []):
                lines.append(f"  layer {copy['layer']}: expert {copy['expert']} worker {copy['source_worker']} -> "
                             f"{copy['destination_worker']}{'' if copy['same_node'] else ' (across nodes)'}")
    return "\n".join(lines)
