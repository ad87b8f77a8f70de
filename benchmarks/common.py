"""Shared pieces of the benchmarks: a mid-sized random Mixtral and a heterogeneous workload."""

from __future__ import annotations

import os
import platform
import random
import subprocess

import torch


def machine_description() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in subprocess.run(["lscpu"], capture_output=True, text=True, timeout=5).stdout.splitlines():
            if line.startswith("Model name"):
                cpu = line.split(":", 1)[1].strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__}, {torch.get_num_threads()} threads"


def build_mixtral(path: str, hidden: int = 256, layers: int = 4, experts: int = 8, top_k: int = 2,
                  intermediate: int = 512, vocab: int = 512, seed: int = 0):
    """Write a random-weight Mixtral checkpoint with transformers; returns the HF model."""
    from transformers import AutoModelForCausalLM, MixtralConfig

    from raymoe.engine.demo_tokenizer import write_demo_tokenizer

    torch.manual_seed(seed)
    config = MixtralConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
        num_attention_heads=8, num_key_value_heads=4, num_local_experts=experts, num_experts_per_tok=top_k,
        max_position_embeddings=1024, initializer_range=0.05, eos_token_id=2, pad_token_id=3, bos_token_id=None,
    )
    model = AutoModelForCausalLM.from_config(config).float().eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 3
    model.save_pretrained(path)
    write_demo_tokenizer(path, vocab)
    return model


def workload(num_requests: int = 100, prompt_range=(4, 64), output_range=(8, 64), vocab: int = 512, seed: int = 0):
    """``[(prompt_ids, max_tokens)]`` with uniform prompt and output lengths."""
    rng = random.Random(seed)
    return [
        ([rng.randrange(4, vocab) for _ in range(rng.randint(*prompt_range))], rng.randint(*output_range))
        for _ in range(num_requests)
    ]
