"""route against plain per-token references, one per gating family.

Legend: T tokens, E logical experts, k experts per token, G expert groups.

- softmax (Mixtral: renormalised; Qwen2/3-MoE: ``norm_topk_prob`` either way);
- sigmoid + correction bias + grouped top-k + routed_scaling_factor (DeepSeek-V3).

References are written per token with Python sorting, in float64.
"""

from __future__ import annotations

import math

import pytest
import torch

from raymoe.moe.gating import GateConfig, ScoringFunction, route


def top_indices(values: list[float], count: int, among: list[int] | None = None) -> list[int]:
    candidates = range(len(values)) if among is None else among
    return sorted(candidates, key=lambda e: -values[e])[:count]


def reference_softmax(logits: torch.Tensor, top_k: int, norm: bool) -> tuple[list[list[int]], list[list[float]]]:
    all_ids, all_weights = [], []
    for row in logits.double().tolist():
        peak = max(row)
        exps = [math.exp(v - peak) for v in row]
        probs = [v / sum(exps) for v in exps]
        ids = top_indices(probs, top_k)
        weights = [probs[e] for e in ids]
        if norm:
            weights = [w / sum(weights) for w in weights]
        all_ids.append(ids)
        all_weights.append(weights)
    return all_ids, all_weights


def reference_deepseek(
    logits: torch.Tensor,
    bias: list[float] | None,
    top_k: int,
    num_groups: int,
    topk_groups: int,
    norm: bool,
    scale: float,
) -> tuple[list[list[int]], list[list[float]]]:
    num_experts = logits.shape[1]
    group_size = num_experts // num_groups
    all_ids, all_weights = [], []
    for row in logits.double().tolist():
        scores = [1.0 / (1.0 + math.exp(-v)) for v in row]
        choice = [s + (bias[e] if bias is not None else 0.0) for e, s in enumerate(scores)]
        # A group scores the sum of its two best biased scores; keep the best topk_groups.
        group_score = []
        for g in range(num_groups):
            members = sorted(choice[g * group_size : (g + 1) * group_size], reverse=True)
            group_score.append(members[0] + members[1] if num_groups > 1 else 0.0)
        groups = top_indices(group_score, topk_groups) if num_groups > 1 else [0]
        candidates = [e for g in groups for e in range(g * group_size, (g + 1) * group_size)]
        ids = top_indices(choice, top_k, among=candidates)
        weights = [scores[e] for e in ids]  # weigh with the unbiased scores
        if norm:
            weights = [w / (sum(weights) + 1e-20) for w in weights]
        all_ids.append(ids)
        all_weights.append([w * scale for w in weights])
    return all_ids, all_weights


def check_route(ids, weights, ref_ids, ref_weights, num_tokens, top_k) -> None:
    assert ids.shape == (num_tokens, top_k) and weights.shape == (num_tokens, top_k)
    assert ids.dtype == torch.int64
    assert weights.dtype == torch.float32
    assert ids.tolist() == ref_ids
    expected = torch.tensor(ref_weights, dtype=torch.float32).reshape(num_tokens, top_k)
    torch.testing.assert_close(weights, expected, rtol=1e-5, atol=1e-6)


# (tokens, experts, k)
SOFTMAX_SHAPES = [(1, 4, 1), (1, 8, 2), (7, 8, 2), (16, 60, 4), (5, 64, 8), (3, 6, 6), (0, 8, 2)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("norm", [True, False], ids=["renorm", "no_renorm"])
@pytest.mark.parametrize("num_tokens,num_experts,top_k", SOFTMAX_SHAPES)
def test_softmax_topk(num_tokens, num_experts, top_k, norm, dtype) -> None:
    gen = torch.Generator().manual_seed(num_tokens * 7 + num_experts)
    if dtype is torch.bfloat16:
        # Distinct multiples of 1/8 are exact in bfloat16: no ties, so the top-k order is defined.
        ranks = [torch.randperm(num_experts, generator=gen) for _ in range(num_tokens)]
        logits = (torch.stack(ranks).float() - num_experts / 2) / 8 if ranks else torch.zeros(0, num_experts)
        logits = logits.to(dtype)
    else:
        logits = torch.randn(num_tokens, num_experts, generator=gen) * 2
    config = GateConfig(ScoringFunction.SOFTMAX, num_experts, top_k, norm_topk_prob=norm)
    ids, weights = route(logits, config)
    ref_ids, ref_weights = reference_softmax(logits, top_k, norm)
    check_route(ids, weights, ref_ids, ref_weights, num_tokens, top_k)
    if norm and num_tokens:
        torch.testing.assert_close(weights.sum(dim=1), torch.ones(num_tokens))
    if not norm and top_k < num_experts and num_tokens:
        assert (weights.sum(dim=1) < 1).all()


def test_mixtral_example_by_hand() -> None:
    """Two tokens, four experts, k=2, renormalised: weights are a softmax over the top two."""
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0], [0.0, 0.0, 5.0, 5.5]])
    config = GateConfig(ScoringFunction.SOFTMAX, 4, 2, norm_topk_prob=True)
    ids, weights = route(logits, config)
    assert ids.tolist() == [[1, 2], [3, 2]]
    e = math.exp(1.0)
    f = math.exp(0.5)
    torch.testing.assert_close(weights, torch.tensor([[e / (e + 1), 1 / (e + 1)], [f / (f + 1), 1 / (f + 1)]]))


