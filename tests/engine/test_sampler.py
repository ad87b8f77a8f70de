"""The sampler against plain-Python references on hand-built logits.

The filter reference (``reference_probs``) follows the documented rule with Python floats
and sorting only: scale by temperature, drop tokens below ``min_p`` times the best one, keep
the ``top_k`` most likely tokens, renormalise, keep the smallest prefix (most likely first)
whose mass reaches ``top_p``, renormalise. Each filter is checked three ways: which tokens
can be drawn, with what probability (exactly, from the sampler's distribution), and how often
they are drawn (empirically, from ``sample()``). Penalties are checked against vLLM's
formulas computed by hand, logit_bias and min_tokens against the logits they must give, and
reported logprobs against an independent ``log_softmax``.
"""

from __future__ import annotations

import math

import pytest
import torch

from raymoe.engine.sampler import filtered_logits, process_logits, sample
from raymoe.engine.sampling_params import SamplingParams
from raymoe.engine.sequence import Sequence

# Probabilities of a 6-token vocabulary, distinct so that every filter's cut is unambiguous.
PROBS = [0.4, 0.25, 0.15, 0.1, 0.06, 0.04]
LOGITS = [math.log(p) for p in PROBS]


def reference_probs(logits: list[float], temperature: float, top_k: int, top_p: float,
                    min_p: float = 0.0) -> list[float]:
    scaled = [v / temperature for v in logits]
    peak = max(scaled)
    weights = [math.exp(v - peak) for v in scaled]  # the best token has weight 1
    weights = [w if w >= min_p else 0.0 for w in weights]  # p < min_p * p_max is dropped
    order = sorted((i for i in range(len(weights)) if weights[i] > 0), key=lambda i: -weights[i])
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


def sequence(params: SamplingParams, seed: int | None = 0, prompt=(1,), outputs=()) -> Sequence:
    generator = None if seed is None else torch.Generator().manual_seed(seed)
    made = Sequence(f"s{seed}", list(prompt), params, generator, 0)
    made.output_ids.extend(outputs)
    return made


