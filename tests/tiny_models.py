"""Tiny random-weight checkpoints written with transformers (the reference), offline."""

from __future__ import annotations

import json
import os

import torch

from raymoe.engine.demo_tokenizer import write_demo_tokenizer

VOCAB = 320
ARCHITECTURES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3")


WEATHER_PARAMETERS = {  # a tool's parameters: enums, a bounded integer, all required (tool-call tests)
    "type": "object",
    "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
                   "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                   "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "unit", "days"],
    "additionalProperties": False,
}


def hf_config(arch: str, **overrides):
    import transformers as tf

    common = dict(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.08,
        tie_word_embeddings=False, bos_token_id=None, eos_token_id=2, pad_token_id=3,
    )
    if arch == "mixtral":
        cfg = dict(common, intermediate_size=96, num_local_experts=8, num_experts_per_tok=2)
        cls = tf.MixtralConfig
    elif arch == "qwen2_moe":
        cfg = dict(common, intermediate_size=96, moe_intermediate_size=48, shared_expert_intermediate_size=80,
                   num_experts=8, num_experts_per_tok=2, norm_topk_prob=False, mlp_only_layers=[1])
        cls = tf.Qwen2MoeConfig
    elif arch == "qwen3_moe":
        cfg = dict(common, intermediate_size=96, moe_intermediate_size=48, head_dim=24, num_experts=8,
                   num_experts_per_tok=3, norm_topk_prob=True)
        cls = tf.Qwen3MoeConfig
    elif arch == "olmoe":
        cfg = dict(common, intermediate_size=48, num_experts=8, num_experts_per_tok=2)
        cls = tf.OlmoeConfig
    elif arch == "deepseek_v3":
        cfg = dict(common, num_key_value_heads=4, intermediate_size=96, moe_intermediate_size=32,
                   n_routed_experts=8, num_experts_per_tok=3, n_group=4, topk_group=2, first_k_dense_replace=1,
                   q_lora_rank=24, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
                   n_shared_experts=1, routed_scaling_factor=2.5, norm_topk_prob=True, rope_scaling=None)
        cls = tf.DeepseekV3Config
    else:
        raise ValueError(arch)
    cfg.update(overrides)
    return cls(**cfg)


def build_reference_model(arch: str, seed: int = 0, **overrides):
    """A transformers model with random weights (float32, eval mode)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config(arch, **overrides), attn_implementation="eager")
    model = model.float().eval()
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(torch.randn_like(buffer) * 0.05)  # exercise the bias (zeros by default)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 3
    return model


def write_checkpoint(model, path: str, dtype: torch.dtype = torch.float32, shard: bool = False) -> str:
    model.to(dtype).save_pretrained(path, max_shard_size="100KB" if shard else "5GB")
    model.float()
    write_demo_tokenizer(path, VOCAB)
    with open(os.path.join(path, "config.json"), encoding="utf-8") as handle:
        json.load(handle)  # written and readable
    return path


def build_skewed_model(hot_experts=(0, 1), seed: int = 0):
    """A tiny DeepSeek-V3-style model whose gate always picks ``hot_experts`` (top-2).

    The score-correction bias of the hot experts is large, so they win every token's choice
    while the weights still come from the unbiased scores: a skewed, deterministic load.
    """
    model = build_reference_model("deepseek_v3", seed=seed, num_experts_per_tok=2, n_group=1, topk_group=1)
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.zero_()
                buffer[list(hot_experts)] = 10.0
    return model


# A Qwen2.5-style chat template with tools (Hermes <tool_call> blocks), written for the tiny
# checkpoints: the demo tokenizer's ChatML template has no tools.
QWEN_TOOLS_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions. Signatures within <tools></tools>:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each call, return a JSON object within <tool_call></tool_call> tags:\\n"
    "<tool_call>\\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{{- '<|im_start|>assistant' }}"
    "{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}"
    "{%- for call in message.tool_calls or [] %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' + call.function.name + '\", \"arguments\": ' }}"
    "{{- call.function.arguments | tojson }}{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + message.content + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def use_chat_template(path: str, template: str = QWEN_TOOLS_TEMPLATE) -> str:
    """Replace the chat template of the checkpoint at ``path`` (tokenizer_config.json)."""
    config_path = os.path.join(path, "tokenizer_config.json")
    with open(config_path, encoding="utf-8") as handle:
        config = json.load(handle)
    config["chat_template"] = template
    with open(config_path, "w", encoding="utf-8") as handle:
        json.dump(config, handle, indent=2)
    return path
