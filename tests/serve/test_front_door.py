"""The front door under hostile and careless clients, on a real `raymoe serve` over loopback:
one poisoned request never fails its neighbours, disconnects stop generation, limits answer
with a 4xx naming the field, /metrics counts each response by its real status, and the event
loop stays responsive while large prompts are tokenized."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import statistics
import threading
import time
import urllib.error
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from raymoe.actors.router_spec import ROUTER_CONCURRENCY
from server_process import served

RAY_OWN_THREADS = 12  # a Ray actor process's own threads beside the call pool (measured: ~5 idle)
ADMIN = "front-door-token"


LONG_CONTEXT = 4096  # the module's tiny model: streams long enough to be abandoned mid-way on busy cores


@pytest.fixture(scope="module")
def long_mixtral_dir(tmp_path_factory) -> str:
    """The tiny Mixtral with a context of LONG_CONTEXT (the shared one has 256)."""
    from tiny_models import build_reference_model, write_checkpoint

    return write_checkpoint(build_reference_model("mixtral", max_position_embeddings=LONG_CONTEXT),
                            str(tmp_path_factory.mktemp("long-mixtral")))


@pytest.fixture(scope="module")
def server(long_mixtral_dir, tmp_path_factory):
    yield from served(tmp_path_factory.mktemp("front"), long_mixtral_dir,
                      "routers: 1\nexpert_workers: 1\nserve:\n  served_model_name: tiny\n  max_body_bytes: 4194304\n",
                      env={"RAYMOE_ADMIN_TOKEN": ADMIN})


def post(url: str, body, timeout: float = 120) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def metrics(url: str) -> dict[tuple[str, tuple], float]:
    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as response:
        text = response.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def status_count(values: dict, status: str) -> float:
    return sum(v for (name, labels), v in values.items()
               if name == "raymoe:http_requests_total" and dict(labels).get("status") == status)


def total(values: dict, name: str, **wanted: str) -> float:
    """Sample ``name`` summed over its series (model_name is on every one) whose labels include
    ``wanted``."""
    return sum(v for (sample, labels), v in values.items()
               if sample == name and all(dict(labels).get(k) == w for k, w in wanted.items()))


def router_threads(url: str) -> list[int]:
    request = urllib.request.Request(f"{url}/admin/placement", headers={"Authorization": f"Bearer {ADMIN}"})
    with urllib.request.urlopen(request, timeout=30) as response:
        return [r["threads"] for r in json.loads(response.read())["routers"]]


HEALTHY = [{"prompt": [10 + i, 20, 30 + i], "max_tokens": 12, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True} for i in range(10)]
POISON = [  # accepted: the math is made safe
    {"prompt": [5, 6], "max_tokens": 12, "temperature": 1e-45, "ignore_eos": True},
    {"prompt": [5, 6], "max_tokens": 12, "temperature": 1.0, "top_p": 1e-46, "ignore_eos": True},
    {"prompt": [5, 6], "max_tokens": 12, "temperature": 1.0, "top_k": 2**63 - 1, "ignore_eos": True},
]


def test_poisoned_requests_leave_ten_healthy_ones_healthy(server):
    url = f"{server.url}/v1/completions"
    alone = [post(url, body)[1]["choices"][0]["token_ids"] for body in HEALTHY]
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        poison = [pool.submit(post, url, body) for body in POISON * 2]
        healthy = [pool.submit(post, url, body) for body in HEALTHY]
        results = [f.result() for f in healthy]
        poisoned = [f.result() for f in poison]
    assert [code for code, _ in results] == [200] * 10
    assert [body["choices"][0]["token_ids"] for _, body in results] == alone  # nothing changed for them
    assert [code for code, _ in poisoned] == [200] * len(poisoned)
    assert all(len(body["choices"][0]["text"]) >= 0 and body["usage"]["completion_tokens"] == 12
               for _, body in poisoned)


def deep_json(depth: int) -> bytes:
    return b'{"prompt": "hi", "extra": ' + b"[" * depth + b"]" * depth + b"}"


HOSTILE = [
    ("seed beyond 64 bits", "/v1/completions", {"prompt": "hi", "seed": 2**70}, "seed"),
    ("too many stop strings", "/v1/completions", {"prompt": "hi", "stop": [f"s{i}" for i in range(100)]}, "stop"),
    ("stop string too long", "/v1/completions", {"prompt": "hi", "stop": ["x" * 1000]}, "stop"),
    ("too many stop ids", "/v1/completions", {"prompt": "hi", "stop_token_ids": list(range(300))}, "stop_token_ids"),
    ("logprobs past 20", "/v1/completions", {"prompt": "hi", "logprobs": 50}, "logprobs"),
    ("JSON nested 10k deep", "/v1/completions", deep_json(10_000), None),
    ("empty messages", "/v1/chat/completions", {"messages": []}, "messages"),
    ("logit_bias key not an ASCII integer", "/v1/completions", {"prompt": "hi", "logit_bias": {"\u00b2": 1}},
     "logit_bias"),
    ("max_completion_tokens 0", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 0}, "max_tokens"),
]


@pytest.mark.parametrize("name, path, body, param", HOSTILE, ids=[h[0] for h in HOSTILE])
def test_hostile_bodies_get_a_4xx_naming_the_field_and_no_internals(server, name, path, body, param):
    code, payload = post(server.url + path, body)
    assert code == 400, payload
    error = payload["error"]
    assert error["type"] == "invalid_request_error"
    if param is not None:
        assert error["param"] == param or param in error["message"], error
    assert "Traceback" not in error["message"] and "Error:" not in error["message"]


def test_metrics_count_each_response_by_its_real_status(server):
    before = metrics(server.url)
    assert post(f"{server.url}/v1/completions", {"prompt": "hi", "seed": 2**70})[0] == 400
    assert post(f"{server.url}/v1/completions", {"prompt": [5], "max_tokens": 2})[0] == 200
    after = metrics(server.url)
    assert status_count(after, "400") - status_count(before, "400") == 1
    assert status_count(after, "200") - status_count(before, "200") == 1


def whole_chunks(body: bytes) -> list[bytes]:
    """The complete chunks at the start of a chunked body (an event is one chunk)."""
    chunks, at = [], 0
    while (line_end := body.find(b"\r\n", at)) != -1:
        size = int(body[at:line_end], 16)
        if size == 0 or line_end + 2 + size + 2 > len(body):
            break
        chunks.append(body[line_end + 2:line_end + 2 + size])
        at = line_end + 2 + size + 2
    return chunks


ENDED_EARLY: list[bytes] = []  # what streams that ended before any event received


async def open_stream_and_hang_up(port: int, max_tokens: int) -> int | None:
    """Start a streamed completion, and disconnect the moment its first event is read. The
    tokens it had received by then (all that had arrived: the hang-up follows the read with no
    await between), or None when it ended before any event."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    body = json.dumps({"prompt": [7, 8, 9], "max_tokens": max_tokens, "stream": True, "ignore_eos": True,
                       "temperature": 0, "return_token_ids": True}).encode()
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    received = b""
    try:
        while b"data:" not in received.partition(b"\r\n\r\n")[2]:  # past the headers
            more = await asyncio.wait_for(reader.read(1 << 20), timeout=60)
            if not more:
                ENDED_EARLY.append(received[:600])  # (the status line and body say why)
                return None
            received += more
        return sum(len(json.loads(e[6:])["choices"][0]["token_ids"])
                   for e in whole_chunks(received.partition(b"\r\n\r\n")[2]) if e.startswith(b"data: {"))
    finally:
        writer.transport.abort()  # the client goes away mid-stream


