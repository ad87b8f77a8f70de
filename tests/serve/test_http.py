"""`raymoe serve` over real HTTP with the official openai client."""

from __future__ import annotations

import concurrent.futures
import http.client
import json
import subprocess
import sys
import urllib.error
import urllib.parse
import urllib.request

import openai
import pytest
import torch

from raymoe.engine.engine import EngineConfig, LLMEngine
from raymoe.engine.sampling_params import SamplingParams
from raymoe.engine.tokenizer import Tokenizer
from openai_tokens import openai_token, token_bytes
import prometheus_text as prom
from server_process import served

MAX_TOKENS = 8
ADMIN_TOKEN = "test-admin-token"


@pytest.fixture(scope="module")
def server(tiny_mixtral_dir, tmp_path_factory):
    yield from served(tmp_path_factory.mktemp("serve"), tiny_mixtral_dir,
                      "routers: 2\nexpert_workers: 2\nplacement:\n  strategy: round_robin\n"
                      "  redundant_slots_per_worker: 1\nserve:\n  host: 127.0.0.1\n  port: 8000\n"
                      "  served_model_name: tiny\n", env={"RAYMOE_ADMIN_TOKEN": ADMIN_TOKEN})


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def reference(tiny_mixtral_dir):
    return LLMEngine.from_pretrained(tiny_mixtral_dir, EngineConfig(dtype="float32"))


def test_models_lists_the_served_model(client):
    assert [m.id for m in client.models.list().data] == ["tiny"]


def test_greedy_completions_on_token_ids_equal_the_in_process_engine(client, reference):
    prompts = [[10, 11, 12], list(range(40, 60)), [7]]
    expected = reference.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))
    for prompt, want in zip(prompts, expected):
        response = client.completions.create(
            model="tiny", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )
        choice = response.choices[0]
        assert choice.model_extra["token_ids"] == want.output_token_ids
        assert choice.model_extra["prompt_token_ids"] == prompt
        assert response.usage.completion_tokens == MAX_TOKENS
        assert choice.finish_reason == "length"


def first_stop_string(text: str, length: int = 3) -> str:
    """A piece of ``text`` whose first occurrence starts past its beginning (so the request
    stops early, after several tokens), free of U+FFFD (half characters)."""
    for start in range(1, len(text) - length):
        piece = text[start:start + length]
        if "\ufffd" not in piece and piece.strip() and text.find(piece) == start:
            return piece
    raise AssertionError(f"no usable stop string in {text!r}")


def test_streamed_text_equals_non_streamed_text(client):
    kwargs = dict(model="tiny", prompt="Hello world", max_tokens=16, temperature=0, extra_body={"ignore_eos": True})
    whole = client.completions.create(**kwargs).choices[0]
    pieces, reasons = [], []
    for chunk in client.completions.create(stream=True, **kwargs):
        pieces.append(chunk.choices[0].text)
        reasons.append(chunk.choices[0].finish_reason)
    assert "".join(pieces) == whole.text and whole.finish_reason == "length"
    assert reasons[-1] == "length" and all(r is None for r in reasons[:-1])


@pytest.mark.parametrize("prompt", ["Hello world", "The sea and the sky"])
def test_a_stop_string_taken_from_the_output_stops_it_streamed_or_not(client, prompt):
    base = dict(model="tiny", prompt=prompt, max_tokens=16, temperature=0, extra_body={"ignore_eos": True})
    full = client.completions.create(**base).choices[0].text
    stop = first_stop_string(full)
    cut = full[:full.find(stop)]
    whole = client.completions.create(stop=[stop], **base)
    assert whole.choices[0].finish_reason == "stop"
    assert whole.choices[0].text == cut  # cut where the stop string starts, nothing of it shown
    assert whole.usage.completion_tokens < 16
    pieces, reasons = [], []
    for chunk in client.completions.create(stream=True, stop=[stop], **base):
        pieces.append(chunk.choices[0].text)
        reasons.append(chunk.choices[0].finish_reason)
    assert "".join(pieces) == cut  # the held-back tail never reached the client
    assert reasons[-1] == "stop" and all(r is None for r in reasons[:-1])


