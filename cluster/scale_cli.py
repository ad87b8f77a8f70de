"""`raymoe scale --workers N --routers M`: grow or shrink a running deployment's expert pool
and/or its router pool while it serves (the controller's ``resize``, actors/resize.py, and
``resize_routers``, actors/router_resize.py; workers first when both are given). Same address
options as ``raymoe status``."""

from __future__ import annotations

import argparse
import json
import sys

from raymoe.cluster.status_cli import NAMESPACE, _controller

# The call returns once the deployment serves at the new size (or rolled back): a grow waits
# for Ray to place the new workers (--ready-timeout), their start and the copies.
SCALE_CALL_TIMEOUT_S = 900.0


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("scale", help="grow or shrink the expert workers and routers of a running "
                                                 "deployment, live")
    parser.add_argument("--workers", type=int, default=None, help="the number of expert workers to serve with")
    parser.add_argument("--routers", type=int, default=None, help="the number of routers to serve with")
    parser.add_argument("--ready-timeout", type=float, default=None,
                        help="seconds to wait for Ray to place new workers (the autoscaler may add a node) "
                             "before the resize is refused (default 60), or for new routers to load (default 300)")
    parser.add_argument("--address", default=None,
                        help="Ray cluster, HOST:PORT (default: RAY_ADDRESS, else auto: the cluster this machine "
                             "started last; name it on a shared host)")
    parser.add_argument("--namespace", default=NAMESPACE, help="Ray namespace of the deployment")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.set_defaults(func=_scale)


def _scale(args: argparse.Namespace) -> int:
    if args.workers is None and args.routers is None:
        print("raymoe scale: say how many: --workers N and/or --routers M", file=sys.stderr)
        return 2
    for flag, value in (("--workers", args.workers), ("--routers", args.routers)):
        if value is not None and value < 1:
            print(f"raymoe scale: {flag} must be >= 1, got {value}", file=sys.stderr)
            return 2
    import ray

    controller = _controller(args)
    if controller is None:
        return 1
    for what, size in (("workers", args.workers), ("routers", args.routers)):
        if size is None:
            continue
        if what == "workers":
            call = controller.resize.remote(size, 60.0 if args.ready_timeout is None else args.ready_timeout)
        else:
            options = {} if args.ready_timeout is None else {"ready_timeout_s": args.ready_timeout}
            call = controller.resize_routers.remote(size, **options)
        report = ray.get(call, timeout=SCALE_CALL_TIMEOUT_S)
        report.pop("moved", None)
        if args.json:
            print(json.dumps(report, indent=2))
        elif report.get("resized") and what == "workers":
            print(f"scaled: {report['workers_before']} -> {report['workers']} expert workers in "
                  f"{report['seconds']:.2f} s (groups paused {report['pause_s']:.3f} s; {report['copies']} expert "
                  f"copies, {report['bytes_copied']} bytes{_of_all(report)})")
        elif report.get("resized"):
            drained = "" if "drain_s" not in report else f"; drained in {report['drain_s']:.2f} s"
            print(f"scaled: {report['routers_before']} -> {report['routers']} routers in {report['seconds']:.2f} s "
                  f"(groups paused {report['pause_s']:.3f} s{drained})")
        elif "error" not in report:
            print(f"scaled: nothing to do ({report.get('reason')})")
        if not report.get("resized") and "error" in report:
            result = "refused" if report.get("refused") else "failed and rolled back"
            detail = "" if report.get("refused") else f" ({report.get('rolled_back')})"
            print(f"raymoe scale: {what}: {result}: {report['error']}{detail}", file=sys.stderr)
            return 1
    return 0


def _of_all(report: dict) -> str:
    total = report.get("bytes_all_experts")
    return f" of {total} for every expert once" if total else ""
