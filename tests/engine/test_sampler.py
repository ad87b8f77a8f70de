"""The sampler against a plain-Python reference on hand-built logits.

The reference (``reference_probs``) follows the documented rule with Python floats and
sorting only: scale by temperature, keep the ``top_k`` most likely tokens, renormalise, keep
the smallest prefix (most likely first) whose mass reaches ``top_p``, renormalise. Each
filter is checked three ways: which tokens can be drawn, with what probability (exactly,
from the sampler's distribution), and how often they are drawn (empirically, from
``sample()``). Reported logprobs are checked against an independent ``log_softmax``.
"""

from __future__ import annotations

import math

import pytest
import torch

from raymoe.engine.sampler import _filtered_probs, sample
from raymoe.engine.sampling_params import SamplingParams
from raymoe.engine.sequence import Sequence

# Probabilities of a 6-token vocabulary, distinct so that every filter's cut is unambiguous.
PROBS = [0.4, 0.25, 0.15, 0.1, 0.06, 0.04]
LOGITS = [math.log(p) for p in PROBS]


def reference_probs(logits: list[float], temperature: float, top_k: int, top_p: float) -> list[float]:
    scaled = [v / temperature for v in logits]
    peak = max(scaled)
    weights = [math.exp(v - peak) for v in scaled]
    order = sorted(range(len(weights)), key=lambda i: -weights[i])
    if top_k > 0:
        order = order[:top_k]
    total = sum(weights[i] for i in order)
    kept, mass = [], 0.0
    for i in order:  # keep tokens while the mass strictly above them is below top_p
        if kept and mass >= top_p:
            break
        kept.append(i)
        mass += weights[i] / total
    kept_total = sum(weights[i] for i in kept)
    return [weights[i] / kept_total if i in kept else 0.0 for i in range(len(weights))]


def sequence(params: SamplingParams, seed: int = 0) -> Sequence:
    return Sequence(f"s{seed}", [1], params, torch.Generator().manual_seed(seed), 0)


# (temperature, top_k, top_p) -> the tokens that may be drawn, written out by hand.
CASES = [
    ((1.0, -1, 1.0), {0, 1, 2, 3, 4, 5}),  # no filter
    ((1.0, 3, 1.0), {0, 1, 2}),  # top-k alone
    ((1.0, 1, 1.0), {0}),
    ((1.0, -1, 0.6), {0, 1}),  # top-p alone: 0.4 above token 1 (< 0.6), 0.65 above token 2
    ((1.0, -1, 0.66), {0, 1, 2}),  # 0.65 above token 2 (< 0.66), 0.8 above token 3
    ((1.0, -1, 0.01), {0}),  # top-p below the best token's mass keeps the best token
    # top-k first, then top-p on the renormalised top-k: [0.5, 0.3125, 0.1875] has 0.8125
    # above token 2, so top_p=0.75 drops it (on the raw probabilities 0.65 would keep it).
    ((1.0, 3, 0.75), {0, 1}),
    # temperature 0.5 squares the probabilities: [.615, .240, .086, .038, ...]; 0.855 lies
    # above token 2 and 0.942 above token 3.
    ((0.5, -1, 0.9), {0, 1, 2}),
    ((2.0, 5, 1.0), {0, 1, 2, 3, 4}),
]


@pytest.mark.parametrize("knobs, support", CASES, ids=[f"T{t}-k{k}-p{p}" for (t, k, p), _ in CASES])
def test_filtered_distribution_equals_the_reference(knobs, support):
    temperature, top_k, top_p = knobs
    params = SamplingParams(max_tokens=1, temperature=temperature, top_k=top_k, top_p=top_p)
    got = _filtered_probs(torch.tensor([LOGITS]), [sequence(params)])[0].double()
    expected = reference_probs(LOGITS, temperature, top_k, top_p)
    assert {i for i, p in enumerate(expected) if p > 0} == support  # the reference agrees with the hand count
    assert {i for i, p in enumerate(got.tolist()) if p > 0} == support
    torch.testing.assert_close(got, torch.tensor(expected, dtype=torch.float64), rtol=1e-5, atol=1e-6)


