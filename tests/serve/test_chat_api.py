"""/v1/chat/completions over real HTTP with the official openai client: content parts, tool
turns in the history, response_format, tools and tool_choice (streamed and not), and the
request shape guidellm sends. The tiny checkpoint carries a Qwen-style template with tools."""

from __future__ import annotations

import concurrent.futures
import json
from typing import Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field
from raymoe.engine.tokenizer import Tokenizer
from server_process import served
from tiny_models import WEATHER_PARAMETERS, build_reference_model, use_chat_template, write_checkpoint

MODEL = "tiny-chat"
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather forecast for a city",
                                      "parameters": WEATHER_PARAMETERS}},
    {"type": "function", "function": {"name": "get_time", "description": "Local time in a city",
                                      "parameters": {"type": "object", "properties": {
                                          "city": {"type": "string", "enum": ["Paris", "Oslo"]}},
                                          "required": ["city"], "additionalProperties": False}}},
]
SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
HISTORY_CALL = {"id": "call_abc", "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius", "days": 2}'}}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tiny-qwen-tools"))
    # A longer context than the default tiny one: a prompt with two tools' signatures in
    # this small vocabulary takes a few hundred tokens.
    write_checkpoint(build_reference_model("qwen3_moe", max_position_embeddings=4096), path)
    return use_chat_template(path)


