"""Rebalancing on skewed traffic: step time before and after, and what one rebalance costs.

A DeepSeek-V3-style random checkpoint (hidden 256, 4 layers, 8 experts, top-2) whose gate
always picks experts 0 and 1 (large score-correction bias), served by 1 router and 4 CPU
expert workers with both hot experts on worker 0. The same workload runs before and after
one rebalance by the controller; the router's telemetry gives the mean step split. The
greedy outputs before and after the rebalance must equal each other and the in-process
engine's: otherwise the script exits non-zero and prints no speed figures.

    python benchmarks/bench_rebalance.py [--requests 32] [--tokens 16]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections import Counter

import ray
import torch

from common import machine_description, workload
from raymoe.cluster.config import parse_cluster_config
from raymoe.cluster.deploy import deploy
from raymoe.engine.demo_tokenizer import write_demo_tokenizer
from raymoe.engine.engine import EngineConfig, LLMEngine
from raymoe.engine.sampling_params import SamplingParams


def build_skewed(path: str) -> None:
    from transformers import AutoModelForCausalLM, DeepseekV3Config

    torch.manual_seed(0)
    config = DeepseekV3Config(
        vocab_size=512, hidden_size=256, intermediate_size=512, moe_intermediate_size=512, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=8, n_routed_experts=8, num_experts_per_tok=2, n_group=1,
        topk_group=1, first_k_dense_replace=0, q_lora_rank=None, kv_lora_rank=64, qk_rope_head_dim=16,
        qk_nope_head_dim=32, v_head_dim=32, n_shared_experts=0, max_position_embeddings=1024, rope_scaling=None,
        eos_token_id=2, pad_token_id=3, bos_token_id=None, initializer_range=0.05,
    )
    model = AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.zero_()
                buffer[:2] = 10.0
    model.save_pretrained(path)
    write_demo_tokenizer(path, 512)


def run(deployment, prompts, params) -> dict:
    skip = len(deployment.telemetry()[0]["steps"])
    started = time.perf_counter()
    outputs = deployment.generate(prompts, params)
    wall = time.perf_counter() - started
    steps = deployment.telemetry()[0]["steps"][skip:]
    mean = {k: 1e3 * sum(s[k] for s in steps) / len(steps) for k in ("dense_s", "dispatch_s", "expert_s", "combine_s")}
    return {"wall_s": wall, "steps": len(steps), "outputs": [o.output_token_ids for o in outputs], **mean}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=16)
    args = parser.parse_args()
    prompts = [p for p, _ in workload(args.requests)]
    params = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    with tempfile.TemporaryDirectory() as path:
        build_skewed(path)
        expected = [o.output_token_ids for o in
                    LLMEngine.from_pretrained(path, EngineConfig(dtype="float32")).generate(prompts, params)]
        ray.init(address="local", include_dashboard=False)
        config = parse_cluster_config({
            "model": path, "device": "cpu", "dtype": "float32", "routers": 1, "expert_workers": 4,
            "placement": {"strategy": "explicit",
                          "experts": {0: [0, 1, 2, 3], 1: [4, 5, 6, 7], 2: [4, 5, 6, 7], 3: [4, 5, 6, 7]}},
            "balancer": {"enabled": True, "interval_steps": 10**9, "window_steps": 10**6},  # rebalance by hand only
        })
        deployment = deploy(config, name="bench-rebalance")
        try:
            deployment.generate(prompts[:2], SamplingParams(max_tokens=2, temperature=0.0))
            before = run(deployment, prompts, params)
            balance_before = deployment.status()["balancedness"]
            report = deployment.rebalance()
            deployment.generate(prompts[:2], SamplingParams(max_tokens=2, temperature=0.0))
            after = run(deployment, prompts, params)
            balance_after = deployment.status()["balancedness"]
        finally:
            deployment.shutdown()
            ray.shutdown()
    same_before = sum(a == b for a, b in zip(before["outputs"], expected))
    same_after = sum(a == b for a, b in zip(after["outputs"], expected))
    print(f"identical greedy outputs vs the in-process engine: before {same_before}/{len(prompts)}, "
          f"after {same_after}/{len(prompts)}")
    if not report.get("rebalanced"):
        print(f"the controller did not rebalance ({report.get('reason')}): nothing to measure", file=sys.stderr)
        sys.exit(1)
    if same_before != len(prompts) or same_after != len(prompts):
        print("outputs changed: refusing to report speed figures", file=sys.stderr)
        sys.exit(1)
    print(f"machine: {machine_description()}")
    print(f"{'':>8} | {'wall s':>7} {'steps':>5} | per step ms: {'dense':>7} {'dispatch':>8} {'experts':>8} "
          f"{'combine':>8} | balancedness")
    for label, row, balance in (("before", before, balance_before), ("after", after, balance_after)):
        print(f"{label:>8} | {row['wall_s']:7.3f} {row['steps']:>5} | {'':13}{row['dense_s']:7.2f} "
              f"{row['dispatch_s']:8.2f} {row['expert_s']:8.2f} {row['combine_s']:8.2f} | {balance:.3f}")
    print(f"step time after / before: {(after['wall_s'] / after['steps']) / (before['wall_s'] / before['steps']):.2f}x; "
          f"slowest-worker expert time after / before: {after['expert_s'] / before['expert_s']:.2f}x")
    per_layer = Counter(copy["layer"] for copy in report["moved"])
    print(f"one rebalance: {report['copies']} expert copies ("
          + ", ".join(f"layer {layer}: {per_layer[layer]}" for layer in sorted(per_layer))
          + f"), {report['bytes_moved'] / 2**20:.2f} MiB moved in {report['seconds']:.3f} s (epoch {report['epoch']}); "
          f"balancedness {report['balancedness_before']:.3f} -> {report['balancedness_predicted']:.3f} predicted")


if __name__ == "__main__":
    main()
