"""The config.json fields the cost model reads, for models named on the command line.

Values are copied from each model's published config.json (only the fields that size
parameters, and the context length that sizes a KV cache). The cost model parses these exactly as it parses a checkpoint's own file.
"""

from __future__ import annotations

from typing import Any


def model_presets() -> dict[str, dict[str, Any]]:
    """Preset name -> config.json subset. A fresh dict each call (no shared state)."""
    return {
        "Mixtral-8x7B": {
            "architectures": ["MixtralForCausalLM"],
            "hidden_size": 4096,
            "intermediate_size": 14336,
            "num_hidden_layers": 32,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "num_local_experts": 8,
            "num_experts_per_tok": 2,
            "vocab_size": 32000,
            "max_position_embeddings": 32768,
            "tie_word_embeddings": False,
            "torch_dtype": "bfloat16",
        },
        "DeepSeek-V3": {
            "architectures": ["DeepseekV3ForCausalLM"],
            "hidden_size": 7168,
            "intermediate_size": 18432,
            "moe_intermediate_size": 2048,
            "num_hidden_layers": 61,
            "first_k_dense_replace": 3,
            "num_attention_heads": 128,
            "num_key_value_heads": 128,
            "q_lora_rank": 1536,
            "kv_lora_rank": 512,
            "qk_nope_head_dim": 128,
            "qk_rope_head_dim": 64,
            "v_head_dim": 128,
            "n_routed_experts": 256,
            "n_shared_experts": 1,
            "n_group": 8,
            "topk_group": 4,
            "num_experts_per_tok": 8,
            "vocab_size": 129280,
            "max_position_embeddings": 163840,
            "tie_word_embeddings": False,
            "torch_dtype": "bfloat16",
            "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]},
        },
        "Qwen3-235B-A22B": {
            "architectures": ["Qwen3MoeForCausalLM"],
            "hidden_size": 4096,
            "intermediate_size": 12288,
            "moe_intermediate_size": 1536,
            "num_hidden_layers": 94,
            "num_attention_heads": 64,
            "num_key_value_heads": 4,
            "head_dim": 128,
            "num_experts": 128,
            "num_experts_per_tok": 8,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "vocab_size": 151936,
            "max_position_embeddings": 40960,
            "tie_word_embeddings": False,
            "torch_dtype": "bfloat16",
        },
    }
