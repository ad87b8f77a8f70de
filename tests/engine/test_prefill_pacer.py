"""Prefill pacing: prompt chunks sized from measured step costs while sequences decode.

The pacer's arithmetic on given timings, the scheduler holding prompt tokens to its
allowance only in steps that decode, and an engine whose steps are timed for real: a long
prompt arriving among decoding streams is spread over more, smaller chunks than the token
budget allows, the streams decode in every step, and every output equals the unpaced
engine's (pacing moves work between steps, never changes it)."""

from __future__ import annotations

import pytest
import torch

from raymoe.cluster.config import load_cluster_config
from raymoe.cluster.config_errors import ConfigError
from raymoe.engine.engine import EngineConfig, LLMEngine
from raymoe.engine.prefill_pacer import MIN_PREFILL_CHUNK, PrefillPacer
from raymoe.engine.sampling_params import SamplingParams
from raymoe.engine.scheduler import SchedulerConfig
from tiny_models import VOCAB


def test_allowance_follows_the_measured_costs():
    pacer = PrefillPacer(slowdown=2.0, token_budget=512)
    assert pacer.prefill_allowance() == 512  # nothing measured: the budget alone
    for _ in range(50):
        pacer.observe(num_decodes=16, num_prompt_tokens=0, seconds=0.002)  # decode-only: 2 ms
    assert pacer.prefill_allowance() == 512  # no prompt token measured yet
    for _ in range(50):
        pacer.observe(num_decodes=16, num_prompt_tokens=100, seconds=0.002 + 100 * 20e-6)  # 20 us a token
    # (2 - 1) * 2 ms / 20 us = 100 tokens keep the step at ~2x a decode-only step.
    assert pacer.prefill_allowance() == pytest.approx(100, abs=1)
    slower = PrefillPacer(slowdown=3.0, token_budget=512)
    for _ in range(50):
        slower.observe(16, 0, 0.002)
        slower.observe(16, 100, 0.002 + 100 * 20e-6)
    assert slower.prefill_allowance() == pytest.approx(200, abs=2)


def test_allowance_is_bounded_and_robust_to_one_stall():
    pacer = PrefillPacer(slowdown=2.0, token_budget=512)
    for _ in range(50):
        pacer.observe(16, 0, 0.001)
        pacer.observe(16, 64, 0.001 + 64 * 1e-3)  # 1 ms a prompt token: a tiny allowance...
    assert pacer.prefill_allowance() == MIN_PREFILL_CHUNK  # ...but prompts always progress
    cheap = PrefillPacer(slowdown=2.0, token_budget=512)
    for _ in range(50):
        cheap.observe(16, 0, 0.010)
        cheap.observe(16, 512, 0.010 + 512 * 1e-7)  # a GPU-like flat cost
    assert cheap.prefill_allowance() == 512  # never above the budget
    before = cheap.prefill_allowance()
    cheap.observe(16, 0, 30.0)  # one step stalled (a recovery): counted as at most 4x
    assert cheap.decode_s < 0.010 * 2
    assert cheap.prefill_allowance() == before
    off = PrefillPacer(slowdown=0, token_budget=512)
    off.observe(16, 0, 0.001)
    off.observe(16, 64, 1.0)
    assert not off.enabled and off.prefill_allowance() == 512
    with pytest.raises(ValueError, match="> 1"):
        PrefillPacer(slowdown=1.0, token_budget=512)


def make_engine(path: str, slowdown: float, budget: int = 512) -> LLMEngine:
    return LLMEngine.from_pretrained(path, EngineConfig(
        dtype="float32", block_size=8, enable_prefix_caching=False,
        scheduler=SchedulerConfig(max_num_batched_tokens=budget, prefill_step_slowdown=slowdown)))


