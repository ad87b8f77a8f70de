"""Incremental detokenization for streaming: the pieces always add up to the final text.

Each call gets all output token ids so far and returns only the new text. Two kinds of tail
are held back until more tokens (or the end) make them safe:

- a trailing U+FFFD, which is half of a multi-byte character split across tokens;
- when the request has stop strings, the last ``len(longest stop) - 1`` characters, which
  could still turn out to be the start of a stop string that must not be shown.

At the end the text is cut at the stop string (if one matched), so the concatenated pieces
equal the non-streamed response's text.
"""

from __future__ import annotations

from typing import Callable


class TextStream:
    def __init__(self, decode: Callable[[list[int]], str], stop: tuple[str, ...] = ()):
        self.decode = decode
        self.holdback = max((len(s) for s in stop), default=1) - 1
        self.sent = 0

    def update(self, token_ids: list[int], finished: bool, stop_text_index: int | None = None) -> str:
        text = self.decode(token_ids)
        if finished:
            final = text[:stop_text_index] if stop_text_index is not None else text
            piece, self.sent = final[self.sent:], len(final)
            return piece
        safe = len(text) - self.holdback
        while safe > self.sent and text[safe - 1] == "\ufffd":
            safe -= 1
        if safe <= self.sent:
            return ""
        piece, self.sent = text[self.sent:safe], safe
        return piece
