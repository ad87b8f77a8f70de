"""Choose each sequence's next token from its logits, on the logits' device.

Legend: B sequences in the step, V vocabulary, Br rows sampled at random, Bp rows with
penalties, Bc rows cut by top-k or top-p, Kc candidates kept by top-k (or V where a row needs a
full sort).

Every stage is a batched tensor op over the step's rows; Python loops run over rows only:

1. the reported logprobs are the model's raw distribution (before every stage below);
2. logits are processed: ``logit_bias`` added; presence, frequency and repetition penalties
   (vLLM's formulas, see ``_apply_penalties``); the grammar's token mask for structured rows;
   EOS and stop ids masked for rows short of ``min_tokens`` (a grammar that allows nothing
   else wins, so the output stays valid);
3. greedy rows take the argmax of the processed logits;
4. the other rows are scaled by temperature and filtered by min-p, then top-k and top-p
   (top-p over the renormalised top-k survivors). The filters become a per-row threshold
   and cut in vocabulary order, so a row's distribution does not depend on its batch;
   top-k uses ``torch.topk``; rows with top_p < 1 and no top_k look for their nucleus among
   the ``NUCLEUS_CANDIDATES`` most likely tokens and sort the whole vocabulary only when it
   reaches past them;
5. each random row draws one uniform and inverts its cumulative distribution: a seeded
   request uses its own generator (the same tokens whatever shares its batch), the others
   one batched draw from the device's default generator;
6. tokens, logprobs and top alternatives come to the host in one transfer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from raymoe.engine.sampling_params import SamplingParams
from raymoe.engine.sequence import Sequence
from raymoe.engine.structured_output import mask_logits


TopLogprobs = list[tuple[int, float]]
NUCLEUS_CANDIDATES = 1024  # top-p without top-k looks for its nucleus among these first
MIN_TEMPERATURE = 1e-5  # below this a request is greedy (the limit of sampling as the temperature -> 0)


@dataclass
class PenaltyState:
    """A penalised sequence's token statistics on the logits' device, kept incrementally."""

    output_counts: torch.Tensor  # [V] float: occurrences of each token in output_ids[:num_counted]
    prompt_mask: torch.Tensor  # [V] bool: tokens of the prompt
    num_counted: int


def sample(
    logits: torch.Tensor, sequences: list[Sequence], eos_token_ids: tuple[int, ...] = ()
) -> tuple[list[int], list[float], list[TopLogprobs | None]]:
    """``logits: [B, V]`` float32 on any device -> (token ids, logprobs, top alternatives).

    Top alternatives are ``(token, logprob)`` pairs, best first, for sequences whose
    ``params.logprobs > 0``; None for the others. ``eos_token_ids`` are masked, with each
    row's stop_token_ids, until the row has ``min_tokens`` outputs.
    """
    logprobs_all = torch.log_softmax(logits, dim=-1)  # [B, V]
    processed = process_logits(logits, sequences, eos_token_ids)  # [B, V]
    random_rows = [i for i, s in enumerate(sequences) if not s.params.is_greedy]
    if len(random_rows) < len(sequences):
        tokens = torch.argmax(processed, dim=-1)  # [B]
    if random_rows:
        params = [sequences[i].params for i in random_rows]
        uniforms = _uniforms([sequences[i].generator for i in random_rows], logits.device)  # [Br]
        if len(random_rows) == len(sequences):
            tokens = _invert_cdf(torch.softmax(filtered_logits(processed, params), dim=-1), uniforms)
        else:
            index = torch.tensor(random_rows, device=logits.device)
            probs = torch.softmax(filtered_logits(processed.index_select(0, index), params), dim=-1)  # [Br, V]
            tokens.index_copy_(0, index, _invert_cdf(probs, uniforms))
    return _to_host(tokens, logprobs_all, [s.params.logprobs for s in sequences])


def process_logits(
    logits: torch.Tensor, sequences: list[Sequence], eos_token_ids: tuple[int, ...] = ()
) -> torch.Tensor:
    """Stage 2: bias, penalties, grammar and min_tokens masks; returns new ``[B, V]`` logits
    (``logits`` itself where no row asks for any of them)."""
    if not any(s.params.logit_bias or s.params.has_penalties or s.grammar is not None or s.params.min_tokens
               for s in sequences):
        return logits
    out = logits.clone()
    device = logits.device
    biased = [(i, s.params.logit_bias) for i, s in enumerate(sequences) if s.params.logit_bias]
    if biased:
        rows = torch.tensor([i for i, bias in biased for _ in bias], device=device)
        cols = torch.tensor([t for _, bias in biased for t, _ in bias], device=device)
        values = torch.tensor([v for _, bias in biased for _, v in bias], dtype=out.dtype, device=device)
        out.index_put_((rows, cols), values, accumulate=True)
    penalised = [i for i, s in enumerate(sequences) if s.params.has_penalties]
    if penalised:
        _apply_penalties(out, penalised, [sequences[i] for i in penalised])
    constrained = [i for i, s in enumerate(sequences) if s.grammar is not None]
    if constrained:
        mask_logits(out, constrained, [sequences[i].grammar for i in constrained])
    early = [(i, _stop_ids(s.params, eos_token_ids)) for i, s in enumerate(sequences)
             if len(s.output_ids) < s.params.min_tokens]
    early = [(i, ids) for i, ids in early if ids]
    if early:
        grammar_rows = [i for i, _ in early if sequences[i].grammar is not None]
        allowed = out[grammar_rows] if grammar_rows else None  # what the grammar alone allows
        rows = torch.tensor([i for i, ids in early for _ in ids], device=device)
        cols = torch.tensor([t for _, ids in early for t in ids], device=device)
        out.index_put_((rows, cols), torch.tensor(float("-inf"), dtype=out.dtype, device=device))
        if grammar_rows:  # where the grammar allows nothing but a stop token, ending wins over min_tokens
            masked = out[grammar_rows]
            stuck = torch.isneginf(masked).all(dim=1, keepdim=True)
            out[grammar_rows] = torch.where(stuck, allowed, masked)
    return out


def _stop_ids(params: SamplingParams, eos_token_ids: tuple[int, ...]) -> list[int]:
    ids = list(params.stop_token_ids) if params.ignore_eos else list(params.stop_token_ids) + list(eos_token_ids)
    return sorted(set(ids))


def _apply_penalties(logits: torch.Tensor, rows: list[int], sequences: list[Sequence]) -> None:
    """In place on ``logits[rows]``, as vLLM does (Bp penalised rows)::

        seen   = token in the prompt or the output
        logit  = logit / repetition if seen and logit > 0 else logit * repetition if seen
        logit -= frequency * (occurrences in the output) + presence * (1 if in the output)
    """
    vocab, device, dtype = logits.shape[1], logits.device, logits.dtype
    states = [_penalty_state(s, vocab, device, dtype) for s in sequences]
    counts = torch.stack([state.output_counts for state in states])  # [Bp, V]
    in_output = counts > 0
    seen = torch.stack([state.prompt_mask for state in states]) | in_output  # [Bp, V]

    def column(name: str) -> torch.Tensor:
        return torch.tensor([getattr(s.params, name) for s in sequences], dtype=dtype, device=device).unsqueeze(1)

    index = torch.tensor(rows, device=device)
    values = logits.index_select(0, index)  # [Bp, V]
    factor = torch.where(seen, column("repetition_penalty"), torch.ones((), dtype=dtype, device=device))
    values = torch.where(values > 0, values / factor, values * factor)
    values = values - column("frequency_penalty") * counts - column("presence_penalty") * in_output.to(dtype)
    logits.index_copy_(0, index, values)


def _penalty_state(sequence: Sequence, vocab: int, device: torch.device, dtype: torch.dtype) -> PenaltyState:
    """The sequence's counts, built once from its tokens and then advanced by the tokens
    output since (one, each step): never a pass over the whole output again."""
    state = sequence.penalty_state
    outputs = sequence.output_ids
    if state is None:
        prompt = torch.tensor(sequence.prompt_ids, dtype=torch.int64, device=device)
        state = PenaltyState(torch.zeros(vocab, dtype=dtype, device=device),
                             torch.zeros(vocab, dtype=torch.bool, device=device).index_fill_(0, prompt, True), 0)
        sequence.penalty_state = state
    if state.num_counted < len(outputs):
        new = torch.tensor(outputs[state.num_counted:], dtype=torch.int64, device=device)
        state.output_counts.index_add_(0, new, torch.ones(new.shape[0], dtype=dtype, device=device))
        state.num_counted = len(outputs)
    return state


def filtered_logits(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Stage 4 over ``logits: [Br, V]``: temperature, min-p, top-k, top-p; dropped tokens -inf."""
    vocab, device, dtype = logits.shape[1], logits.device, logits.dtype
    # Bounds that keep the math finite whatever a request asked for: a temperature below
    # MIN_TEMPERATURE would overflow the scaled logits, a top-k past the vocabulary means all.
    temperature = torch.tensor([max(p.temperature, MIN_TEMPERATURE) for p in params], dtype=dtype, device=device)
    scaled = logits / temperature.unsqueeze(1)
    if any(p.min_p > 0 for p in params):  # p < min_p * p_max  <=>  logit < max_logit + log(min_p)
        min_p = torch.tensor([p.min_p for p in params], dtype=dtype, device=device).unsqueeze(1)
        scaled = scaled.masked_fill(scaled < scaled.amax(dim=1, keepdim=True) + torch.log(min_p), float("-inf"))
    top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    cut = [r for r, p in enumerate(params) if top_k[r] < vocab or p.top_p < 1.0]
    if cut:
        index = torch.tensor(cut, device=device)
        rows = scaled.index_select(0, index)
        threshold = _top_k_top_p_threshold(rows, [top_k[r] for r in cut], [params[r].top_p for r in cut])
        scaled = scaled.index_copy(0, index, rows.masked_fill(rows < threshold, float("-inf")))
    return scaled


