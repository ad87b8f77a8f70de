"""Log probabilities of a prompt's own tokens, from the logits at every prompt position.

Legend: T prompt tokens, V vocabulary, Na alternatives asked for, Tc the positions of one chunk.

Position ``i`` of a prompt is scored by the logits at position ``i - 1`` (what the model
predicted before it saw token ``i``); the first token has no prediction, so its entry is
None, as in OpenAI's and vLLM's echo. Reduced where the logits are (a router, the
in-process engine), so that only ``T * (Na + 1)`` numbers travel, not ``T * V``. The engine
never holds a prompt's ``[T, V]`` logits for this: it reduces each chunk of at most its token
budget's positions as it computes them (``LLMEngine.score_prompts``, :func:`reduce_rows`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PromptLogprobs:
    """One prompt's scores; every list has one entry per prompt token, None at position 0."""

    token_logprobs: list[float | None]
    ranks: list[int | None]  # 1 = the model's most likely token at that position
    top: list[list[tuple[int, float]] | None]  # the Na most likely (token, logprob), best first

    def trimmed(self, num_top: int) -> "PromptLogprobs":
        """The same scores with at most ``num_top`` alternatives per position."""
        return PromptLogprobs(self.token_logprobs, self.ranks,
                              [None if t is None else t[:num_top] for t in self.top])


def prompt_logprobs(logits: torch.Tensor, prompt: list[int], num_top: int) -> PromptLogprobs:
    """``logits: [T, V]`` of ``prompt`` (T tokens) -> its tokens' logprobs, ranks and top ``num_top``.

    For logits that exist already; the engine scores without them (``LLMEngine.score_prompts``:
    :func:`reduce_rows` over one chunk of positions at a time)."""
    if logits.shape[0] != len(prompt):
        raise ValueError(f"{logits.shape[0]} rows of logits for a prompt of {len(prompt)} tokens")
    if len(prompt) < 2:
        return PromptLogprobs([None] * len(prompt), [None] * len(prompt), [None] * len(prompt))
    targets = torch.tensor(prompt[1:], dtype=torch.int64, device=logits.device)  # row i predicts token i+1
    chosen, ranks, tops = [], [], []
    for start in range(0, len(prompt) - 1, ROWS_PER_BLOCK):  # one [rows, V] log_softmax at a time
        stop = min(start + ROWS_PER_BLOCK, len(prompt) - 1)
        c, r, t = reduce_rows(logits[start:stop], targets[start:stop], num_top)
        chosen += c
        ranks += r
        tops += t
    return PromptLogprobs([None, *chosen], [None, *ranks], [None, *tops])


ROWS_PER_BLOCK = 512  # prompt_logprobs' rows per log_softmax (each row's result is the same either way)


def reduce_rows(logits: torch.Tensor, targets: torch.Tensor, num_top: int
                ) -> tuple[list[float], list[int], list[list[tuple[int, float]]]]:
    """``logits: [Tc, V]`` of Tc positions, ``targets: [Tc]`` the token that came next at each ->
    per row the target's logprob, its rank (1 = the most likely) and the ``num_top`` most likely
    (token, logprob), best first: float32 log_softmax per row, only these numbers leave the device."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # [Tc, V]
    chosen = logprobs.gather(1, targets.view(-1, 1))  # [Tc, 1]
    ranks = (logprobs > chosen).sum(dim=1) + 1  # [Tc]
    tops: list[list[tuple[int, float]]] = [[] for _ in range(logits.shape[0])]
    if num_top > 0:
        values, ids = torch.topk(logprobs, min(num_top, logprobs.shape[1]), dim=-1)  # [Tc, Na]
        tops = [list(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]
    return chosen.squeeze(1).tolist(), ranks.tolist(), tops
