"""A router warms its kernels before it can join the group (issue 34, item 5); runs on any machine.

FlashInfer compiles its attention modules on the first plan and run; on a router inside the
group that is the first step, with every worker waiting under its deadline. The router's
constructor runs the warm-up (``kernels/attention_flashinfer.warm_up_attention`` for every
kind of step, the native CPU kernels' build, cuBLAS's handle on CUDA) before ``join`` can be
called. On the CPU the attention backend is the generic SDPA path: the warm-up runs it for
real here, and the order (warm-up, then join) is what these tests check.
"""

from __future__ import annotations

import pytest
import torch

import raymoe.actors.router as router_module
from raymoe.actors.router import Router
from raymoe.engine.engine import EngineConfig
from raymoe.kernels.attention import AttentionSpec, SdpaAttention
from raymoe.kernels.attention_flashinfer import warm_up_attention
from raymoe.moe.model_config import AttentionKind
from ep_helpers import record_warm_up_then_join, single_worker_placement


def test_the_warm_up_runs_in_the_constructor_before_any_join(tiny_mixtral_dir, monkeypatch):
    events = record_warm_up_then_join(monkeypatch, router_module, "warm_up_attention")
    router = Router("router-0", tiny_mixtral_dir, EngineConfig(dtype="float32"), single_worker_placement(tiny_mixtral_dir),
                    [], "gloo", 10.0)
    assert events == ["warm-up"]
    assert router.experts.exchange is None and router._thread is None  # not in any group yet
    report = router.warm_up
    assert report["attention"]["backend"] == "sdpa"
    assert [step["step"] for step in report["attention"]["steps"]] == ["prompt", "chunk after context", "decodes"]
    assert report["native_cpu"] == "loaded" or report["native_cpu"].startswith("unavailable: ")
    assert "cublas" not in report and report["seconds"] >= report["attention"]["seconds"] > 0
    from raymoe.kernels.comm import new_rendezvous, CommBackend

    with pytest.raises(RuntimeError, match="stop here"):
        router.join(new_rendezvous(CommBackend.GLOO, host="127.0.0.1"), 0, [0])
    assert events == ["warm-up", "join"]


class RecordingBackend:
    """Stands in for FlashInfer: records every plan and checks each step's shapes."""

    name = "recording"

    def __init__(self, spec: AttentionSpec):
        self.spec = spec
        self.plans = []

    def plan(self, metadata, block_size):
        self.plans.append((metadata.query_lens.tolist(), metadata.context_lens.tolist()))
        spec = self.spec

        class Step:
            def attend(self, q, cache):
                assert q.shape[1:] == (spec.num_heads, spec.key_dim)
                return torch.zeros(q.shape[0], spec.num_heads, spec.value_dim, dtype=q.dtype)

        return Step()


def test_every_kind_of_step_is_planned_and_run_once():
    spec = AttentionSpec(AttentionKind.GQA, 8, 2, 64, 64, 64 ** -0.5, None)
    backend = RecordingBackend(spec)
    cache = tuple(torch.zeros(4, 16, 2, 64) for _ in range(2))
    report = warm_up_attention(backend, cache, 16, torch.bfloat16, torch.device("cpu"))
    assert backend.plans == [([3], [3]), ([2], [18]), ([1, 1], [17, 2])]  # prompt, chunk, decode batch
    assert report["backend"] == "recording" and len(report["steps"]) == 3
    single = RecordingBackend(spec)  # a cache of one block still warms a prompt and a decode
    warm_up_attention(single, tuple(t[:1] for t in cache), 16, torch.bfloat16, torch.device("cpu"))
    assert single.plans == [([3], [3]), ([1], [2])]


@pytest.mark.parametrize("spec", [
    AttentionSpec(AttentionKind.GQA, 4, 2, 32, 32, 32 ** -0.5, None),
    AttentionSpec(AttentionKind.GQA, 4, 2, 32, 32, 32 ** -0.5, 8),  # a sliding window
    AttentionSpec(AttentionKind.MLA, 4, 1, 48, 32, 48 ** -0.5, None),  # one latent row per token
], ids=["gqa", "gqa-window", "mla"])
def test_the_generic_backend_warms_up_for_real_and_leaves_the_cache_untouched(spec):
    rows = (spec.key_dim,) if spec.kind is AttentionKind.MLA else (spec.num_kv_heads, spec.key_dim)
    count = 1 if spec.kind is AttentionKind.MLA else 2
    cache = tuple(torch.randn(3, 16, *rows) for _ in range(count))
    before = [t.clone() for t in cache]
    report = warm_up_attention(SdpaAttention(spec, torch.float32, torch.device("cpu")), cache, 16, torch.float32,
                               torch.device("cpu"))
    assert report["backend"] == "sdpa" and len(report["steps"]) == 3
    assert all(torch.equal(a, b) for a, b in zip(cache, before))
