"""Tool calls in a model's output: the format its chat template uses, parsed and streamed.

Formats, each chosen from the chat template's text (``detect_format``):

- ``hermes`` (Qwen2, Qwen2.5, Qwen3 and their MoE checkpoints, Hermes): text, then one
  ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`` block per call.
- ``mistral`` (Mistral and Mixtral templates with tools): text, then ``[TOOL_CALLS]`` (a
  special token) and a JSON array of ``{"name": ..., "arguments": {...}}``.

With ``tool_choice`` ``required`` or a named function the output is not free text: the
structured sampler holds it to JSON (``required_schema`` / the function's parameters), read
by the ``json`` and ``named`` parsers below, so even a random-weight model makes a valid call.

Parsing is incremental: ``split`` reads any prefix of the output (a stream so far) into the
content before the calls and each call's name and the arguments text seen so far. Arguments
are the model's own JSON text (a growing prefix while streaming), so the streamed fragments
add up to exactly the non-streamed ``arguments``.
"""

from __future__ import annotations

import json
import secrets
import string
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


class MalformedCall(ValueError):
    """The text after a tool-call marker is not the JSON the format expects."""


@dataclass(frozen=True)
class PartialCall:
    name: str | None  # None until the name's string is complete
    arguments: str  # the arguments' JSON text so far ('' before it starts)
    complete: bool  # the call's JSON object (or the named call's arguments) is closed


@dataclass(frozen=True)
class Split:
    content_end: int  # text[:content_end] is content: safe to show (never part of a marker)
    calls: tuple[PartialCall, ...]
    malformed: bool = False  # what follows the marker is not the format's JSON


# ---- a partial-JSON reader --------------------------------------------------------------
_WHITESPACE = " \t\r\n"


def _skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WHITESPACE:
        i += 1
    return i


def _string_end(text: str, i: int) -> int | None:
    """``text[i] == '"'``: the index past the closing quote, or None if the text ends first."""
    i += 1
    while i < len(text):
        if text[i] == "\\":
            i += 2
            continue
        if text[i] == '"':
            return i + 1
        i += 1
    return None


def _value_end(text: str, i: int) -> int | None:
    """The index past the JSON value starting at ``text[i]``, or None if it is not closed yet
    (a number or literal is closed only by what follows it)."""
    if text[i] == '"':
        return _string_end(text, i)
    if text[i] in "{[":
        depth = 0
        while i < len(text):
            char = text[i]
            if char == '"':
                end = _string_end(text, i)
                if end is None:
                    return None
                i = end
                continue
            if char in "{[":
                depth += 1
            elif char in "}]":
                depth -= 1
                if depth == 0:
                    return i + 1
            i += 1
        return None
    start = i
    while i < len(text) and text[i] not in _WHITESPACE + ",}]":
        i += 1
    if i == start:
        raise MalformedCall(f"unexpected {text[i]!r} where a JSON value should start")
    return i if i < len(text) else None


def _load_string(literal: str) -> str:
    try:
        return json.loads(literal)
    except json.JSONDecodeError as error:  # a bad escape, a raw control character
        raise MalformedCall(f"bad JSON string {literal[:40]!r}: {error}") from None


def _object_members(text: str, i: int) -> tuple[dict[str, tuple[int, int | None]], int | None]:
    """Members of the (possibly unfinished) JSON object at ``text[i] == '{'``: key -> (value
    start, value end or None), and the index past the object (None while it is open)."""
    members: dict[str, tuple[int, int | None]] = {}
    i = _skip_ws(text, i + 1)
    while i < len(text):
        if text[i] == "}":
            return members, i + 1
        if text[i] == ",":
            i = _skip_ws(text, i + 1)
            continue
        if text[i] != '"':
            raise MalformedCall(f"unexpected {text[i]!r} where an object key should be")
        key_end = _string_end(text, i)
        if key_end is None:
            return members, None
        key = _load_string(text[i:key_end])
        i = _skip_ws(text, key_end)
        if i >= len(text):
            return members, None
        if text[i] != ":":
            raise MalformedCall(f"expected ':' after the key {key!r}")
        i = _skip_ws(text, i + 1)
        if i >= len(text):
            return members, None
        end = _value_end(text, i)
        members[key] = (i, end)
        if end is None:
            return members, None
        i = _skip_ws(text, end)
    return members, None


