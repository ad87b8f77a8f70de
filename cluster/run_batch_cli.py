"""`raymoe run-batch`: offline batch inference from an OpenAI batch JSONL file."""

from __future__ import annotations

import argparse
import json
import os
import sys

from raymoe.engine.api.completions import ModelLimits
from raymoe.engine.engine import EngineConfig, LLMEngine
from raymoe.engine.api.run_batch import read_batch, run_batch
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

    def score_prompts(self, prompts, num_top):
        return self.engine.score_prompts(prompts, num_top)  # within the token budget, never [L, vocab]


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "run-batch",
        help="offline batch inference (OpenAI batch JSONL in, JSONL out)",
        description="Run an OpenAI batch file: each input line is {custom_id, method, url, body}.",
    )
    parser.add_argument("config", nargs="?", help="cluster config YAML: run on the cluster it describes")
    parser.add_argument("-i", "--input", required=True, help="input JSONL file ('-' for stdin)")
    parser.add_argument("-o", "--output", required=True, help="output JSONL file ('-' for stdout)")
    parser.add_argument("--model", help="Hugging Face checkpoint directory (in-process engine, no Ray)")
    parser.add_argument("--address", default=None, help="Ray address to join (default: RAY_ADDRESS, else a local Ray)")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    parser.add_argument("--served-model-name", default=None, help="model name in responses (default: DIR's name)")
    parser.set_defaults(func=_run)


class ClusterBatchEngine:
    """run-batch's engine for a cluster config: the requests go to the deployment's routers."""

    def __init__(self, deployment):
        self.deployment = deployment

    def run(self, requests, on_finish) -> None:
        for output in self.deployment.run(requests):
            on_finish(output)

    def score_prompts(self, prompts, num_top):
        import ray

        return ray.get(self.deployment.routers[0].score_prompts.remote(prompts, num_top))


def _run(args: argparse.Namespace) -> int:
    if (args.config is None) == (args.model is None):
        print("raymoe run-batch: give either a cluster CONFIG.yaml or --model DIR", file=sys.stderr)
        return 2
    model = args.model
    if args.config is not None:
        from raymoe.cluster.config import ConfigError, load_cluster_config

        from raymoe.cluster.serve_cli import ensure_demo_model

        try:
            cluster = ensure_demo_model(load_cluster_config(args.config))  # the demo path: written on first use
        except (ConfigError, OSError) as error:
            print(f"raymoe run-batch: {error}", file=sys.stderr)
            return 2
        model = cluster.model
    if not os.path.isdir(model):
        print(f"raymoe run-batch: model {model!r} is not a directory", file=sys.stderr)
        return 2
    with (sys.stdin if args.input == "-" else open(args.input, encoding="utf-8")) as handle:
        try:
            items = read_batch(handle)
        except ValueError as error:
            print(f"raymoe run-batch: {args.input}: {error}", file=sys.stderr)
            return 2
    tokenizer = Tokenizer(model) if os.path.isfile(os.path.join(model, "tokenizer.json")) else None
    name = args.served_model_name or os.path.basename(os.path.normpath(model))
    if args.config is None:
        engine = LLMEngine.from_pretrained(
            model, EngineConfig(dtype=args.dtype), detokenize=tokenizer.decode if tokenizer else None,
            text_holds=tokenizer.byte_fallback_ids if tokenizer else frozenset(),
        )
        limits = ModelLimits(name, engine.config.vocab_size, engine.max_model_len)
        lines = run_batch(items, InProcessBatchEngine(engine), tokenizer, limits)
    else:
        lines = _run_on_cluster(cluster, args.address, items, tokenizer, name)
    with (sys.stdout if args.output == "-" else open(args.output, "w", encoding="utf-8")) as handle:
        for line in lines:
            handle.write(json.dumps(line) + "\n")
    failed = sum(line["response"]["status_code"] != 200 for line in lines)
    print(f"raymoe run-batch: {len(lines) - failed} ok, {failed} failed -> {args.output}", file=sys.stderr)
    return 0


def _run_on_cluster(cluster, address, items, tokenizer, name):
    import ray

    from raymoe.cluster.deploy import deploy, engine_config, ensure_ray

    started_here = not ray.is_initialized() and not (address or os.environ.get("RAY_ADDRESS"))
    ensure_ray(address)
    deployment = deploy(cluster)
    try:
        config = deployment.model_config
        max_len = min(engine_config(cluster).max_model_len or config.max_position_embeddings,
                      config.max_position_embeddings)
        limits = ModelLimits(name, config.vocab_size, max_len)
        return run_batch(items, ClusterBatchEngine(deployment), tokenizer, limits)
    finally:
        deployment.shutdown()
        if started_here:
            ray.shutdown()
