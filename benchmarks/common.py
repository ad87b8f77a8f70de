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


# Real models' per-layer shapes, fewer layers (issue 29): what a served bfloat16 checkpoint costs per
# token, at a size this machine holds. Random weights; never committed.
REAL_SHAPES = {
    # Qwen3-30B-A3B: hidden 2048, 128 experts top-8 of intermediate 768, 32 / 4 heads of 128, vocab
    # 151,936; 4 of its 48 layers (3.1 B parameters, 5.9 GB in bfloat16)
    "qwen3-30b-a3b-4l": ("Qwen3MoeConfig", dict(
        vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
        num_hidden_layers=4, num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
        num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
        max_position_embeddings=4096, rope_theta=1e6, tie_word_embeddings=False)),
    # Mixtral-8x7B: hidden 4096, 8 experts top-2 of intermediate 14,336, 32 / 8 heads, vocab 32,000;
    # 2 of its 32 layers (3.2 B parameters)
    "mixtral-8x7b-2l": ("MixtralConfig", dict(
        vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=2,
        num_attention_heads=32, num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2,
        max_position_embeddings=4096, rope_theta=1e6, tie_word_embeddings=False)),
}


def build_real_shape(path: str, preset: str, seed: int = 0) -> None:
    """Write a random-weight bfloat16 checkpoint of ``preset``'s shapes (:data:`REAL_SHAPES`) to
    ``path``, built in bfloat16 directly (a float32 build would need twice the memory), with
    benchmarks' demo tokenizer (its few hundred tokens index into the full-size vocabulary)."""
    import transformers
    from transformers import AutoModelForCausalLM

    from raymoe.engine.demo_tokenizer import write_demo_tokenizer

    class_name, fields = REAL_SHAPES[preset]
    config = getattr(transformers, class_name)(**fields, initializer_range=0.02, eos_token_id=2, pad_token_id=3,
                                               bos_token_id=None, dtype="bfloat16")
    torch.manual_seed(seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    finally:
        torch.set_default_dtype(previous)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 3
    model.save_pretrained(path, max_shard_size="2GB")
    del model
    write_demo_tokenizer(path, fields["vocab_size"])
