"""`raymoe demo-model DIR`: write a small random-weight demo checkpoint (no download)."""

from __future__ import annotations

import argparse

from raymoe.engine.demo_model import DEMO_ARCHITECTURES, write_demo_model


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("demo-model", help="write a small random-weight demo checkpoint")
    parser.add_argument("directory", help="where to write config.json, model.safetensors, tokenizer.json")
    parser.add_argument("--arch", default="mixtral", choices=sorted(DEMO_ARCHITECTURES))
    parser.add_argument("--seed", type=int, default=0)
    parser.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    path = write_demo_model(args.directory, args.arch, seed=args.seed)
    print(f"wrote a random-weight {args.arch} demo checkpoint to {path}")
    return 0
