"""OpenAI-compatible request and response bodies (completions, chat completions).

Requests are decoded with msgspec into typed structs (never pickled), validated once, and
turned into :class:`~raymoe.engine.sampling_params.SamplingParams`. Every problem raises
:class:`RequestError`, which carries OpenAI's error shape and an HTTP status.
"""

from __future__ import annotations

import re
import time
import uuid
from typing import Any, Literal

import msgspec

from raymoe.engine.sampler import MIN_TEMPERATURE
from raymoe.engine.sampling_params import SamplingParams

MAX_LOGPROBS = 20


class RequestError(ValueError):
    """A request that cannot be served; ``body()`` is OpenAI's error object."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str | None = None,
                 error_type: str = "invalid_request_error"):
        super().__init__(message)
        self.message, self.param, self.status, self.code, self.error_type = message, param, status, code, error_type

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.error_type, "param": self.param, "code": self.code}}


class StreamOptions(msgspec.Struct, forbid_unknown_fields=True):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: accepted, usage still comes once at the end


# Unknown fields are refused (a 400 naming them), never ignored: a field raymoe does not
# implement would otherwise change nothing silently. Subclasses inherit the setting.
class _Sampling(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    model: str | None = None
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    return_token_ids: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    user: str | None = None  # OpenAI's end-user id: accepted, not used
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> bias added to its logit
    min_tokens: int = 0


class CompletionRequest(_Sampling, kw_only=True):
    # A string, a list of token ids, or a batch: a list of strings or of token-id lists
    # (checked in engine/api/completions.py, which names what is wrong).
    prompt: str | list[Any]
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None  # refused: no fill-in-the-middle
    prompt_logprobs: int | None = None  # vLLM's: logprobs of the prompt's tokens, top-N each


class TokenizeRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """vLLM's /tokenize: ``prompt`` (completions) or ``messages`` (the chat template's rendering)."""
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # default: true for a prompt, false for messages
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    model: str | None = None
    tokens: list[int]


class FunctionCall(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    name: str
    arguments: str  # JSON text, as OpenAI returns it


class ToolCall(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """A call the assistant made, sent back in the conversation's history."""
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """One turn. ``content``: a string, a list of parts (only ``{"type": "text"}`` parts are
    served; engine/api/chat.py refuses the others naming them), or null on an assistant turn
    that made ``tool_calls``. The history-only fields ``refusal`` and ``annotations`` are
    accepted and not shown to the model; ``audio`` and ``function_call`` only as null
    (as clients echo a previous response's message)."""
    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    refusal: str | None = None
    annotations: list[Any] | None = None
    audio: None = None  # an audio reply: refused unless null (text only)
    function_call: None = None  # OpenAI's deprecated form of tool_calls: refused unless null