def probs_of(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution sample() draws a row from (float64)."""
    return torch.softmax(filtered_logits(logits, [params]).double(), dim=-1)[0]


# (temperature, top_k, top_p[, min_p]) -> the tokens that may be drawn, written out by hand.
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
    # min-p keeps p >= min_p * 0.4: 0.3 -> 0.12 keeps {0, 1, 2}; 0.2 -> 0.08 keeps {0, 1, 2, 3}
    ((1.0, -1, 1.0, 0.3), {0, 1, 2}),
    ((1.0, -1, 1.0, 0.2), {0, 1, 2, 3}),
    # min-p first, then top-p on its survivors: [.4 .25 .15 .1]/0.9 has 0.722 above token 2
    ((1.0, -1, 0.7, 0.2), {0, 1}),
    # temperature 2 takes square roots: [.632 .5 .387 .316 .245 .2]; min_p 0.7 keeps those
    # >= 0.443 (of which top-k 3 keeps all): min-p cuts inside the top-k
    ((2.0, 3, 1.0, 0.7), {0, 1}),
    ((1.0, -1, 1.0, 1.0), {0}),
]


def knob_params(knobs) -> SamplingParams:
    temperature, top_k, top_p, *rest = knobs
    min_p = rest[0] if rest else 0.0
    return SamplingParams(max_tokens=1, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)


@pytest.mark.parametrize("knobs, support", CASES, ids=["-".join(map(str, knobs)) for knobs, _ in CASES])
def test_filtered_distribution_equals_the_reference(knobs, support):
    params = knob_params(knobs)
    got = probs_of(torch.tensor([LOGITS]), params)
    expected = reference_probs(LOGITS, params.temperature, params.top_k, params.top_p, params.min_p)
    assert {i for i, p in enumerate(expected) if p > 0} == support  # the reference agrees with the hand count
    assert {i for i, p in enumerate(got.tolist()) if p > 0} == support
    torch.testing.assert_close(got, torch.tensor(expected, dtype=torch.float64), rtol=1e-5, atol=1e-6)


def test_rows_with_different_filters_do_not_mix():
    logits = torch.tensor([LOGITS, LOGITS[::-1], LOGITS])
    params = [SamplingParams(max_tokens=1, temperature=1.0, top_k=2),
              SamplingParams(max_tokens=1, temperature=1.0, top_p=0.6),
              SamplingParams(max_tokens=1, temperature=0.5, min_p=0.1)]
    got = torch.softmax(filtered_logits(logits, params).double(), dim=-1)
    for row, (values, p) in enumerate(zip(logits.tolist(), params)):
        expected = reference_probs(values, p.temperature, p.top_k, p.top_p, p.min_p)
        torch.testing.assert_close(got[row], torch.tensor(expected, dtype=torch.float64), rtol=1e-5, atol=1e-6)


DRAWS = 4000


@pytest.mark.parametrize("knobs, seeded", [
    ((1.0, 3, 1.0), True), ((1.0, -1, 0.6), True), ((1.0, 3, 0.75), True), ((0.5, -1, 0.9), True),
    ((1.0, -1, 1.0), True), ((1.0, -1, 1.0, 0.2), True), ((1.0, 3, 0.75), False), ((1.0, -1, 1.0), False),
], ids=["top_k", "top_p", "top_k+top_p", "temperature+top_p", "plain", "min_p", "top_k+top_p-unseeded",
        "plain-unseeded"])
def test_drawn_tokens_follow_the_reference_distribution(knobs, seeded):
    """Many sequences drawn in one batch, each with its own seeded generator or all from the
    default one: only allowed tokens come out, each within 5 standard errors of its
    reference probability."""
    params = knob_params(knobs)
    torch.manual_seed(1234)
    sequences = [sequence(params, seed if seeded else None) for seed in range(DRAWS)]
    tokens, _, _ = sample(torch.tensor([LOGITS] * DRAWS), sequences)
    expected = reference_probs(LOGITS, params.temperature, params.top_k, params.top_p, params.min_p)
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


# ---- penalties, logit_bias, min_tokens ------------------------------------------------

HAND = [2.0, -1.0, 0.5, -0.5, 1.0, 0.0]  # a 6-token vocabulary with positive and negative logits


def test_penalties_follow_vllm_formulas_by_hand():
    """Prompt [0, 3], outputs [2, 2, 3]: token 0 is seen in the prompt only, 2 twice in the
    output, 3 in both. vLLM: repetition divides a seen positive logit and multiplies a seen
    negative one; frequency subtracts penalty x count; presence subtracts penalty once."""
    params = SamplingParams(max_tokens=8, repetition_penalty=1.5, frequency_penalty=0.3, presence_penalty=0.2)
    row = sequence(params, prompt=[0, 3], outputs=[2, 2, 3])
    got = process_logits(torch.tensor([HAND]), [row])[0].tolist()
    expected = [
        2.0 / 1.5,  # seen (prompt), positive: divided; not in the output: no frequency/presence
        -1.0,  # never seen
        0.5 / 1.5 - 0.3 * 2 - 0.2,  # output twice
        -0.5 * 1.5 - 0.3 * 1 - 0.2,  # prompt and output once, negative: multiplied
        1.0,
        0.0,
    ]
    assert got == pytest.approx(expected, abs=1e-6)


def vllm_reference(logits, prompt, outputs, repetition, frequency, presence):
    """vLLM's apply_penalties, written over Python lists."""
    out = []
    for token, value in enumerate(logits):
        seen = token in prompt or token in outputs
        if seen and value > 0:
            value /= repetition
        elif seen:
            value *= repetition
        count = outputs.count(token)
        out.append(value - frequency * count - presence * (count > 0))
    return out


def test_penalties_batched_rows_match_the_reference_and_counts_stay_incremental():
    """Rows with different penalties (and one without) in one batch; then each row grows by
    a token and the counts kept since the first step must still match a fresh count."""
    generator = torch.Generator().manual_seed(3)
    vocab = 40
    logits = torch.randn(4, vocab, generator=generator) * 2
    rows = [
        sequence(SamplingParams(max_tokens=50, repetition_penalty=1.3), prompt=[1, 2, 3], outputs=[5, 5, 9]),
        sequence(SamplingParams(max_tokens=50, frequency_penalty=-0.7, presence_penalty=1.1),
                 prompt=[4], outputs=[4, 7, 7, 7, 30]),
        sequence(SamplingParams(max_tokens=50), prompt=[6], outputs=[6, 6]),
        sequence(SamplingParams(max_tokens=50, repetition_penalty=0.5, frequency_penalty=2.0, presence_penalty=-2.0),
                 prompt=[0, 39], outputs=[39, 12]),
    ]
    for step in range(3):
        got = process_logits(logits, rows)
        for i, row in enumerate(rows):
            p = row.params
            expected = vllm_reference(logits[i].tolist(), row.prompt_ids, row.output_ids,
                                      p.repetition_penalty, p.frequency_penalty, p.presence_penalty)
            assert got[i].tolist() == pytest.approx(expected, abs=1e-5), (step, i)
        for i, row in enumerate(rows):
            row.output_ids.append([5, 7, 6, 12][i] if step else 20 + i)


def test_logit_bias_shifts_the_distribution_and_the_argmax():
    bias = ((5, 4.0), (0, -1.5), (3, 100.0))
    params = SamplingParams(max_tokens=1, logit_bias=bias)
    got = process_logits(torch.tensor([LOGITS]), [sequence(params)])[0]
    expected = list(LOGITS)
    for token, value in bias:
        expected[token] += value
    assert got.tolist() == pytest.approx(expected, rel=1e-6, abs=1e-6)
    probs = torch.softmax(got.double(), dim=-1)  # token 3 (+100) takes all the mass
    assert probs.tolist() == pytest.approx(reference_probs(expected, 1.0, 0, 1.0), abs=1e-9)
    assert probs[3] == pytest.approx(1.0)
    tokens, logprobs, _ = sample(torch.tensor([LOGITS]), [sequence(SamplingParams(max_tokens=1, temperature=0.0,
                                                                                   logit_bias=((4, 3.0),)))])
    assert tokens == [4]  # log(0.06) + 3 = 0.19 beats log(0.4) = -0.92
    assert logprobs[0] == pytest.approx(LOGITS[4] - math.log(sum(PROBS)), abs=1e-6)  # raw logprob, before bias


def test_min_tokens_masks_eos_and_stop_ids_until_reached():
    eos = (0,)
    params = SamplingParams(max_tokens=8, temperature=0.0, min_tokens=2, stop_token_ids=(1,))
    rows = [sequence(params, outputs=[]), sequence(params, outputs=[4]), sequence(params, outputs=[4, 4])]
    got = process_logits(torch.tensor([LOGITS] * 3), rows, eos)
    for i in (0, 1):  # short of min_tokens: EOS (0) and the stop id (1) can never be drawn
        assert got[i, :2].tolist() == [float("-inf")] * 2 and got[i, 2:].tolist() == pytest.approx(LOGITS[2:])
    assert got[2].tolist() == pytest.approx(LOGITS)  # reached
    tokens, _, _ = sample(torch.tensor([LOGITS] * 3), rows, eos)
    assert tokens == [2, 2, 0]
    ignoring = sequence(SamplingParams(max_tokens=8, min_tokens=2, ignore_eos=True))  # EOS does not stop it anyway
    assert process_logits(torch.tensor([LOGITS]), [ignoring], eos)[0].tolist() == pytest.approx(LOGITS)


def test_penalised_and_biased_random_rows_draw_from_the_processed_distribution():
    """Drawn frequencies equal the reference softmax of the hand-processed logits."""
    params = SamplingParams(max_tokens=4, temperature=1.0, presence_penalty=1.0, logit_bias=((5, 2.0),))
    torch.manual_seed(7)
    rows = [sequence(params, seed=None, outputs=[0]) for _ in range(DRAWS)]
    tokens, _, _ = sample(torch.tensor([LOGITS] * DRAWS), rows)
    processed = list(LOGITS)
    processed[0] -= 1.0
    processed[5] += 2.0
    expected = reference_probs(processed, 1.0, 0, 1.0)
    for token, p in enumerate(expected):
        error = 5 * math.sqrt(p * (1 - p) / DRAWS)
        assert abs(tokens.count(token) / DRAWS - p) <= error, (token, tokens.count(token) / DRAWS, p)


# ---- seeds and batch composition ---------------------------------------------------------

def test_a_seeded_row_draws_the_same_tokens_whatever_shares_its_batch():
    """The same seeded request (top-k + top-p) in three batches whose other rows force the
    other code paths (a full sort for top-p only, unseeded draws, greedy, penalties)."""
    generator = torch.Generator().manual_seed(11)
    row_logits = torch.randn(1, 64, generator=generator)
    target = SamplingParams(max_tokens=1, temperature=0.9, top_k=20, top_p=0.9, seed=42)
    others = [
        [],
        [SamplingParams(max_tokens=1, temperature=1.0, top_p=0.5)],  # no top_k: a sort for the batch
        [SamplingParams(max_tokens=1, temperature=0.0), SamplingParams(max_tokens=1, temperature=1.3, top_k=60,
                                                                       frequency_penalty=1.0)],
    ]
    draws = []
    for company in others:
        seeded = sequence(target, seed=42)
        batch = [sequence(p, seed=None, outputs=[3]) for p in company]
        rows = batch[:1] + [seeded] + batch[1:]
        noise = torch.randn(len(rows), 64, generator=generator)
        logits = noise.clone()
        logits[rows.index(seeded)] = row_logits[0]
        drawn = []
        for _ in range(30):  # the same generator advances draw after draw
            tokens, _, _ = sample(logits, rows)
            drawn.append(tokens[rows.index(seeded)])
        draws.append(drawn)
    assert draws[0] == draws[1] == draws[2]
    assert len(set(draws[0])) > 3  # and it really samples


def test_top_k_rows_never_sort_the_vocabulary(monkeypatch):
    """top_k alone (and with top_p) uses torch.topk; only a row with top_p and no top_k sorts."""
    calls = []
    real_sort = torch.sort
    monkeypatch.setattr(torch, "sort", lambda *a, **k: calls.append(1) or real_sort(*a, **k))
    logits = torch.randn(3, 1000)
    sample(logits, [sequence(SamplingParams(max_tokens=1, top_k=50)),
                    sequence(SamplingParams(max_tokens=1, top_k=5, top_p=0.8)),
                    sequence(SamplingParams(max_tokens=1))])
    assert calls == []
    sample(logits, [sequence(SamplingParams(max_tokens=1, top_p=0.8))])
    assert calls == [1]


@pytest.mark.parametrize("top_p", [0.5, 0.9, 0.99])
def test_top_p_from_candidates_keeps_exactly_what_the_full_sort_keeps(top_p, monkeypatch):
    """Top-p without top-k over a large vocabulary: the nucleus found among the most likely
    candidates (sampler.NUCLEUS_CANDIDATES) equals the full sort's, row by row, including a
    flat row whose nucleus reaches past the candidates (the full-sort fallback)."""
    import raymoe.engine.sampler as sampler

    vocab = 5000
    generator = torch.Generator().manual_seed(11)
    peaked = torch.randn(3, vocab, generator=generator) * 4  # nucleus within the first few hundred
    flat = torch.randn(1, vocab, generator=generator) * 0.01  # nucleus of thousands of tokens
    extra = torch.randn(1, vocab, generator=generator) * 4  # a top-k row beside them
    for logits in (torch.cat([peaked, extra]), torch.cat([peaked, flat, extra])):
        rows = logits.shape[0]
        params = [SamplingParams(temperature=1.0, top_p=top_p)] * (rows - 1) + [SamplingParams(top_k=7)]
        fast = filtered_logits(logits, params)
        monkeypatch.setattr(sampler, "NUCLEUS_CANDIDATES", vocab)  # forces the full sort
        slow = filtered_logits(logits, params)
        monkeypatch.undo()
        assert torch.equal(fast.isfinite(), slow.isfinite())
        # an independent reference: sorted probabilities, smallest prefix reaching top_p
        for row in range(rows - 1):
            probs = torch.softmax(logits[row].double(), dim=0)
            order = torch.argsort(probs, descending=True)
            above = torch.cumsum(probs[order], 0) - probs[order]
            kept = set(order[above < top_p].tolist())
            assert set(fast[row].isfinite().nonzero().flatten().tolist()) == kept
        assert int(fast[-1].isfinite().sum()) == 7  # the top-k row beside them
