"""Config variants against transformers: YaRN RoPE (DeepSeek-V3), sliding window (Mixtral),
no q-LoRA (DeepSeek-V3), bfloat16 checkpoints."""

from __future__ import annotations

import pytest
import torch

from raymoe.engine.engine import EngineConfig, LLMEngine
from tiny_models import VOCAB, build_reference_model, write_checkpoint

VARIANTS = {
    "deepseek-yarn": ("deepseek_v3", dict(rope_scaling={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 32,
        "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0})),
    "deepseek-no-q-lora": ("deepseek_v3", dict(q_lora_rank=None, rope_interleave=False)),
    "mixtral-sliding-window": ("mixtral", dict(sliding_window=6)),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_prefill_logits_match(variant, tmp_path):
    arch, overrides = VARIANTS[variant]
    model = build_reference_model(arch, **overrides)
    engine = LLMEngine.from_pretrained(write_checkpoint(model, str(tmp_path)), EngineConfig(dtype="float32"))
    generator = torch.Generator().manual_seed(3)
    prompts = [torch.randint(4, VOCAB, (n,), generator=generator).tolist() for n in (3, 21, 40)]
    with torch.no_grad():
        for prompt, logits in zip(prompts, engine.score(prompts)):
            expected = model(input_ids=torch.tensor([prompt])).logits[0]
            assert (logits - expected).abs().max().item() < 1e-4, variant


def test_bfloat16_checkpoint_loads_and_tracks_float32(tmp_path):
    model = build_reference_model("qwen3_moe")
    path = write_checkpoint(model, str(tmp_path), dtype=torch.bfloat16)
    engine = LLMEngine.from_pretrained(path, EngineConfig(dtype="auto"))
    assert engine.cache.k.dtype == torch.bfloat16
    prompt = list(range(10, 30))
    ours = engine.score([prompt])[0]
    with torch.no_grad():
        reference = model.to(torch.bfloat16)(input_ids=torch.tensor([prompt])).logits[0].float()
    # bf16 rounding differs between implementations; the distributions must still agree closely.
    assert (ours - reference).abs().max().item() < 0.1
    assert (ours.argmax(-1) == reference.argmax(-1)).float().mean().item() >= 0.9
