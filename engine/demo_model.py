"""A small random-weight demo checkpoint, written without downloading anything.

The weights are random (the text it generates is noise), but the checkpoint is a real
Hugging Face layout: ``config.json``, ``model.safetensors``, ``tokenizer.json`` and a chat
template, so every path of the server runs on it.
"""

from __future__ import annotations

import json
import os

import torch
from safetensors.torch import save_file

from raymoe.engine.demo_tokenizer import SPECIAL_TOKENS, write_demo_tokenizer
from raymoe.engine.weights import expected_shapes
from raymoe.engine.hf_config import parse_model_config

DEMO_ARCHITECTURES = {
    "mixtral": {
        "architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
        "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "num_local_experts": 8, "num_experts_per_tok": 2,
    },
    "qwen3_moe": {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
        "hidden_size": 128, "intermediate_size": 256, "moe_intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "num_experts": 8,
        "num_experts_per_tok": 2, "norm_topk_prob": True,
    },
}


def write_demo_model(model_dir: str, arch: str = "mixtral", vocab_size: int = 512, seed: int = 0) -> str:
    """Write a demo checkpoint into ``model_dir`` (created if needed); returns the directory."""
    if arch not in DEMO_ARCHITECTURES:
        raise ValueError(f"unknown demo architecture {arch!r}; choose one of {sorted(DEMO_ARCHITECTURES)}")
    os.makedirs(model_dir, exist_ok=True)
    specials = write_demo_tokenizer(model_dir, vocab_size)
    raw = dict(
        DEMO_ARCHITECTURES[arch], vocab_size=vocab_size, max_position_embeddings=1024, rms_norm_eps=1e-6,
        rope_theta=10000.0, hidden_act="silu", tie_word_embeddings=False, torch_dtype="float32",
        bos_token_id=None, eos_token_id=specials["<|im_end|>"], pad_token_id=specials[SPECIAL_TOKENS[3]],
    )
    config = parse_model_config(raw)
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, shape in expected_shapes(config).items():
        if name.endswith(("norm.weight", "layernorm.weight")):
            tensors[name] = torch.ones(shape)
        else:
            tensors[name] = torch.randn(shape, generator=generator) * 0.05
    save_file(tensors, os.path.join(model_dir, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(model_dir, "config.json"), "w", encoding="utf-8") as handle:
        json.dump(raw, handle, indent=2)
    return model_dir
