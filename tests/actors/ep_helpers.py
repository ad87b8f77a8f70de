"""Helpers for expert-parallel tests: configs, the in-process reference, routing capture."""

from __future__ import annotations

import time

import ray
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


def wait_until(condition, timeout_s: float, what: str, interval_s: float = 0.05):
    """Poll ``condition`` every ``interval_s`` until it returns something true (returned), failing
    the test after ``timeout_s`` with ``what``."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        assert time.monotonic() < deadline, f"not within {timeout_s} s: {what}"
        time.sleep(interval_s)


def rank_states(deployment) -> dict:
    """The controller's rank watch report (actors/rank_watch.py)."""
    return ray.get(deployment.controller.rank_states.remote(), timeout=30)


def by_rank(report: dict) -> dict[str, dict]:
    return {row["rank"]: row for row in report["ranks"]}
