"""`raymoe serve` with no config (the README's command): the demo checkpoint written on first
use answers, and, although its ChatML template has no tool-call format, makes tool calls for
the official openai client under tool_choice "required" and named functions (constrained to
the tools' schemas)."""

from __future__ import annotations

import concurrent.futures
import json
import urllib.request

import jsonschema
import openai
import pytest
from server_process import ServerProcess


def complete(url: str, body: dict) -> dict:
    request = urllib.request.Request(f"{url}/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())


@pytest.fixture(scope="module")
def demo_server(tmp_path_factory):
    # The README's command, `raymoe serve`, here on a free port and a private cache directory.
    folder = tmp_path_factory.mktemp("serve-demo")
    server = ServerProcess(None, str(folder / "serve.log"), env={"RAYMOE_CACHE": str(folder / "cache")})
    server.cache = folder / "cache"
    try:
        server.wait_ready()
        yield server
    finally:
        assert server.stop() == 0, server.tail()


def test_serve_without_a_config_writes_the_demo_and_answers(demo_server):
    assert (demo_server.cache / "demo-mixtral" / "config.json").is_file()
    with urllib.request.urlopen(f"{demo_server.url}/health", timeout=30) as response:
        health = json.loads(response.read())  # (with each rank's state from the rank watch since a3ca700)
    assert {key: health[key] for key in ("status", "routers", "expert_workers")} == \
        {"status": "ok", "routers": 2, "expert_workers": 4}
    body = complete(demo_server.url, {"prompt": "Hello", "max_tokens": 4, "temperature": 0, "ignore_eos": True})
    assert body["usage"]["completion_tokens"] == 4
    assert "ready at" in demo_server.tail()


WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "unit", "days"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
        "required": ["city"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather forecast",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}


def test_demo_checkpoint_makes_required_tool_calls_for_the_openai_client(demo_server):
    """The demo's ChatML template has no tool-call format: tool_choice "required" is served by
    constraining the output to the tools' schemas. 10 of 10 at temperature 1 (concurrent, so
    they batch), each a parsed call whose arguments validate; then one streamed."""
    client = openai.OpenAI(base_url=f"{demo_server.url}/v1", api_key="unused", max_retries=0, timeout=300)
    model = client.models.list().data[0].id
    messages = [{"role": "user", "content": "What is the weather in Oslo?"}]

    def ask(seed: int):
        return client.chat.completions.create(model=model, messages=messages, tools=TOOLS, tool_choice="required",
                                              temperature=1.0, seed=seed)

    with concurrent.futures.ThreadPoolExecutor(10) as pool:
        responses = list(pool.map(ask, range(10)))
    made = []
    for response in responses:
        choice = response.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        assert choice.message.content is None and choice.message.tool_calls
        for call in choice.message.tool_calls:
            assert call.type == "function" and call.id.startswith("call_")
            jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
            made.append((call.function.name, call.function.arguments))
    assert len(set(made)) > 2  # sampled, not one call repeated

    calls, reasons = {}, []
    for chunk in client.chat.completions.create(model=model, messages=messages, tools=TOOLS, stream=True,
                                                tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                                temperature=1.0, seed=10):
        reasons.append(chunk.choices[0].finish_reason)
        assert not chunk.choices[0].delta.content
        for delta in chunk.choices[0].delta.tool_calls or []:
            if delta.index not in calls:  # the first delta: id, type, name
                assert delta.id.startswith("call_") and delta.type == "function"
                calls[delta.index] = [delta.function.name, ""]
            calls[delta.index][1] += delta.function.arguments or ""
    assert reasons[-1] == "tool_calls" and list(calls) == [0] and calls[0][0] == "get_weather"
    jsonschema.validate(json.loads(calls[0][1]), WEATHER)
