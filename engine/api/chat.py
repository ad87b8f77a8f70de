"""A chat request's prompt and output plan: messages and tools through the chat template,
``tool_choice`` and ``response_format`` to a tool-call parser and a structured output.

Every problem is a :class:`RequestError` naming the field (``messages[2].content[1].type``).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from raymoe.engine.api.openai_protocol import (
    ChatCompletionRequest,
    ChatMessage,
    NamedToolChoice,
    RequestError,
)
from raymoe.engine.structured_output import StructuredOutput
from raymoe.engine.tokenizer import ChatTemplateError, Tokenizer
from raymoe.engine.api.tool_calls import (
    NamedParser,
    RequiredParser,
    ToolCallParser,
    ToolCallStream,
    detect_format,
    function_parameters,
    required_schema,
)

ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}
FUNCTION_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for function names
PART_SEPARATOR = "\n"  # text parts of one message are joined as vLLM joins them


@dataclass(frozen=True)
class ChatPlan:
    prompt: str  # the rendered chat template
    parser: ToolCallParser | None = None  # reads tool calls from the output; None: plain text
    keep_tokens: dict[int, str] = field(default_factory=dict)  # special tokens kept in the output text
    structured: StructuredOutput | None = None  # what the sampler holds the output to


def plan_chat(request: ChatCompletionRequest, tokenizer: Tokenizer | None) -> ChatPlan:
    if tokenizer is None:
        raise RequestError("this model has no tokenizer, so chat is unavailable", param="messages")
    if not request.messages:
        raise RequestError("messages is empty: send at least one message", param="messages")
    messages = template_messages(request.messages)
    tools = _tools(request)
    choice = request.tool_choice or "auto"
    if choice == "auto" and not tools:  # nothing to call: plain text
        choice = "none"
    if choice != "none" and not tools:
        raise RequestError(f"tool_choice {_choice_text(choice)} needs tools", param="tool_choice")
    parser = structured = None
    if choice != "none":
        template_format = detect_format(tokenizer.chat_template)
        # required and named calls are constrained JSON (as vLLM serves them), so they need no
        # format of the template's; its parser only makes the ids it reads back (Mistral: 9
        # alphanumerics), the default ``call_...``.
        ids_from = template_format or ToolCallParser()
        if choice == "required":
            structured = _schema(required_schema(tools, request.parallel_tool_calls), "tools")
            parser = RequiredParser(ids_from)
        elif isinstance(choice, NamedToolChoice):
            index = next((i for i, t in enumerate(tools) if t["function"]["name"] == choice.function.name), None)
            if index is None:
                raise RequestError(f"tool_choice names {choice.function.name!r}, which is not among the tools",
                                   param="tool_choice")
            structured = _schema(function_parameters(tools[index]), f"tools[{index}].function.parameters")
            parser = NamedParser(choice.function.name, ids_from)
        elif template_format is None:  # auto: the model writes calls in its template's format
            raise RequestError("this model's chat template has no tool-call format (raymoe reads Hermes/Qwen "
                               "<tool_call> and Mistral [TOOL_CALLS] templates), so tool_choice \"auto\" cannot "
                               "read calls: send tool_choice \"required\" or a named function (held to the tools' "
                               "schemas), or the request without tools", param="tools")
        else:
            parser = template_format
    response_structured = _response_format(request)
    if response_structured is not None and structured is not None:
        raise RequestError(f"response_format {request.response_format.type} cannot be combined with tool_choice "
                           f"{_choice_text(choice)}: both constrain the whole output", param="response_format")
    if response_structured is not None and parser is not None:
        raise RequestError(f"response_format {request.response_format.type} with tools needs tool_choice \"none\": "
                           "an output held to your format cannot also hold a tool call", param="response_format")
    try:
        prompt = tokenizer.apply_chat_template(messages, tools=tools if choice != "none" else None)
    except ChatTemplateError as error:
        raise RequestError(str(error), param="messages") from None
    keep = {}
    for marker in parser.special_markers if parser is not None else ():
        token = tokenizer.token_to_id(marker)
        if token is not None:
            keep[token] = marker
    return ChatPlan(prompt, parser, keep, structured or response_structured)


def template_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as chat templates read them (transformers' layout): text parts joined, null
    content as '', history tool calls' arguments as objects, ``developer`` as ``system``."""
    return [_template_message(i, m) for i, m in enumerate(messages)]


def _choice_text(choice: Any) -> str:
    return f"{{function: {choice.function.name}}}" if isinstance(choice, NamedToolChoice) else repr(choice)


