"""Tool-call formats: parsing whole outputs, streaming them in every split, and the chat plan
(messages, tools, tool_choice) refusing what it cannot serve, naming the field."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from raymoe.engine.api.chat import ChatStream, plan_chat
from raymoe.engine.demo_tokenizer import CHATML_TEMPLATE, write_demo_tokenizer
from raymoe.engine.api.openai_protocol import (
    ChatCompletionRequest,
    RequestError,
    decode_request,
)
from raymoe.engine.tokenizer import Tokenizer
from raymoe.engine.api.tool_calls import (
    HermesParser,
    MistralParser,
    NamedParser,
    RequiredParser,
    ToolCallStream,
    decode_keeping,
    detect_format,
    parse_calls,
)
from tiny_models import QWEN_TOOLS_TEMPLATE, use_chat_template

MISTRAL_TEMPLATE = ("{% if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}"
                    "{% for m in messages %}[INST]{{ m.content }}[/INST]{% endfor %}[TOOL_CALLS]")

HERMES_OUTPUT = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par\\"is", "days": 3}}\n'
                 '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')
CASES = [  # parser, output, expected content, expected [(name, arguments)]
    (HermesParser(), HERMES_OUTPUT, "Let me check.\n",
     [("get_weather", '{"city": "Par\\"is", "days": 3}'), ("get_time", "{}")]),
    (MistralParser(), 'Sure[TOOL_CALLS] [{"name": "f", "arguments": {"x": [1, {"y": "]"}]}}, '
                      '{"name": "g", "arguments": {}}]', "Sure", [("f", '{"x": [1, {"y": "]"}]}'), ("g", "{}")]),
    (RequiredParser(HermesParser()), '[{"name": "f", "parameters": {"a": 1}}, {"name": "g", "parameters": {"b": 2.5}}]',
     None, [("f", '{"a": 1}'), ("g", '{"b": 2.5}')]),
    (NamedParser("f", HermesParser()), '{"a": [1, 2], "b": "x"}', None, [("f", '{"a": [1, 2], "b": "x"}')]),
]


@pytest.mark.parametrize("parser, text, content, calls", CASES, ids=lambda c: getattr(c, "name", None))
def test_whole_outputs_parse_into_calls(parser, text, content, calls):
    got_content, got_calls = parse_calls(parser, text)
    assert got_content == content
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in got_calls] == calls
    assert all(c["type"] == "function" and c["id"] for c in got_calls)
    assert all(json.loads(c["function"]["arguments"]) is not None for c in got_calls)


@pytest.mark.parametrize("parser, text, content, calls", CASES, ids=lambda c: getattr(c, "name", None))
def test_every_streamed_split_adds_up_to_the_whole(parser, text, content, calls):
    """Character by character (the worst split): content pieces then, per call, one header
    (index, id, name) followed only by argument fragments, together equal to the whole."""
    stream = ToolCallStream(parser)
    sent_content, assembled, order = "", {}, []
    for end in range(1, len(text) + 1):
        piece, deltas = stream.update(text[:end], end == len(text))
        sent_content += piece
        for delta in deltas:
            index = delta["index"]
            if index not in assembled:
                assert delta["id"] and delta["type"] == "function" and delta["function"]["name"]
                assert index == len(assembled)  # announced in order
                assembled[index] = [delta["function"]["name"], delta["function"]["arguments"]]
                order.append(index)
            else:
                assert set(delta) == {"index", "function"} and set(delta["function"]) == {"arguments"}
                assembled[index][1] += delta["function"]["arguments"]
    assert sent_content == (content or "")
    assert [tuple(assembled[i]) for i in order] == calls


def test_content_never_shows_a_half_marker():
    stream = ToolCallStream(HermesParser())
    assert stream.update("Hi <tool_", finished=False) == ("Hi ", [])
    assert stream.update("Hi <tool_x", finished=False) == ("<tool_x", [])
    assert stream.update("Hi <tool_x <tool", finished=True) == (" <tool", [])


def test_text_that_is_not_a_call_stays_content():
    for text in ["plain text", "see <tool_call> not json", 'cut <tool_call>\n{"name": "f", "argu']:
        assert parse_calls(HermesParser(), text) == (text, [])
    stream = ToolCallStream(HermesParser())
    assert stream.update("see <tool_call> oops", finished=False) == ("see ", [])
    assert stream.update("see <tool_call> oops", finished=True) == ("<tool_call> oops", [])


def test_chat_stream_sets_finish_reason_and_nulls_content_beside_calls():
    stream = ChatStream(plan=type("Plan", (), {"parser": NamedParser("f", HermesParser())})())
    choice = {"finish_reason": None}
    first = stream.delta('{"a":', False, choice)
    assert first["role"] == "assistant" and first["content"] is None
    assert first["tool_calls"][0]["function"] == {"name": "f", "arguments": '{"a":'}
    choice = {"finish_reason": "stop"}
    last = stream.delta(" 1}", True, choice)
    assert last["tool_calls"] == [{"index": 0, "function": {"arguments": " 1}"}}]
    assert choice["finish_reason"] == "tool_calls"


def test_formats_are_read_from_the_template():
    assert isinstance(detect_format(QWEN_TOOLS_TEMPLATE), HermesParser)
    assert isinstance(detect_format(MISTRAL_TEMPLATE), MistralParser)
    assert detect_format(CHATML_TEMPLATE) is None
    assert detect_format(None) is None
    assert len(MistralParser().new_id()) == 9 and MistralParser().new_id().isalnum()


def test_decode_keeping_keeps_only_the_marker_tokens():
    words = {1: "a", 2: "b", 3: "c"}

    def decode(ids):
        return "".join(words.get(i, "") for i in ids)  # 9 and 8 are "special": dropped

    assert decode_keeping(decode, [1, 9, 2, 8, 3], {9: "[TOOL_CALLS]"}) == "a[TOOL_CALLS]bc"
    assert decode_keeping(decode, [1, 2], {}) == "ab"


# ---- the chat plan ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    plain = str(tmp_path_factory.mktemp("chatml"))
    write_demo_tokenizer(plain, 320)
    tools = str(tmp_path_factory.mktemp("qwen-tools"))
    write_demo_tokenizer(tools, 320)
    use_chat_template(tools)
    return Tokenizer(plain), Tokenizer(tools), tools


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def plan(body, tokenizer):
    return plan_chat(decode_request(json.dumps(body).encode(), ChatCompletionRequest), tokenizer)


@pytest.mark.parametrize("body, param, words", [
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                {"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content[1].type", "image_url"),
    ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages[0].content[0].text", "string"),
    ({"messages": [{"role": "user", "content": None}]}, "messages[0].content", "required"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role", "wizard"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id", "tool_call_id"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]},
     "messages[1].tool_calls[0].function.arguments", "not JSON"),
    ({"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [WEATHER],
      "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "nope"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [WEATHER, WEATHER]},
     "tools[1].function.name", "twice"),
    ({"messages": [{"role": "user", "content": "x"}], "tool_choice": {"type": "function", "function": {"name": "f"}},
      "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}]},
     "tools[0].function.parameters", "JSON Schema"),
    ({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_schema"}},
     "response_format", "json_schema"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [WEATHER], "tool_choice": "required",
      "response_format": {"type": "json_object"}}, "response_format", "tool_choice"),
])
def test_refusals_name_the_field(tokenizers, body, param, words):
    with pytest.raises(RequestError) as caught:
        plan(body, tokenizers[1])
    assert caught.value.param == param and words in caught.value.message


def test_tools_are_refused_where_the_template_has_no_tool_format(tokenizers):
    body = {"messages": [{"role": "user", "content": "x"}], "tools": [WEATHER]}
    with pytest.raises(RequestError) as caught:
        plan(body, tokenizers[0])
    assert caught.value.param == "tools" and "without tools" in caught.value.message
    plain = plan(dict(body, tool_choice="none"), tokenizers[0])  # "none": the tools are not used
    assert plain.parser is None and plain.prompt == plan({"messages": body["messages"]}, tokenizers[0]).prompt


def test_plans_per_tool_choice(tokenizers):
    base = {"messages": [{"role": "user", "content": "x"}], "tools": [WEATHER]}
    auto = plan(base, tokenizers[1])
    assert isinstance(auto.parser, HermesParser) and auto.structured is None and "get_weather" in auto.prompt
    none = plan(dict(base, tool_choice="none"), tokenizers[1])
    assert none.parser is None and "get_weather" not in none.prompt
    required = plan(dict(base, tool_choice="required", parallel_tool_calls=False), tokenizers[1])
    schema = json.loads(required.structured.spec)
    assert isinstance(required.parser, RequiredParser) and schema["maxItems"] == 1 and schema["minItems"] == 1
    assert schema["items"]["properties"]["name"]["enum"] == ["get_weather"]
    named = plan(dict(base, tool_choice={"type": "function", "function": {"name": "get_weather"}}), tokenizers[1])
    assert isinstance(named.parser, NamedParser)
    assert json.loads(named.structured.spec) == WEATHER["function"]["parameters"]


def test_parts_null_content_and_tool_turns_render_as_transformers_renders_them(tokenizers):
    """The reference: transformers' own apply_chat_template on the same checkpoint files."""
    transformers = pytest.importorskip("transformers")
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    body = {"messages": [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Weather"}, {"type": "text", "text": "in Paris?"}]},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "20 C"},
    ], "tools": [WEATHER]}
    ours = plan(body, tokenizers[1]).prompt
    reference = transformers.AutoTokenizer.from_pretrained(tokenizers[2]).apply_chat_template([
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather\nin Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [dict(call, function={
            "name": "get_weather", "arguments": {"city": "Paris"}})]},
        {"role": "tool", "tool_call_id": "call_1", "content": "20 C"},
    ], tools=[WEATHER], add_generation_prompt=True, tokenize=False)
    assert ours == reference
    assert '{"name": "get_weather", "arguments": {"city": "Paris"}}' in ours


