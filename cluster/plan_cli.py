"""`raymoe plan`: placement planning, simulation and cost model (filled in by issue 5)."""

from __future__ import annotations

import argparse


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("plan", help="plan expert placement and estimate costs")
    parser.set_defaults(func=lambda args: parser.print_help() or 2)
