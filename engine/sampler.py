"""Choose each sequence's next token from its logits.

Legend: B sequences in the step, V vocabulary.

Greedy rows take the argmax. Other rows are scaled by temperature, filtered by top-k and
top-p, and drawn with the request's own generator, so a seeded request samples the same
tokens whatever else shares its batch. The reported logprob is the chosen token's log
probability under the model's raw distribution (before temperature and filters).
"""

from __future__ import annotations

import torch

from raymoe.engine.sequence import Sequence


TopLogprobs = list[tuple[int, float]]
MIN_TEMPERATURE = 1e-5  # below this a request is greedy (the limit of sampling as T -> 0)


def sample(logits: torch.Tensor, sequences: list[Sequence]) -> tuple[list[int], list[float], list[TopLogprobs | None]]:
    """``logits: [B, V]`` float32 -> (token ids, logprobs, top alternatives), one per sequence.

    Top alternatives are ``(token, logprob)`` pairs, best first, for sequences whose
    ``params.logprobs > 0``; None for the others.
    """
    logprobs_all = torch.log_softmax(logits, dim=-1)  # [B, V]
    tokens = torch.argmax(logits, dim=-1)  # [B]
    random_rows = [i for i, s in enumerate(sequences) if not s.params.is_greedy]
    if random_rows:
        index = torch.tensor(random_rows, dtype=torch.int64)
        probs = _filtered_probs(logits.index_select(0, index), [sequences[i] for i in random_rows])
        for row, i in enumerate(random_rows):
            choice = torch.multinomial(probs[row], 1, generator=sequences[i].generator)
            tokens[i] = choice[0]
    chosen = logprobs_all.gather(1, tokens.unsqueeze(1)).squeeze(1)
    tops: list[TopLogprobs | None] = [None] * len(sequences)
    wanted = max(s.params.logprobs for s in sequences)
    if wanted:
        values, ids = torch.topk(logprobs_all, min(wanted, logprobs_all.shape[1]), dim=-1)
        for i, sequence in enumerate(sequences):
            n = sequence.params.logprobs
            if n:
                tops[i] = list(zip(ids[i, :n].tolist(), values[i, :n].tolist()))
    return tokens.tolist(), chosen.tolist(), tops


def _filtered_probs(logits: torch.Tensor, sequences: list[Sequence]) -> torch.Tensor:
    """Temperature, top-k, top-p over ``logits: [R, V]``; returns probabilities ``[R, V]``."""
    vocab = logits.shape[1]
    # Bounds that keep the math finite whatever a request asked for: a temperature below
    # MIN_TEMPERATURE would overflow the scaled logits, a top-k past the vocabulary means all.
    temperature = torch.tensor([max(s.params.temperature, MIN_TEMPERATURE) for s in sequences], dtype=logits.dtype)
    top_k = torch.tensor([min(s.params.top_k, vocab) if s.params.top_k > 0 else vocab for s in sequences])
    top_p = torch.tensor([s.params.top_p for s in sequences], dtype=logits.dtype)
    scaled = logits / temperature.unsqueeze(1)
    sorted_logits, sorted_index = torch.sort(scaled, dim=-1, descending=True)  # [R, V]
    rank = torch.arange(vocab).unsqueeze(0)
    drop = rank >= top_k.clamp(max=vocab).unsqueeze(1)  # top-k
    sorted_probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
    before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs  # mass strictly above each token
    drop |= before >= top_p.unsqueeze(1)  # top-p keeps the smallest prefix reaching top_p
    drop[:, 0] = False  # ...and always the most likely token, however small top_p is
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    filtered = torch.full_like(scaled, float("-inf")).scatter_(1, sorted_index, sorted_logits)
    return torch.softmax(filtered, dim=-1)
