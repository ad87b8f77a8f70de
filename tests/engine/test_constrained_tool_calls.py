"""tool_choice "required" and named functions served in process, as vLLM serves them: the
output is constrained to the tools' JSON schemas (xgrammar) and returned as parsed
``tool_calls``, streamed and not, on the demo checkpoint, whose ChatML template has no
tool-call format, and on the same weights with Hermes (Qwen) and Mistral templates.

Each case runs 10 seeds at temperature 1 in one batch: every sequence's outputs go through
both the streamed path (``StreamedChoice``, as the ingress streams) and the non-streamed one
(``response_body``), so the two are compared on the very same tokens."""

from __future__ import annotations

import itertools
import json
import os
import shutil

import jsonschema
import pytest
from raymoe.engine.api.chat import plan_chat
from raymoe.engine.api.completions import Endpoint, ModelLimits, prepare_request, response_body
from raymoe.engine.demo_model import write_demo_model
from raymoe.engine.engine import EngineConfig, LLMEngine
from raymoe.engine.api.openai_protocol import ChatCompletionRequest, RequestError, decode_request
from raymoe.engine.api.stream_choices import StreamedChoice
from raymoe.engine.tokenizer import Tokenizer
from raymoe.engine.api.tool_calls import NamedParser, RequiredParser, decode_keeping, detect_format
from tiny_models import QWEN_TOOLS_TEMPLATE, WEATHER_PARAMETERS, use_chat_template

MODEL = "demo"
SEEDS = range(10)
MISTRAL_TEMPLATE = ("{% if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}"
                    "{% for m in messages %}{% if m.tool_calls %}[TOOL_CALLS]{{ m.tool_calls | tojson }}"
                    "{% else %}[INST]{{ m.content }}[/INST]{% endif %}{% endfor %}")
WEATHER = WEATHER_PARAMETERS
TIME = {  # a free (bounded) string as well: the model spells it, the grammar escapes it
    "type": "object",
    "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}, "note": {"type": "string", "maxLength": 8}},
    "required": ["city", "note"],
    "additionalProperties": False,
}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather forecast",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
NAMED = {"type": "function", "function": {"name": "get_time"}}
_ids = itertools.count()


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory) -> str:
    """The checkpoint `raymoe serve` writes with no config (write_demo_model's defaults)."""
    return write_demo_model(str(tmp_path_factory.mktemp("demo-mixtral")))


@pytest.fixture(scope="module")
def engine(demo_dir) -> LLMEngine:
    return LLMEngine.from_pretrained(demo_dir, EngineConfig(dtype="float32"))


@pytest.fixture(scope="module")
def tokenizers(demo_dir, tmp_path_factory) -> dict[str, Tokenizer]:
    """The demo's own tokenizer (ChatML: no tool-call format), and the same vocabulary with
    Hermes and Mistral templates (the weights don't depend on the template)."""
    out = {"chatml": Tokenizer(demo_dir)}
    for name, template in (("hermes", QWEN_TOOLS_TEMPLATE), ("mistral", MISTRAL_TEMPLATE)):
        path = str(tmp_path_factory.mktemp(name))
        for file in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(os.path.join(demo_dir, file), path)
        out[name] = Tokenizer(use_chat_template(path, template))
    return out


def test_the_demo_template_has_no_tool_format_and_its_vocabulary_spells_json(tokenizers):
    assert detect_format(tokenizers["chatml"].chat_template) is None
    text = '[{"name": "get_time", "parameters": {"city": "Oslo", "note": "a\\"\\\\b\\u00e9 {}[],:"}}]'
    assert tokenizers["chatml"].decode(tokenizers["chatml"].encode(text, add_special_tokens=False)) == text


def plan(body: dict, tokenizer: Tokenizer):
    return plan_chat(decode_request(json.dumps(body).encode(), ChatCompletionRequest), tokenizer)


def test_plans_on_a_template_without_a_tool_format(tokenizers):
    base = {"messages": [{"role": "user", "content": "x"}], "tools": TOOLS}
    required = plan(dict(base, tool_choice="required"), tokenizers["chatml"])
    assert isinstance(required.parser, RequiredParser) and required.structured is not None
    assert required.parser.new_id().startswith("call_")
    named = plan(dict(base, tool_choice=NAMED), tokenizers["chatml"])
    assert isinstance(named.parser, NamedParser) and json.loads(named.structured.spec) == TIME
    with pytest.raises(RequestError) as caught:  # auto: unchanged, the template's format or a 400
        plan(base, tokenizers["chatml"])
    assert caught.value.param == "tools" and "required" in caught.value.message
    assert plan(dict(base, tool_choice="none"), tokenizers["chatml"]).parser is None


