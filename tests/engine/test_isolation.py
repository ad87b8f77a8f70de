"""A failure that belongs to one sequence finishes that sequence alone; its batch goes on.

The reference is the same engine run without the poisoned request: the healthy requests'
tokens must be identical, and the poisoned one must end with an error (no tokens invented).
"""

from __future__ import annotations

import pytest
import torch

import raymoe.engine.engine as engine_module
from raymoe.engine.engine import EngineConfig, LLMEngine
from raymoe.engine.sampler import sample
from raymoe.engine.sampling_params import SamplingParams

HEALTHY = [[5, 9, 11], [40, 41, 42, 43], [7], [100, 3, 3]]
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def run(engine: LLMEngine, requests: list[tuple[str, list[int], SamplingParams]]) -> dict:
    for request_id, prompt, params in requests:
        engine.add_request(request_id, prompt, params)
    finals = {}
    for _ in range(100):
        for output in engine.step():
            if output.finished:
                finals[output.request_id] = output
        if not engine.has_unfinished():
            break
    return finals


@pytest.fixture(scope="module")
def expected(tiny_mixtral_dir):
    engine = LLMEngine.from_pretrained(tiny_mixtral_dir, EngineConfig(dtype="float32"))
    finals = run(engine, [(f"h{i}", p, GREEDY) for i, p in enumerate(HEALTHY)])
    return {k: v.output_token_ids for k, v in finals.items()}


def test_a_sampling_failure_fails_only_its_sequence(tiny_mixtral_dir, expected, monkeypatch):
    def poisoned_sample(logits, sequences, *rest):  # fails whenever the poisoned request is in the batch
        if any(s.params.seed == 666 for s in sequences):
            raise RuntimeError("invalid multinomial distribution (sum of probabilities <= 0)")
        return sample(logits, sequences, *rest)

    monkeypatch.setattr(engine_module, "sample", poisoned_sample)
    engine = LLMEngine.from_pretrained(tiny_mixtral_dir, EngineConfig(dtype="float32"))
    poison = SamplingParams(max_tokens=6, temperature=1.0, seed=666, ignore_eos=True)
    finals = run(engine, [(f"h{i}", p, GREEDY) for i, p in enumerate(HEALTHY)] + [("poison", [8, 9], poison)])
    assert {k: v.output_token_ids for k, v in finals.items() if k != "poison"} == expected
    assert finals["poison"].error is not None and "sampling" in finals["poison"].error
    assert "multinomial" not in finals["poison"].error  # internal text stays in the log
    assert finals["poison"].output_token_ids == []
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks  # every sequence's blocks came back


def test_a_stop_check_failure_fails_only_its_sequence(tiny_mixtral_dir, expected):
    def detokenize(ids):  # a detokenizer that breaks on this request's text only
        raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte")

    engine = LLMEngine.from_pretrained(tiny_mixtral_dir, EngineConfig(dtype="float32"), detokenize=detokenize)
    with_stop = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, stop=("zz",))
    finals = run(engine, [(f"h{i}", p, GREEDY) for i, p in enumerate(HEALTHY)] + [("stopper", [8, 9], with_stop)])
    assert {k: v.output_token_ids for k, v in finals.items() if k != "stopper"} == expected
    assert finals["stopper"].error is not None and "stop" in finals["stopper"].error


@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=4, temperature=1e-30, ignore_eos=True, seed=1),
    SamplingParams(max_tokens=4, temperature=1.0, top_p=1e-46, ignore_eos=True, seed=1),
    SamplingParams(max_tokens=4, temperature=1.0, top_k=2**63 - 1, ignore_eos=True, seed=1),
], ids=["tiny temperature", "tiny top_p", "huge top_k"])
def test_extreme_sampling_values_are_safe_math(params):
    """What the HTTP layer lets through still samples: tiny temperature and top_p reduce to
    the argmax, a top_k past the vocabulary means no filter."""
    from raymoe.engine.sequence import Sequence

    logits = torch.tensor([[0.5, 3.0, -1.0, 2.9]])
    generator = torch.Generator().manual_seed(0)
    sequence = Sequence("extreme", [1], params, generator, 0)
    tokens, logprobs, _ = sample(logits, [sequence])
    if params.top_k > 4:
        assert 0 <= tokens[0] < 4
    else:
        assert tokens == [1]
    assert logprobs[0] == pytest.approx(float(torch.log_softmax(logits, -1)[0, tokens[0]]))