def _template_message(index: int, message: ChatMessage) -> dict[str, Any]:
    """One message as chat templates read it (transformers' layout)."""
    where = f"messages[{index}]"
    role = ROLES.get(message.role)
    if role is None:
        raise RequestError(f"{where}.role {message.role!r} is not one of {sorted(ROLES)}", param=f"{where}.role")
    if message.tool_calls and role != "assistant":
        raise RequestError(f"{where}: only assistant messages carry tool_calls", param=f"{where}.tool_calls")
    if message.content is None and not (role == "assistant" and (message.tool_calls or message.refusal)):
        raise RequestError(f"{where}.content is required (null only on an assistant turn with tool_calls)",
                           param=f"{where}.content")
    out: dict[str, Any] = {"role": role, "content": _content_text(where, message.content)}
    if message.name is not None:
        out["name"] = message.name
    if role == "tool":
        if not message.tool_call_id:
            raise RequestError(f"{where}: a tool message needs the tool_call_id it answers",
                               param=f"{where}.tool_call_id")
        out["tool_call_id"] = message.tool_call_id
    if message.tool_calls:
        out["tool_calls"] = [_history_call(f"{where}.tool_calls[{j}]", call)
                             for j, call in enumerate(message.tool_calls)]
    return out


def _content_text(where: str, content: str | list[dict[str, Any]] | None) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text":
            raise RequestError(f"{where}.content[{j}].type {kind!r} is not supported: this model reads text only "
                               f"(send {{\"type\": \"text\", \"text\": ...}} parts)",
                               param=f"{where}.content[{j}].type")
        if not isinstance(part.get("text"), str):
            raise RequestError(f"{where}.content[{j}].text must be a string", param=f"{where}.content[{j}].text")
        texts.append(part["text"])
    return PART_SEPARATOR.join(texts)


def _history_call(where: str, call: Any) -> dict[str, Any]:
    """Arguments as an object: templates write them with ``tojson`` (as transformers expects)."""
    try:
        arguments = json.loads(call.function.arguments)
    except (json.JSONDecodeError, RecursionError) as error:
        raise RequestError(f"{where}.function.arguments is not JSON: {error}"[:300],
                           param=f"{where}.function.arguments") from None
    return {"id": call.id, "type": "function", "function": {"name": call.function.name, "arguments": arguments}}


def _tools(request: ChatCompletionRequest) -> list[dict[str, Any]] | None:
    if not request.tools:
        return None
    tools, seen = [], set()
    for i, tool in enumerate(request.tools):
        name = tool.function.name
        if not FUNCTION_NAME.match(name):
            raise RequestError(f"tools[{i}].function.name {name!r} must be 1-64 letters, digits, _ or -",
                               param=f"tools[{i}].function.name")
        if name in seen:
            raise RequestError(f"tools[{i}].function.name {name!r} is defined twice", param=f"tools[{i}].function.name")
        seen.add(name)
        function = {"name": name}
        if tool.function.description is not None:
            function["description"] = tool.function.description
        if tool.function.parameters is not None:
            function["parameters"] = tool.function.parameters
        tools.append({"type": "function", "function": function})
    return tools


def _response_format(request: ChatCompletionRequest) -> StructuredOutput | None:
    response_format = request.response_format
    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_object":
        return StructuredOutput.json_object()
    if response_format.json_schema is None:
        raise RequestError("response_format json_schema needs its json_schema object ({\"name\": ..., "
                           "\"schema\": {...}})", param="response_format")
    if response_format.json_schema.schema is None:
        return StructuredOutput.json_object()
    return _schema(response_format.json_schema.schema, "response_format")


def _schema(schema: dict[str, Any], param: str) -> StructuredOutput:
    try:
        return StructuredOutput.json_schema(schema)
    except ValueError as error:
        text = str(error)
        if param != "response_format":
            text = text.replace("response_format json_schema", "the tools' parameters schema")
        raise RequestError(text, param=param) from None


class ChatStream:
    """One streamed chat choice: text pieces in, OpenAI ``delta`` objects out, with tool calls
    read from the text as it grows (``ToolCallStream``)."""

    def __init__(self, plan: ChatPlan | None):
        self.calls = ToolCallStream(plan.parser) if plan is not None and plan.parser is not None else None
        self.text = ""
        self.started = False

    def delta(self, piece: str, finished: bool, choice: dict[str, Any]) -> dict[str, Any]:
        """The delta for the next ``piece``; on the last one, sets ``choice["finish_reason"]``
        to "tool_calls" when calls were made (as a non-streamed response would)."""
        self.text += piece
        content, calls = (piece, []) if self.calls is None else self.calls.update(self.text, finished)
        delta: dict[str, Any] = {} if self.started else {"role": "assistant"}
        self.started = True
        delta["content"] = None if calls and not content else content
        if calls:
            delta["tool_calls"] = calls
        if finished and self.calls is not None and self.calls.has_calls and choice.get("finish_reason") == "stop":
            choice["finish_reason"] = "tool_calls"
        return delta
