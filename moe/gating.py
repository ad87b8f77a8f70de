"""Gating: router logits -> (top-k experts, combine weights), per the checkpoint's rule.

Legend: T tokens, E logical experts, k experts per token, G expert groups.

Two scoring families cover the supported checkpoints:

- softmax (Mixtral, Qwen2/3-MoE, OLMoE): ``p = softmax(logits)``, take top-k of ``p``;
  renormalise the k weights to sum to one when ``norm_topk_prob`` (always for Mixtral).
- sigmoid (DeepSeek-V3): ``s = sigmoid(logits)``; choose with ``s + correction_bias``
  restricted to the best ``topk_groups`` of ``G`` groups (a group scores the sum of its two
  best biased scores); weigh with the unbiased ``s``, renormalised when ``norm_topk_prob``,
  then times ``routed_scaling_factor``.

Everything is computed in float32, as the reference implementations do.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch


class ScoringFunction(enum.Enum):
    SOFTMAX = "softmax"
    SIGMOID = "sigmoid"


@dataclass(frozen=True)
class GateConfig:
    scoring: ScoringFunction
    num_experts: int
    top_k: int
    norm_topk_prob: bool
    num_groups: int = 1
    topk_groups: int = 1
    routed_scaling_factor: float = 1.0
    has_correction_bias: bool = False

    def __post_init__(self) -> None:
        if not 0 < self.top_k <= self.num_experts:
            raise ValueError(f"top_k={self.top_k} must be in [1, num_experts={self.num_experts}]")
        if self.num_groups < 1 or self.num_experts % self.num_groups:
            raise ValueError(f"num_experts={self.num_experts} is not divisible into n_group={self.num_groups} groups")
        if not 0 < self.topk_groups <= self.num_groups:
            raise ValueError(f"topk_group={self.topk_groups} must be in [1, n_group={self.num_groups}]")
        if self.num_groups > 1 and self.num_experts // self.num_groups < 2:
            raise ValueError("grouped top-k needs at least 2 experts per group")
        if self.top_k > self.topk_groups * (self.num_experts // self.num_groups):
            raise ValueError(
                f"top_k={self.top_k} exceeds the {self.topk_groups} selected groups' experts"
            )


def route(
    logits: torch.Tensor, config: GateConfig, correction_bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Select experts for each token.

    Args:
        logits: ``[T, E]`` router logits (any float dtype; computed on in float32).
        correction_bias: ``[E]`` score-correction bias (sigmoid gating only).
    Returns:
        ``topk_ids: [T, k]`` int64 logical experts and ``topk_weights: [T, k]`` float32.
    """
    logits = logits.float()
    if config.scoring is ScoringFunction.SOFTMAX:
        probs = torch.softmax(logits, dim=-1)  # [T, E]
        weights, ids = torch.topk(probs, config.top_k, dim=-1)  # [T, k]
        if config.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return ids, weights
    scores = torch.sigmoid(logits)  # [T, E]
    choice = scores if correction_bias is None else scores + correction_bias.float()
    if config.num_groups > 1:
        choice = _mask_to_top_groups(choice, config)
    ids = torch.topk(choice, config.top_k, dim=-1)[1]  # [T, k]
    weights = scores.gather(1, ids)
    if config.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return ids, weights * config.routed_scaling_factor


def _mask_to_top_groups(choice: torch.Tensor, config: GateConfig) -> torch.Tensor:
    """Keep only the experts of the ``topk_groups`` best groups; others become -inf."""
    num_tokens = choice.shape[0]
    grouped = choice.view(num_tokens, config.num_groups, config.num_experts // config.num_groups)  # [T, G, E/G]
    group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)  # [T, G]
    top_groups = torch.topk(group_scores, config.topk_groups, dim=-1)[1]  # [T, topk_groups]
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, top_groups, True)
    return grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(num_tokens, config.num_experts)
