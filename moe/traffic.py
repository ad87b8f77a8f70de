"""Synthetic router traffic: expert popularity and sampled top-k routing.

Legend: L MoE layers, E logical experts, T tokens, k experts per token (top-k),
Ns time steps of a drifting workload.

Popularity is a probability per expert per layer. Routing draws each token's k distinct
experts without replacement in proportion to popularity (Gumbel top-k, which is exactly
sequential sampling without replacement). Kinds:

- uniform: every expert equally likely.
- zipf: the expert of rank r gets weight r^-s; ranks are shuffled per layer, so different
  layers have different hot experts.
- hot: ``num_hot`` experts share ``hot_fraction`` of the mass; the rest share the remainder.
- domain_mix: a mix of ``num_domains`` Zipf profiles, each with its own hot experts, as when
  code, chat and math requests share a batch.
Drift moves popularity over time from one draw of the spec to another.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import numpy as np


class TrafficKind(enum.Enum):
    UNIFORM = "uniform"
    ZIPF = "zipf"
    HOT = "hot"
    DOMAIN_MIX = "domain_mix"


@dataclass(frozen=True)
class TrafficSpec:
    kind: TrafficKind = TrafficKind.UNIFORM
    zipf_s: float = 1.0
    num_hot: int = 2
    hot_fraction: float = 0.5
    num_domains: int = 3

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", TrafficKind(self.kind))
        if self.zipf_s < 0:
            raise ValueError(f"zipf_s must be >= 0, got {self.zipf_s}")
        if not 0 <= self.hot_fraction <= 1:
            raise ValueError(f"hot_fraction must be in [0, 1], got {self.hot_fraction}")
        if self.num_hot < 1 or self.num_domains < 1:
            raise ValueError("num_hot and num_domains must be >= 1")


def zipf_weights(num_experts: int, exponent: float) -> np.ndarray:
    """[E] rank-ordered Zipf probabilities, rank 1 first."""
    weights = np.arange(1, num_experts + 1, dtype=np.float64) ** -exponent
    return weights / weights.sum()


def _one_layer(spec: TrafficSpec, num_experts: int, rng: np.random.Generator) -> np.ndarray:
    if spec.kind is TrafficKind.UNIFORM:
        return np.full(num_experts, 1.0 / num_experts)
    if spec.kind is TrafficKind.ZIPF:
        return rng.permutation(zipf_weights(num_experts, spec.zipf_s))
    if spec.kind is TrafficKind.HOT:
        if spec.num_hot >= num_experts:
            raise ValueError(f"num_hot={spec.num_hot} must be below the {num_experts} experts")
        cold = (1.0 - spec.hot_fraction) / (num_experts - spec.num_hot)
        weights = np.full(num_experts, cold)
        weights[rng.choice(num_experts, spec.num_hot, replace=False)] = spec.hot_fraction / spec.num_hot
        return weights
    domains = np.stack([rng.permutation(zipf_weights(num_experts, spec.zipf_s)) for _ in range(spec.num_domains)])
    mix = rng.dirichlet(np.ones(spec.num_domains))
    return mix @ domains


def popularity(spec: TrafficSpec, num_layers: int, num_experts: int, rng: np.random.Generator) -> np.ndarray:
    """[L, E] expert probabilities; each row sums to 1."""
    if num_layers < 1 or num_experts < 1:
        raise ValueError(f"need layers >= 1 and experts >= 1, got {num_layers}, {num_experts}")
    rows = np.stack([_one_layer(spec, num_experts, rng) for _ in range(num_layers)])
    return rows / rows.sum(axis=1, keepdims=True)


def drifting_popularity(
    spec: TrafficSpec,
    num_layers: int,
    num_experts: int,
    num_steps: int,
    rng: np.random.Generator,
    drift: float = 1.0,
) -> np.ndarray:
    """[Ns, L, E] popularity moving linearly from one draw of ``spec`` towards another.

    drift: how far along the way the last step is (0: no drift, 1: the new hot set).
    """
    if num_steps < 1 or not 0 <= drift <= 1:
        raise ValueError(f"need num_steps >= 1 and drift in [0, 1], got {num_steps}, {drift}")
    start = popularity(spec, num_layers, num_experts, rng)
    end = popularity(spec, num_layers, num_experts, rng)
    fraction = drift * np.linspace(0.0, 1.0, num_steps)[:, None, None] if num_steps > 1 else np.zeros((1, 1, 1))
    return (1.0 - fraction) * start[None] + fraction * end[None]


def sample_routing(
    probabilities: np.ndarray, num_tokens: int, top_k: int, rng: np.random.Generator
) -> np.ndarray:
    """Top-k routing for every layer. probabilities: [L, E]. Returns expert ids [L, T, k].

    Each token gets k distinct experts, drawn without replacement in proportion to
    popularity (Gumbel top-k).
    """
    probabilities = np.asarray(probabilities, dtype=np.float64)
    if probabilities.ndim != 2:
        raise ValueError(f"probabilities must be [layers, experts], got {probabilities.shape}")
    num_experts = probabilities.shape[1]
    if not 1 <= top_k <= num_experts or num_tokens < 0:
        raise ValueError(f"need 1 <= top_k <= {num_experts} and num_tokens >= 0")
    with np.errstate(divide="ignore"):
        log_probability = np.log(probabilities)  # [L, E]
    keys = log_probability[:, None, :] + rng.gumbel(size=(probabilities.shape[0], num_tokens, num_experts))
    return np.argsort(-keys, axis=2)[:, :, :top_k]  # [L, T, k]


def routing_to_load(topk_ids: np.ndarray, num_experts: int) -> np.ndarray:
    """[L, T, k] expert ids -> [L, E] assignments per expert."""
    num_layers = topk_ids.shape[0]
    load = np.zeros((num_layers, num_experts), dtype=np.int64)
    for layer in range(num_layers):
        load[layer] = np.bincount(topk_ids[layer].reshape(-1), minlength=num_experts)
    return load


def sample_load(probabilities: np.ndarray, num_tokens: int, top_k: int, rng: np.random.Generator) -> np.ndarray:
    """[L, E] assignment counts of ``num_tokens`` routed tokens."""
    return routing_to_load(sample_routing(probabilities, num_tokens, top_k, rng), np.asarray(probabilities).shape[1])
