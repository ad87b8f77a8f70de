"""Per-request sampling parameters, validated once when the request arrives."""

from __future__ import annotations

from dataclasses import dataclass

# Limits that keep one request's share of the shared step loop small (each stop string is
# searched in every step's text; each stop id compared per token).
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 512
MAX_STOP_TOKEN_IDS = 256
SEED_RANGE = (-(2**63), 2**64 - 1)  # what torch.Generator.manual_seed takes


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

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0
