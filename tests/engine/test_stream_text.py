"""TextStream: streamed pieces never show what the final text cuts, and add up to it.

The reference is a plain simulation of a request: tokens decode to fixed strings, the text
after each token is searched for the stop strings (as the engine does), and the request
ends at the first step whose text holds one, cut where it starts. Whatever the tokens, the
pieces must (1) add up to the final text, and (2) never run ahead of it: after every step,
what was sent so far is a prefix of the final text.
"""

from __future__ import annotations

import random

import pytest

from raymoe.engine.api.stream_text import TextStream


def simulate(pieces: list[str], stop: tuple[str, ...]) -> tuple[list[str], str]:
    """Stream ``pieces`` (one token each) through TextStream; returns (sent pieces, final text)."""
    decode = lambda ids: "".join(pieces[i] for i in ids)  # noqa: E731
    stream = TextStream(decode, stop)
    sent: list[str] = []
    for n in range(1, len(pieces) + 1):
        text = decode(list(range(n)))
        found = [i for i in (text.find(s) for s in stop) if i >= 0]
        finished = bool(found) or n == len(pieces)
        index = min(found) if found else None
        sent.append(stream.update(list(range(n)), finished, index))
        if finished:
            return sent, text[:index] if index is not None else text
    raise AssertionError("unreachable")


def check(pieces: list[str], stop: tuple[str, ...]) -> tuple[list[str], str]:
    sent, final = simulate(pieces, stop)
    shown = ""
    for piece in sent:
        shown += piece
        assert final.startswith(shown), (shown, final)  # never ahead of the final text
    assert shown == final
    return sent, final


def test_a_stop_string_split_across_tokens_is_held_back_then_cut():
    sent, final = check(["Hel", "lo ", "wo", "r", "ld", "!"], stop=("world",))
    assert final == "Hello "
    # "wo" and "r" could be the start of "world": they are never shown.
    assert "".join(sent) == "Hello " and not any("w" in piece for piece in sent)


def test_text_that_turns_out_not_to_be_a_stop_string_is_released():
    sent, final = check(["ab", "c", "abd", "x", "y", "z"], stop=("abc!",))
    assert final == "abcabdxyz"
    assert sent[-1] != final  # the tail came late, but it came


def test_without_stop_strings_only_a_split_character_waits():
    sent, final = check(["a", "b\ufffd", "\u00e9", "c"], stop=())
    assert sent[:2] == ["a", "b"]  # the half character (U+FFFD) waits for the next token
    assert final == "ab\ufffd\u00e9c"


def test_the_earliest_of_several_stop_strings_wins():
    _, final = check(["x", "yz", "STOP", "end"], stop=("end", "yzS"))
    assert final == "x"


@pytest.mark.parametrize("seed", range(40))
def test_random_tokens_and_stops_never_leak_and_always_add_up(seed):
    rng = random.Random(seed)
    alphabet = "ab \ufffd"
    pieces = ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 3))) for _ in range(rng.randint(1, 15))]
    stop = tuple({"".join(rng.choice("ab ") for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(0, 3))})
    check(pieces, stop)
