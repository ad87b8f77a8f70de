"""Turn OpenAI request bodies into engine requests, and engine outputs into response bodies.

Shared by ``raymoe run-batch`` and the HTTP ingress, so both accept and answer the same
things. Every rejection is a :class:`~raymoe.engine.api.openai_protocol.RequestError` raised
before the request reaches the engine's step loop.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass
from typing import Any

import msgspec

from raymoe.engine.api.chat import ChatPlan, plan_chat
from raymoe.engine.api.choices import (
    SequenceRequest, TextOffsets, best_outputs, chat_logprobs, completion_logprobs, output_positions, prompt_positions,
    sequence_requests, vllm_prompt_logprobs,
)
from raymoe.engine.engine import RequestOutput
from raymoe.engine.api.openai_protocol import (
    MAX_LOGPROBS,
    ChatCompletionRequest,
    CompletionRequest,
    RequestError,
    completion_body,
    decode_request,
    sampling_params,
)
from raymoe.engine.prompt_logprobs import PromptLogprobs
from raymoe.engine.sampling_params import SamplingParams
from raymoe.engine.tokenizer import PromptTooLong, Tokenizer
from raymoe.engine.api.tool_calls import decode_keeping, parse_calls

DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default for /v1/completions
MAX_SEQUENCES = 256  # sequences one request may generate (prompts * best_of): a router's batch or two


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
    chat: ChatPlan | None = None  # chat: the tool-call parser and kept markers for the output
    # A batch of prompts (completions), ``n`` choices each out of ``best_of`` sequences
    # (engine/api/choices.py); ``prompts`` defaults to ``[prompt_ids]``.
    prompts: list[list[int]] = dataclasses.field(default_factory=list)
    n: int = 1
    best_of: int = 1
    echo: bool = False  # completions: each choice's text and logprobs start with its prompt's
    echo_texts: list[str] = dataclasses.field(default_factory=list)  # each prompt's text, for echo
    generates: bool = True  # False: echo with max_tokens 0 (prompts scored, nothing sampled)
    logprobs: int = 0  # alternatives per position in a choice's logprobs (echoed prompt positions too)
    score_top: int | None = None  # alternatives to score at each prompt position; None: not scored
    prompt_logprobs: int | None = None  # vLLM's prompt_logprobs, returned in each choice

    def __post_init__(self) -> None:
        if not self.prompts:
            object.__setattr__(self, "prompts", [self.prompt_ids])

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(prompt) for prompt in self.prompts)

    def sequences(self) -> list[SequenceRequest]:
        """The sequences to generate, in order (none for an echo with max_tokens 0)."""
        return sequence_requests(self.params, len(self.prompts), self.best_of) if self.generates else []


def prepare_request(endpoint: Endpoint, body: bytes | dict[str, Any], tokenizer: Tokenizer | None,
                    limits: ModelLimits) -> PreparedRequest:
    """Validate a body for ``endpoint`` and tokenize its prompt."""
    if endpoint is Endpoint.CHAT:
        request = decode_request(body, ChatCompletionRequest)
        chat = plan_chat(request, tokenizer)
        prompt_ids = encode_prompt(tokenizer, chat.prompt, limits, "prompt", add_special_tokens=False)
        logprobs = request.top_logprobs or 0
        want_logprobs = request.logprobs
    else:
        return prepare_completion(body, tokenizer, limits)
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
    params = sampling_params(request, min(default_tokens, room), logprobs, limits.vocab_size)
    if chat is not None and chat.structured is not None:
        params = dataclasses.replace(params, structured=chat.structured)
    if len(prompt_ids) + params.max_tokens > limits.max_model_len:
        raise RequestError(
            f"max_tokens={params.max_tokens} plus the prompt's {len(prompt_ids)} tokens exceeds the context "
            f"length {limits.max_model_len}", param="max_tokens", code="context_length_exceeded",
        )
    include_usage = bool(request.stream_options and request.stream_options.include_usage)
    n, best_of = choice_counts(request.n, None, 1)
    return PreparedRequest(endpoint, prompt_ids, params, request.stream, request.return_token_ids, want_logprobs,
                           include_usage, chat, n=n, best_of=best_of)


def prepare_completion(body: bytes | dict[str, Any], tokenizer: Tokenizer | None,
                       limits: ModelLimits) -> PreparedRequest:
    """A /v1/completions body: its prompts tokenized, its choices and scoring planned."""
    request = decode_request(body, CompletionRequest)
    check_model(request.model, limits)
    if request.suffix:
        raise RequestError("suffix is not supported: this model has no fill-in-the-middle; send the text "
                           "before the gap as the prompt", param="suffix", code="unsupported_field")
    prompts, texts = completion_prompts(request.prompt, tokenizer, limits)
    n, best_of = choice_counts(request.n, request.best_of, len(prompts))
    if request.stream and best_of > n:
        raise RequestError("best_of cannot be used with stream: the best choices are known only at the end",
                           param="best_of")
    for field_name in ("logprobs", "prompt_logprobs"):
        value = getattr(request, field_name)
        if value is not None and not 0 <= value <= MAX_LOGPROBS:
            raise RequestError(f"{field_name} must be in [0, {MAX_LOGPROBS}], got {value!r}", param=field_name)
    if request.prompt_logprobs is not None and request.stream:
        raise RequestError("prompt_logprobs are not available with stream (use echo with logprobs)",
                           param="prompt_logprobs")
    generates = request.max_tokens != 0
    if not generates and not request.echo:
        raise RequestError("max_tokens must be >= 1 (0 is allowed with echo: the prompt is scored, nothing "
                           "is generated)", param="max_tokens")
    longest = max(len(p) for p in prompts)
    if longest >= limits.max_model_len:
        raise RequestError(f"the prompt has {longest} tokens; this model's context length is "
                           f"{limits.max_model_len}", param="prompt", code="context_length_exceeded")
    room = limits.max_model_len - longest
    params = sampling_params(request if generates else msgspec.structs.replace(request, max_tokens=1),
                             min(DEFAULT_COMPLETION_TOKENS, room), request.logprobs or 0, limits.vocab_size)
    if generates and longest + params.max_tokens > limits.max_model_len:
        raise RequestError(f"max_tokens={params.max_tokens} plus the prompt's {longest} tokens exceeds the "
                           f"context length {limits.max_model_len}", param="max_tokens",
                           code="context_length_exceeded")
    echo_top = request.logprobs if request.echo and request.logprobs is not None else None
    wanted = [v for v in (echo_top, request.prompt_logprobs) if v is not None]
    return PreparedRequest(
        Endpoint.COMPLETIONS, prompts[0], params, request.stream, request.return_token_ids,
        request.logprobs is not None, bool(request.stream_options and request.stream_options.include_usage),
        prompts=prompts, n=n, best_of=best_of, echo=request.echo, echo_texts=texts if request.echo else [],
        generates=generates, logprobs=request.logprobs or 0, score_top=max(wanted) if wanted else None,
        prompt_logprobs=request.prompt_logprobs,
    )


def encode_prompt(tokenizer: Tokenizer, text: str, limits: ModelLimits, param: str,
                  add_special_tokens: bool = True) -> list[int]:
    """``text``'s token ids; a text of the context length or more is refused with its token
    count, without listing its ids (a 900 kB prompt's list held the GIL for 25 ms)."""
    try:
        return tokenizer.encode(text, add_special_tokens=add_special_tokens, limit=limits.max_model_len - 1)
    except PromptTooLong as long:
        raise RequestError(f"the prompt has {long.tokens} tokens; this model's context length is "
                           f"{limits.max_model_len}", param=param, code="context_length_exceeded") from None


def check_model(model: str | None, limits: ModelLimits) -> None:
    if model is not None and model != limits.name:
        raise RequestError(f"the model {model!r} does not exist; this server serves {limits.name!r}",
                           param="model", status=404, code="model_not_found")


def choice_counts(n: int, best_of: int | None, num_prompts: int) -> tuple[int, int]:
    """``(n, best_of)`` checked: 1 <= n <= best_of, prompts * best_of <= MAX_SEQUENCES."""
    best_of = n if best_of is None else best_of
    if n < 1:
        raise RequestError(f"n must be >= 1, got {n}", param="n")
    if best_of < n:
        raise RequestError(f"best_of must be >= n ({n}), got {best_of}", param="best_of")
    if num_prompts * best_of > MAX_SEQUENCES:
        raise RequestError(f"{num_prompts} prompts * {best_of} sequences each exceeds {MAX_SEQUENCES} per "
                           f"request: split the batch", param="best_of" if best_of > n else "n")
    return n, best_of


def completion_prompts(prompt: str | list[Any], tokenizer: Tokenizer | None,
                       limits: ModelLimits) -> tuple[list[list[int]], list[str]]:
    """The prompts of ``prompt`` (a string, token ids, or a list of either) as token ids,
    with their texts (token ids decoded) for echo."""
    if isinstance(prompt, str):
        batch: list[Any] = [prompt]
    elif prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        batch = [prompt]
    elif prompt and all(isinstance(p, str) for p in prompt):
        batch = list(prompt)
    elif prompt and all(isinstance(p, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in p)
                        for p in prompt):
        batch = list(prompt)
    elif not prompt:
        raise RequestError("the prompt is empty", param="prompt")
    else:
        raise RequestError("prompt must be a string, a list of token ids, a list of strings or a list of "
                           "token-id lists (not a mix)", param="prompt")
    if len(batch) > MAX_SEQUENCES:
        raise RequestError(f"the batch holds {len(batch)} prompts; at most {MAX_SEQUENCES}", param="prompt")
    prompts, texts = [], []
    for index, item in enumerate(batch):
        param = "prompt" if len(batch) == 1 else f"prompt[{index}]"
        if isinstance(item, str):
            if tokenizer is None:
                raise RequestError("this model has no tokenizer; send the prompt as token ids", param=param)
            ids, text = encode_prompt(tokenizer, item, limits, "prompt"), item
        else:
            bad = [t for t in item if not 0 <= t < limits.vocab_size]
            if bad:
                raise RequestError(f"token ids {bad[:5]} are outside the vocabulary [0, {limits.vocab_size})",
                                   param=param)
            ids, text = list(item), (tokenizer.decode(item, skip_special_tokens=False) if tokenizer else "")
        if not ids:
            raise RequestError("the prompt is empty", param=param)
        prompts.append(ids)
        texts.append(text)
    return prompts, texts


def output_text(output: RequestOutput, tokenizer: Tokenizer | None, chat: ChatPlan | None = None) -> str:
    if tokenizer is None:
        return ""
    text = decode_keeping(tokenizer.decode, output.output_token_ids, chat.keep_tokens if chat else {})
    return text[: output.stop_text_index] if output.stop_text_index is not None else text


def response_body(prepared: PreparedRequest, outputs: RequestOutput | list[RequestOutput],
                  tokenizer: Tokenizer | None, request_id: str, model: str,
                  scores: list[PromptLogprobs] | None = None) -> dict[str, Any]:
    """The final (non-streaming) response: ``outputs`` are the finished sequences in
    ``prepared.sequences()`` order, ``scores`` each prompt's (when ``prepared.score_top`` is set)."""
    outputs = [outputs] if isinstance(outputs, RequestOutput) else outputs
    num_choices = len(prepared.prompts) * prepared.n
    chosen = (best_outputs(outputs, len(prepared.prompts), prepared.n, prepared.best_of) if prepared.generates
              else [None] * num_choices)
    choices = [choice_body(prepared, index, output, tokenizer, scores) for index, output in enumerate(chosen)]
    body = completion_body(request_id, model, choices[0], prepared.num_prompt_tokens,
                           sum(len(o.output_token_ids) for o in chosen if o is not None),
                           prepared.endpoint is Endpoint.CHAT)
    body["choices"] = choices
    return body


def choice_body(prepared: PreparedRequest, index: int, output: RequestOutput | None, tokenizer: Tokenizer | None,
                scores: list[PromptLogprobs] | None) -> dict[str, Any]:
    """Choice ``index`` (of prompt ``index // n``) of a finished request; ``output`` None: an
    echo with max_tokens 0."""
    prompt_index = index // prepared.n
    prompt = prepared.prompts[prompt_index]
    text = output_text(output, tokenizer, prepared.chat) if output is not None else ""
    positions = output_positions(output) if output is not None else []
    choice: dict[str, Any] = {"index": index, "finish_reason": output.finish_reason if output else "length"}
    if prepared.endpoint is Endpoint.CHAT:
        choice["message"] = chat_message(prepared.chat, text, choice)
        choice["logprobs"] = chat_logprobs(positions, tokenizer) if prepared.want_logprobs else None
    else:
        if prepared.echo:
            text = prepared.echo_texts[prompt_index] + text
            if prepared.want_logprobs:
                positions = prompt_positions(prompt, scores[prompt_index], prepared.logprobs) + positions
        choice["text"] = text
        choice["logprobs"] = completion_logprobs(positions, tokenizer) if prepared.want_logprobs else None
        if prepared.prompt_logprobs is not None:
            choice["prompt_logprobs"] = vllm_prompt_logprobs(prompt, scores[prompt_index], prepared.prompt_logprobs,
                                                             tokenizer)
    if prepared.return_token_ids:
        choice["token_ids"] = list(output.output_token_ids) if output is not None else []
        choice["prompt_token_ids"] = list(prompt)
    return choice


def chat_message(plan: ChatPlan | None, text: str, choice: dict[str, Any]) -> dict[str, Any]:
    """The assistant message of a finished chat output: its tool calls read by the plan's
    parser (finish_reason "tool_calls" when it made any and was not cut short)."""
    if plan is None or plan.parser is None:
        return {"role": "assistant", "content": text}
    content, calls = parse_calls(plan.parser, text)
    if not calls:
        return {"role": "assistant", "content": text}
    if choice["finish_reason"] == "stop":
        choice["finish_reason"] = "tool_calls"
    return {"role": "assistant", "content": content, "tool_calls": calls}


def logprobs_body(output: RequestOutput, tokenizer: Tokenizer | None, chat: bool, start: int = 0,
                  offsets: TextOffsets | None = None) -> dict[str, Any]:
    """Logprobs of the generated tokens ``start:`` in OpenAI's completions or chat layout
    (a stream's pieces, ``offsets`` carried from one to the next; see engine/api/choices.py)."""
    positions = output_positions(output, start)
    return chat_logprobs(positions, tokenizer) if chat else completion_logprobs(positions, tokenizer, offsets)
