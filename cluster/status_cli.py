"""`raymoe status` and `raymoe rebalance`: look at and steer a running deployment's controller."""

from __future__ import annotations

import argparse
import json
import sys
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


def _controller(args: argparse.Namespace):
    import ray

    from raymoe.cluster.ray_connect import ClusterUnreachable, connect, requested_address

    address = requested_address(args.address) or "auto"
    try:
        connect(address, namespace=args.namespace, logging_level="ERROR", log_to_driver=False)
    except ClusterUnreachable as error:  # AuthenticationFailed says "authentication failed: ..."
        print(f"raymoe {getattr(args, 'command', 'status')}: {error}", file=sys.stderr)
        return None
    try:
        return ray.get_actor(CONTROLLER_NAME)
    except ValueError as error:
        print(f"raymoe {getattr(args, 'command', 'status')}: no running raymoe deployment found at {address} "
              f"(namespace {args.namespace}): {error}", file=sys.stderr)
        return None


def _status(args: argparse.Namespace) -> int:
    import ray

    controller = _controller(args)
    if controller is None:
        return 1
    status = ray.get(controller.status.remote(), timeout=60)
    print(json.dumps(status, indent=2) if args.json else format_status(status))
    return 0


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


def format_status(status: dict[str, Any]) -> str:
    slots = status["slots_per_worker"]
    lines = [
        f"epoch {status['epoch']}   balancedness {status['balancedness']:.3f} (min layer "
        f"{status['balancedness_min']:.3f}) over {status['window_steps']} steps   rebalances {status['rebalances']}",
        "",
        f"{'worker':>6} {'node':>4} {'load':>10}   experts per MoE layer",
    ]
    for worker, load in enumerate(status["worker_load"]):
        experts = " | ".join(
            ",".join(str(e) for e in layer[worker * slots:(worker + 1) * slots]) for layer in status["placement"])
        lines.append(f"{worker:>6} {status['worker2node'][worker]:>4} {load:>10.0f}   {experts}")
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
