"""torch._grouped_mm needs torch 2.8 and an sm90 GPU; elsewhere bfloat16 experts take the
per-slot loop, and the log says so once per process, with the reason (issue 34, item 8)."""

from __future__ import annotations

import logging

import pytest

from raymoe.kernels import expert_mlp
from raymoe.kernels.expert_mlp import grouped_mm_unavailable


@pytest.mark.parametrize("version, has, capability, expected", [
    ("2.9.0", True, (9, 0), None),
    ("2.9.0", True, (10, 0), None),
    ("2.7.1", False, (9, 0), "torch 2.7.1 has no torch._grouped_mm (torch 2.8 or later has it)"),
    ("2.9.0", True, (8, 0), "this GPU is sm80; torch._grouped_mm needs sm90 (H100/H200) or later"),
])
def test_why_grouped_mm_is_off(version, has, capability, expected):
    assert grouped_mm_unavailable(version, has, capability) == expected


def test_the_fallback_is_logged_once(monkeypatch, caplog):
    monkeypatch.setattr(expert_mlp, "_fallback_logged", False)
    with caplog.at_level(logging.WARNING, logger="raymoe.kernels"):
        expert_mlp._log_fallback_once("this GPU is sm80")
        expert_mlp._log_fallback_once("this GPU is sm80")
    lines = [r.getMessage() for r in caplog.records if "torch._grouped_mm" in r.getMessage()]
    assert lines == ["bfloat16 experts run one GEMM pair per slot, not torch._grouped_mm: this GPU is sm80"]
