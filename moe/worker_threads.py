"""How many threads a CPU expert worker runs a layer's experts on when the cluster config leaves
``cpu.worker_threads`` unset: 2 where one expert's weights take ``LARGE_EXPERT_BYTES`` or more,
else 1.

A worker's second thread takes some of the layer's experts (engine/experts.py::run_rows: whole
experts, the same kernel calls, so the outputs never depend on it). It pays where a token's
experts are few and each is long to read: at one decoding sequence a token's top-k experts often
fall on one worker (Mixtral-8x7B's 2 of 8 over 2 workers: both on one in 3 of 7 layers), which
then reads them on one core while the other worker's core waits. Measured on the 2-vCPU EPYC of
docs/BENCHMARKS.md, 1 router x 2 workers, bf16, served over HTTP (benchmarks/bench_vs_vllm.py,
16 random prompts of 128 tokens, 32 out), the two settings alternating twice:
- Mixtral-8x7B's shapes (an expert 352 MB): TPOT P50 at concurrency 1 77.4 / 75.8 ms on 2 threads
  against 96.2 / 92.1 on 1; output tok/s at 16: 47.5 / 46.9 against 44.4 / 39.0;
- Qwen3-30B-A3B's (9.4 MB): no gain at 1 (TPOT 79.2 vs 79.4 ms) and a loss at 16 (51.4 vs
  57.6 tok/s); the f32 toy (0.8 MB): a loss (served 1x1 1,679 vs 1,815 tok/s).
An expert of ``LARGE_EXPERT_BYTES`` takes ~4 ms to read at this machine's ~16 GB/s a core: a
thread hand-off (~0.1 ms) is small beside it.
"""

from __future__ import annotations

LARGE_EXPERT_BYTES = 64 << 20


def default_worker_threads(hidden_size: int, moe_intermediate_size: int, bytes_per_value: int) -> int:
    """Threads for a worker's experts: 2 where one expert (gate, up and down projections) takes
    ``LARGE_EXPERT_BYTES`` or more in the serving dtype, else 1."""
    return 2 if 3 * hidden_size * moe_intermediate_size * bytes_per_value >= LARGE_EXPERT_BYTES else 1