# (tokens, experts, k, groups, topk_groups, norm, scale, with_bias)
DEEPSEEK_CASES = [
    (9, 16, 4, 4, 2, True, 2.5, True),  # DeepSeek-V3 style at small scale
    (12, 32, 8, 8, 4, True, 2.5, True),
    (6, 32, 8, 8, 4, False, 1.0, True),
    (5, 16, 2, 4, 1, True, 1.0, True),  # one group: all k from it
    (8, 16, 4, 1, 1, True, 2.5, True),  # no grouping, bias only
    (8, 16, 4, 4, 2, True, 2.5, False),  # grouping, no bias
    (4, 8, 3, 1, 1, False, 1.0, False),  # plain sigmoid top-k
    (1, 8, 4, 2, 2, True, 1.5, True),  # all groups selected: grouping is a no-op
]


@pytest.mark.parametrize("num_tokens,num_experts,top_k,groups,topk_groups,norm,scale,with_bias", DEEPSEEK_CASES)
def test_sigmoid_grouped_topk(num_tokens, num_experts, top_k, groups, topk_groups, norm, scale, with_bias) -> None:
    gen = torch.Generator().manual_seed(num_tokens * 13 + num_experts + groups)
    logits = torch.randn(num_tokens, num_experts, generator=gen) * 2
    bias = torch.randn(num_experts, generator=gen) * 0.5 if with_bias else None
    config = GateConfig(
        ScoringFunction.SIGMOID,
        num_experts,
        top_k,
        norm_topk_prob=norm,
        num_groups=groups,
        topk_groups=topk_groups,
        routed_scaling_factor=scale,
        has_correction_bias=with_bias,
    )
    ids, weights = route(logits, config, bias)
    ref_ids, ref_weights = reference_deepseek(
        logits, bias.tolist() if bias is not None else None, top_k, groups, topk_groups, norm, scale
    )
    check_route(ids, weights, ref_ids, ref_weights, num_tokens, top_k)
    if norm and num_tokens:
        torch.testing.assert_close(weights.sum(dim=1), torch.full((num_tokens,), scale))


@pytest.mark.parametrize(
    "scoring,groups,topk_groups",
    [(ScoringFunction.SOFTMAX, 1, 1), (ScoringFunction.SIGMOID, 1, 1), (ScoringFunction.SIGMOID, 4, 2)],
)
def test_empty_batch_routes_to_empty_outputs(scoring, groups, topk_groups) -> None:
    """T=0 (a rank with no tokens this step) must give [0, k] outputs, as plan_dispatch accepts."""
    config = GateConfig(scoring, 16, 4, True, num_groups=groups, topk_groups=topk_groups)
    ids, weights = route(torch.zeros(0, 16), config, torch.zeros(16))
    assert ids.shape == (0, 4) and weights.shape == (0, 4)
    assert ids.dtype == torch.int64 and weights.dtype == torch.float32