PARSERS = [HermesParser(), MistralParser(), RequiredParser(HermesParser()), NamedParser("f", HermesParser())]
outputs = st.one_of(
    st.text(max_size=80),
    st.builds(lambda marker, tail: marker + tail, st.sampled_from(["<tool_call>", "[TOOL_CALLS]", "[", "{"]),
              st.text(alphabet='{}[]",:\\ nameargumts01\n', max_size=60)),
)


@settings(max_examples=300, deadline=None)
@given(text=outputs)
def test_any_output_parses_or_stays_content_without_raising(text):
    """Whatever a model writes, reading it never fails: it is calls, or content."""
    for parser in PARSERS:
        content, calls = parse_calls(parser, text)
        assert calls or content == (text or None)
        stream = ToolCallStream(parser)
        for end in sorted({len(text) // 3, len(text) // 2, len(text)}):
            stream.update(text[:end], end == len(text))


def test_deeply_nested_history_arguments_are_a_400(tokenizers):
    call = {"id": "1", "type": "function", "function": {"name": "f", "arguments": "[" * 100_000}}
    with pytest.raises(RequestError) as caught:
        plan({"messages": [{"role": "assistant", "content": None, "tool_calls": [call]}]}, tokenizers[1])
    assert caught.value.param == "messages[0].tool_calls[0].function.arguments"
