"""`raymoe run-batch`: offline batch inference from an OpenAI batch JSONL file."""

from __future__ import annotations

import argparse
import json
import os
import sys

from raymoe.engine.completions import ModelLimits
from raymoe.engine.engine import EngineConfig, LLMEngine
from raymoe.engine.run_batch import read_batch, run_batch
from raymoe.engine.tokenizer import Tokenizer


class InProcessBatchEngine:
    """run-batch's engine for ``--model DIR``: everything in this process."""

    def __init__(self, engine: LLMEngine):
        self.engine = engine

    def run(self, requests, on_finish) -> None:
        for request_id, prompt_ids, params in requests:
            self.engine.add_request(request_id, prompt_ids, params)
        while self.engine.has_unfinished():
            for output in self.engine.step():
                if output.finished:
                    on_finish(output)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "run-batch",
        help="offline batch inference (OpenAI batch JSONL in, JSONL out)",
        description="Run an OpenAI batch file: each input line is {custom_id, method, url, body}.",
    )
    parser.add_argument("-i", "--input", required=True, help="input JSONL file ('-' for stdin)")
    parser.add_argument("-o", "--output", required=True, help="output JSONL file ('-' for stdout)")
    parser.add_argument("--model", required=True, help="Hugging Face checkpoint directory")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    parser.add_argument("--served-model-name", default=None, help="model name in responses (default: DIR's name)")
    parser.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    if not os.path.isdir(args.model):
        print(f"raymoe run-batch: --model {args.model!r} is not a directory", file=sys.stderr)
        return 2
    with (sys.stdin if args.input == "-" else open(args.input, encoding="utf-8")) as handle:
        try:
            items = read_batch(handle)
        except ValueError as error:
            print(f"raymoe run-batch: {args.input}: {error}", file=sys.stderr)
            return 2
    tokenizer = Tokenizer(args.model) if os.path.isfile(os.path.join(args.model, "tokenizer.json")) else None
    engine = LLMEngine.from_pretrained(
        args.model, EngineConfig(dtype=args.dtype), detokenize=tokenizer.decode if tokenizer else None
    )
    name = args.served_model_name or os.path.basename(os.path.normpath(args.model))
    limits = ModelLimits(name, engine.config.vocab_size, engine.max_model_len)
    lines = run_batch(items, InProcessBatchEngine(engine), tokenizer, limits)
    with (sys.stdout if args.output == "-" else open(args.output, "w", encoding="utf-8")) as handle:
        for line in lines:
            handle.write(json.dumps(line) + "\n")
    failed = sum(line["response"]["status_code"] != 200 for line in lines)
    print(f"raymoe run-batch: {len(lines) - failed} ok, {failed} failed -> {args.output}", file=sys.stderr)
    return 0
