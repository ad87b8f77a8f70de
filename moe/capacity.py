"""Expert capacity and what happens to assignments beyond it.

Legend: T tokens, E logical experts, k experts per token.

Capacity is counted per *logical* expert over the whole batch a router plans, never per
physical slot, so that replicas and placement cannot change which assignments survive:
placement never changes outputs, drops included.

Priority when an expert overflows: every token's first choice beats any token's second
choice, and within one choice rank earlier tokens win (GShard's rule). Dropped
assignments contribute zero; the remaining weights are not renormalised.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

import torch


class OverflowPolicy(enum.Enum):
    NONE = "none"  # dropless: capacity is unlimited
    DROP = "drop"  # assignments past capacity contribute zero and are counted


@dataclass(frozen=True)
class CapacityConfig:
    capacity_factor: float = 1.0
    policy: OverflowPolicy = OverflowPolicy.NONE

    def __post_init__(self) -> None:
        if not self.capacity_factor > 0:
            raise ValueError(f"capacity_factor must be > 0, got {self.capacity_factor}")


def expert_capacity(num_tokens: int, top_k: int, num_experts: int, capacity_factor: float) -> int:
    """``ceil(capacity_factor * tokens * k / experts)`` assignments per logical expert.

    A relative 1e-9 guard keeps float noise from rounding an exact integer up
    (``1.1 * 100`` is ``110.00000000000001`` in binary floating point).
    """
    exact = capacity_factor * num_tokens * top_k / num_experts
    return math.ceil(exact * (1 - 1e-9))


def keep_mask(topk_ids: torch.Tensor, num_experts: int, config: CapacityConfig) -> torch.Tensor:
    """Which assignments survive capacity.

    Args:
        topk_ids: ``[T, k]`` logical expert of each assignment.
    Returns:
        ``kept: [T, k]`` bool; all True under :attr:`OverflowPolicy.NONE`.
    """
    num_tokens, top_k = topk_ids.shape
    if config.policy is OverflowPolicy.NONE:
        return torch.ones_like(topk_ids, dtype=torch.bool)
    capacity = expert_capacity(num_tokens, top_k, num_experts, config.capacity_factor)
    # Step 1: lay assignments out in priority order: choice rank first, then token.
    by_priority = topk_ids.t().reshape(-1)  # [k * T]
    # Step 2: rank of each assignment among those of its expert (stable sort keeps priority).
    order = torch.argsort(by_priority, stable=True)
    counts = torch.bincount(by_priority, minlength=num_experts)
    starts = torch.cumsum(counts, 0) - counts
    rank_sorted = torch.arange(by_priority.numel(), device=topk_ids.device) - starts[by_priority[order]]
    rank = torch.empty_like(rank_sorted).scatter_(0, order, rank_sorted)
    # Step 3: keep the first `capacity` of each expert, back in [T, k] layout.
    return (rank < capacity).view(top_k, num_tokens).t()
