"""The `raymoe` command line. Each subcommand lives in its own module and registers itself
here through an ``add_parser(subparsers)`` function; this file only wires them together."""

from __future__ import annotations

import argparse
import sys
from typing import Sequence


def build_parser() -> argparse.ArgumentParser:
    from raymoe import __version__
    from raymoe.cluster import bench_cli, demo_model_cli, plan_cli, run_batch_cli, scale_cli, serve_cli, status_cli

    parser = argparse.ArgumentParser(
        prog="raymoe",
        description="Serve Mixture-of-Experts LLMs with expert parallelism on Ray.",
    )
    parser.add_argument("--version", action="version", version=f"raymoe {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module in (serve_cli, run_batch_cli, demo_model_cli, plan_cli, bench_cli, status_cli, scale_cli):
        module.add_parser(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