async def disconnect_storm(port: int, streams: int, at_once: int, max_tokens: int) -> list[int | None]:
    """``streams`` streams abandoned at their first event, ``at_once`` at a time, from one
    event loop; the tokens each had received."""
    gate = asyncio.Semaphore(at_once)

    async def one() -> int | None:
        async with gate:
            return await open_stream_and_hang_up(port, max_tokens)

    return await asyncio.gather(*(one() for _ in range(streams)))


STORM_TOKENS = 2_000  # each stream's max_tokens: seconds of generation, far past its hang-up


def test_a_disconnect_storm_stops_generation_and_leaks_no_thread(server):
    """200 streams of STORM_TOKENS each, 32 at a time, each abandoned at its first event: every
    one ends as an abort, none runs on to its length, and the routers stop generating for them
    within a step or so of each hang-up.

    The client is one event loop that hangs up in the same callback that reads the first event.
    (It was 32 threads: on 2 busy cores a thread got to its first event up to 1.2 s after it
    was sent, queued for the GIL, and a 200-token stream of this model had ended by then: the
    server rightly finished those as ``length``. Even one loop was seen 0.75 s off the CPU, so
    the streams are long: a 2,000-token stream takes seconds.)"""
    threads_before = router_threads(server.url)
    before = metrics(server.url)
    ENDED_EARLY.clear()
    seen = asyncio.run(disconnect_storm(server.port, 200, 32, STORM_TOKENS))
    closed_at = time.monotonic()
    assert None not in seen, f"{seen.count(None)} of 200 streams ended before any event: {ENDED_EARLY[:2]}"
    stopped_after = None
    deadline = closed_at + 30
    last = None
    while time.monotonic() < deadline:  # bounded
        values = metrics(server.url)
        running = total(values, "raymoe:num_requests_running") + total(values, "raymoe:num_requests_waiting")
        sampled = total(values, "raymoe:router_generated_tokens_total")
        if running == 0 and sampled == last:
            stopped_after = time.monotonic() - closed_at
            break
        last = sampled
        time.sleep(0.1)
    assert stopped_after is not None, "the routers kept generating for requests nobody reads"
    generated = total(values, "raymoe:router_generated_tokens_total") - total(before, "raymoe:router_generated_tokens_total")
    after_hang_up = generated - sum(seen)  # generated after each stream's last read, its hang-up
    print(f"disconnect storm: generation stopped {stopped_after:.2f} s after the last hang-up; "
          f"{generated:.0f} tokens generated for 200 abandoned streams, {sum(seen)} of them read before the "
          f"hang-ups, {after_hang_up:.0f} after ({after_hang_up / 200:.1f} a stream)")
    assert stopped_after < 3.0  # the issue asks 1 s; the margin is for 2 shared cores
    # Every abandoned stream was aborted, none ran to its length (one way that happened is
    # pinned by tests/serve/test_event_stream_response.py: 4 of 200 did, uncounted).
    reasons = {reason: total(values, "raymoe:request_success_total", finished_reason=reason)
               - total(before, "raymoe:request_success_total", finished_reason=reason)
               for reason in ("abort", "length", "stop", "error")}
    assert reasons == {"abort": 200, "length": 0, "stop": 0, "error": 0}, reasons
    # Each hang-up stopped its stream within a few steps: measured 10-19 tokens a stream after
    # it alone, 7-134 beside two busy processes (the ingress process then waits for a core,
    # once 1.5 s). The bound is an eighth of a stream: far below one stream left running on.
    assert after_hang_up < 200 * STORM_TOKENS / 8
    hung_up = status_count(values, "499") - status_count(before, "499")
    deltas = {status: status_count(values, status) - status_count(before, status)
              for status in ("200", "400", "429", "499", "500", "503")}
    assert hung_up == 200, f"{hung_up} of the 200 abandoned streams counted as 499 (status deltas: {deltas})"
    # No thread per request: the router answers calls from a pool capped at ROUTER_CONCURRENCY
    # (plus its step thread and Ray's own), whatever the number of streams that came and went.
    threads_after = router_threads(server.url)
    print(f"router threads: {threads_before} before the storm, {threads_after} after")
    assert max(threads_after) <= max(max(threads_before), ROUTER_CONCURRENCY + RAY_OWN_THREADS)