def test_stream_options_include_usage_adds_one_usage_chunk(client):
    kwargs = dict(model="tiny", prompt=[4, 5, 6], max_tokens=5, temperature=0, stream=True,
                  extra_body={"ignore_eos": True})
    chunks = list(client.completions.create(stream_options={"include_usage": True}, **kwargs))
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage is not None
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (3, 5, 8)
    assert all(c.usage is None and len(c.choices) == 1 for c in chunks[:-1])
    assert all(c.usage is None for c in client.completions.create(**kwargs))  # not asked: none


def test_chat_logprobs_are_the_log_softmax_of_the_model(client, tiny_mixtral_dir, reference):
    """Each token's logprob and top alternatives against torch's log_softmax (float64) of the
    in-process engine's logits for the prompt plus the answer: independent of the sampler."""
    messages = [{"role": "user", "content": "Name a colour."}]
    response = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=5, temperature=0, logprobs=True, top_logprobs=3,
        extra_body={"ignore_eos": True, "return_token_ids": True})
    choice = response.choices[0]
    tokenizer = Tokenizer(tiny_mixtral_dir)
    prompt = tokenizer.encode(tokenizer.apply_chat_template(messages), add_special_tokens=False)
    output = choice.model_extra["token_ids"]
    logits = reference.score([prompt + output])[0].double()
    logprobs = torch.log_softmax(logits[len(prompt) - 1:-1], dim=-1)  # the distribution each token came from
    entries = choice.logprobs.content
    assert len(entries) == len(output) == 5
    for position, (entry, token) in enumerate(zip(entries, output)):
        assert entry.token == openai_token(tokenizer, token)
        assert bytes(entry.bytes) == token_bytes(tokenizer, token)
        assert entry.logprob == pytest.approx(logprobs[position, token].item(), abs=1e-4)
        values, ids = torch.topk(logprobs[position], 3)
        assert [t.token for t in entry.top_logprobs] == [openai_token(tokenizer, i) for i in ids.tolist()]
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(values.tolist(), abs=1e-4)
        assert token == ids[0].item()  # greedy
    plain = client.chat.completions.create(model="tiny", messages=messages, max_tokens=5, temperature=0,
                                           extra_body={"ignore_eos": True})
    assert plain.choices[0].logprobs is None


def test_max_completion_tokens_caps_chat_and_zero_is_refused(server, client):
    messages = [{"role": "user", "content": "Count."}]
    response = client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, max_completion_tokens=3,
                                              temperature=0, extra_body={"ignore_eos": True})
    assert response.usage.completion_tokens == 3 and response.choices[0].finish_reason == "length"
    code, payload = post(server.url + "/v1/chat/completions", {"model": "tiny", "messages": messages,
                                                               "max_completion_tokens": 0})
    assert code == 400, payload  # never a silent fall back to max_tokens or the default


def test_32_concurrent_requests_all_succeed(client):
    def one(i: int) -> int:
        response = client.completions.create(model="tiny", prompt=[5 + i, 6 + i, 7], max_tokens=6, temperature=0,
                                             extra_body={"ignore_eos": True})
        return response.usage.completion_tokens

    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        assert list(pool.map(one, range(32))) == [6] * 32


def test_chat_works_with_the_template(client, tiny_mixtral_dir, reference):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    response = client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, temperature=0,
                                              extra_body={"ignore_eos": True})
    tokenizer = Tokenizer(tiny_mixtral_dir)
    prompt = tokenizer.encode(tokenizer.apply_chat_template(messages), add_special_tokens=False)
    expected = reference.generate([prompt], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))[0]
    assert response.choices[0].message.role == "assistant"
    assert response.choices[0].message.content == tokenizer.decode(expected.output_token_ids)
    assert response.usage.prompt_tokens == len(prompt)
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=6, temperature=0, stream=True, extra_body={"ignore_eos": True}))
    assert streamed == response.choices[0].message.content


