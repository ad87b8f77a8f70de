"""Log probabilities of a prompt's own tokens, from the logits at every prompt position.

Legend: L prompt tokens, V vocabulary, N alternatives asked for.

Position ``i`` of a prompt is scored by the logits at position ``i - 1`` (what the model
predicted before it saw token ``i``); the first token has no prediction, so its entry is
None, as in OpenAI's and vLLM's echo. Reduced where the logits are (a router, the
in-process engine), so that only ``L * (N + 1)`` numbers travel, not ``L * V``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PromptLogprobs:
    """One prompt's scores; every list has one entry per prompt token, None at position 0."""

    token_logprobs: list[float | None]
    ranks: list[int | None]  # 1 = the model's most likely token at that position
    top: list[list[tuple[int, float]] | None]  # the N most likely (token, logprob), best first

    def trimmed(self, num_top: int) -> "PromptLogprobs":
        """The same scores with at most ``num_top`` alternatives per position."""
        return PromptLogprobs(self.token_logprobs, self.ranks,
                              [None if t is None else t[:num_top] for t in self.top])


def prompt_logprobs(logits: torch.Tensor, prompt: list[int], num_top: int) -> PromptLogprobs:
    """``logits: [L, V]`` of ``prompt`` (L tokens) -> its tokens' logprobs, ranks and top ``num_top``."""
    if logits.shape[0] != len(prompt):
        raise ValueError(f"{logits.shape[0]} rows of logits for a prompt of {len(prompt)} tokens")
    if len(prompt) < 2:
        return PromptLogprobs([None] * len(prompt), [None] * len(prompt), [None] * len(prompt))
    logprobs = torch.log_softmax(logits[:-1].float(), dim=-1)  # [L-1, V]: row i predicts token i+1
    targets = torch.tensor(prompt[1:], dtype=torch.int64).unsqueeze(1)  # [L-1, 1]
    chosen = logprobs.gather(1, targets)  # [L-1, 1]
    ranks = (logprobs > chosen).sum(dim=1) + 1  # [L-1]
    tops: list[list[tuple[int, float]] | None] = [[] for _ in prompt[1:]]
    if num_top > 0:
        values, ids = torch.topk(logprobs, min(num_top, logprobs.shape[1]), dim=-1)  # [L-1, N]
        tops = [list(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]
    return PromptLogprobs([None, *chosen.squeeze(1).tolist()], [None, *ranks.tolist()], [None, *tops])
