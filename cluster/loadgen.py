"""The load generator of `raymoe bench`: a workload, and streaming requests against an
OpenAI-compatible ``/v1/completions`` endpoint, closed or open loop.

Closed loop: ``concurrency`` clients, each sending its next request when the previous one
ends. Open loop: requests sent at Poisson arrival times of ``request_rate`` per second,
whatever is in flight. Both stop at the last request or at ``max_seconds``, when requests
still in flight are cancelled and counted as failed and the rest as not sent.

Each request streams (``stream``, ``ignore_eos``, ``return_token_ids``, ``max_tokens`` = its
drawn output length, greedy) so the client sees every token-carrying chunk arrive.
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
import time
from dataclasses import dataclass
from typing import Any, Sequence

from raymoe.cluster.bench_report import RequestResult


@dataclass(frozen=True)
class BenchRequest:
    prompt: str | list[int]  # text, or token ids
    max_tokens: int

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt) if isinstance(self.prompt, list) else len(self.prompt.split())


@dataclass(frozen=True)
class LengthDistribution:
    """``N`` (fixed), ``LO:HI`` or ``uniform:LO:HI`` (integers, inclusive), ``normal:MEAN:STD``."""

    kind: str
    a: float
    b: float

    @classmethod
    def parse(cls, text: str) -> "LengthDistribution":
        parts = text.split(":")
        try:
            if len(parts) == 1:
                return cls._checked("fixed", int(parts[0]), int(parts[0]), text)
            if len(parts) == 2:
                return cls._checked("uniform", int(parts[0]), int(parts[1]), text)
            if len(parts) == 3 and parts[0] in ("uniform", "normal"):
                kind = parts[0]
                cast = int if kind == "uniform" else float
                return cls._checked(kind, cast(parts[1]), cast(parts[2]), text)
        except ValueError:
            pass
        raise ValueError(f"length {text!r}: expected N, LO:HI, uniform:LO:HI or normal:MEAN:STD")

    @classmethod
    def _checked(cls, kind: str, a: float, b: float, text: str) -> "LengthDistribution":
        if a < 1 or (kind != "normal" and b < a) or b < 0:
            raise ValueError(f"length {text!r}: lengths must be >= 1 and LO <= HI")
        return cls(kind, a, b)

    def sample(self, rng: random.Random) -> int:
        if self.kind == "fixed":
            return int(self.a)
        if self.kind == "uniform":
            return rng.randint(int(self.a), int(self.b))
        return max(1, round(rng.gauss(self.a, self.b)))


def synthetic_workload(num_requests: int, prompt_len: LengthDistribution, output_len: LengthDistribution,
                       vocab_size: int, seed: int) -> list[BenchRequest]:
    """Token-id prompts with ids uniform in [4, vocab_size) (clear of the usual special ids)."""
    if vocab_size <= 4:
        raise ValueError(f"vocab size must be > 4, got {vocab_size}")
    rng = random.Random(seed)
    requests = []
    for _ in range(num_requests):
        prompt = [rng.randrange(4, vocab_size) for _ in range(prompt_len.sample(rng))]
        requests.append(BenchRequest(prompt, output_len.sample(rng)))
    return requests


def read_workload(path: str, num_requests: int | None, default_max_tokens: int) -> list[BenchRequest]:
    """JSONL: one ``{"prompt": "text" | [ids], "max_tokens": N}`` per line (max_tokens optional)."""
    requests = []
    with open(path) as handle:
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
                prompt, max_tokens = item["prompt"], int(item.get("max_tokens", default_max_tokens))
            except (ValueError, KeyError, TypeError) as error:
                raise ValueError(f"{path}:{number}: expected {{\"prompt\": ..., \"max_tokens\": N}}: {error}")
            if not (isinstance(prompt, str) or (isinstance(prompt, list) and all(isinstance(t, int) for t in prompt))):
                raise ValueError(f"{path}:{number}: prompt must be a string or a list of token ids")
            if max_tokens < 1:
                raise ValueError(f"{path}:{number}: max_tokens must be >= 1")
            requests.append(BenchRequest(prompt, max_tokens))
            if num_requests is not None and len(requests) == num_requests:
                break
    if not requests:
        raise ValueError(f"{path}: no requests")
    return requests


def poisson_arrivals(num_requests: int, rate: float, seed: int) -> list[float]:
    """Send times (s from the start) with exponential gaps of mean ``1 / rate``."""
    rng = random.Random(seed + 1)
    now, times = 0.0, []
    for _ in range(num_requests):
        times.append(now)
        now += rng.expovariate(rate)
    return times


class ProgressBar:
    """``[#####-----] 5/10 ok 5 failed 0 3.1 s`` on one stderr line, redrawn at most 5 times a second."""

    def __init__(self, total: int, label: str = "", stream=None, enabled: bool = True):
        self.total, self.label, self.stream, self.enabled = total, label, stream or sys.stderr, enabled
        self.ok = self.failed = 0
        self.started = time.monotonic()
        self.drawn = 0.0

    def update(self, ok: bool) -> None:
        self.ok += ok
        self.failed += not ok
        if time.monotonic() - self.drawn >= 0.2 or self.ok + self.failed == self.total:
            self.draw()

    def draw(self) -> None:
        if not self.enabled:
            return
        done = self.ok + self.failed
        filled = 30 * done // max(self.total, 1)
        self.stream.write(f"\r{self.label}[{'#' * filled}{'-' * (30 - filled)}] {done}/{self.total} "
                          f"ok {self.ok} failed {self.failed} {time.monotonic() - self.started:.1f} s")
        self.stream.flush()
        self.drawn = time.monotonic()

    def close(self) -> None:
        if self.enabled:
            if self.ok + self.failed < self.total:
                self.draw()
            self.stream.write("\n")
            self.stream.flush()


async def _one(session, url: str, body: dict[str, Any], result: RequestResult, clock) -> None:
    """Send one streaming request and record, into ``result``, when each token-carrying chunk came."""
    result.sent_s = clock()
    try:
        async with session.post(f"{url}/v1/completions", json=body) as response:
            if response.status != 200:
                result.error = f"HTTP {response.status}: {(await response.text())[:200]}"
                return
            async for raw in response.content:
                line = raw.decode().strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = f"stream error: {chunk['error'].get('message', chunk['error'])}"[:200]
                    return
                for choice in chunk.get("choices", []):
                    num_tokens = len(choice.get("token_ids") or [])
                    if num_tokens:
                        result.chunk_times_s.append(clock())
                        result.output_tokens += num_tokens
            result.done_s = clock()
    except asyncio.CancelledError:
        result.error = "cancelled at the time limit"
        raise
    except Exception as error:  # a refused connection or a broken stream fails this request only
        result.error = f"{type(error).__name__}: {error}"[:200]


def request_body(model: str, request: BenchRequest) -> dict[str, Any]:
    return {"model": model, "prompt": request.prompt, "max_tokens": request.max_tokens, "temperature": 0.0,
            "stream": True, "ignore_eos": True, "return_token_ids": True}


async def _run(url: str, model: str, requests: Sequence[BenchRequest], concurrency: int | None,
               request_rate: float | None, max_seconds: float, seed: int, warmup: int,
               progress: ProgressBar | None, request_timeout_s: float) -> tuple[list[RequestResult], int]:
    import aiohttp

    timeout = aiohttp.ClientTimeout(total=request_timeout_s)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        for request in list(requests)[:warmup]:  # excluded from the figures
            await _one(session, url, request_body(model, request), RequestResult(0, 0), time.perf_counter)
        started = time.perf_counter()
        clock = lambda: time.perf_counter() - started  # noqa: E731
        results: list[RequestResult] = []

        async def send(request: BenchRequest) -> None:
            result = RequestResult(request.num_prompt_tokens, request.max_tokens)
            results.append(result)
            try:
                await _one(session, url, request_body(model, request), result, clock)
            finally:
                if progress:
                    progress.update(result.ok)

        pending = list(requests)
        tasks: list[asyncio.Task] = []
        if request_rate is None:  # closed loop
            async def client() -> None:
                while pending and clock() < max_seconds:
                    await send(pending.pop(0))

            tasks = [asyncio.ensure_future(client()) for _ in range(min(concurrency or 1, len(pending)))]
        else:  # open loop
            for at in poisson_arrivals(len(pending), request_rate, seed):
                if at >= max_seconds:
                    break
                await asyncio.sleep(max(0.0, at - clock()))
                tasks.append(asyncio.ensure_future(send(pending.pop(0))))
        _, late = await asyncio.wait(tasks, timeout=max(0.0, max_seconds - clock())) if tasks else (set(), set())
        for task in late:
            task.cancel()
        await asyncio.gather(*late, return_exceptions=True)
        return results, len(pending)


def run_load(url: str, model: str, requests: Sequence[BenchRequest], *, concurrency: int | None = None,
             request_rate: float | None = None, max_seconds: float = 600.0, seed: int = 0, warmup: int = 1,
             progress: ProgressBar | None = None,
             request_timeout_s: float = 600.0) -> tuple[list[RequestResult], int]:
    """Run the workload; returns the sent requests' results and how many were never sent.

    Exactly one of ``concurrency`` (closed loop) and ``request_rate`` (open loop) is set.
    """
    if (concurrency is None) == (request_rate is None):
        raise ValueError("set exactly one of concurrency (closed loop) and request_rate (open loop)")
    if concurrency is not None and concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    if request_rate is not None and request_rate <= 0:
        raise ValueError(f"request rate must be > 0, got {request_rate}")
    return asyncio.run(_run(url.rstrip("/").removesuffix("/v1"), model, requests, concurrency, request_rate,
                            max_seconds, seed, warmup, progress, request_timeout_s))


def served_model(url: str, timeout_s: float = 30.0) -> str:
    """The first model id at ``URL/v1/models``."""
    import urllib.request

    base = url.rstrip("/").removesuffix("/v1")
    with urllib.request.urlopen(f"{base}/v1/models", timeout=timeout_s) as response:
        return json.loads(response.read())["data"][0]["id"]