def _call_object(text: str, i: int, arguments_keys: tuple[str, ...]) -> tuple[PartialCall, int | None]:
    """The call object at ``text[i] == '{'``: ``{"name": ..., "arguments": ...}``."""
    if text[i] != "{":
        raise MalformedCall(f"expected a JSON object for a tool call, found {text[i]!r}")
    members, end = _object_members(text, i)
    name = None
    if "name" in members and members["name"][1] is not None:
        start, stop = members["name"]
        if text[start] != '"':
            raise MalformedCall("a tool call's name must be a string")
        name = _load_string(text[start:stop])
    arguments = ""
    key = next((k for k in arguments_keys if k in members), None)
    if key is not None:
        start, stop = members[key]
        arguments = text[start:len(text) if stop is None else stop]
    if end is not None and (name is None or key is None):
        raise MalformedCall(f"a tool call needs \"name\" and \"{arguments_keys[0]}\"")
    return PartialCall(name, arguments, end is not None), end


def _call_array(text: str, i: int, arguments_keys: tuple[str, ...]) -> list[PartialCall]:
    """Calls in the (possibly unfinished) JSON array at ``text[i]``; a lone object is read as
    an array of one."""
    if text[i] == "{":
        return [_call_object(text, i, arguments_keys)[0]]
    if text[i] != "[":
        raise MalformedCall(f"expected a JSON array of tool calls, found {text[i]!r}")
    calls = []
    i = _skip_ws(text, i + 1)
    while i < len(text) and text[i] != "]":
        if text[i] == ",":
            i = _skip_ws(text, i + 1)
            continue
        call, end = _call_object(text, i, arguments_keys)
        calls.append(call)
        if end is None:
            break
        i = _skip_ws(text, end)
    return calls


def _held_back(text: str, marker: str) -> int:
    """Where content must stop: before a tail of ``text`` that may be the start of ``marker``."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return len(text) - size
    return len(text)


# ---- the parsers ------------------------------------------------------------------------
ARGUMENT_KEYS = ("arguments", "parameters")  # Qwen and Mistral write "arguments"; some models "parameters"


class ToolCallParser:
    """Reads one tool-call format from an output's text (or any prefix of it)."""

    name = ""
    marker = ""  # what opens the calls ('' : the whole output is calls)
    special_markers: tuple[str, ...] = ()  # special tokens the text must keep (decode_keeping)

    def new_id(self) -> str:
        return f"call_{secrets.token_hex(12)}"

    def split(self, text: str, finished: bool) -> Split:
        index = text.find(self.marker)
        if index < 0:
            return Split(len(text) if finished else _held_back(text, self.marker), ())
        try:
            return Split(index, tuple(self._calls(text[index + len(self.marker):])))
        except MalformedCall:
            return Split(index, (), malformed=True)

    def _calls(self, body: str) -> list[PartialCall]:
        raise NotImplementedError


class HermesParser(ToolCallParser):
    name = "hermes"
    marker = "<tool_call>"
    closer = "</tool_call>"

    def _calls(self, body: str) -> list[PartialCall]:
        calls = []
        for block in body.split(self.marker):
            block = block.split(self.closer, 1)[0]
            start = _skip_ws(block, 0)
            if start < len(block):
                calls.append(_call_object(block, start, ARGUMENT_KEYS)[0])
        return calls


class MistralParser(ToolCallParser):
    name = "mistral"
    marker = "[TOOL_CALLS]"
    special_markers = ("[TOOL_CALLS]",)

    def new_id(self) -> str:  # Mistral's templates require 9 alphanumeric characters
        return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))

    def _calls(self, body: str) -> list[PartialCall]:
        start = _skip_ws(body, 0)
        return _call_array(body, start, ARGUMENT_KEYS) if start < len(body) else []


class RequiredParser(ToolCallParser):
    """tool_choice "required": the whole output is ``required_schema``'s JSON array."""

    name = "json"

    def __init__(self, ids_from: ToolCallParser):
        self._ids_from = ids_from

    def new_id(self) -> str:
        return self._ids_from.new_id()

    def split(self, text: str, finished: bool) -> Split:
        start = _skip_ws(text, 0)
        try:
            return Split(0, tuple(_call_array(text, start, ("parameters",)) if start < len(text) else ()))
        except MalformedCall:
            return Split(0, (), malformed=True)


