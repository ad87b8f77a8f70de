"""cpu.worker_threads left unset: a worker's threads by its experts' size (moe/worker_threads.py)."""

from __future__ import annotations

from raymoe.moe.worker_threads import LARGE_EXPERT_BYTES, default_worker_threads


def test_large_experts_get_a_second_thread_and_small_ones_do_not():
    assert default_worker_threads(4096, 14336, 2) == 2  # Mixtral-8x7B in bf16: 352 MB an expert
    assert default_worker_threads(2048, 768, 2) == 1  # Qwen3-30B-A3B in bf16: 9.4 MB
    assert default_worker_threads(2048, 768, 4) == 1  # the same in float32: 18.9 MB
    assert default_worker_threads(256, 512, 4) == 1  # the toy checkpoint of docs/BENCHMARKS.md


def test_the_boundary_is_one_experts_three_projections():
    hidden = 4096
    inter = -(-LARGE_EXPERT_BYTES // (3 * hidden * 2))  # the smallest bf16 expert of LARGE_EXPERT_BYTES or more
    assert 3 * hidden * (inter - 1) * 2 < LARGE_EXPERT_BYTES <= 3 * hidden * inter * 2
    assert default_worker_threads(hidden, inter, 2) == 2
    assert default_worker_threads(hidden, inter - 1, 2) == 1
    assert default_worker_threads(hidden, -(-inter // 2), 4) == 2  # float32 doubles the bytes
