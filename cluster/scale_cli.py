"""`raymoe scale --workers N`: grow or shrink a running deployment's expert pool while it
serves (the controller's ``resize``, actors/resize.py). Same address options as ``raymoe
status``. ``--routers`` is refused: resizing the router pool is not built yet (issue 31)."""

from __future__ import annotations

import argparse
import json
import sys

from raymoe.cluster.status_cli import NAMESPACE, _controller

# The call returns once the deployment serves at the new size (or rolled back): a grow waits
# for Ray to place the new workers (--ready-timeout), their start and the copies.
SCALE_CALL_TIMEOUT_S = 900.0


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("scale", help="grow or shrink the expert workers of a running deployment, live")
    parser.add_argument("--workers", type=int, default=None, help="the number of expert workers to serve with")
    parser.add_argument("--routers", type=int, default=None,
                        help="the number of routers (not supported yet: refused)")
    parser.add_argument("--ready-timeout", type=float, default=60.0,
                        help="seconds to wait for Ray to place new workers (the autoscaler may add a node) "
                             "before the resize is refused (default 60)")
    parser.add_argument("--address", default=None,
                        help="Ray cluster, HOST:PORT (default: RAY_ADDRESS, else auto: the cluster this machine "
                             "started last; name it on a shared host)")
    parser.add_argument("--namespace", default=NAMESPACE, help="Ray namespace of the deployment")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.set_defaults(func=_scale)


def _scale(args: argparse.Namespace) -> int:
    if args.routers is not None:
        print("raymoe scale: --routers is not supported yet (only the expert workers resize at runtime; "
              "the router count is the config's `routers`)", file=sys.stderr)
        return 2
    if args.workers is None:
        print("raymoe scale: say how many expert workers: --workers N", file=sys.stderr)
        return 2
    if args.workers < 1:
        print(f"raymoe scale: --workers must be >= 1, got {args.workers}", file=sys.stderr)
        return 2
    import ray

    controller = _controller(args)
    if controller is None:
        return 1
    report = ray.get(controller.resize.remote(args.workers, args.ready_timeout), timeout=SCALE_CALL_TIMEOUT_S)
    report.pop("moved", None)
    if args.json:
        print(json.dumps(report, indent=2))
    elif report.get("resized"):
        print(f"scaled: {report['workers_before']} -> {report['workers']} expert workers in {report['seconds']:.2f} s "
              f"(groups paused {report['pause_s']:.3f} s; {report['copies']} expert copies, "
              f"{report['bytes_copied']} bytes{_of_all(report)})")
    elif "error" not in report:
        print(f"scaled: nothing to do ({report.get('reason')})")
    if not report.get("resized") and "error" in report:
        what = "refused" if report.get("refused") else "failed and rolled back"
        detail = "" if report.get("refused") else f" ({report.get('rolled_back')})"
        print(f"raymoe scale: {what}: {report['error']}{detail}", file=sys.stderr)
        return 1
    return 0


def _of_all(report: dict) -> str:
    total = report.get("bytes_all_experts")
    return f" of {total} for every expert once" if total else ""