BAD_REQUESTS = [
    ("bad json", "/v1/completions", b"{not json", 400),
    ("missing prompt", "/v1/completions", {"max_tokens": 3}, 400),
    ("prompt mistyped", "/v1/completions", {"prompt": 12}, 400),
    ("max_tokens mistyped", "/v1/completions", {"prompt": "hi", "max_tokens": "lots"}, 400),
    ("temperature out of range", "/v1/completions", {"prompt": "hi", "temperature": -1}, 400),
    ("top_p out of range", "/v1/completions", {"prompt": "hi", "top_p": 1.5}, 400),
    ("top_k out of range", "/v1/completions", {"prompt": "hi", "top_k": -7}, 400),
    ("max_tokens zero", "/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400),
    ("token id outside vocab", "/v1/completions", {"prompt": [1, 10**7]}, 400),
    ("prompt beyond context", "/v1/completions", {"prompt": [5] * 300}, 400),
    ("max_tokens beyond context", "/v1/completions", {"prompt": [5, 6], "max_tokens": 100000}, 400),
    ("unknown model", "/v1/completions", {"model": "gpt-9", "prompt": "hi"}, 404),
    ("chat without messages", "/v1/chat/completions", {"model": "tiny"}, 400),
    ("n zero", "/v1/completions", {"prompt": "hi", "n": 0}, 400),
    ("body too large", "/v1/completions", {"prompt": "x" * (2 << 20)}, 413),
    ("unknown route", "/v1/embeddings", {"input": "hi"}, 404),
]


HEADERS_ONLY_ABOVE = 1 << 20  # bodies beyond serve.max_body_bytes' default: see post()


def post(url: str, body, headers: dict | None = None) -> tuple[int, dict]:
    """POST and return (status, JSON body). A body over 1 MiB is declared in Content-Length but
    not sent: the server must refuse it from the header alone (413), and a client still
    sending when that answer comes would break its pipe on a race, not on the server's fault."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    parts = urllib.parse.urlsplit(url)
    connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)
    try:
        connection.putrequest("POST", parts.path)
        for key, value in {"Content-Type": "application/json", "Content-Length": str(len(data)),
                           **(headers or {})}.items():
            connection.putheader(key, value)
        connection.endheaders()
        if len(data) <= HEADERS_ONLY_ABOVE:
            connection.send(data)
        response = connection.getresponse()
        return response.status, json.loads(response.read())
    finally:
        connection.close()


@pytest.mark.parametrize("name, path, body, status", BAD_REQUESTS, ids=[b[0] for b in BAD_REQUESTS])
def test_bad_requests_get_openai_errors(server, name, path, body, status):
    code, payload = post(server.url + path, body)
    assert code == status, payload
    assert set(payload["error"]) == {"message", "type", "param", "code"}
    assert payload["error"]["message"]


def test_server_still_answers_after_bad_requests(server, client):
    for _, path, body, _ in BAD_REQUESTS:
        post(server.url + path, body)
    response = client.completions.create(model="tiny", prompt=[9, 9], max_tokens=2, temperature=0)
    assert response.choices[0].finish_reason in ("length", "stop")


def test_metrics_use_vllm_names_types_and_move_with_the_requests(server, client):
    """vLLM's names under raymoe:, each family of its type, model_name on every sample, and
    the counters moved by exactly what four requests (streamed, not, chat, stopped) imply."""
    before = prom.families(prom.scrape(server.url))
    base = dict(model="tiny", temperature=0, extra_body={"ignore_eos": True})
    usages = [client.completions.create(prompt=[4, 5, 6], max_tokens=3, **base).usage]
    chunks = list(client.completions.create(prompt="Hello world", max_tokens=5, stream=True,
                                            stream_options={"include_usage": True}, **base))
    usages.append(chunks[-1].usage)
    usages.append(client.chat.completions.create(messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                                 **base).usage)
    full = client.completions.create(prompt="The sea and the sky", max_tokens=16, **base)
    stopped = client.completions.create(prompt="The sea and the sky", max_tokens=16,
                                        stop=[first_stop_string(full.choices[0].text)], **base)
    assert stopped.choices[0].finish_reason == "stop"
    usages += [full.usage, stopped.usage]
    text = prom.scrape(server.url)
    after = prom.families(text)

    for name, kind in prom.FAMILIES.items():
        assert name in after, f"{name} missing from /metrics"
        assert after[name].type == kind, (name, after[name].type)
    unlabelled = [s for f in after.values() if f.name.startswith("raymoe:") for s in f.samples
                  if s.labels.get("model_name") != "tiny"]
    assert not unlabelled, unlabelled[:3]

    def delta(sample: str, **labels: str) -> float:
        return prom.value(after, sample, **labels) - prom.value(before, sample, **labels)

    generated = sum(u.completion_tokens for u in usages)
    assert delta("raymoe:generation_tokens_total") == generated
    assert delta("raymoe:router_generated_tokens_total") == generated  # nothing aborted
    assert delta("raymoe:prompt_tokens_total") == sum(u.prompt_tokens for u in usages)
    assert delta("raymoe:request_success_total", finished_reason="length") == 4
    assert delta("raymoe:request_success_total", finished_reason="stop") == 1
    assert delta("raymoe:request_success_total") == 5
    assert delta("raymoe:http_requests_total", status="200") == 5
    for histogram in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds"):
        assert delta(f"raymoe:{histogram}_count") == 5, histogram
    assert delta("raymoe:time_per_output_token_seconds_count") == sum(u.completion_tokens > 1 for u in usages)
    assert delta("raymoe:inter_token_latency_seconds_count") > 0
    assert delta("raymoe:worker_routed_tokens_total") > 0
    assert delta("raymoe:prefix_cache_queries_total") > 0
    assert 0 <= delta("raymoe:prefix_cache_hits_total") <= delta("raymoe:prefix_cache_queries_total")
    assert prom.value(after, "raymoe:num_requests_running") == prom.value(after, "raymoe:num_requests_waiting") == 0
    assert 0 <= prom.value(after, "raymoe:kv_cache_usage_perc") <= 1
    assert 0 <= prom.value(after, "raymoe:prefix_cache_hit_rate") <= 1
    assert prom.value(after, "raymoe:kv_cache_capacity_tokens") > 0
    assert 0 < prom.value(after, "raymoe:balancedness") <= 1
    assert len(after["raymoe:worker_routed_tokens"].samples) == 2  # one per expert worker
    assert {s.labels["stat"] for s in after["raymoe:window_balancedness"].samples} == {"avg", "min"}

    problems = prom.promtool_problems(text)
    if problems is None:
        print("metrics checked with prometheus_client's parser (promtool is not on PATH)")
    else:
        print("metrics checked with prometheus_client's parser and promtool check metrics")
        assert not problems, problems


def test_health_reports_every_actor(server):
    with urllib.request.urlopen(f"{server.url}/health", timeout=30) as response:
        payload = json.loads(response.read())
    # (since a3ca700 /health also lists each rank's state from the controller's rank watch)
    assert {key: payload[key] for key in ("status", "routers", "expert_workers")} == \
        {"status": "ok", "routers": 2, "expert_workers": 2}
    assert sorted(row["rank"] for row in payload["ranks"]) == ["router 0", "router 1", "worker 0", "worker 1"]


def get(url: str, headers: dict | None = None) -> tuple[int, dict]:
    request = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def test_admin_routes_need_the_token(server, client):
    client.completions.create(model="tiny", prompt=[4, 5, 6], max_tokens=3, temperature=0)
    assert get(f"{server.url}/admin/placement")[0] == 401
    assert get(f"{server.url}/admin/placement", {"Authorization": "Bearer wrong"})[0] == 401
    assert post(f"{server.url}/admin/rebalance", {})[0] == 401
    auth = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    code, placement = get(f"{server.url}/admin/placement", auth)
    assert code == 200
    assert isinstance(placement["epoch"], int) and 0 < placement["balancedness"] <= 1
    layers = placement["placement"]
    assert len(layers) == 3 and all(len(row) == 2 * placement["slots_per_worker"] for row in layers)
    assert all(set(range(8)) <= set(row) for row in layers)  # every logical expert has a slot
    code, report = post(f"{server.url}/admin/rebalance", {}, auth)
    assert code == 200 and isinstance(report["rebalanced"], bool) and report["reason"]


def test_status_and_rebalance_commands(server):
    command = [sys.executable, "-m", "raymoe.cluster.cli"]
    address = ["--address", server.ray_address()]  # this server's Ray, not the machine's latest one
    done = subprocess.run(command + ["status", "--json", *address], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    status = json.loads(done.stdout)
    assert {"epoch", "balancedness", "placement", "worker_load", "last_rebalance"} <= set(status)
    text = subprocess.run(command + ["status", *address], capture_output=True, text=True, timeout=120)
    assert text.returncode == 0 and "balancedness" in text.stdout and "worker" in text.stdout
    done = subprocess.run(command + ["rebalance", *address], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.startswith("rebalanced:"), done.stderr[-2000:]

