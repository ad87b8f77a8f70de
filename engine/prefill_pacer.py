"""Prefill pacing: size prompt chunks from measured step costs, so decodes keep their pace.

A fixed token budget (``max_num_batched_tokens``) bounds a step's tokens, not its time: on a
CPU a 512-token chunk of a long prompt makes the step ~10x slower than a decode-only step, so
every running stream's inter-token latency jumps by that much while the prompt prefills. On
a GPU the same budget costs almost nothing over a decode. The right chunk depends on the
hardware, the model and the context, so it is measured:

- ``decode_s``: a decode-only step's wall time (moving average);
- ``token_s``: what one prompt token adds to a step (moving average over steps that compute
  prompt chunks: ``(step - decode_s) / prompt tokens``).

While sequences decode, the prompt tokens of a step are held to
``(slowdown - 1) * decode_s / token_s``, at least ``min_chunk`` (so prompts always progress)
and at most the token budget. With no sequence decoding, prompts take the whole budget
(their time to first token is all that is at stake). Pure arithmetic: the engine times its
steps and asks before each schedule.
"""

from __future__ import annotations

# A step that computes prompt chunks while others decode aims at 2x a decode-only step: the
# running streams' inter-token latency at most doubles while a long prompt prefills.
DEFAULT_PREFILL_STEP_SLOWDOWN = 2.0
# Fewest prompt tokens a step computes while sequences decode: prompts always progress, and
# prompts of up to this many tokens are never split by pacing.
MIN_PREFILL_CHUNK = 32
SMOOTHING = 0.2  # weight of the newest observation in the moving averages
OUTLIER = 4.0  # an observation counts at most this many times the current average (a stall,
# a recovery or a compile must not set the pace for many steps after)


def check_slowdown(slowdown: float) -> None:
    """A slowdown is a factor > 1 (a paced step may take that many decode-only steps) or 0 (off)."""
    if slowdown != 0 and not slowdown > 1:
        raise ValueError(f"prefill_step_slowdown must be > 1 (or 0: off), got {slowdown}")


class PrefillPacer:
    def __init__(self, slowdown: float, token_budget: int, min_chunk: int = MIN_PREFILL_CHUNK):
        check_slowdown(slowdown)
        self.slowdown = slowdown
        self.token_budget = token_budget
        self.min_chunk = min(min_chunk, token_budget)
        self.decode_s: float | None = None
        self.token_s: float | None = None

    @property
    def enabled(self) -> bool:
        return self.slowdown > 0

    def prefill_allowance(self) -> int:
        """Prompt tokens the next step may compute if it also decodes."""
        if not self.enabled or self.decode_s is None or self.token_s is None:
            return self.token_budget  # nothing measured yet: the budget alone bounds the step
        if self.token_s <= 0:
            return self.token_budget
        tokens = int((self.slowdown - 1.0) * self.decode_s / self.token_s)
        return max(self.min_chunk, min(self.token_budget, tokens))

    def observe(self, num_decodes: int, num_prompt_tokens: int, seconds: float) -> None:
        """One step ran: ``num_decodes`` sequences decoded one token each and prompts computed
        ``num_prompt_tokens`` tokens, in ``seconds`` of wall time."""
        if not self.enabled or seconds <= 0:
            return
        if num_prompt_tokens == 0:
            if num_decodes:
                self.decode_s = _average(self.decode_s, seconds)
            return
        base = self.decode_s if (num_decodes and self.decode_s is not None) else 0.0
        per_token = max(seconds - base, 0.0) / num_prompt_tokens
        self.token_s = _average(self.token_s, per_token)


def _average(current: float | None, value: float) -> float:
    if current is None:
        return value
    return current + SMOOTHING * (min(value, OUTLIER * current) - current)
