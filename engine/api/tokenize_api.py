"""vLLM's ``POST /tokenize`` and ``POST /detokenize``: the served tokenizer, over HTTP.

/tokenize takes ``prompt`` (encoded as /v1/completions encodes it) or ``messages``
(rendered by the chat template as /v1/chat/completions renders them) and answers
``{count, max_model_len, tokens, token_strs}``; /detokenize takes ``tokens`` and answers
``{prompt}``.
"""

from __future__ import annotations

from typing import Any

from raymoe.engine.api.chat import plan_chat
from raymoe.engine.api.completions import ModelLimits, check_model
from raymoe.engine.api.openai_protocol import (
    ChatCompletionRequest, DetokenizeRequest, RequestError, TokenizeRequest, decode_request,
)
from raymoe.engine.tokenizer import Tokenizer


def tokenize_body(body: bytes | dict[str, Any], tokenizer: Tokenizer | None, limits: ModelLimits) -> dict[str, Any]:
    request = decode_request(body, TokenizeRequest)
    check_model(request.model, limits)
    if tokenizer is None:
        raise RequestError("this model has no tokenizer", param="prompt", status=404, code="no_tokenizer")
    if (request.prompt is None) == (request.messages is None):
        raise RequestError("give exactly one of prompt and messages", param="prompt")
    if request.prompt is not None:
        tokens = tokenizer.encode(request.prompt, add_special_tokens=request.add_special_tokens is not False)
    else:
        if not request.add_generation_prompt:
            raise RequestError("add_generation_prompt false is not supported: the chat is rendered as "
                               "/v1/chat/completions renders it", param="add_generation_prompt")
        text = plan_chat(ChatCompletionRequest(messages=request.messages), tokenizer).prompt
        tokens = tokenizer.encode(text, add_special_tokens=bool(request.add_special_tokens))
    return {"count": len(tokens), "max_model_len": limits.max_model_len, "tokens": tokens,
            "token_strs": [tokenizer.id_to_token(t) for t in tokens] if request.return_token_strs else None}


def detokenize_body(body: bytes | dict[str, Any], tokenizer: Tokenizer | None, limits: ModelLimits) -> dict[str, Any]:
    request = decode_request(body, DetokenizeRequest)
    check_model(request.model, limits)
    if tokenizer is None:
        raise RequestError("this model has no tokenizer", param="tokens", status=404, code="no_tokenizer")
    bad = [t for t in request.tokens if not 0 <= t < tokenizer.vocab_size]
    if bad:
        raise RequestError(f"token ids {bad[:5]} are outside the vocabulary [0, {tokenizer.vocab_size})",
                           param="tokens")
    return {"prompt": tokenizer.decode(request.tokens, skip_special_tokens=False)}
