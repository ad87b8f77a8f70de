"""Incremental detokenization for streaming: the pieces always add up to the final text.

Each call gets all output token ids so far and returns only the new text. Two kinds of tail
are held back until more tokens (or the end) make them safe:

- a trailing U+FFFD, which is half of a multi-byte character split across tokens;
- when the request has stop strings, the last ``len(longest stop) - 1`` characters, which
  could still turn out to be the start of a stop string that must not be shown.

At the end the text is cut at the stop string (if one matched), so the concatenated pieces
equal the non-streamed response's text. Until then the text is kept up to date by decoding
only the newest tokens (engine/incremental_text.py: a whole decode per token made a stream
of n tokens cost O(n^2)); the last piece comes from one whole decode, the response's text.
"""

from __future__ import annotations

from typing import Callable, Collection

from raymoe.engine.incremental_text import IncrementalText


class TextStream:
    def __init__(self, decode: Callable[[list[int]], str], stop: tuple[str, ...] = (),
                 holds: Collection[int] = frozenset()):
        """``holds``: the tokenizer's byte-fallback ids (engine/incremental_text.py)."""
        self.decode = decode
        self.incremental = IncrementalText(decode, holds)
        self.holdback = max((len(s) for s in stop), default=1) - 1
        self.sent = 0

    def update(self, token_ids: list[int], finished: bool, stop_text_index: int | None = None) -> str:
        if finished:
            text = self.decode(token_ids)
            final = text[:stop_text_index] if stop_text_index is not None else text
            piece, self.sent = final[self.sent:], len(final)
            return piece
        text = self.incremental.update(token_ids)
        safe = len(text) - self.holdback
        while safe > self.sent and text[safe - 1] == "\ufffd":
            safe -= 1
        if safe <= self.sent:
            return ""
        piece, self.sent = text[self.sent:safe], safe
        return piece