def run_streams_then_long_prompt(engine: LLMEngine, allowance: int | None):
    """4 streams decode; then a 200-token prompt arrives. The pacer's allowance is pinned
    (``allowance``) so the schedule does not depend on this machine's timings. Returns every
    request's tokens and, per step after the arrival, (decodes, prompt tokens)."""
    generator = torch.Generator().manual_seed(7)
    streams = [torch.randint(4, VOCAB, (12,), generator=generator).tolist() for _ in range(4)]
    long_prompt = torch.randint(4, VOCAB, (200,), generator=generator).tolist()
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    if allowance is not None:
        engine.pacer.prefill_allowance = lambda: allowance
    for index, prompt in enumerate(streams):
        engine.add_request(f"stream-{index}", prompt, params)
    tokens: dict[str, list[int]] = {}
    steps = []
    schedule = engine.scheduler.schedule

    def recording_schedule(*args):
        batch = schedule(*args)
        if batch is not None and "long" in tokens:
            # A prompt chunk is whatever a sequence computes before its prompt is done: a
            # last chunk of one token is still a prompt token, not a decode.
            in_prompt = [sequence.num_computed < len(sequence.prompt_ids) for sequence in batch.sequences]
            prompt = sum(n for n, flag in zip(batch.num_new_tokens, in_prompt) if flag)
            steps.append((in_prompt.count(False), prompt))
        return batch

    engine.scheduler.schedule = recording_schedule
    for step in range(400):
        if step == 5:
            engine.add_request("long", long_prompt, SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
            tokens["long"] = []
        for output in engine.step():
            tokens.setdefault(output.request_id, []).extend(output.new_token_ids)
        if not engine.has_unfinished():
            break
    return tokens, steps


def test_paced_prompt_is_spread_over_steps_and_outputs_do_not_change(tiny_mixtral_dir):
    paced_tokens, paced_steps = run_streams_then_long_prompt(make_engine(tiny_mixtral_dir, 2.0), allowance=48)
    whole_tokens, whole_steps = run_streams_then_long_prompt(make_engine(tiny_mixtral_dir, 0), allowance=None)
    assert paced_tokens == whole_tokens  # the same tokens for every request
    assert len(paced_tokens["long"]) == 3
    # Unpaced, the 200-token prompt runs in one step beside the 4 decodes.
    assert max(prompt for _, prompt in whole_steps) == 200
    # Paced, every step that decodes holds prompts to the allowance, and the prompt took
    # ceil(200 / 48) = 5 steps, each of them beside all 4 streams.
    prefill = [(decodes, prompt) for decodes, prompt in paced_steps if prompt > 0]
    assert all(prompt <= 48 for _, prompt in prefill), prefill
    assert len(prefill) == 5 and all(decodes == 4 for decodes, _ in prefill), prefill


def test_real_timings_pace_a_long_prompt(tiny_mixtral_dir):
    # No pinned allowance: the engine times its own steps. Whatever this machine's speed,
    # a decode-only step is cheaper than 200 prompt tokens, so the allowance lands between
    # the minimum chunk and the budget, and the prompt is spread over more than one step.
    engine = make_engine(tiny_mixtral_dir, 2.0)
    tokens, steps = run_streams_then_long_prompt(engine, allowance=None)
    prefill = [prompt for decodes, prompt in steps if prompt > 0 and decodes]
    assert engine.pacer.decode_s is not None and engine.pacer.token_s is not None
    assert len(prefill) >= 2 and all(prompt >= MIN_PREFILL_CHUNK or prompt == prefill[-1] for prompt in prefill)
    assert sum(prefill) == 200 and len(tokens["long"]) == 3


def test_config_refuses_a_slowdown_that_cannot_be_met():
    with pytest.raises(ConfigError, match="engine.prefill_step_slowdown: expected a factor > 1"):
        load_cluster_config("model: /m\nengine:\n  prefill_step_slowdown: 0.5\n")
    assert load_cluster_config("model: /m\nengine:\n  prefill_step_slowdown: 0\n").engine.prefill_step_slowdown == 0