def test_bias_chooses_but_does_not_weigh() -> None:
    """The bias must change selection for some tokens; weights stay the unbiased sigmoid."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(32, 16, generator=gen)
    bias = torch.randn(16, generator=gen)
    config = GateConfig(ScoringFunction.SIGMOID, 16, 4, norm_topk_prob=False, has_correction_bias=True)
    ids, weights = route(logits, config, bias)
    plain_ids, _ = route(logits, GateConfig(ScoringFunction.SIGMOID, 16, 4, norm_topk_prob=False))
    assert not torch.equal(ids, plain_ids)
    torch.testing.assert_close(weights, torch.sigmoid(logits).gather(1, ids))


def test_group_restriction_changes_choice() -> None:
    """Grouped top-k must differ from ungrouped top-k for some tokens, and stay inside groups."""
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(32, 32, generator=gen) * 2
    bias = torch.randn(32, generator=gen) * 0.5
    grouped = GateConfig(
        ScoringFunction.SIGMOID, 32, 8, True, num_groups=8, topk_groups=2,
        routed_scaling_factor=2.5, has_correction_bias=True,
    )
    flat = GateConfig(ScoringFunction.SIGMOID, 32, 8, True, routed_scaling_factor=2.5, has_correction_bias=True)
    ids, _ = route(logits, grouped, bias)
    flat_ids, _ = route(logits, flat, bias)
    assert not torch.equal(ids.sort(dim=1)[0], flat_ids.sort(dim=1)[0])
    groups_per_token = [len({e // 4 for e in row}) for row in ids.tolist()]
    assert max(groups_per_token) <= 2


def test_negative_biased_scores_still_pick_from_selected_groups() -> None:
    """With a large negative bias every biased score is < 0: masked experts must still lose."""
    logits = torch.zeros(1, 8)
    bias = torch.tensor([-5.0, -5.1, -5.2, -5.3, -1.0, -1.1, -1.2, -1.3])
    config = GateConfig(
        ScoringFunction.SIGMOID, 8, 2, True, num_groups=2, topk_groups=1, has_correction_bias=True
    )
    ids, weights = route(logits, config, bias)
    assert ids.tolist() == [[4, 5]]
    torch.testing.assert_close(weights, torch.tensor([[0.5, 0.5]]))


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(num_experts=8, top_k=0),
        dict(num_experts=8, top_k=9),
        dict(num_experts=8, top_k=2, num_groups=3),  # 8 not divisible into 3 groups
        dict(num_experts=8, top_k=2, num_groups=0),
        dict(num_experts=8, top_k=2, num_groups=4, topk_groups=0),
        dict(num_experts=8, top_k=2, num_groups=4, topk_groups=5),
        dict(num_experts=8, top_k=2, num_groups=8, topk_groups=2),  # 1 expert per group
        dict(num_experts=16, top_k=5, num_groups=4, topk_groups=1),  # 5 > 1 group * 4 experts
    ],
)
@pytest.mark.parametrize("scoring", list(ScoringFunction))
def test_gate_config_rejects(kwargs, scoring) -> None:
    with pytest.raises(ValueError):
        GateConfig(scoring, norm_topk_prob=True, **kwargs)


def test_gate_config_accepts_edges() -> None:
    """Configs at the edges of what is valid are accepted and route like the references."""
    gen = torch.Generator().manual_seed(9)
    # k == E: every expert, ordered by probability.
    logits = torch.randn(5, 8, generator=gen)
    config = GateConfig(ScoringFunction.SOFTMAX, 8, 8, True)
    check_route(*route(logits, config), *reference_softmax(logits, 8, True), 5, 8)
    # k == group size with one group kept: exactly the best group's experts.
    logits = torch.randn(5, 16, generator=gen)
    config = GateConfig(ScoringFunction.SIGMOID, 16, 4, True, num_groups=4, topk_groups=1)
    ids, weights = route(logits, config)
    check_route(ids, weights, *reference_deepseek(logits, None, 4, 4, 1, True, 1.0), 5, 4)
    assert all(len({e // 4 for e in row}) == 1 for row in ids.tolist())
    # DeepSeek-V3's own shape.
    logits, bias = torch.randn(3, 256, generator=gen), torch.randn(256, generator=gen) * 0.1
    config = GateConfig(ScoringFunction.SIGMOID, 256, 8, True, num_groups=8, topk_groups=4,
                        routed_scaling_factor=2.5, has_correction_bias=True)
    check_route(*route(logits, config, bias), *reference_deepseek(logits, bias.tolist(), 8, 8, 4, True, 2.5), 3, 8)
