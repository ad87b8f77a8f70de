"""Long contexts on the in-process engine: chunked prefill and prefix caching.

A benchmark, not a timed test: it prints numbers measured in one run, it asserts nothing.
No Ray: one :class:`~raymoe.engine.engine.LLMEngine` in this process, on the CPU, over a
random-weight demo Mixtral whose context is raised to 4,096 positions.

(a) **Chunked prefill.** 16 streams decode (32-token prompts); after ``--warm-steps`` steps
    4 prompts of 1,500 tokens arrive at once. A stream's ITL is the time between two of its
    tokens. Reported: the streams' ITL p50 before the prompts arrived, and their ITL p99
    from the arrival until all 4 prompts have their first token; once with the token
    budget (``--chunk``, the CPU default 512) and once without chunking (a budget that
    holds every prompt whole: the 4 prefills run in one step), both unpaced; and paced
    (``--slowdown``, the default ``engine.prefill_step_slowdown`` 2: prompt chunks sized from
    measured step times, engine/prefill_pacer.py). Goal: p99 during < 3x p50 before.
(b) **Prefix caching.** 32 requests share a 1,000-token prefix and differ in a 24-token
    suffix; they arrive one after another (each when the previous one has its first
    token: the prefix is cached by then), ``max_tokens=1``. Reported: TTFT of the first,
    TTFT p50 of requests 2-32, and their ratio, with prefix caching on and off. Goal: <= 0.3.

Clocks: ``--clock cpu`` (the default) times the engine in CPU seconds of this thread, with
torch on one thread, so what other processes on a shared machine do moves it little (it
still counts work, not waiting); ``--clock wall`` times it in wall seconds, with torch's
default threads, as a client would see it on an otherwise idle machine.

Run: ``python benchmarks/bench_long_context.py [--chunk 512 256 128]`` (a few minutes).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import machine_description  # noqa: E402

from raymoe.engine.demo_model import write_demo_model  # noqa: E402
from raymoe.engine.engine import EngineConfig, LLMEngine  # noqa: E402
from raymoe.engine.sampling_params import SamplingParams  # noqa: E402
from raymoe.engine.scheduler import SchedulerConfig  # noqa: E402

CONTEXT = 4096
VOCAB = 512


def write_long_context_model(path: str) -> str:
    """The demo Mixtral with 4,096 positions (its RoPE tables are built from this field)."""
    write_demo_model(path, "mixtral", vocab_size=VOCAB)
    config_path = os.path.join(path, "config.json")
    with open(config_path, encoding="utf-8") as handle:
        config = json.load(handle)
    config["max_position_embeddings"] = CONTEXT
    with open(config_path, "w", encoding="utf-8") as handle:
        json.dump(config, handle, indent=2)
    return path


def random_prompt(rng: random.Random, length: int) -> list[int]:
    return [rng.randrange(4, VOCAB) for _ in range(length)]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def make_engine(path: str, budget: int, prefix_caching: bool, slowdown: float = 0) -> LLMEngine:
    return LLMEngine.from_pretrained(path, EngineConfig(
        dtype="float32", kv_cache_bytes=64 << 20, enable_prefix_caching=prefix_caching,
        scheduler=SchedulerConfig(max_num_batched_tokens=budget, prefill_step_slowdown=slowdown)))


def streams_itl(path: str, budget: int, warm_steps: int, clock, seed: int = 0, slowdown: float = 0) -> dict[str, float]:
    """(a): the 16 streams' ITL p50 before the long prompts and p99 while they prefill."""
    rng = random.Random(seed)
    engine = make_engine(path, budget, prefix_caching=False, slowdown=slowdown)
    stream_params = SamplingParams(max_tokens=10_000 // 4, temperature=0.0, ignore_eos=True)
    for index in range(16):
        engine.add_request(f"stream-{index}", random_prompt(rng, 32), stream_params)
    last: dict[str, float] = {}
    before: list[float] = []
    during: list[float] = []
    long_ids = [f"long-{index}" for index in range(4)]
    first_token: set[str] = set()
    step = 0
    while len(first_token) < len(long_ids):
        if step == warm_steps:  # the streams decode steadily: the long prompts arrive
            for request_id in long_ids:
                engine.add_request(request_id, random_prompt(rng, 1500), SamplingParams(max_tokens=4, temperature=0.0))
        outputs = engine.step()
        now = clock()
        for output in outputs:
            if output.request_id in long_ids:
                first_token.add(output.request_id)
            elif output.request_id in last:
                itl = now - last[output.request_id]
                if step >= warm_steps:
                    during.append(itl)
                elif step >= 3:  # past the streams' own prefill
                    before.append(itl)
            last[output.request_id] = now
        step += 1
        if step > warm_steps + 10_000:
            raise RuntimeError("the long prompts never got their first token")
    return {"itl_p50_before_ms": 1e3 * statistics.median(before), "itl_p99_during_ms": 1e3 * percentile(during, 0.99),
            "steps_to_prefill": step - warm_steps}


def shared_prefix_ttft(path: str, prefix_caching: bool, clock, seed: int = 0) -> dict[str, float]:
    """(b): TTFT of the first request and p50 of requests 2-32, arriving one after another."""
    rng = random.Random(seed)
    engine = make_engine(path, 512, prefix_caching)
    prefix = random_prompt(rng, 1000)
    ttfts = []
    for index in range(32):
        started = clock()
        engine.add_request(f"shared-{index}", prefix + random_prompt(rng, 24), SamplingParams(max_tokens=1))
        while not engine.step():
            pass
        ttfts.append(clock() - started)
    stats = engine.prefix_cache_stats()
    return {"ttft_first_ms": 1e3 * ttfts[0], "ttft_p50_rest_ms": 1e3 * statistics.median(ttfts[1:]),
            "ratio": statistics.median(ttfts[1:]) / ttfts[0], "hit_rate": stats.hit_rate}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chunk", type=int, nargs="+", default=[512], help="token budgets per step to run (a)")
    parser.add_argument("--slowdown", type=float, nargs="+", default=[2.0],
                        help="engine.prefill_step_slowdown values to run (a) with (the default pacing is 2)")
    parser.add_argument("--clock", choices=("cpu", "wall"), default="cpu", help="see the module docstring")
    parser.add_argument("--warm-steps", type=int, default=30, help="decode steps before the long prompts arrive")
    args = parser.parse_args()
    clock = time.perf_counter
    if args.clock == "cpu":
        torch.set_num_threads(1)
        clock = time.thread_time
    print(f"machine: {machine_description()}; load average {os.getloadavg()[0]:.1f}; clock: {args.clock}")
    with tempfile.TemporaryDirectory() as tmp, torch.inference_mode():
        path = write_long_context_model(os.path.join(tmp, "model"))
        make_engine(path, 512, False).generate([random_prompt(random.Random(1), 600)],
                                                      SamplingParams(max_tokens=2))  # warm-up
        print("(a) 16 decoding streams, then 4 prompts of 1,500 tokens")
        runs = ([(f"paced (slowdown {slowdown:g}, budget 512)", 512, slowdown) for slowdown in args.slowdown]
                + [(f"chunked ({chunk} tokens/step)", chunk, 0) for chunk in args.chunk]
                + [("unchunked", 16 + 4 * 1500, 0)])
        for name, budget, slowdown in runs:
            r = streams_itl(path, budget, args.warm_steps, clock, slowdown=slowdown)
            print(f"  {name:34s} ITL p50 before {r['itl_p50_before_ms']:7.1f} ms   p99 during "
                  f"{r['itl_p99_during_ms']:7.1f} ms   ratio {r['itl_p99_during_ms'] / r['itl_p50_before_ms']:5.2f}"
                  f"   ({r['steps_to_prefill']} steps until every long prompt had a token)")
        print("(b) 32 requests sharing a 1,000-token prefix, arriving one after another")
        for caching in (True, False):
            r = shared_prefix_ttft(path, caching, clock)
            print(f"  prefix caching {'on ' if caching else 'off'}  TTFT first {r['ttft_first_ms']:7.1f} ms   "
                  f"p50 of 2-32 {r['ttft_p50_rest_ms']:7.1f} ms   ratio {r['ratio']:5.2f}   "
                  f"hit rate {r['hit_rate']:.2f}")
    print(f"load average after: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
