"""The in-process engine against transformers on tiny random checkpoints of every architecture."""

from __future__ import annotations

import pytest
import torch

from raymoe.engine.engine import EngineConfig, LLMEngine
from raymoe.engine.sampling_params import SamplingParams
from tiny_models import ARCHITECTURES, VOCAB, build_reference_model, write_checkpoint

PROMPT_LENGTHS = (5, 17, 1, 33, 9)
NEW_TOKENS = 32


def make_prompts(seed: int, lengths=PROMPT_LENGTHS) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(4, VOCAB, (n,), generator=generator).tolist() for n in lengths]


@pytest.fixture(scope="module", params=ARCHITECTURES)
def reference(request, tmp_path_factory):
    arch = request.param
    model = build_reference_model(arch)
    path = write_checkpoint(model, str(tmp_path_factory.mktemp(arch)), shard=arch == "qwen2_moe")
    engine = LLMEngine.from_pretrained(path, EngineConfig(dtype="float32", block_size=8))
    return arch, model, engine


def test_prefill_logits_match_transformers(reference):
    arch, model, engine = reference
    prompts = make_prompts(1)
    ours = engine.score(prompts)
    with torch.no_grad():
        for prompt, logits in zip(prompts, ours):
            expected = model(input_ids=torch.tensor([prompt])).logits[0].float()
            assert logits.shape == expected.shape
            diff = (logits - expected).abs().max().item()
            assert diff < 1e-4, f"{arch}: prompt of {len(prompt)} tokens differs by {diff}"


def test_greedy_decode_matches_generate_with_midflight_joins(reference):
    arch, model, engine = reference
    prompts = make_prompts(2)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    # Requests join a running batch at different steps.
    join_at = {0: [0, 1], 3: [2], 7: [3, 4]}
    finals, step = {}, 0
    while len(finals) < len(prompts):
        for index in join_at.get(step, []):
            engine.add_request(f"{arch}-{index}", prompts[index], params)
        for output in engine.step():
            if output.finished:
                finals[output.request_id] = output.output_token_ids
        step += 1
        assert step < 500, "engine did not finish"
    with torch.no_grad():
        for index, prompt in enumerate(prompts):
            expected = model.generate(
                torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                do_sample=False, eos_token_id=None,
            )[0, len(prompt):].tolist()
            assert finals[f"{arch}-{index}"] == expected, f"{arch}: request {index} diverged"
