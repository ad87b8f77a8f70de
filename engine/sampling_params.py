"""Per-request sampling parameters, validated once when the request arrives."""

from __future__ import annotations

import math
from dataclasses import dataclass

from raymoe.engine.structured_output import StructuredOutput

# Limits that keep one request's share of the shared step loop small (each stop string is
# searched in every step's text; each stop id compared per token).
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 512
MAX_STOP_TOKEN_IDS = 256
SEED_RANGE = (-(2**63), 2**64 - 1)  # what torch.Generator.manual_seed takes
MAX_LOGIT_BIAS_ENTRIES = 300  # OpenAI's limit


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k filter
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int = 0  # alternatives to report beside each chosen token's logprob
    # Penalties as vLLM applies them: presence and frequency subtract from the logits of
    # tokens in the output (once, and once per occurrence); repetition divides positive and
    # multiplies negative logits of tokens in the prompt or the output.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)
    min_tokens: int = 0  # EOS and stop_token_ids are masked until this many outputs
    min_p: float = 0.0  # drop tokens less likely than min_p times the most likely one
    structured: StructuredOutput | None = None  # the output must match this grammar

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not 0.0 <= self.temperature <= 100.0:
            raise ValueError(f"temperature must be in [0, 100], got {self.temperature!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 (disabled) or a positive integer, got {self.top_k!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or not SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]):
            raise ValueError(f"seed must be an integer in [-2**63, 2**64 - 1], got {self.seed!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError("stop must hold non-empty strings")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(f"stop holds {len(self.stop)} strings; at most {MAX_STOP_STRINGS} are allowed")
        if any(len(s) > MAX_STOP_STRING_CHARS for s in self.stop):
            raise ValueError(f"stop strings must be at most {MAX_STOP_STRING_CHARS} characters long")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"stop_token_ids holds {len(self.stop_token_ids)} ids; "
                             f"at most {MAX_STOP_TOKEN_IDS} are allowed")
        if not isinstance(self.logprobs, int) or not 0 <= self.logprobs <= 20:
            raise ValueError(f"logprobs must be an integer in [0, 20], got {self.logprobs!r}")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must hold non-negative integers")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_real(value) or not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be a number in [-2, 2], got {value!r}")
        if not _is_real(self.repetition_penalty) or not 0.0 < self.repetition_penalty <= 2.0:
            raise ValueError(f"repetition_penalty must be a number in (0, 2], got {self.repetition_penalty!r}")
        if not _is_real(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be a number in [0, 1], got {self.min_p!r}")
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be an integer in [0, max_tokens={self.max_tokens}], "
                             f"got {self.min_tokens!r}")
        self._check_logit_bias()
        if self.structured is not None and not isinstance(self.structured, StructuredOutput):
            raise ValueError(f"structured must be a StructuredOutput, got {type(self.structured).__name__}")

    def _check_logit_bias(self) -> None:
        """Token ids are checked against the vocabulary when the engine takes the request."""
        bias = self.logit_bias
        if not isinstance(bias, tuple) or any(not isinstance(entry, tuple) or len(entry) != 2 for entry in bias):
            raise ValueError("logit_bias must be a tuple of (token id, bias) pairs")
        if len(bias) > MAX_LOGIT_BIAS_ENTRIES:
            raise ValueError(f"logit_bias holds {len(bias)} entries; at most {MAX_LOGIT_BIAS_ENTRIES} are allowed")
        for token, value in bias:
            if not isinstance(token, int) or isinstance(token, bool) or token < 0:
                raise ValueError(f"logit_bias keys must be non-negative token ids, got {token!r}")
            if not _is_real(value) or not -100.0 <= value <= 100.0:
                raise ValueError(f"logit_bias values must be numbers in [-100, 100], got {value!r} for token {token}")
        if len({token for token, _ in bias}) != len(bias):
            raise ValueError("logit_bias holds a token id more than once")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0


def _is_real(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
