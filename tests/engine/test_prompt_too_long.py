"""A prompt over the context is refused by its token count alone (engine/tokenizer.py's
``limit``): the same count and message as before, without its ids becoming a Python list
(that list held the GIL for 25 ms for a 900 kB prompt, stalling the ingress' event loop)."""

from __future__ import annotations

import json

import pytest

from raymoe.engine.api.completions import Endpoint, ModelLimits, prepare_request
from raymoe.engine.api.openai_protocol import RequestError
from raymoe.engine.tokenizer import PromptTooLong, Tokenizer


@pytest.fixture(scope="module")
def tokenizer(tiny_mixtral_dir) -> Tokenizer:
    return Tokenizer(tiny_mixtral_dir)


def test_encode_with_a_limit_counts_a_longer_text_and_lists_a_shorter_one(tokenizer):
    text = "lorem ipsum dolor sit amet " * 50
    ids = tokenizer.encode(text)
    assert tokenizer.encode(text, limit=len(ids)) == ids  # at the limit: listed as without one
    with pytest.raises(PromptTooLong) as raised:
        tokenizer.encode(text, limit=len(ids) - 1)
    assert (raised.value.tokens, raised.value.limit) == (len(ids), len(ids) - 1)


@pytest.mark.parametrize("endpoint", [Endpoint.COMPLETIONS, Endpoint.CHAT])
def test_a_prompt_over_the_context_is_refused_with_its_token_count(tokenizer, endpoint):
    text = "lorem ipsum dolor sit amet " * 50
    limits = ModelLimits("tiny", tokenizer.vocab_size, 64)
    body = ({"prompt": text} if endpoint is Endpoint.COMPLETIONS
            else {"messages": [{"role": "user", "content": text}]})
    with pytest.raises(RequestError) as raised:
        prepare_request(endpoint, json.dumps(body).encode(), tokenizer, limits)
    error = raised.value
    assert error.param == "prompt" and error.body()["error"]["code"] == "context_length_exceeded"
    assert "this model's context length is 64" in error.message
    counted = int(error.message.split("the prompt has ")[1].split(" tokens")[0])
    expected = (len(tokenizer.encode(text)) if endpoint is Endpoint.COMPLETIONS
                else len(tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": text}]),
                                          add_special_tokens=False)))
    assert counted == expected
