"""A request resumed after tokens it produced elsewhere (a stream migrated from a lost router)
continues exactly as if it had never moved: the engine's own uninterrupted run is the reference.

Each case runs the request whole, then again from every cut point with the tokens before the
cut given as ``resume_output_ids``: the tokens after the cut, the finish reason and the prompt
token count must be the uninterrupted run's. Greedy, seeded random sampling (its random stream
resumes where it stood), penalties (they count the resumed tokens), stop strings (matched over
the whole output) and a JSON grammar (it stands past the resumed tokens) each get a case, with
other requests sharing the batch.
"""

from __future__ import annotations

import pytest

from raymoe.engine.engine import EngineConfig, LLMEngine
from raymoe.engine.sampling_params import SamplingParams
from raymoe.engine.structured_output import StructuredOutput
from raymoe.engine.tokenizer import Tokenizer

PROMPT = [11, 23, 35, 47]
OTHERS = [[5, 6, 7], [40, 41, 42, 43, 44]]


@pytest.fixture(scope="module")
def engine(tiny_mixtral_dir) -> LLMEngine:
    tokenizer = Tokenizer(tiny_mixtral_dir)
    return LLMEngine.from_pretrained(tiny_mixtral_dir, EngineConfig(dtype="float32"), detokenize=tokenizer.decode)


def run(engine: LLMEngine, prompt: list[int], params: SamplingParams, resume: list[int] = ()) -> tuple:
    """The request's new tokens, finish reason and prompt count, two other requests beside it."""
    engine.add_request("resumed", prompt, params, resume_output_ids=resume)
    for i, other in enumerate(OTHERS):
        engine.add_request(f"other-{i}", other, SamplingParams(max_tokens=7, temperature=0.7, seed=i))
    new, last = [], None
    while engine.has_unfinished():
        for output in engine.step():
            if output.request_id == "resumed":
                new += output.new_token_ids
                last = output
    return new, last.finish_reason, last.num_prompt_tokens, last.output_token_ids


CASES = {
    "greedy": SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True),
    "seeded": SamplingParams(max_tokens=24, temperature=1.0, top_p=0.9, seed=1234, ignore_eos=True),
    "penalties": SamplingParams(max_tokens=24, temperature=0.8, seed=7, frequency_penalty=1.5, presence_penalty=0.5,
                                repetition_penalty=1.3, ignore_eos=True),
    "json": SamplingParams(max_tokens=60, temperature=1.0, seed=3, structured=StructuredOutput.json_schema(
        {"type": "object", "properties": {"name": {"type": "string", "minLength": 3, "maxLength": 6},
                                          "age": {"type": "integer"}}, "required": ["name", "age"],
         "additionalProperties": False})),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_resumed_request_continues_as_if_it_had_never_moved(engine, case):
    params = CASES[case]
    whole, reason, prompt_count, _ = run(engine, PROMPT, params)
    assert len(whole) >= 4, whole
    for cut in sorted({1, len(whole) // 2, len(whole) - 1}):
        new, cut_reason, cut_prompt_count, outputs = run(engine, PROMPT, params, whole[:cut])
        assert new == whole[cut:], (case, cut)
        assert (cut_reason, cut_prompt_count) == (reason, prompt_count) == (reason, len(PROMPT))
        assert outputs == whole  # the engine's output holds the resumed tokens and the new ones


def test_stop_strings_see_the_resumed_text(engine):
    free = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    whole, _, _, _ = run(engine, PROMPT, free)
    text = engine.detokenize(whole)
    stop = text[len(engine.detokenize(whole[:6])):][:2]  # a piece of text that first appears after token 6
    assert stop and stop not in engine.detokenize(whole[:6]), text
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, stop=(stop,))
    stopped, reason, _, _ = run(engine, PROMPT, params)
    assert reason == "stop"
    new, cut_reason, _, _ = run(engine, PROMPT, params, stopped[:3])
    assert (stopped[:3] + new, cut_reason) == (stopped, "stop")


def test_a_resume_with_nothing_left_to_produce_is_refused(engine):
    with pytest.raises(ValueError, match="tokens left to produce"):
        engine.add_request("full", PROMPT, SamplingParams(max_tokens=3), resume_output_ids=[1, 2, 3])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.add_request("bad", PROMPT, SamplingParams(max_tokens=8), resume_output_ids=[10**9])
    assert not engine.has_unfinished()
