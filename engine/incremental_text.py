"""A growing output's text, decoding only the last few tokens at each new one.

``decode(ids)`` of a whole output at every token costs time in proportion to its length, so a
stream of n tokens cost O(n^2): on the 2-vCPU guest of docs/BENCHMARKS.md a byte-level BPE
decode of 512 / 4,000 ids took ~0.05 / ~1.3 ms, once per token for the streamed text (the
ingress) and again for the stop strings (the router's step thread, for every sequence of the
batch that has one). :class:`IncrementalText` keeps what is settled and decodes a window: the
ids since the last settled point, after the ids of the update before it as context (so a
decoder that treats a window's first token specially, e.g. a SentencePiece leading space,
treats the context's first token that way and not the new one):

    context = decode(ids[prefix:read])       # settled already
    window  = decode(ids[prefix:])
    new     = window[len(context):]           # what ids[read:] add

``new`` is settled (``prefix, read = read, len(ids)``) unless it ends in U+FFFD, half of a
character whose bytes are still coming; until then it is the unsettled tail. The text is
``settled + tail``: ``decode(ids)`` for every decoder whose output for a list starts with its
output for any prefix of that list, up to a trailing U+FFFD. A window whose text does not
start with its context's breaks that (SentencePiece's byte fallback turns a run of byte tokens
that is not valid UTF-8 into U+FFFD as a whole, so a byte that decoded alone may read
differently once an invalid one follows it). So nothing settles right after a token of
``holds`` (the tokenizer's byte-fallback tokens, engine/tokenizer.py): a window then always
starts after a whole run. Should a window still break the rule, that output is decoded whole
at every update from then on (the old cost, the exact text).
"""

from __future__ import annotations

from typing import Callable, Collection

REPLACEMENT = "\ufffd"


class IncrementalText:
    def __init__(self, decode: Callable[[list[int]], str], holds: Collection[int] = frozenset()):
        self.decode = decode
        self.holds = holds  # ids after which the text does not settle
        self.settled = ""  # decode(ids[:read])
        self.tail = ""  # what ids[read:] add, not settled yet (ends in U+FFFD)
        self.prefix = 0  # ids[prefix:read] are the next window's context
        self.read = 0
        self.whole = False  # a window broke the prefix rule: every update decodes the whole output

    @property
    def text(self) -> str:
        """``decode(ids)`` of the last update's ids."""
        return self.settled + self.tail

    def update(self, ids: list[int]) -> str:
        """The text of ``ids``, which extend the last update's ids; returns :attr:`text`."""
        if not self.whole and len(ids) >= self.read:
            context = self.decode(ids[self.prefix:self.read]) if self.read > self.prefix else ""
            window = self.decode(ids[self.prefix:])
            if window.startswith(context):
                new = window[len(context):]
                if new.endswith(REPLACEMENT) or (ids and ids[-1] in self.holds):
                    self.tail = new
                else:
                    self.settled += new
                    self.tail = ""
                    self.prefix, self.read = self.read, len(ids)
                return self.text
        self.whole = True
        self.settled, self.tail = self.decode(ids), ""
        return self.settled