@pytest.fixture(scope="module")
def server(checkpoint, tmp_path_factory):
    yield from served(tmp_path_factory.mktemp("serve-chat"), checkpoint,
                      f"routers: 1\nexpert_workers: 1\nserve:\n  served_model_name: {MODEL}\n")


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def reference_template(checkpoint):
    """transformers' own rendering of the checkpoint's template: the independent reference."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(checkpoint)


def prompt_ids(checkpoint, reference_template, messages, tools=None) -> list[int]:
    text = reference_template.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
    return Tokenizer(checkpoint).encode(text, add_special_tokens=False)


GREEDY = dict(model=MODEL, temperature=0, max_tokens=6, extra_body={"ignore_eos": True, "return_token_ids": True})


# ---- messages ---------------------------------------------------------------------------
def test_text_parts_are_the_same_prompt_as_their_joined_string(client, checkpoint, reference_template):
    parts = client.chat.completions.create(messages=[{"role": "user", "content": [
        {"type": "text", "text": "Hello"}, {"type": "text", "text": "world"}]}], **GREEDY)
    string = client.chat.completions.create(messages=[{"role": "user", "content": "Hello\nworld"}], **GREEDY)
    want = prompt_ids(checkpoint, reference_template, [{"role": "user", "content": "Hello\nworld"}])
    assert parts.choices[0].model_extra["prompt_token_ids"] == want
    assert parts.choices[0].model_extra["token_ids"] == string.choices[0].model_extra["token_ids"]
    assert parts.choices[0].message.content == string.choices[0].message.content


@pytest.mark.parametrize("part", [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
                                  {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}])
def test_other_part_types_are_refused_naming_the_part(client, part):
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, max_tokens=2, messages=[
            {"role": "user", "content": [{"type": "text", "text": "Look:"}, part]}])
    assert caught.value.param == "messages[0].content[1].type"
    assert part["type"] in caught.value.message


def test_history_with_tool_calls_null_content_and_tool_results(client, checkpoint, reference_template):
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Weather in Paris for two days?"},
        {"role": "assistant", "content": None, "tool_calls": [HISTORY_CALL]},
        {"role": "tool", "tool_call_id": "call_abc", "content": '{"forecast": "sun"}'},
    ]
    response = client.chat.completions.create(messages=messages, tools=TOOLS, **GREEDY)
    reference = [*messages[:2], {"role": "assistant", "content": "", "tool_calls": [
        dict(HISTORY_CALL, function={"name": "get_weather", "arguments": json.loads(
            HISTORY_CALL["function"]["arguments"])})]}, messages[3]]
    assert response.choices[0].model_extra["prompt_token_ids"] == prompt_ids(
        checkpoint, reference_template, reference, tools=TOOLS)
    assert response.choices[0].finish_reason in ("stop", "length")


def test_tool_choice_none_leaves_the_tools_out(client, checkpoint, reference_template):
    messages = [{"role": "user", "content": "Hi"}]
    response = client.chat.completions.create(messages=messages, tools=TOOLS, tool_choice="none", **GREEDY)
    assert response.choices[0].model_extra["prompt_token_ids"] == prompt_ids(checkpoint, reference_template, messages)
    assert response.choices[0].message.tool_calls is None


def test_guidellm_chat_request_shape(client):
    """What guidellm's default chat benchmark sends (its OpenAI HTTP backend): content as a
    list of text parts, streamed with continuous usage stats, max_completion_tokens, stop null,
    ignore_eos; it reads delta.content and the final usage."""
    tokens = 12
    stream = client.chat.completions.create(
        model=MODEL, stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True},
        max_completion_tokens=tokens, stop=None, extra_body={"ignore_eos": True},
        messages=[{"role": "user", "content": [{"type": "text", "text": "The quick brown fox jumps over the dog"}]}])
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text and chunks[-1].usage.completion_tokens == tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


# ---- response_format --------------------------------------------------------------------
class Forecast(BaseModel):
    city: Literal["Paris", "Oslo", "Lima"]
    sunny: bool
    days: int = Field(ge=1, le=7)
    notes: list[Literal["wind", "rain", "fog"]] = Field(max_length=3)


def test_parse_returns_a_pydantic_instance(client):
    completion = client.chat.completions.parse(
        model=MODEL, messages=[{"role": "user", "content": "Forecast for Oslo as JSON."}],
        response_format=Forecast, max_tokens=120, temperature=0.7, seed=3)
    choice = completion.choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    assert isinstance(choice.message.parsed, Forecast)
    assert Forecast.model_validate_json(choice.message.content) == choice.message.parsed


def test_json_schema_twenty_samples_at_temperature_one_all_validate(client):
    schema = {"type": "object",
              # ASCII names: a maxLength string can hold invalid UTF-8 from this random model's
              # byte tokens (the grammar counts one invalid 4-byte sequence as one character).
              "properties": {"name": {"type": "string", "pattern": "^[a-z]{1,6}$"},
                             "ok": {"type": "boolean"},
                             "score": {"type": "integer", "minimum": 0, "maximum": 100},
                             "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3}},
              "required": ["name", "ok", "score", "tags"], "additionalProperties": False}

    def sample(seed: int) -> str:
        response = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "A record, please."}], temperature=1.0, seed=seed,
            max_tokens=120, response_format={"type": "json_schema",
                                             "json_schema": {"name": "record", "schema": schema, "strict": True}})
        assert response.choices[0].finish_reason == "stop", response.choices[0].message.content
        return response.choices[0].message.content

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        outputs = list(pool.map(sample, range(20)))
    for text in outputs:
        jsonschema.validate(json.loads(text), schema)
    assert len(set(outputs)) > 1  # sampled, not one greedy answer


def test_json_object_is_an_object(client):
    response = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "JSON please"}], response_format={"type": "json_object"},
        temperature=0, max_tokens=150)
    if response.choices[0].finish_reason == "stop":  # an open object may run to max_tokens
        assert isinstance(json.loads(response.choices[0].message.content), dict)
    else:
        assert response.choices[0].message.content.lstrip().startswith("{")


@pytest.mark.parametrize("response_format, words", [
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}, "json_schema"),
    ({"type": "xml"}, "xml"),
])
def test_invalid_response_formats_are_refused(client, response_format, words):
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "x"}],
                                       response_format=response_format)
    assert caught.value.param.startswith("response_format") and words in caught.value.message


# ---- tool calls -------------------------------------------------------------------------
def check_call(name: str, arguments: str, allowed=tuple(SCHEMAS)) -> None:
    assert name in allowed
    jsonschema.validate(json.loads(arguments), SCHEMAS[name])


def test_named_tool_call(client):
    response = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Weather in Lima?"}], tools=TOOLS, max_tokens=80,
        tool_choice={"type": "function", "function": {"name": "get_weather"}}, temperature=1.0, seed=7)
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None and len(choice.message.tool_calls) == 1
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.id.startswith("call_")
    check_call(call.function.name, call.function.arguments, ("get_weather",))


def reassemble(chunks) -> tuple[dict[int, dict], list]:
    """Tool calls from streamed deltas, as a client does: the first delta of an index has its
    id, type and name; later ones only argument fragments."""
    calls, reasons = {}, []
    for chunk in chunks:
        if not chunk.choices:
            continue
        reasons.append(chunk.choices[0].finish_reason)
        for delta in chunk.choices[0].delta.tool_calls or []:
            if delta.index not in calls:
                assert delta.id and delta.type == "function" and delta.function.name
                calls[delta.index] = {"id": delta.id, "name": delta.function.name, "arguments": "", "fragments": 0}
            else:
                assert delta.id is None and delta.function.name is None
            calls[delta.index]["arguments"] += delta.function.arguments or ""
            calls[delta.index]["fragments"] += 1
    return calls, reasons


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_streamed_tool_call_reassembles(client, tool_choice):
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "Time in Oslo?"}], tools=TOOLS,
                  tool_choice=tool_choice, max_tokens=120, temperature=0, parallel_tool_calls=False)
    calls, reasons = reassemble(client.chat.completions.create(stream=True, **kwargs))
    assert reasons[-1] == "tool_calls" and all(r is None for r in reasons[:-1])
    assert list(calls) == [0]
    check_call(calls[0]["name"], calls[0]["arguments"])
    assert calls[0]["fragments"] > 1  # arguments streamed as they grew, not in one piece
    whole = client.chat.completions.create(**kwargs).choices[0]  # greedy: the same call
    assert whole.finish_reason == "tool_calls"
    assert (whole.message.tool_calls[0].function.name, whole.message.tool_calls[0].function.arguments) == (
        calls[0]["name"], calls[0]["arguments"])


def test_required_with_parallel_calls_validates_each(client):
    response = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Weather and time in Paris?"}], tools=TOOLS,
        tool_choice="required", max_tokens=200, temperature=1.0, seed=11)
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert choice.message.tool_calls
    for call in choice.message.tool_calls:
        check_call(call.function.name, call.function.arguments)
    assert len({c.id for c in choice.message.tool_calls}) == len(choice.message.tool_calls)


def test_tool_choice_auto_renders_the_tools_and_answers(client, checkpoint, reference_template):
    """A random-weight model writes no <tool_call> of its own: the answer is content; the
    parsing of real calls is tested on hand-written outputs (tests/engine/test_tool_calls.py)."""
    messages = [{"role": "user", "content": "Anything?"}]
    response = client.chat.completions.create(messages=messages, tools=TOOLS, **GREEDY)
    assert response.choices[0].model_extra["prompt_token_ids"] == prompt_ids(
        checkpoint, reference_template, messages, tools=TOOLS)
    assert isinstance(response.choices[0].message.content, str)


def test_n_choices_each_carry_their_own_tool_call(client):
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "Weather?"}], tools=TOOLS, n=3, seed=5,
                  tool_choice={"type": "function", "function": {"name": "get_weather"}}, max_tokens=80,
                  temperature=1.0)
    response = client.chat.completions.create(**kwargs)
    assert [c.index for c in response.choices] == [0, 1, 2]
    for choice in response.choices:
        assert choice.finish_reason == "tool_calls"
        check_call(choice.message.tool_calls[0].function.name, choice.message.tool_calls[0].function.arguments)
    streamed: dict[int, list] = {}
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            streamed.setdefault(choice.index, []).append(type(chunk)(**{**chunk.model_dump(), "choices": [choice]}))
    assert sorted(streamed) == [0, 1, 2]
    for index, chunks in streamed.items():
        calls, reasons = reassemble(chunks)
        assert reasons[-1] == "tool_calls"
        check_call(calls[0]["name"], calls[0]["arguments"])
        whole = response.choices[index].message.tool_calls[0].function  # same seeds: the same calls
        assert (calls[0]["name"], calls[0]["arguments"]) == (whole.name, whole.arguments)


def test_n_plain_chat_choices_differ_and_count_usage(client):
    response = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], n=4,
                                              temperature=1.0, seed=1, max_tokens=5, extra_body={"ignore_eos": True})
    assert [c.index for c in response.choices] == [0, 1, 2, 3]
    assert len({c.message.content for c in response.choices}) > 1
    assert response.usage.completion_tokens == 20