def run_chat(engine: LLMEngine, requests: list[tuple[Tokenizer, dict]]) -> list[tuple[dict, list[dict]]]:
    """Each (tokenizer, body)'s non-streamed response and its streamed chunk choices, from one
    batched run of them all."""
    limits = ModelLimits(MODEL, engine.config.vocab_size, engine.max_model_len)
    prepared = [(t, prepare_request(Endpoint.CHAT, body, t, limits)) for t, body in requests]
    ids = [f"chat-{next(_ids)}" for _ in prepared]
    streams = {}
    for request_id, (tokenizer, p) in zip(ids, prepared):
        streams[request_id] = StreamedChoice(0, p, tokenizer, lambda t, tokenizer=tokenizer, keep=p.chat.keep_tokens:
                                             decode_keeping(tokenizer.decode, t, keep))
        engine.add_request(request_id, p.prompt_ids, p.params)
    chunks: dict[str, list[dict]] = {i: [] for i in ids}
    final = {}
    while len(final) < len(ids):
        for output in engine.step():
            chunks[output.request_id].append(streams[output.request_id].update(output))
            if output.finished:
                final[output.request_id] = output
    return [(response_body(p, final[i], tokenizer, "chatcmpl-test", MODEL), chunks[i])
            for i, (tokenizer, p) in zip(ids, prepared)]


TEMPLATES = ("chatml", "hermes", "mistral")
CHOICES = {"required": ("required", True), "required-one": ("required", False), "named": (NAMED, True)}


@pytest.fixture(scope="module")
def results(engine, tokenizers) -> dict[tuple[str, str], list[tuple[dict, list[dict]]]]:
    """Every template x tool_choice case, 10 seeds each, in one batch (one run's steps)."""
    cases = [(template, choice) for template in TEMPLATES for choice in CHOICES]
    requests = [(tokenizers[template], {
        "messages": [{"role": "user", "content": "Weather or time in Oslo?"}], "tools": TOOLS,
        "tool_choice": CHOICES[choice][0], "parallel_tool_calls": CHOICES[choice][1], "temperature": 1.0,
        "seed": seed}) for template, choice in cases for seed in SEEDS]
    answers = run_chat(engine, requests)
    return {case: answers[k * len(SEEDS):(k + 1) * len(SEEDS)] for k, case in enumerate(cases)}


def reassemble(chunks: list[dict]) -> tuple[list[dict], str | None]:
    """Calls from streamed deltas, as OpenAI clients do; checks each delta's shape."""
    calls: list[dict] = []
    for k, chunk in enumerate(chunks):
        delta = chunk["delta"]
        assert ("role" in delta) == (k == 0)
        assert not delta.get("content"), delta  # a constrained output is only calls
        assert chunk["finish_reason"] is None or k == len(chunks) - 1
        for entry in delta.get("tool_calls", []):
            if entry["index"] == len(calls):  # a call's first delta: index, id, type, name
                assert entry["type"] == "function" and entry["function"]["name"] and entry["id"]
                calls.append({"id": entry["id"], "name": entry["function"]["name"],
                              "arguments": entry["function"]["arguments"], "fragments": 1})
            else:  # later: only argument fragments
                assert set(entry) == {"index", "function"} and set(entry["function"]) == {"arguments"}
                calls[entry["index"]]["arguments"] += entry["function"]["arguments"]
                calls[entry["index"]]["fragments"] += 1
    return calls, chunks[-1]["finish_reason"]


def check_id(call_id: str, template: str) -> None:
    if template == "mistral":  # ids as Mistral's templates read them back: 9 alphanumerics
        assert len(call_id) == 9 and call_id.isalnum()
    else:
        assert call_id.startswith("call_") and len(call_id) > 5


@pytest.mark.parametrize("template", TEMPLATES)
@pytest.mark.parametrize("choice", CHOICES)
def test_constrained_calls_validate_streamed_and_not(results, template, choice):
    tool_choice, parallel = CHOICES[choice]
    seen = set()
    for response, chunks in results[template, choice]:
        answer = response["choices"][0]
        assert answer["finish_reason"] == "tool_calls", answer
        message = answer["message"]
        assert message["role"] == "assistant" and message["content"] is None
        calls = message["tool_calls"]
        assert len(calls) >= 1
        if not parallel or tool_choice is NAMED:
            assert len(calls) == 1
        if tool_choice is NAMED:
            assert calls[0]["function"]["name"] == "get_time"
        for call in calls:
            assert call["type"] == "function"
            check_id(call["id"], template)
            jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[call["function"]["name"]])
        assert len({c["id"] for c in calls}) == len(calls)
        streamed, reason = reassemble(chunks)
        assert reason == "tool_calls"
        assert [(c["name"], c["arguments"]) for c in streamed] == [
            (c["function"]["name"], c["function"]["arguments"]) for c in calls]
        for call in streamed:
            check_id(call["id"], template)
        assert streamed[0]["fragments"] > 1  # arguments streamed as they grew
        seen.add(json.dumps([(c["function"]["name"], c["function"]["arguments"]) for c in calls]))
    assert len(seen) > 2  # really sampled: the seeds make different calls


def test_parallel_calls_are_made_where_allowed(results):
    counts = {choice: [len(r["choices"][0]["message"]["tool_calls"]) for t in TEMPLATES for r, _ in results[t, choice]]
              for choice in ("required", "required-one")}
    assert max(counts["required"]) > 1 and set(counts["required-one"]) == {1}


def test_a_call_cut_by_max_tokens_says_length(engine, tokenizers):
    body = {"messages": [{"role": "user", "content": "Weather?"}], "tools": TOOLS, "tool_choice": "required",
            "max_tokens": 12, "temperature": 1.0, "seed": 3}
    [(response, chunks)] = run_chat(engine, [(tokenizers["chatml"], body)])
    assert response["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["finish_reason"] == "length"
