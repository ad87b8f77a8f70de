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


def single_worker_placement(model_dir: str) -> dict:
    """The checkpoint's experts all on one worker (contiguous), as a placement dict."""
    from raymoe.engine.hf_config import load_model_config
    from raymoe.moe.initial_placement import initial_placement

    config = load_model_config(model_dir)
    return initial_placement(num_layers=len(config.moe_layers), num_experts=config.num_experts, num_workers=1,
                             strategy="contiguous").to_dict()


def record_warm_up_then_join(monkeypatch, module, warm_up: str) -> list[str]:
    """In ``module`` (an actor's), record its call of ``warm_up`` (still run) and of
    ``make_communicator`` (the group's join, which raises, so a constructor stops there):
    the returned list fills with "warm-up" and "join" in the order they happen."""
    events: list[str] = []
    real_warm_up = getattr(module, warm_up)

    def recorded_warm_up(*args, **kwargs):
        events.append("warm-up")
        return real_warm_up(*args, **kwargs)

    def recorded_join(*args, **kwargs):
        events.append("join")
        raise RuntimeError("stop here: the test only needs the order")

    monkeypatch.setattr(module, warm_up, recorded_warm_up)
    monkeypatch.setattr(module, "make_communicator", recorded_join)
    return events
