"""`raymoe bench`'s workload and load generator, against a fake streaming endpoint whose
timing and failures the test controls (no Ray)."""

from __future__ import annotations

import asyncio
import json
import random
import threading

import pytest
from aiohttp import web

from raymoe.cluster.loadgen import (
    BenchRequest,
    LengthDistribution,
    ProgressBar,
    poisson_arrivals,
    read_workload,
    run_load,
    served_model,
    synthetic_workload,
)

GAP_S = 0.05  # the fake server's pause between tokens
# Requests with prompt [3] wait until `expected` of them are in flight at once (or fail after
# BARRIER_TIMEOUT_S): a request that finishes proves they overlapped, with no timing luck.
BARRIER = {"expected": 0, "arrived": 0, "event": None}
BARRIER_TIMEOUT_S = 10.0


async def completions(request: web.Request) -> web.StreamResponse:
    body = await request.json()
    assert body["stream"] and body["ignore_eos"] and body["return_token_ids"]
    if body["prompt"] == [1]:
        return web.json_response({"error": {"message": "bad prompt"}}, status=400)
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    if body["prompt"] == [3]:
        if BARRIER["event"] is None:
            BARRIER["event"] = asyncio.Event()
        BARRIER["arrived"] += 1
        if BARRIER["arrived"] >= BARRIER["expected"]:
            BARRIER["event"].set()
        try:
            await asyncio.wait_for(BARRIER["event"].wait(), BARRIER_TIMEOUT_S)
        except asyncio.TimeoutError:
            await response.write(b'data: {"error": {"message": "the requests never overlapped"}}\n\n')
            return response
    for index in range(body["max_tokens"]):
        await asyncio.sleep(GAP_S)
        if body["prompt"] == [2] and index == 1:
            await response.write(b'data: {"error": {"message": "step failed"}}\n\n')
            return response
        chunk = {"choices": [{"index": 0, "text": "x", "token_ids": [7]}]}
        await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
    await response.write(b"data: [DONE]\n\n")
    return response


@pytest.fixture(scope="module")
def fake_url():
    loop = asyncio.new_event_loop()
    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", lambda _: web.json_response({"data": [{"id": "fake"}]}))
    runner = web.AppRunner(app)
    loop.run_until_complete(runner.setup())
    site = web.TCPSite(runner, "127.0.0.1", 0)
    loop.run_until_complete(site.start())
    port = site._server.sockets[0].getsockname()[1]
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{port}/v1"
    asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)


@pytest.mark.parametrize("text, kind, a, b", [
    ("32", "fixed", 32, 32), ("4:64", "uniform", 4, 64), ("uniform:1:9", "uniform", 1, 9),
    ("normal:100:20", "normal", 100.0, 20.0),
])
def test_length_distributions_parse(text, kind, a, b):
    assert LengthDistribution.parse(text) == LengthDistribution(kind, a, b)


@pytest.mark.parametrize("text", ["0", "9:3", "x", "gamma:1:2", "1:2:3", "uniform:0:4"])
def test_bad_length_distributions_are_refused(text):
    with pytest.raises(ValueError, match="length"):
        LengthDistribution.parse(text)


def test_lengths_stay_in_range_and_normal_has_its_mean():
    rng = random.Random(0)
    assert {LengthDistribution.parse("3:5").sample(rng) for _ in range(200)} == {3, 4, 5}
    normal = [LengthDistribution.parse("normal:100:10").sample(rng) for _ in range(2000)]
    assert 98 < sum(normal) / len(normal) < 102 and min(normal) >= 1


def test_synthetic_workload_is_seeded_and_in_bounds():
    make = lambda seed: synthetic_workload(50, LengthDistribution.parse("2:8"), LengthDistribution.parse("5"),  # noqa: E731
                                           vocab_size=20, seed=seed)
    first = make(3)
    assert first == make(3) and first != make(4)
    assert all(2 <= len(r.prompt) <= 8 and r.max_tokens == 5 and all(4 <= t < 20 for t in r.prompt) for r in first)


