"""Chunked prefill against transformers on every architecture, and the scheduler's token
budget, preemption and admission limits.

With ``max_num_batched_tokens=16`` every prompt longer than 16 tokens is computed over
several steps, beside decodes of requests that joined earlier; each sampled token and its
logits must still be transformers' (teacher-forced on the same tokens, so one reference
forward per request checks every step)."""

from __future__ import annotations

import pytest
import torch

from raymoe.engine.engine import EngineConfig, LLMEngine
from raymoe.engine.sampling_params import SamplingParams
from raymoe.engine.scheduler import SchedulerConfig
from tiny_models import ARCHITECTURES, VOCAB, build_reference_model, write_checkpoint

CHUNK = 16
PROMPT_LENGTHS = (9, 57, 23, 70, 33)  # all but the first span several chunks
JOIN_AT = {0: [0], 2: [1], 3: [2, 3], 9: [4]}  # step -> requests joining then (mid-flight)
NEW_TOKENS = 6
LOGITS_TOLERANCE = 1e-4


def make_prompts(seed: int, lengths=PROMPT_LENGTHS) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(4, VOCAB, (n,), generator=generator).tolist() for n in lengths]


def chunked_engine(path: str, **overrides) -> LLMEngine:
    config = dict(dtype="float32", block_size=8, keep_logits=True, enable_prefix_caching=False,
                  scheduler=SchedulerConfig(max_num_batched_tokens=CHUNK))
    config.update(overrides)
    return LLMEngine.from_pretrained(path, EngineConfig(**config))


def run_with_joins(engine: LLMEngine, prompts, params, join_at, tag: str):
    """Step the engine, adding requests at the given steps; returns per request its outputs
    (one per sampled token) and the step of each, plus the steps at which it joined."""
    outputs: dict[int, list] = {i: [] for i in range(len(prompts))}
    steps: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
    joined: dict[int, int] = {}
    finished: set[int] = set()
    step = 0
    while len(finished) < len(prompts):
        for index in join_at.get(step, []):
            engine.add_request(f"{tag}-{index}", prompts[index], params)
            joined[index] = step
        for output in engine.step():
            index = int(output.request_id.rsplit("-", 1)[1])
            outputs[index].append(output)
            steps[index].append(step)
            if output.finished:
                finished.add(index)
        step += 1
        assert step < 1000, "the engine did not finish"
    return outputs, steps, joined


def assert_matches_transformers(model, prompt, outputs, label: str) -> None:
    """Tokens are transformers' argmax, step logits within tolerance (teacher-forced)."""
    tokens = outputs[-1].output_token_ids
    assert len(tokens) == len(outputs) == NEW_TOKENS, label
    with torch.no_grad():
        reference = model(input_ids=torch.tensor([prompt + tokens])).logits[0].float()
    reference = reference[len(prompt) - 1:-1]  # the logits each output token was sampled from
    ours = torch.stack([output.logits for output in outputs])
    diff = (ours - reference).abs().max().item()
    assert diff < LOGITS_TOLERANCE, f"{label}: logits differ by {diff}"
    assert tokens == reference.argmax(dim=-1).tolist(), f"{label}: greedy tokens differ"


@pytest.fixture(scope="module", params=ARCHITECTURES)
def reference(request, tmp_path_factory):
    arch = request.param
    model = build_reference_model(arch)
    return arch, model, write_checkpoint(model, str(tmp_path_factory.mktemp(arch)))


