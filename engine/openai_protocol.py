"""OpenAI-compatible request and response bodies (completions, chat completions).

Requests are decoded with msgspec into typed structs (never pickled), validated once, and
turned into :class:`~raymoe.engine.sampling_params.SamplingParams`. Every problem raises
:class:`RequestError`, which carries OpenAI's error shape and an HTTP status.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

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


class StreamOptions(msgspec.Struct):
    include_usage: bool = False


class _Sampling(msgspec.Struct, kw_only=True):
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
    user: str | None = None


class CompletionRequest(_Sampling, kw_only=True):
    prompt: str | list[int | str]  # a string, token ids, or a one-string list
    logprobs: int | None = None
    echo: bool = False


class ChatMessage(msgspec.Struct):
    role: str
    content: str


class ChatCompletionRequest(_Sampling, kw_only=True):
    messages: list[ChatMessage]
    logprobs: bool = False
    top_logprobs: int | None = None
    max_completion_tokens: int | None = None


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
        text = str(error)
        param = text.rsplit("at `$.", 1)[1].rstrip("`") if "at `$." in text else None
        raise RequestError(f"invalid request: {text}", param=param) from None
    except msgspec.DecodeError as error:
        raise RequestError(f"the request body is not valid JSON: {error}") from None


def sampling_params(request: _Sampling, default_max_tokens: int, logprobs: int = 0) -> SamplingParams:
    if request.n != 1:
        raise RequestError("only n=1 is supported", param="n")
    max_tokens = getattr(request, "max_completion_tokens", None)
    max_tokens = request.max_tokens if max_tokens is None else max_tokens
    stop = [request.stop] if isinstance(request.stop, str) else list(request.stop or [])
    if not 0 <= logprobs <= MAX_LOGPROBS:
        raise RequestError(f"logprobs must be in [0, {MAX_LOGPROBS}]", param="logprobs")
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