def test_jsonl_workload(tmp_path):
    path = tmp_path / "w.jsonl"
    path.write_text('{"prompt": "Hello there", "max_tokens": 3}\n\n{"prompt": [5, 6, 7]}\n{"prompt": "z"}\n')
    assert read_workload(str(path), 2, default_max_tokens=9) == [
        BenchRequest("Hello there", 3), BenchRequest([5, 6, 7], 9)]
    path.write_text('{"prompt": [5, "x"]}\n')
    with pytest.raises(ValueError, match="w.jsonl:1"):
        read_workload(str(path), None, 4)


def test_poisson_arrivals_have_the_asked_rate():
    times = poisson_arrivals(4000, rate=20.0, seed=0)
    assert times[0] == 0 and all(b >= a for a, b in zip(times, times[1:]))
    assert times[-1] / (len(times) - 1) == pytest.approx(1 / 20, rel=0.05)


def test_closed_loop_measures_ttft_and_itl_and_counts_failures(fake_url):
    assert served_model(fake_url) == "fake"
    requests = [BenchRequest([9], 4), BenchRequest([1], 4), BenchRequest([2], 4), BenchRequest([9, 9], 3)]
    progress = ProgressBar(len(requests), enabled=False)
    results, not_sent = run_load(fake_url, "fake", requests, concurrency=2, warmup=0, progress=progress)
    assert not_sent == 0 and len(results) == 4 and (progress.ok, progress.failed) == (2, 2)
    by_prompt = {r.prompt_tokens: r for r in results if r.ok}
    assert [r.output_tokens for r in sorted(by_prompt.values(), key=lambda r: r.prompt_tokens)] == [4, 3]
    for result in by_prompt.values():
        assert result.ttft_ms >= GAP_S * 1e3 * 0.9
        assert all(GAP_S * 1e3 * 0.9 <= gap for gap in result.itls_ms)  # upper bounds are timing luck
        assert len(result.itls_ms) == result.output_tokens - 1
    errors = sorted(r.error for r in results if not r.ok)
    assert errors[0].startswith("HTTP 400") and "bad prompt" in errors[0]
    assert errors[1] == "stream error: step failed"


def test_the_time_limit_cancels_requests_in_flight_and_leaves_the_rest_unsent(fake_url):
    requests = [BenchRequest([9], 100)] * 5  # 5 s each
    results, not_sent = run_load(fake_url, "fake", requests, concurrency=2, warmup=0, max_seconds=0.5)
    assert len(results) == 2 and not_sent == 3
    assert all(r.error == "cancelled at the time limit" for r in results)


def test_open_loop_sends_every_request_on_schedule_without_waiting_for_answers(fake_url):
    # Each request is answered only once all six are in flight (the [3] barrier above), so
    # every one succeeding proves the generator did not wait for an answer before sending on.
    BARRIER.update(expected=6, arrived=0, event=None)
    requests = [BenchRequest([3], 2)] * 6
    results, not_sent = run_load(fake_url, "fake", requests, request_rate=40.0, warmup=0, seed=0)
    assert not_sent == 0 and len(results) == 6 and all(r.ok for r in results), [r.error for r in results]
    assert BARRIER["arrived"] == 6
    # Never ahead of the seeded Poisson schedule at 40/s.
    sends = sorted(r.sent_s for r in results)
    assert all(sent >= at for sent, at in zip(sends, poisson_arrivals(6, 40.0, seed=0))), sends


def test_exactly_one_loop_kind():
    with pytest.raises(ValueError, match="exactly one"):
        run_load("http://127.0.0.1:9", "m", [BenchRequest([9], 1)], concurrency=2, request_rate=1.0)


def test_an_unreachable_endpoint_fails_every_request():
    results, _ = run_load("http://127.0.0.1:9", "m", [BenchRequest([9], 1)] * 2, concurrency=1, warmup=0)
    assert [r.ok for r in results] == [False, False] and all("Error" in r.error for r in results)