def test_rows_with_different_filters_do_not_mix():
    logits = torch.tensor([LOGITS, LOGITS[::-1], LOGITS])
    params = [SamplingParams(max_tokens=1, temperature=1.0, top_k=2),
              SamplingParams(max_tokens=1, temperature=1.0, top_p=0.6),
              SamplingParams(max_tokens=1, temperature=0.5)]
    got = _filtered_probs(logits, [sequence(p) for p in params]).double()
    for row, (values, p) in enumerate(zip(logits.tolist(), params)):
        expected = reference_probs(values, p.temperature, p.top_k, p.top_p)
        torch.testing.assert_close(got[row], torch.tensor(expected, dtype=torch.float64), rtol=1e-5, atol=1e-6)


DRAWS = 4000


@pytest.mark.parametrize("knobs", [(1.0, 3, 1.0), (1.0, -1, 0.6), (1.0, 3, 0.75), (0.5, -1, 0.9), (1.0, -1, 1.0)],
                         ids=["top_k", "top_p", "top_k+top_p", "temperature+top_p", "plain"])
def test_drawn_tokens_follow_the_reference_distribution(knobs):
    """Many sequences, each with its own seeded generator, drawn in one batch: only allowed
    tokens come out, each within 5 standard errors of its reference probability."""
    temperature, top_k, top_p = knobs
    params = SamplingParams(max_tokens=1, temperature=temperature, top_k=top_k, top_p=top_p)
    sequences = [sequence(params, seed) for seed in range(DRAWS)]
    tokens, _, _ = sample(torch.tensor([LOGITS] * DRAWS), sequences)
    expected = reference_probs(LOGITS, temperature, top_k, top_p)
    counts = [tokens.count(i) for i in range(len(LOGITS))]
    for token, (count, p) in enumerate(zip(counts, expected)):
        if p == 0:
            assert count == 0, f"token {token} is filtered out but was drawn {count} times"
        else:
            error = 5 * math.sqrt(p * (1 - p) / DRAWS) + 1e-9
            assert abs(count / DRAWS - p) <= error, (token, count / DRAWS, p)


def test_the_same_seed_draws_the_same_tokens_and_greedy_rows_ignore_generators():
    params = SamplingParams(max_tokens=1, temperature=1.0)
    first, _, _ = sample(torch.tensor([LOGITS] * 64), [sequence(params, seed) for seed in range(64)])
    again, _, _ = sample(torch.tensor([LOGITS] * 64), [sequence(params, seed) for seed in range(64)])
    assert first == again and len(set(first)) > 1  # seeded, and really random across seeds
    greedy = SamplingParams(max_tokens=1, temperature=0.0)
    rows = torch.tensor([LOGITS, LOGITS[::-1]])
    tokens, _, _ = sample(rows, [sequence(greedy, 1), sequence(greedy, 2)])
    assert tokens == [0, 5]


def reference_log_softmax(row: list[float]) -> list[float]:
    peak = max(row)
    total = sum(math.exp(v - peak) for v in row)
    return [v - peak - math.log(total) for v in row]


@pytest.mark.parametrize("temperature, top_k", [(0.0, -1), (0.7, 3)], ids=["greedy", "sampled"])
def test_logprobs_are_the_raw_log_softmax_of_the_chosen_and_top_tokens(temperature, top_k):
    generator = torch.Generator().manual_seed(5)
    logits = torch.randn(4, 50, generator=generator) * 3
    params = SamplingParams(max_tokens=1, temperature=temperature, top_k=top_k, logprobs=4)
    tokens, chosen, tops = sample(logits, [sequence(params, seed) for seed in range(4)])
    for row, values in enumerate(logits.double().tolist()):
        reference = reference_log_softmax(values)
        if temperature == 0.0:
            assert tokens[row] == max(range(50), key=lambda i: values[i])
        # Under the model's raw distribution, before temperature and filters (module doc).
        assert chosen[row] == pytest.approx(reference[tokens[row]], abs=1e-5)
        best = sorted(range(50), key=lambda i: -reference[i])[:4]
        assert [token for token, _ in tops[row]] == best
        assert [lp for _, lp in tops[row]] == pytest.approx([reference[i] for i in best], abs=1e-5)
