"""A chat template that fails on its input, grows without bound or runs long is a 400 for that
request, never a 500: the real Tokenizer, a real template file, prepare_request's answer."""

from __future__ import annotations

import shutil

import pytest

from raymoe.engine.api.completions import Endpoint, ModelLimits, prepare_request
from raymoe.engine.api.openai_protocol import RequestError
from raymoe.engine.tokenizer import TEMPLATE_MAX_CHARS, Tokenizer


def tokenizer_with(template: str, source_dir: str, tmp_path) -> Tokenizer:
    folder = tmp_path / "tok"
    folder.mkdir()
    shutil.copy(f"{source_dir}/tokenizer.json", folder / "tokenizer.json")
    (folder / "chat_template.jinja").write_text(template)
    return Tokenizer(str(folder))


@pytest.mark.parametrize("template, messages, match", [
    ("{{ messages[5]['content'] }}", [{"role": "user", "content": "hi"}],
     "cannot render these messages"),  # UndefinedError inside (an empty list is refused before any template)
    ("{% for i in range(99999) %}{{ 'x' * 99999 }}{% endfor %}", [{"role": "user", "content": "hi"}],
     f"exceeds {TEMPLATE_MAX_CHARS} characters"),
    ("{{ raise_exception('only user turns, please') }}", [{"role": "user", "content": "hi"}], "only user turns"),
], ids=["reads messages[5] of one", "output grows without bound", "the template's own raise_exception"])
def test_template_failures_are_400s_naming_messages(tiny_mixtral_dir, tmp_path, template, messages, match):
    tokenizer = tokenizer_with(template, tiny_mixtral_dir, tmp_path)
    body = {"messages": messages, "max_tokens": 2}
    with pytest.raises(RequestError, match=match) as caught:
        prepare_request(Endpoint.CHAT, body, tokenizer, ModelLimits("tiny", 512, 256))
    assert caught.value.status == 400 and caught.value.param == "messages"
