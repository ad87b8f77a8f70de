"""The checkpoint's tokenizer: ``tokenizer.json`` through ``tokenizers``, plus its chat template.

The chat template comes from ``tokenizer_config.json`` (``chat_template``) or a
``chat_template.jinja`` file beside it, and is rendered in a sandboxed Jinja environment.
"""

from __future__ import annotations

import functools
import json
import os
import re
import time
from typing import Any, Callable

from tokenizers import Tokenizer as HFTokenizer


TEMPLATE_MAX_CHARS = 1 << 22  # 4 Mi characters: far beyond any context, small for a server
TEMPLATE_TIME_LIMIT_S = 2.0


class ChatTemplateError(ValueError):
    """The model has no chat template, or rendering it failed."""


class PromptTooLong(ValueError):
    """A text has more tokens than the caller's limit (:meth:`Tokenizer.encode`'s ``limit``)."""

    def __init__(self, tokens: int, limit: int):
        super().__init__(f"{tokens} tokens, more than {limit}")
        self.tokens, self.limit = tokens, limit


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
        self._added_ids = set(self._tokenizer.get_added_tokens_decoder())
        self._piece_bytes = _piece_decoder(self._tokenizer.decoder)
        self._bytes: dict[int, bytes] = {}

    @functools.cached_property
    def byte_fallback_ids(self) -> frozenset[int]:
        """Ids of SentencePiece's byte-fallback tokens (``<0x41>``). Their decoder turns a run of
        them that is not valid UTF-8 into U+FFFD as a whole, so streamed text does not settle
        right after one (engine/incremental_text.py). Byte-level BPE has none."""
        vocab = self._tokenizer.get_vocab(with_added_tokens=False)
        return frozenset(i for token, i in vocab.items()
                         if len(token) == 6 and token.startswith("<0x") and token.endswith(">"))

    @property
    def vocab_size(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True, limit: int | None = None) -> list[int]:
        """``text``'s token ids; with ``limit``, a text of more tokens raises :class:`PromptTooLong`
        (with its count) before its ids become a Python list.

        encode_batch releases the GIL while it works (encode holds it: measured 0.9 s of a
        server's event loop frozen by one 1 MiB prompt), so other threads and requests go on.
        Its ``ids`` hold the GIL for the whole list (25 ms for 714k tokens, one C call the
        event loop cannot interrupt), so a prompt over the context is counted, never listed."""
        encoding = self._tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0]
        if limit is not None and len(encoding) > limit:
            raise PromptTooLong(len(encoding), limit)
        return encoding.ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str:
        """The vocabulary entry of ``token_id`` (unique per id, unlike decoding it alone)."""
        return self._tokenizer.id_to_token(token_id) or f"<{token_id}>"

    def token_to_id(self, token: str) -> int | None:
        return self._tokenizer.token_to_id(token)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes ``token_id`` stands for in decoded text (a byte-level piece such as
        ``ĠFrance`` is `` France``; a piece of a multi-byte character is that part alone)."""
        cached = self._bytes.get(token_id)
        if cached is None:
            piece = self._tokenizer.id_to_token(token_id)
            if piece is None:
                cached = b""
            elif token_id in self._added_ids:  # special and added tokens are their own text
                cached = piece.encode("utf-8")
            else:
                cached = self._piece_bytes(piece)
            self._bytes[token_id] = cached
        return cached

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None) -> str:
        """Render ``messages`` (and ``tools``, OpenAI's ``{"type": "function", "function": ...}``
        entries, as transformers passes them) with the checkpoint's chat template."""
        if self.chat_template is None:
            raise ChatTemplateError("this model has no chat template; use /v1/completions with a plain prompt")
        if self._compiled is None:
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            def raise_exception(message: str) -> None:
                raise ChatTemplateError(message)

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=["jinja2.ext.loopcontrols"])
            env.globals["raise_exception"] = raise_exception
            # As transformers renders templates (what checkpoints were trained on): tojson keeps
            # key order and does not escape HTML, unlike Jinja's own filter.
            env.filters["tojson"] = _tojson
            self._compiled = env.from_string(self.chat_template)
        # Rendered piece by piece, so that a template that grows without bound or runs long
        # is stopped at the limits (the sandbox already bounds ranges and forbids unsafe calls).
        deadline = time.monotonic() + TEMPLATE_TIME_LIMIT_S
        pieces, size = [], 0
        try:
            for piece in self._compiled.generate(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                tools=tools,
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


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _token_text(token: Any) -> str:
    if isinstance(token, dict):
        return token.get("content", "")
    return token or ""


def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE's printable stand-ins (GPT-2's): the character that spells each byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
                 *range(ord("\u00ae"), ord("\u00ff") + 1)]
    stand_ins, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            stand_ins[chr(byte)] = byte
        else:  # unprintable bytes are spelled by the characters from U+0100 on, in order
            stand_ins[chr(256 + extra)] = byte
            extra += 1
    return stand_ins


_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _piece_decoder(decoder: Any) -> Callable[[str], bytes]:
    """How a vocabulary piece becomes bytes under the tokenizer's decoder (byte-level BPE,
    SentencePiece-style ``▁`` and ``<0xNN>`` byte fallback, WordPiece ``##``)."""
    spec = json.loads(decoder.__getstate__()) if decoder is not None else {}
    parts = spec.get("decoders", [spec]) if spec.get("type") == "Sequence" else [spec]
    kinds = {part.get("type") for part in parts}
    if "ByteLevel" in kinds:
        alphabet = _byte_level_alphabet()

        def byte_level(piece: str) -> bytes:
            if all(c in alphabet for c in piece):
                return bytes(alphabet[c] for c in piece)
            return piece.encode("utf-8")
        return byte_level
    replacements = [(p["pattern"]["String"], p["content"]) for p in parts
                    if p.get("type") == "Replace" and "String" in p.get("pattern", {})]
    replacements += [(p.get("replacement", "\u2581"), " ") for p in parts if p.get("type") == "Metaspace"]
    prefix = next((p.get("prefix", "##") for p in parts if p.get("type") == "WordPiece"), None)
    byte_fallback = "ByteFallback" in kinds

    def text_piece(piece: str) -> bytes:
        if byte_fallback and (match := _BYTE_FALLBACK.fullmatch(piece)):
            return bytes([int(match.group(1), 16)])
        if prefix and piece.startswith(prefix):
            piece = piece[len(prefix):]
        for pattern, content in replacements:
            piece = piece.replace(pattern, content)
        return piece.encode("utf-8")
    return text_piece