IN_FLIGHT_S = 2.5  # how long six large prompts are kept in flight in a round while /v1/models is polled
IDLE_S = 1.0  # polling before each round, nothing in flight
LOADED_ROUNDS = 3


def poll_models(url: str, seconds: float) -> list[float]:
    """/v1/models latencies, one call after another for ``seconds``, sorted."""
    latencies = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        started = time.perf_counter()
        with urllib.request.urlopen(f"{url}/v1/models", timeout=30) as response:
            response.read()
        latencies.append(time.perf_counter() - started)
    return sorted(latencies)


def p99(latencies: list[float]) -> float:
    return latencies[int(0.99 * (len(latencies) - 1))]


def test_models_stays_responsive_while_large_prompts_are_tokenized(server):
    """Six ~900 kB prompts kept in flight (each posted again once answered: parsed, tokenized,
    then refused, 714k tokens against the tiny model's context) while /v1/models is polled, one
    call after another, in LOADED_ROUNDS rounds of IN_FLIGHT_S, each after IDLE_S of polling
    with nothing in flight. Before the prompts were counted rather than listed
    (engine/tokenizer.py: the id list held the GIL 25 ms per prompt) and took turns on a
    low-priority pool of their own (actors/ingress.py, LARGE_BODY_BYTES), p99 was 120-200 ms
    on a quiet machine and 690 ms beside two busy processes; since, 6-20 and 36-41 ms
    (benchmarks/bench_front_door.py, docs/BENCHMARKS.md).

    A blocked event loop shows in every round; a neighbour's burst (the other CI worker) in
    one or two: so each round's p99 is compared with the idle p99 next to it, and the median
    round decides. (One 8 s window against one 2 s idle window failed a CI run: p99 111 ms
    loaded against 8.6 ms idle, where this machine measures 5 ms against 3 ms when quiet.)"""
    big = json.dumps({"prompt": "lorem ipsum dolor sit amet " * 34_000}).encode()  # 918 kB
    answers: list = []

    def sender(stop: threading.Event) -> None:
        while not stop.is_set():
            answers.append(post(f"{server.url}/v1/completions", big))

    rounds = []  # (idle p99, loaded p99, loaded p50, calls) per round
    for _ in range(LOADED_ROUNDS):
        idle = poll_models(server.url, IDLE_S)  # this machine's own noise, now
        stop = threading.Event()
        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            senders = [pool.submit(sender, stop) for _ in range(6)]
            time.sleep(0.5)  # every prompt on its way
            loaded = poll_models(server.url, IN_FLIGHT_S)
            stop.set()
            for done in senders:
                done.result()
        rounds.append((p99(idle), p99(loaded), statistics.median(loaded), len(loaded)))
    # Beyond the tiny model's context: every one refused after tokenizing, with its count.
    assert len(answers) >= 6 and all(code == 400 for code, _ in answers), [code for code, _ in answers]
    assert all(body["error"]["code"] == "context_length_exceeded" and "714000 tokens" in body["error"]["message"]
               for _, body in answers), answers[0]
    for idle_p99, loaded_p99, loaded_p50, calls in rounds:
        print(f"/v1/models idle p99 {1e3 * idle_p99:.1f} ms; with 6 x 900 kB prompts in flight: {calls} calls, "
              f"p50 {1e3 * loaded_p50:.1f} ms, p99 {1e3 * loaded_p99:.1f} ms")
    print(f"{len(answers)} prompts answered")
    assert statistics.median(r[1] for r in rounds) < 0.15, rounds  # the bound, in most rounds
    # The bound that tells a blocked event loop apart on a quiet machine too (there the old
    # code stayed under 150 ms: 120 ms): relative to this machine's idle p99 next to it.
    calm = sum(loaded < max(0.06, 5 * idle) for idle, loaded, _, _ in rounds)
    assert calm > LOADED_ROUNDS // 2, rounds
