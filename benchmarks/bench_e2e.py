"""End-to-end generation: raymoe's in-process engine vs transformers ``generate()``.

~100 heterogeneous requests (prompt 4-64 tokens, output 8-64 tokens, EOS ignored, greedy)
on a mid-sized random Mixtral (hidden 256, 4 layers, 8 experts, top-2, intermediate 512).
transformers runs static batches of 32 (left-padded; each batch runs to its longest
output); raymoe batches continuously. Start-up is excluded from both. Prints the ratio.

    python benchmarks/bench_e2e.py [--requests 100] [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import tempfile
import time

import torch

from common import build_mixtral, machine_description, workload
from raymoe.engine.engine import EngineConfig, LLMEngine
from raymoe.engine.sampling_params import SamplingParams


def run_raymoe(path: str, requests, dtype: str) -> tuple[float, int, list[list[int]]]:
    engine = LLMEngine.from_pretrained(path, EngineConfig(dtype=dtype))
    engine.generate([requests[0][0]], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))  # warm-up
    started = time.perf_counter()
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for _, n in requests]
    outputs = engine.generate([p for p, _ in requests], params)
    elapsed = time.perf_counter() - started
    return elapsed, sum(len(o.output_token_ids) for o in outputs), [o.output_token_ids for o in outputs]


def run_transformers(model, requests, batch_size: int) -> tuple[float, int, list[list[int]]]:
    outputs: list[list[int]] = []
    with torch.inference_mode():
        model.generate(torch.tensor([requests[0][0]]), max_new_tokens=2, do_sample=False)  # warm-up
        started = time.perf_counter()
        for begin in range(0, len(requests), batch_size):
            batch = requests[begin : begin + batch_size]
            width = max(len(p) for p, _ in batch)
            ids = torch.full((len(batch), width), 3, dtype=torch.int64)
            mask = torch.zeros((len(batch), width), dtype=torch.int64)
            for row, (prompt, _) in enumerate(batch):
                ids[row, width - len(prompt):] = torch.tensor(prompt)
                mask[row, width - len(prompt):] = 1
            generated = model.generate(
                ids, attention_mask=mask, max_new_tokens=max(n for _, n in batch), do_sample=False
            )
            outputs.extend(generated[row, width : width + n].tolist() for row, (_, n) in enumerate(batch))
        elapsed = time.perf_counter() - started
    return elapsed, sum(len(o) for o in outputs), outputs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=100)
    parser.add_argument("--batch-size", type=int, default=32, help="transformers static batch size")
    parser.add_argument("--profile", action="store_true", help="cProfile raymoe's run and print the top costs")
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="both sides")
    parser.add_argument("--threads", type=int, default=None, help="torch threads for both (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    requests = workload(args.requests)
    with tempfile.TemporaryDirectory() as path:
        model = build_mixtral(path)
        if args.profile:
            profiler = cProfile.Profile()
            profiler.enable()
        ours, ours_tokens, ours_out = run_raymoe(path, requests, args.dtype)
        if args.profile:
            profiler.disable()
            pstats.Stats(profiler).sort_stats("cumulative").print_stats(25)
        print(f"machine: {machine_description()}; dtype {args.dtype}")
        print(f"raymoe:       {ours:7.2f} s  {ours_tokens / ours:8.1f} output tok/s  ({ours_tokens} tokens)")
        if args.skip_transformers:
            return
        model = model.to(getattr(torch, args.dtype))
        theirs, theirs_tokens, theirs_out = run_transformers(model, requests, args.batch_size)
        print(f"transformers: {theirs:7.2f} s  {theirs_tokens / theirs:8.1f} output tok/s  (static batches of {args.batch_size})")
        same = sum(a == b for a, b in zip(ours_out, theirs_out))
        print(f"speed-up raymoe / transformers: {theirs / ours:.2f}x   identical greedy outputs: {same}/{len(requests)}")


if __name__ == "__main__":
    main()
