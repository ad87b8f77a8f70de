"""The in-process engine's behaviour: batching, preemption, sampling, stops, validation."""

from __future__ import annotations

import pytest
import torch

from raymoe.engine.engine import EngineConfig, LLMEngine
from raymoe.engine.sampling_params import SamplingParams
from raymoe.engine.tokenizer import Tokenizer

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(tiny_mixtral_dir):
    return LLMEngine.from_pretrained(tiny_mixtral_dir, EngineConfig(dtype="float32", block_size=4))


def prompts(count: int, seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(4, 300, (int(n),), generator=generator).tolist()
            for n in torch.randint(2, 20, (count,), generator=generator)]


def test_batched_outputs_equal_one_at_a_time(engine):
    batch = prompts(6)
    together = [o.output_token_ids for o in engine.generate(batch, GREEDY)]
    alone = [engine.generate([p], GREEDY)[0].output_token_ids for p in batch]
    assert together == alone
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks  # everything released


def test_kv_exhaustion_preempts_and_recomputes_without_changing_outputs(tiny_mixtral_dir, engine):
    batch = prompts(8, seed=1)
    expected = [o.output_token_ids for o in engine.generate(batch, GREEDY)]
    # Room for about two sequences at a time (16 blocks of 4 tokens): the scheduler must preempt and recompute.
    per_token = engine.cache.bytes_per_token(engine.config, torch.float32)
    small = LLMEngine.from_pretrained(
        tiny_mixtral_dir, EngineConfig(dtype="float32", block_size=4, kv_cache_bytes=16 * 4 * per_token, max_model_len=64)
    )
    small_blocks = small.blocks.num_blocks
    assert small_blocks == 16
    got = [o.output_token_ids for o in small.generate(batch, GREEDY)]
    assert got == expected
    assert small.scheduler.num_preemptions > 0
    assert small.blocks.num_free_blocks == small_blocks


def test_seeded_sampling_does_not_depend_on_batch_company(engine):
    params = SamplingParams(max_tokens=10, temperature=0.9, top_p=0.95, top_k=50, seed=1234, ignore_eos=True)
    target = prompts(1, seed=2)[0]
    alone = engine.generate([target], params)[0].output_token_ids
    company = prompts(4, seed=3)
    mixed = engine.generate([*company, target], [SamplingParams(max_tokens=10, temperature=1.0, seed=i)
                                                 for i in range(4)] + [params])
    assert mixed[-1].output_token_ids == alone
    other_seed = engine.generate([target], SamplingParams(max_tokens=10, temperature=0.9, seed=99, ignore_eos=True))
    assert other_seed[0].output_token_ids != alone


def test_top_k_one_is_greedy(engine):
    batch = prompts(3, seed=4)
    greedy = [o.output_token_ids for o in engine.generate(batch, GREEDY)]
    top1 = engine.generate(batch, SamplingParams(max_tokens=12, temperature=1.5, top_k=1, seed=5, ignore_eos=True))
    assert [o.output_token_ids for o in top1] == greedy


def test_stop_token_ids_and_max_tokens(engine):
    prompt = prompts(1, seed=5)[0]
    full = engine.generate([prompt], GREEDY)[0].output_token_ids
    stop_at = full[4]
    first = full.index(stop_at)
    out = engine.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=(stop_at,)))[0]
    assert out.output_token_ids == full[: first + 1]
    assert out.finish_reason == "stop"
    assert engine.generate([prompt], SamplingParams(max_tokens=3, temperature=0.0))[0].output_token_ids == full[:3]


def test_eos_stops_unless_ignored(engine):
    prompt = prompts(1, seed=6)[0]
    full = engine.generate([prompt], GREEDY)[0].output_token_ids
    eos = full[2]
    engine_eos = engine.config.eos_token_ids
    object.__setattr__(engine.config, "eos_token_ids", (eos,))
    try:
        stopped = engine.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0))[0]
        ignored = engine.generate([prompt], GREEDY)[0]
    finally:
        object.__setattr__(engine.config, "eos_token_ids", engine_eos)
    assert stopped.output_token_ids == full[: full.index(eos) + 1] and stopped.finish_reason == "stop"
    assert ignored.output_token_ids == full and ignored.finish_reason == "length"


def test_stop_strings_cut_the_text(tiny_mixtral_dir):
    tokenizer = Tokenizer(tiny_mixtral_dir)
    engine = LLMEngine.from_pretrained(tiny_mixtral_dir, EngineConfig(dtype="float32"), detokenize=tokenizer.decode)
    prompt = tokenizer.encode("Hello world")
    full = engine.generate([prompt], GREEDY)[0]
    text = tokenizer.decode(full.output_token_ids)
    stop = text[3:6]
    assert stop
    out = engine.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0, stop=(stop,), ignore_eos=True))[0]
    assert out.finish_reason == "stop"
    assert out.stop_text_index == text.find(stop)
    assert len(out.output_token_ids) < len(full.output_token_ids) or text.endswith(stop)


def test_abort_releases_blocks(engine):
    engine.add_request("to-abort", prompts(1, seed=7)[0], GREEDY)
    engine.step()
    assert engine.blocks.num_free_blocks < engine.blocks.num_blocks
    engine.abort_request("to-abort")
    assert not engine.has_unfinished()
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks


@pytest.mark.parametrize(
    "prompt, params, message",
    [
        ([], GREEDY, "empty"),
        ([1, 10**6], GREEDY, "outside the vocabulary"),
        (list(range(300)), GREEDY, "context length"),
    ],
)
def test_bad_requests_are_refused_before_queueing(engine, prompt, params, message):
    with pytest.raises(ValueError, match=message):
        engine.add_request("bad", prompt, params)
    assert not engine.has_unfinished()


@pytest.mark.parametrize(
    "field, value",
    [("max_tokens", 0), ("temperature", -1.0), ("top_p", 0.0), ("top_p", 1.5), ("top_k", -2), ("logprobs", 21)],
)
def test_sampling_params_validate(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_duplicate_request_id_is_refused(engine):
    engine.add_request("same", [5, 6], GREEDY)
    try:
        with pytest.raises(ValueError, match="already in use"):
            engine.add_request("same", [5, 6], GREEDY)
    finally:
        engine.abort_request("same")