def test_chunked_prefill_with_midflight_joins_matches_transformers(reference):
    arch, model, path = reference
    engine = chunked_engine(path)
    prompts = make_prompts(1)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    outputs, steps, joined = run_with_joins(engine, prompts, params, JOIN_AT, arch)
    for index, prompt in enumerate(prompts):
        assert_matches_transformers(model, prompt, outputs[index], f"{arch} request {index}")
        # Its prompt needed at least ceil(len / CHUNK) steps: it was chunked.
        assert steps[index][0] - joined[index] + 1 >= -(-len(prompt) // CHUNK), (arch, index)
    # Request 0 kept decoding, one token per step, while request 1's 57-token prompt was
    # being computed: decode and prefill chunks shared steps.
    prefill_steps = range(joined[1], steps[1][0])
    assert len(prefill_steps) >= 3
    assert all(step in steps[0] for step in prefill_steps if step <= steps[0][-1]), (steps[0], steps[1][0])
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks


def test_token_budget_bounds_every_step(tiny_mixtral_dir, monkeypatch):
    engine = chunked_engine(tiny_mixtral_dir)
    scheduled = []  # per step: (tokens, [(is a decode, tokens it computes)])
    schedule = engine.scheduler.schedule

    def recording_schedule(*args):
        batch = schedule(*args)
        if batch is not None:
            scheduled.append((batch.num_tokens, [(s.num_computed == s.num_tokens - 1, n)
                                                 for s, n in zip(batch.sequences, batch.num_new_tokens)]))
        return batch

    monkeypatch.setattr(engine.scheduler, "schedule", recording_schedule)
    prompts = make_prompts(2, (40, 3, 90, 17))
    outputs = engine.generate(prompts, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    assert all(len(o.output_token_ids) == 4 for o in outputs)
    assert all(0 < tokens <= CHUNK for tokens, _ in scheduled)
    assert sum(tokens for tokens, _ in scheduled) == sum(len(p) + 3 for p in prompts)  # nothing computed twice
    assert any(tokens == CHUNK for tokens, _ in scheduled)  # prompts were cut at the budget
    for _, rows in scheduled:  # decodes first, then prompt chunks
        decodes = [is_decode and n == 1 for is_decode, n in rows]
        assert decodes == sorted(decodes, reverse=True), rows
    assert any(any(d for d, _ in rows) and any(not d for d, _ in rows) for _, rows in scheduled)  # mixed steps
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks


def test_preemption_under_a_tiny_kv_budget_keeps_outputs(tiny_mixtral_dir):
    prompts = make_prompts(3, (40, 33, 9, 57, 21, 12))
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    roomy = chunked_engine(tiny_mixtral_dir, keep_logits=False)
    expected = [o.output_token_ids for o in roomy.generate(prompts, params)]
    assert roomy.scheduler.num_preemptions == 0
    for caching in (False, True):
        # 10 blocks of 8 tokens: the longest sequence (67 tokens) fits, the six together do not.
        per_token = roomy.cache.bytes_per_token(roomy.config, torch.float32)
        tiny = chunked_engine(tiny_mixtral_dir, keep_logits=False, kv_cache_bytes=10 * 8 * per_token,
                              enable_prefix_caching=caching, max_model_len=80)
        assert tiny.blocks.num_blocks == 10
        got = [o.output_token_ids for o in tiny.generate(prompts, params)]
        assert got == expected, f"prefix caching {caching}"
        assert tiny.scheduler.num_preemptions > 0
        assert tiny.blocks.num_free_blocks == tiny.blocks.num_blocks
        assert all(tiny.blocks.ref_count(b) == 0 for b in range(tiny.blocks.num_blocks))


def test_a_prompt_that_can_never_fit_is_refused(tiny_mixtral_dir):
    engine = chunked_engine(tiny_mixtral_dir, kv_cache_bytes=1 << 16)  # a few hundred tokens of KV
    capacity = engine.kv_cache_capacity_tokens
    assert 0 < capacity < engine.max_model_len
    prompt = make_prompts(4, (capacity - 4,))[0]
    with pytest.raises(ValueError, match=f"max_tokens=8 need {capacity + 4} tokens.*holds {capacity}"):
        engine.add_request("too-long", prompt, SamplingParams(max_tokens=8))
    assert not engine.has_unfinished()
    # The same prompt with room for its output fits, and runs.
    out = engine.generate([prompt], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))[0]
    assert len(out.output_token_ids) == 4


def test_a_kv_budget_below_one_block_is_refused_at_start(tiny_mixtral_dir):
    with pytest.raises(ValueError, match="holds no KV block.*raise engine.kv_cache_bytes"):
        chunked_engine(tiny_mixtral_dir, kv_cache_bytes=1)


def test_score_beside_chunked_prefills(tiny_mixtral_dir):
    """score (prompt logprobs, echo) runs between steps while a prompt is half computed."""
    model = build_reference_model("mixtral")  # the weights of tiny_mixtral_dir
    engine = chunked_engine(tiny_mixtral_dir)
    prompts = make_prompts(5, (70, 20))
    engine.add_request("half", prompts[0], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    engine.step()
    assert 0 < engine.scheduler.running[0].num_computed < len(prompts[0])
    with torch.no_grad():
        for prompt, logits in zip(prompts, engine.score(prompts)):
            expected = model(input_ids=torch.tensor([prompt])).logits[0].float()
            assert (logits - expected).abs().max().item() < LOGITS_TOLERANCE
    while engine.has_unfinished():
        engine.step()
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
