"""Reference names and bytes of byte-level BPE tokens, from transformers' byte alphabet
(independent of raymoe's tokenizer code)."""

from __future__ import annotations


def token_bytes(tokenizer, token: int) -> bytes:
    """The bytes a byte-level token stands for: its vocabulary piece through GPT-2's alphabet;
    special tokens are their own text."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    alphabet = {char: byte for byte, char in bytes_to_unicode().items()}
    piece = tokenizer.id_to_token(token)
    if not all(c in alphabet for c in piece):
        return piece.encode()
    return bytes(alphabet[c] for c in piece)


def openai_token(tokenizer, token: int) -> str:
    """The token as OpenAI names it: its text, or ``bytes:\\xNN...`` when it is part of a character."""
    data = token_bytes(tokenizer, token)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in data)