class NamedParser(ToolCallParser):
    """tool_choice naming a function: the whole output is that function's arguments."""

    name = "named"

    def __init__(self, function: str, ids_from: ToolCallParser):
        self.function, self._ids_from = function, ids_from

    def new_id(self) -> str:
        return self._ids_from.new_id()

    def split(self, text: str, finished: bool) -> Split:
        return Split(0, (PartialCall(self.function, text, finished),))


FORMATS: dict[str, type[ToolCallParser]] = {"hermes": HermesParser, "mistral": MistralParser}


def detect_format(chat_template: str | None) -> ToolCallParser | None:
    """The parser for the tool-call format ``chat_template`` writes; None when it has none."""
    if not chat_template or "tools" not in chat_template:
        return None
    for parser in FORMATS.values():
        if parser.marker in chat_template:
            return parser()
    return None


def required_schema(tools: list[dict[str, Any]], parallel: bool) -> dict[str, Any]:
    """The JSON schema of a "required" output: an array of ``{"name", "parameters"}`` calls of
    the given tools (``{"type": "function", "function": {...}}`` entries); one call when not
    ``parallel``. "name" sorts before "parameters", so a schema written with sorted keys still
    has the model write the name first (and a stream can announce the call before its arguments)."""
    options = [{
        "type": "object",
        "properties": {"name": {"type": "string", "enum": [tool["function"]["name"]]},
                       "parameters": function_parameters(tool)},
        "required": ["name", "parameters"],
        "additionalProperties": False,
    } for tool in tools]
    schema: dict[str, Any] = {"type": "array", "minItems": 1,
                              "items": options[0] if len(options) == 1 else {"anyOf": options}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def function_parameters(tool: dict[str, Any]) -> dict[str, Any]:
    return tool["function"].get("parameters") or {"type": "object", "properties": {}}


def decode_keeping(decode: Callable[..., str], ids: list[int], keep: dict[int, str]) -> str:
    """``decode(ids)`` without special tokens, except those in ``keep`` (id -> text), which
    stay in place: the markers a parser looks for (``[TOOL_CALLS]`` is a special token)."""
    pieces, start = [], 0
    for i, token in enumerate(ids):
        if token in keep:
            pieces += [decode(ids[start:i]), keep[token]]
            start = i + 1
    pieces.append(decode(ids[start:]))
    return "".join(pieces)


# ---- responses --------------------------------------------------------------------------
def _call_body(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def parse_calls(parser: ToolCallParser, text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """A finished output's content (None when empty) and its calls in OpenAI's layout.

    Free-text formats fall back to the whole text as content when what follows the marker
    is not a complete call; the constrained (json, named) outputs keep whatever they hold,
    since only max_tokens can cut them short (finish_reason "length" says so).
    """
    constrained = isinstance(parser, (RequiredParser, NamedParser))
    split = parser.split(text, finished=True)
    named = [c for c in split.calls if c.name is not None]
    if split.malformed or not named or (not constrained and not all(c.complete for c in split.calls)):
        return text or None, []
    return text[:split.content_end] or None, [_call_body(parser.new_id(), c.name, c.arguments) for c in named]


class ToolCallStream:
    """A growing output text -> the content piece and ``delta.tool_calls`` entries to send.

    A call is announced (index, id, type, function.name, the arguments so far) once its name
    is complete; later updates send only new argument text. Content stops where the first
    call starts; a tail that may be the start of the marker waits for the next update.
    """

    def __init__(self, parser: ToolCallParser):
        self.parser = parser
        self.content_sent = 0
        self.arguments_sent: list[int] = []  # per announced call

    @property
    def has_calls(self) -> bool:
        return bool(self.arguments_sent)

    def update(self, text: str, finished: bool) -> tuple[str, list[dict[str, Any]]]:
        split = self.parser.split(text, finished)
        if split.malformed and finished and not self.arguments_sent:  # not a call after all: content
            split = Split(len(text), ())
        piece = text[self.content_sent:split.content_end]
        self.content_sent = max(self.content_sent, split.content_end)
        deltas = []
        for index, call in enumerate(split.calls):
            if call.name is None:
                break  # announce calls in order
            if index == len(self.arguments_sent):
                deltas.append({"index": index, **_call_body(self.parser.new_id(), call.name, call.arguments)})
                self.arguments_sent.append(len(call.arguments))
            elif len(call.arguments) > self.arguments_sent[index]:
                deltas.append({"index": index, "function": {"arguments": call.arguments[self.arguments_sent[index]:]}})
                self.arguments_sent[index] = len(call.arguments)
        return piece, deltas
