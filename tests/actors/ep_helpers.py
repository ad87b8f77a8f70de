"""Helpers for expert-parallel tests: configs, the in-process reference, routing capture."""

from __future__ import annotations

import torch

from raymoe.cluster.config import parse_cluster_config
from raymoe.engine.engine import EngineConfig, LLMEngine
from raymoe.engine.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


def cluster_config(model: str, **fields):
    data = {"model": model, "device": "cpu", "dtype": "float32", "routers": 1, "expert_workers": 2}
    data.update(fields)
    return parse_cluster_config(data)


def prompts(count: int, seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(4, 300, (int(n),), generator=generator).tolist()
            for n in torch.randint(3, 24, (count,), generator=generator)]


class RecordingExperts:
    """Wraps the reference engine's experts and records each MoE layer's gate output."""

    def __init__(self, inner):
        self.inner = inner
        self.calls: list[tuple[int, torch.Tensor, torch.Tensor]] = []

    def forward(self, moe_layer, hidden, topk_ids, topk_weights):
        self.calls.append((moe_layer, topk_ids.clone(), topk_weights.clone()))
        return self.inner.forward(moe_layer, hidden, topk_ids, topk_weights)


def reference_engine(model: str) -> LLMEngine:
    engine = LLMEngine.from_pretrained(model, EngineConfig(dtype="float32"))
    engine.model.experts = RecordingExperts(engine.model.experts)
    return engine
