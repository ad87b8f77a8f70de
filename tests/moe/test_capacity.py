"""keep_mask and expert_capacity against a plain loop reference, over a table of shapes.

Legend: T tokens, E logical experts, k experts per token, cf capacity factor.

The documented priority: all first choices in token order, then all second choices, ...;
each logical expert keeps its first ``ceil(cf * T * k / E)`` assignments in that order.
"""

from __future__ import annotations

import math

import pytest
import torch

from raymoe.moe.capacity import CapacityConfig, OverflowPolicy, expert_capacity, keep_mask


def reference_keep(topk_ids: torch.Tensor, num_experts: int, capacity: int) -> list[list[bool]]:
    num_tokens, top_k = topk_ids.shape
    used = [0] * num_experts
    kept = [[False] * top_k for _ in range(num_tokens)]
    for choice in range(top_k):  # every first choice beats any second choice
        for t in range(num_tokens):  # within a choice rank, earlier tokens win
            expert = int(topk_ids[t, choice])
            if used[expert] < capacity:
                used[expert] += 1
                kept[t][choice] = True
    return kept


def random_ids(num_tokens: int, num_experts: int, top_k: int, seed: int, skew: bool) -> torch.Tensor:
    """Distinct experts per row; ``skew`` favours low expert ids so some overflow hard."""
    gen = torch.Generator().manual_seed(seed)
    if num_tokens == 0:
        return torch.zeros(0, top_k, dtype=torch.int64)
    if skew:
        scores = torch.rand(num_tokens, num_experts, generator=gen) - torch.arange(num_experts) * 0.5 / num_experts
        return torch.topk(scores, top_k, dim=1)[1]
    return torch.stack([torch.randperm(num_experts, generator=gen)[:top_k] for _ in range(num_tokens)])


# (tokens, experts, k, capacity_factor, skew)
TABLE = [
    (0, 4, 2, 1.0, False),
    (1, 4, 1, 1.0, False),
    (1, 8, 2, 0.1, False),  # capacity 1 even when cf * T * k / E is tiny
    (8, 4, 1, 1.0, False),
    (8, 4, 2, 0.5, False),
    (16, 4, 2, 0.25, True),
    (16, 8, 2, 1.0, True),
    (16, 8, 2, 1.25, True),
    (32, 8, 4, 0.75, True),
    (33, 7, 3, 1.1, True),
    (64, 16, 8, 0.5, False),
    (20, 4, 2, 100.0, True),  # large cf: nothing dropped
    (12, 6, 6, 1.0, False),  # k == E: every expert gets every token
]


@pytest.mark.parametrize("num_tokens,num_experts,top_k,cf,skew", TABLE)
def test_keep_mask_matches_reference(num_tokens, num_experts, top_k, cf, skew) -> None:
    ids = random_ids(num_tokens, num_experts, top_k, seed=num_tokens * 31 + top_k, skew=skew)
    capacity = math.ceil(cf * num_tokens * top_k / num_experts)
    kept = keep_mask(ids, num_experts, CapacityConfig(cf, OverflowPolicy.DROP))
    assert kept.dtype == torch.bool
    assert kept.shape == (num_tokens, top_k)
    assert kept.tolist() == reference_keep(ids, num_experts, capacity)
    # Independent of the reference: no expert keeps more than its capacity, and an expert
    # under capacity keeps every assignment it got.
    for expert in range(num_experts):
        got = int((ids == expert).sum())
        kept_here = int(((ids == expert) & kept).sum())
        assert kept_here == min(got, capacity)
    if cf >= num_experts:  # capacity >= T * k: no drops
        assert kept.all()


def test_table_has_drops_and_no_drops() -> None:
    """The table above must really exercise both overflow and the dropless regime."""
    outcomes = set()
    for num_tokens, num_experts, top_k, cf, skew in TABLE:
        ids = random_ids(num_tokens, num_experts, top_k, seed=num_tokens * 31 + top_k, skew=skew)
        kept = keep_mask(ids, num_experts, CapacityConfig(cf, OverflowPolicy.DROP))
        if kept.numel():
            outcomes.add(bool(kept.all()))
        if cf < 1 and num_tokens > 1:
            assert not kept.all(), (num_tokens, num_experts, top_k, cf)
    assert outcomes == {True, False}


def test_first_choices_beat_earlier_tokens_second_choices() -> None:
    """Capacity 1 for expert 0: token 1's first choice wins over token 0's second choice."""
    ids = torch.tensor([[1, 0], [0, 1], [2, 3], [3, 2]])  # T=4, k=2, E=4 -> capacity ceil(cf*2)
    kept = keep_mask(ids, 4, CapacityConfig(0.5, OverflowPolicy.DROP))  # capacity 1
    assert kept.tolist() == [[True, False], [True, False], [True, False], [True, False]]


def test_earlier_token_wins_within_a_choice_rank() -> None:
    ids = torch.tensor([[0], [0], [0], [1]])  # T=4, k=1, E=2, cf=0.5 -> capacity 1
    kept = keep_mask(ids, 2, CapacityConfig(0.5, OverflowPolicy.DROP))
    assert kept[:, 0].tolist() == [True, False, False, True]


@pytest.mark.parametrize("cf", [0.01, 0.5, 1.0, 2.0])
def test_policy_none_keeps_everything(cf: float) -> None:
    ids = random_ids(16, 4, 2, seed=3, skew=True)
    kept = keep_mask(ids, 4, CapacityConfig(cf, OverflowPolicy.NONE))
    assert kept.dtype == torch.bool and kept.shape == (16, 2)
    assert kept.all()


def test_keep_mask_is_per_logical_expert_and_deterministic() -> None:
    ids = random_ids(40, 8, 2, seed=5, skew=True)
    config = CapacityConfig(0.5, OverflowPolicy.DROP)
    assert torch.equal(keep_mask(ids, 8, config), keep_mask(ids.clone(), 8, config))


@pytest.mark.parametrize(
    "num_tokens,top_k,num_experts,cf,expected",
    [
        (0, 2, 4, 1.0, 0),
        (8, 2, 4, 1.0, 4),  # exactly T * k / E
        (8, 2, 4, 1.25, 5),
        (8, 2, 4, 0.5, 2),
        (9, 2, 4, 1.0, 5),  # 4.5 rounds up
        (1, 1, 8, 1.0, 1),  # 0.125 rounds up to 1
        (1, 8, 64, 0.01, 1),
        (16, 1, 4, 2.0, 8),
        (100, 2, 8, 1.5, 38),  # 37.5 rounds up
        (128, 8, 256, 1.0, 4),  # DeepSeek-V3-like shape
    ],
)
def test_expert_capacity_formula(num_tokens, top_k, num_experts, cf, expected) -> None:
    assert expert_capacity(num_tokens, top_k, num_experts, cf) == expected


@pytest.mark.parametrize("cf", [0.0, -1.0, float("nan")])
def test_capacity_config_rejects_non_positive_factor(cf: float) -> None:
    with pytest.raises(ValueError):
        CapacityConfig(cf, OverflowPolicy.DROP)
