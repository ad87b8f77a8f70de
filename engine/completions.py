"""Turn OpenAI request bodies into engine requests, and engine outputs into response bodies.

Shared by ``raymoe run-batch`` and the HTTP ingress, so both accept and answer the same
things. Every rejection is a :class:`~raymoe.engine.openai_protocol.RequestError` raised
before the request reaches the engine's step loop.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from raymoe.engine.engine import RequestOutput
from raymoe.engine.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    RequestError,
    completion_body,
    decode_request,
    sampling_params,
)
from raymoe.engine.sampling_params import SamplingParams
from raymoe.engine.tokenizer import ChatTemplateError, Tokenizer

DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default for /v1/completions


class Endpoint(enum.Enum):
    COMPLETIONS = "/v1/completions"
    CHAT = "/v1/chat/completions"

    @classmethod
    def parse(cls, url: str) -> "Endpoint":
        for endpoint in cls:
            if url == endpoint.value:
                return endpoint
        raise RequestError(f"unsupported url {url!r}; expected one of {[e.value for e in cls]}", param="url",
                           status=404, code="not_found")


@dataclass(frozen=True)
class ModelLimits:
    name: str
    vocab_size: int
    max_model_len: int


@dataclass(frozen=True)
class PreparedRequest:
    endpoint: Endpoint
    prompt_ids: list[int]
    params: SamplingParams
    stream: bool
    return_token_ids: bool
    want_logprobs: bool
    include_usage: bool = False


def prepare_request(endpoint: Endpoint, body: bytes | dict[str, Any], tokenizer: Tokenizer | None,
                    limits: ModelLimits) -> PreparedRequest:
    """Validate a body for ``endpoint`` and tokenize its prompt."""
    if endpoint is Endpoint.CHAT:
        request = decode_request(body, ChatCompletionRequest)
        if tokenizer is None:
            raise RequestError("this model has no tokenizer, so chat is unavailable", param="messages")
        try:
            text = tokenizer.apply_chat_template([{"role": m.role, "content": m.content} for m in request.messages])
        except ChatTemplateError as error:
            raise RequestError(str(error), param="messages") from None
        prompt_ids = tokenizer.encode(text, add_special_tokens=False)
        logprobs = request.top_logprobs or 0
        want_logprobs = request.logprobs
    else:
        request = decode_request(body, CompletionRequest)
        if request.echo:
            raise RequestError("echo is not supported", param="echo")
        prompt_ids = _completion_prompt(request.prompt, tokenizer, limits)
        logprobs = request.logprobs or 0
        want_logprobs = request.logprobs is not None
    if request.model is not None and request.model != limits.name:
        raise RequestError(f"the model {request.model!r} does not exist; this server serves {limits.name!r}",
                           param="model", status=404, code="model_not_found")
    if not prompt_ids:
        raise RequestError("the prompt is empty", param="prompt")
    if len(prompt_ids) >= limits.max_model_len:
        raise RequestError(
            f"the prompt has {len(prompt_ids)} tokens; this model's context length is {limits.max_model_len}",
            param="prompt", code="context_length_exceeded",
        )
    room = limits.max_model_len - len(prompt_ids)
    default_tokens = DEFAULT_COMPLETION_TOKENS if endpoint is Endpoint.COMPLETIONS else room
    params = sampling_params(request, min(default_tokens, room), logprobs)
    if len(prompt_ids) + params.max_tokens > limits.max_model_len:
        raise RequestError(
            f"max_tokens={params.max_tokens} plus the prompt's {len(prompt_ids)} tokens exceeds the context "
            f"length {limits.max_model_len}", param="max_tokens", code="context_length_exceeded",
        )
    include_usage = bool(request.stream_options and request.stream_options.include_usage)
    return PreparedRequest(endpoint, prompt_ids, params, request.stream, request.return_token_ids, want_logprobs,
                           include_usage)


def _completion_prompt(prompt: str | list[int | str], tokenizer: Tokenizer | None,
                       limits: ModelLimits) -> list[int]:
    if isinstance(prompt, list) and any(isinstance(p, str) for p in prompt) and any(isinstance(p, int) for p in prompt):
        raise RequestError("prompt must be a string or a list of token ids, not a mix", param="prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        if len(prompt) != 1:
            raise RequestError("a batch of prompts is not supported; send one prompt per request", param="prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        if tokenizer is None:
            raise RequestError("this model has no tokenizer; send the prompt as token ids", param="prompt")
        return tokenizer.encode(prompt)
    bad = [t for t in prompt if not 0 <= t < limits.vocab_size]
    if bad:
        raise RequestError(f"token ids {bad[:5]} are outside the vocabulary [0, {limits.vocab_size})",
                           param="prompt")
    return list(prompt)


def output_text(output: RequestOutput, tokenizer: Tokenizer | None) -> str:
    if tokenizer is None:
        return ""
    text = tokenizer.decode(output.output_token_ids)
    return text[: output.stop_text_index] if output.stop_text_index is not None else text


def response_body(prepared: PreparedRequest, output: RequestOutput, tokenizer: Tokenizer | None,
                  request_id: str, model: str) -> dict[str, Any]:
    """The final (non-streaming) response for a finished request."""
    text = output_text(output, tokenizer)
    chat = prepared.endpoint is Endpoint.CHAT
    choice: dict[str, Any] = {"index": 0, "finish_reason": output.finish_reason}
    if chat:
        choice["message"] = {"role": "assistant", "content": text}
    else:
        choice["text"] = text
    choice["logprobs"] = logprobs_body(output, tokenizer, chat) if prepared.want_logprobs else None
    if prepared.return_token_ids:
        choice["token_ids"] = list(output.output_token_ids)
        choice["prompt_token_ids"] = list(prepared.prompt_ids)
    return completion_body(request_id, model, choice, len(prepared.prompt_ids), len(output.output_token_ids), chat)


def logprobs_body(output: RequestOutput, tokenizer: Tokenizer | None, chat: bool, start: int = 0) -> dict[str, Any]:
    """Logprobs of tokens ``start:`` in OpenAI's completions or chat layout.

    Tokens are named by their vocabulary entries, which are unique per id (decoding a lone
    byte-level token can yield the same replacement character for many ids).
    """
    def piece(token: int) -> str:
        return tokenizer.id_to_token(token) if tokenizer else str(token)

    ids = output.output_token_ids[start:]
    lps = output.output_logprobs[start:]
    tops = output.output_top_logprobs[start:]
    if chat:
        return {"content": [
            {"token": piece(t), "logprob": lp, "bytes": list(piece(t).encode()),
             "top_logprobs": [{"token": piece(a), "logprob": alp, "bytes": list(piece(a).encode())} for a, alp in top or []]}
            for t, lp, top in zip(ids, lps, tops)
        ]}
    tokens = [piece(t) for t in ids]
    offsets, position = [], 0
    for token in tokens:
        offsets.append(position)
        position += len(token)
    return {
        "tokens": tokens,
        "token_logprobs": lps,
        "top_logprobs": [{piece(a): alp for a, alp in top} if top else None for top in tops],
        "text_offset": offsets,
    }