def _top_k_top_p_threshold(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """``logits: [Bc, V]`` -> ``[Bc, 1]``: the smallest logit each row keeps under its top-k,
    then top-p over the renormalised top-k (the smallest prefix reaching top_p, at least one).

    A row with top_p and no top-k needs its tokens in order only as far as its nucleus
    reaches: the ``NUCLEUS_CANDIDATES`` most likely tokens (``topk``), checked to hold at least
    top_p of the row's whole mass (else the full sort, exactly as before). A full sort of a
    32k vocabulary costs ~2 ms per row on a CPU core; the candidates a tenth of that.
    """
    vocab, device = logits.shape[1], logits.device
    k_max = max(top_k)
    full_mass = None  # [Bc, 1] log of each row's whole mass, where the candidates are a prefix
    if k_max < vocab:
        values = torch.topk(logits, k_max, dim=-1).values  # [Bc, Kc], best first
    else:
        values = None
        limited = [k for k in top_k if k < vocab]
        count = max(NUCLEUS_CANDIDATES, max(limited, default=0))
        if count < vocab:
            candidates = torch.topk(logits, count, dim=-1).values  # [Bc, count], best first
            log_mass = torch.logsumexp(logits, dim=-1, keepdim=True)
            covered = torch.exp(candidates - log_mass).sum(dim=-1)  # each row's mass among them
            unlimited = torch.tensor([k >= vocab for k in top_k], device=device)
            wanted = torch.tensor(top_p, dtype=covered.dtype, device=device)
            if bool(((covered >= wanted) | ~unlimited).all()):  # every nucleus lies among them
                values, full_mass = candidates, torch.where(unlimited.unsqueeze(1), log_mass, float("nan"))
        if values is None:  # only a full sort gives these rows' cumulative mass
            values = torch.sort(logits, dim=-1, descending=True).values  # [Bc, V]
    rank = torch.arange(values.shape[1], device=device).unsqueeze(0)
    in_top_k = rank < torch.tensor(top_k, device=device).unsqueeze(1)
    probs = torch.softmax(values.masked_fill(~in_top_k, float("-inf")), dim=-1)
    if full_mass is not None:  # rows without top-k: probabilities under the whole vocabulary
        probs = torch.where(full_mass.isnan(), probs, torch.exp(values - full_mass))
    above = torch.cumsum(probs, dim=-1) - probs  # mass strictly above each candidate
    keep = in_top_k & (above < torch.tensor(top_p, dtype=probs.dtype, device=device).unsqueeze(1))
    keep[:, 0] = True  # the most likely token, however small top_p is
    return values.gather(1, keep.sum(dim=1, keepdim=True) - 1)  # keep is a prefix of each row


def _uniforms(generators: list[torch.Generator | None], device: torch.device) -> torch.Tensor:
    """``[Br]`` uniforms in [0, 1): a seeded row's from its own generator, the rest in one draw."""
    uniforms = torch.empty(len(generators), dtype=torch.float64, device=device)
    seeded = [r for r, g in enumerate(generators) if g is not None]
    if len(seeded) < len(generators):
        free = torch.tensor([r for r, g in enumerate(generators) if g is None], device=device)
        uniforms.index_copy_(0, free, torch.rand(free.shape[0], dtype=torch.float64, device=device))
    if seeded:
        draws = [_seeded_draw(generators[r], device) for r in seeded]
        uniforms.index_copy_(0, torch.tensor(seeded, device=device), torch.cat(draws))
    return uniforms


def _seeded_draw(generator: torch.Generator, device: torch.device) -> torch.Tensor:
    """A seeded row's one uniform of a step: its random stream advances by exactly this."""
    return torch.rand(1, dtype=torch.float64, device=device, generator=generator)


def seeded_generator(seed: int, device: torch.device, tokens_sampled: int = 0) -> torch.Generator:
    """A seeded request's generator, where it stands after ``tokens_sampled`` sampled tokens
    (a request continued on another router resumes its random stream there: the same tokens
    as if it had never moved). Each sampled token of a random row draws one uniform."""
    generator = torch.Generator(device=device).manual_seed(seed)
    for _ in range(tokens_sampled):
        _seeded_draw(generator, device)
    return generator


def _invert_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """The token whose cumulative-probability interval holds each row's uniform ``[Br]``."""
    cdf = torch.cumsum(probs, dim=-1, dtype=torch.float64)  # [Br, V]; float64: exact enough for 1e-9 tails
    total = cdf[:, -1:].contiguous()
    chosen = torch.searchsorted(cdf, uniforms.unsqueeze(1) * total, right=True)
    # Rounding may put u * total at the total: the last token with mass is the last candidate.
    last = torch.searchsorted(cdf, total, right=False)
    return torch.minimum(chosen, last).squeeze(1)


def _to_host(tokens: torch.Tensor, logprobs_all: torch.Tensor, wanted: list[int]):
    """One device-to-host transfer: token ids (exact in float64), chosen logprobs, top pairs."""
    batch = tokens.shape[0]
    chosen = logprobs_all.gather(1, tokens.unsqueeze(1)).squeeze(1)
    parts = [tokens.to(torch.float64), chosen.to(torch.float64)]
    n = min(max(wanted, default=0), logprobs_all.shape[1])
    if n:
        values, ids = torch.topk(logprobs_all, n, dim=-1)  # [B, n]
        parts += [ids.to(torch.float64).flatten(), values.to(torch.float64).flatten()]
    host = torch.cat(parts).cpu()
    token_list = [int(t) for t in host[:batch].tolist()]
    chosen_list = host[batch:2 * batch].tolist()
    tops: list[TopLogprobs | None] = [None] * batch
    if n:
        ids = host[2 * batch:2 * batch + batch * n].view(batch, n).tolist()
        values = host[2 * batch + batch * n:].view(batch, n).tolist()
        for i, count in enumerate(wanted):
            if count:
                tops[i] = [(int(t), v) for t, v in zip(ids[i][:count], values[i][:count])]
    return token_list, chosen_list, tops