class FunctionDefinition(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema
    strict: bool | None = None


class Tool(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    name: str


class NamedToolChoice(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    type: Literal["function"]
    function: FunctionName


class JsonSchemaFormat(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    name: str = "response"
    description: str | None = None
    schema: dict[str, Any] | None = None  # absent: any JSON object
    strict: bool | None = None


class ResponseFormat(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class ChatCompletionRequest(_Sampling, kw_only=True):
    messages: list[ChatMessage]
    logprobs: bool = False
    top_logprobs: int | None = None
    max_completion_tokens: int | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    response_format: ResponseFormat | None = None


MAX_JSON_DEPTH = 32  # OpenAI bodies nest 4-6 deep; deeper is refused before decoding


def check_json_depth(raw: bytes, limit: int = MAX_JSON_DEPTH) -> None:
    """Refuse JSON nested deeper than ``limit`` (arrays and objects), without parsing it: a
    linear scan that skips strings. Deep nesting would otherwise exhaust the decoder's stack."""
    if raw.count(b"[") + raw.count(b"{") <= limit:  # cannot nest deeper: no scan (fast, C)
        return
    depth, in_string, escaped = 0, False, False
    for byte in raw:
        if in_string:
            if escaped:
                escaped = False
            elif byte == 0x5C:  # backslash
                escaped = True
            elif byte == 0x22:  # quote
                in_string = False
        elif byte == 0x22:
            in_string = True
        elif byte in (0x5B, 0x7B):  # [ {
            depth += 1
            if depth > limit:
                raise RequestError(f"the request body nests JSON deeper than {limit} levels")
        elif byte in (0x5D, 0x7D):
            depth -= 1


def decode_request(raw: bytes | dict[str, Any], kind: type[msgspec.Struct]) -> Any:
    """Decode JSON bytes (or an already-parsed dict) into ``kind``; errors name the field."""
    if isinstance(raw, (bytes, bytearray)):
        check_json_depth(raw)
    elif isinstance(raw, str):
        check_json_depth(raw.encode("utf-8", "surrogatepass"))
    try:
        if isinstance(raw, (bytes, bytearray, str)):
            return msgspec.json.decode(raw, type=kind)
        return msgspec.convert(raw, type=kind)
    except msgspec.ValidationError as error:
        raise _validation_error(str(error)) from None
    except msgspec.DecodeError as error:
        raise RequestError(f"the request body is not valid JSON: {error}") from None


def _validation_error(text: str) -> RequestError:
    """msgspec's message as a RequestError whose ``param`` is the field at fault: for an
    unknown field its own path (``messages[0].foo``), else the path msgspec names."""
    where = text.rsplit(" - at `$", 1)[1].rstrip("`").lstrip(".") if " - at `$" in text else ""
    if text.startswith("Object contains unknown field `"):
        field = text.split("`", 2)[1]
        param = f"{where}.{field}" if where else field
        return RequestError(f"unsupported field {param!r}: raymoe does not implement it (see docs/API.md); "
                            f"remove it from the request", param=param, code="unsupported_field")
    return RequestError(f"invalid request: {text}", param=where or None)


_ASCII_INT = re.compile(r"-?[0-9]+")  # str.isdigit() also takes "²", which int() refuses


def logit_bias(request: _Sampling, vocab_size: int) -> tuple[tuple[int, float], ...]:
    """``logit_bias`` as sorted (token id, bias) pairs; keys must be token ids in the vocabulary."""
    pairs = []
    for key, bias in (request.logit_bias or {}).items():
        if not _ASCII_INT.fullmatch(key.strip()) or not 0 <= int(key) < vocab_size:
            raise RequestError(f"logit_bias keys must be token ids in [0, {vocab_size}), got {key!r}",
                               param="logit_bias")
        if not -100.0 <= bias <= 100.0:
            raise RequestError(f"logit_bias values must be in [-100, 100], got {bias!r} for token {key}",
                               param="logit_bias")
        pairs.append((int(key), float(bias)))
    return tuple(sorted(pairs))


def sampling_params(request: _Sampling, default_max_tokens: int, logprobs: int = 0,
                    vocab_size: int | None = None) -> SamplingParams:
    """The request's sampling fields as SamplingParams (``n``/``best_of`` are the caller's:
    one SamplingParams per generated sequence)."""
    max_tokens = getattr(request, "max_completion_tokens", None)
    max_tokens = request.max_tokens if max_tokens is None else max_tokens
    stop = [request.stop] if isinstance(request.stop, str) else list(request.stop or [])
    if not 0 <= logprobs <= MAX_LOGPROBS:
        raise RequestError(f"logprobs must be in [0, {MAX_LOGPROBS}]", param="logprobs")
    if not -2.0 <= request.presence_penalty <= 2.0:
        raise RequestError(f"presence_penalty must be in [-2, 2], got {request.presence_penalty!r}",
                           param="presence_penalty")
    if not -2.0 <= request.frequency_penalty <= 2.0:
        raise RequestError(f"frequency_penalty must be in [-2, 2], got {request.frequency_penalty!r}",
                           param="frequency_penalty")
    if not 0.0 < request.repetition_penalty <= 2.0:
        raise RequestError(f"repetition_penalty must be in (0, 2], got {request.repetition_penalty!r}",
                           param="repetition_penalty")
    if request.min_tokens < 0:
        raise RequestError(f"min_tokens must be >= 0, got {request.min_tokens!r}", param="min_tokens")
    try:
        return SamplingParams(
            max_tokens=default_max_tokens if max_tokens is None else max_tokens,
            # Below MIN_TEMPERATURE sampling is greedy in the limit, and the scaled logits
            # would overflow: such a request is served greedy.
            temperature=0.0 if 0.0 < request.temperature < MIN_TEMPERATURE else request.temperature,
            top_p=request.top_p,
            top_k=request.top_k,
            seed=request.seed,
            stop=tuple(stop),
            stop_token_ids=tuple(request.stop_token_ids or ()),
            ignore_eos=request.ignore_eos,
            logprobs=logprobs,
            presence_penalty=request.presence_penalty,
            frequency_penalty=request.frequency_penalty,
            repetition_penalty=request.repetition_penalty,
            logit_bias=logit_bias(request, vocab_size if vocab_size is not None else 2**63),
            min_tokens=request.min_tokens,
        )
    except ValueError as error:
        param = str(error).split(" ", 1)[0]
        raise RequestError(str(error), param=param) from None


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def completion_body(
    request_id: str, model: str, choice: dict[str, Any], prompt_tokens: int, completion_tokens: int, chat: bool = False
) -> dict[str, Any]:
    return {
        "id": request_id,
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        },
    }
