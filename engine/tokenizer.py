"""The checkpoint's tokenizer: ``tokenizer.json`` through ``tokenizers``, plus its chat template.

The chat template comes from ``tokenizer_config.json`` (``chat_template``) or a
``chat_template.jinja`` file beside it, and is rendered in a sandboxed Jinja environment.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

from tokenizers import Tokenizer as HFTokenizer


TEMPLATE_MAX_CHARS = 1 << 22  # 4 Mi characters: far beyond any context, small for a server
TEMPLATE_TIME_LIMIT_S = 2.0


class ChatTemplateError(ValueError):
    """The model has no chat template, or rendering it failed."""


class Tokenizer:
    def __init__(self, model_dir: str):
        path = os.path.join(model_dir, "tokenizer.json")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{path} not found: raymoe needs a fast-tokenizer tokenizer.json")
        self._tokenizer = HFTokenizer.from_file(path)
        config_path = os.path.join(model_dir, "tokenizer_config.json")
        self.config: dict[str, Any] = {}
        if os.path.isfile(config_path):
            with open(config_path, encoding="utf-8") as handle:
                self.config = json.load(handle)
        template = self.config.get("chat_template")
        template_path = os.path.join(model_dir, "chat_template.jinja")
        if not template and os.path.isfile(template_path):
            with open(template_path, encoding="utf-8") as handle:
                template = handle.read()
        if isinstance(template, list):  # named templates: take the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        self.chat_template: str | None = template or None
        self._compiled = None

    @property
    def vocab_size(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # encode_batch releases the GIL while it works (encode holds it: measured 0.9 s of a
        # server's event loop frozen by one 1 MiB prompt), so other threads and requests go on.
        return self._tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str:
        """The vocabulary entry of ``token_id`` (unique per id, unlike decoding it alone)."""
        return self._tokenizer.id_to_token(token_id) or f"<{token_id}>"

    def token_to_id(self, token: str) -> int | None:
        return self._tokenizer.token_to_id(token)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        if self.chat_template is None:
            raise ChatTemplateError("this model has no chat template; use /v1/completions with a plain prompt")
        if self._compiled is None:
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            def raise_exception(message: str) -> None:
                raise ChatTemplateError(message)

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = raise_exception
            self._compiled = env.from_string(self.chat_template)
        # Rendered piece by piece, so that a template that grows without bound or runs long
        # is stopped at the limits (the sandbox already bounds ranges and forbids unsafe calls).
        deadline = time.monotonic() + TEMPLATE_TIME_LIMIT_S
        pieces, size = [], 0
        try:
            for piece in self._compiled.generate(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=_token_text(self.config.get("bos_token")),
                eos_token=_token_text(self.config.get("eos_token")),
            ):
                size += len(piece)
                if size > TEMPLATE_MAX_CHARS:
                    raise ChatTemplateError(f"the chat template's output exceeds {TEMPLATE_MAX_CHARS} characters")
                if time.monotonic() > deadline:
                    raise ChatTemplateError(f"rendering the chat template took longer than {TEMPLATE_TIME_LIMIT_S} s")
                pieces.append(piece)
        except ChatTemplateError:
            raise
        except Exception as error:  # the template failed on these messages (e.g. messages[0] of [])
            raise ChatTemplateError(f"the chat template cannot render these messages: "
                                    f"{type(error).__name__}: {error}"[:500]) from None
        return "".join(pieces)


def _token_text(token: Any) -> str:
    if isinstance(token, dict):
        return token.get("content", "")
    return token or ""
