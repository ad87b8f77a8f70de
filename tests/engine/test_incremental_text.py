"""engine/incremental_text.py: a growing output's text, decoding a few tokens a step, equals the
whole output decoded (the reference) after every token, for the decoders checkpoints ship:
byte-level BPE (GPT-2 / Qwen style: tokens that split a UTF-8 character) and SentencePiece
style (a leading-space marker stripped at the start, byte fallback). The engine's stop strings
are then found at the same step and index as in the whole text."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from raymoe.engine.demo_tokenizer import build_demo_tokenizer, write_demo_tokenizer
from raymoe.engine.engine import LLMEngine
from raymoe.engine.incremental_text import IncrementalText
from raymoe.engine.sampling_params import SamplingParams
from raymoe.engine.sequence import Sequence
from raymoe.engine.tokenizer import Tokenizer as RaymoeTokenizer


def byte_level():
    tokenizer = build_demo_tokenizer(524)
    return tokenizer.get_vocab_size(), lambda ids: tokenizer.decode(ids, skip_special_tokens=True), frozenset()


def sentencepiece_tokenizer() -> tuple[Tokenizer, dict[str, int]]:
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    for piece in ["\u2581", "\u2581Hello", "\u2581world", "Hello", ".", ",", "\u2581a", "b", "\u2581\u00e9", "\u00e9"]:
        vocab.setdefault(piece, len(vocab))
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    tokenizer.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                           decoders.Strip(" ", 1, 0)])  # Llama / Mixtral's decoder
    return tokenizer, vocab


def sentencepiece_style():
    tokenizer, vocab = sentencepiece_tokenizer()
    return len(vocab), lambda ids: tokenizer.decode(ids, skip_special_tokens=True), frozenset(range(3, 259))


def random_ids(rng: random.Random, vocab_size: int, holds: frozenset[int]) -> list[int]:
    """Up to 80 random ids; where there are byte-fallback tokens, a third of them are (runs of a
    few bytes, valid UTF-8 or not, between words: what a SentencePiece vocabulary produces)."""
    words = [i for i in range(vocab_size) if i not in holds]
    return [rng.choice(sorted(holds)) if holds and rng.random() < 0.35 else rng.choice(words)
            for _ in range(rng.randint(1, 80))]


@pytest.mark.parametrize("make", [byte_level, sentencepiece_style])
def test_the_text_equals_the_whole_decode_after_every_token(make):
    vocab_size, decode, holds = make()
    windows: list[int] = []
    rewrites = 0
    counted = lambda ids: (windows.append(len(ids)), decode(ids))[1]  # noqa: E731
    for seed in range(60):
        rng = random.Random(seed)
        ids = random_ids(rng, vocab_size, holds)
        text = IncrementalText(counted, holds)
        for n in range(1, len(ids) + 1):
            assert text.update(ids[:n]) == decode(ids[:n]), (seed, n)
        assert not text.whole  # never fell back to whole decodes
    # SentencePiece's byte fallback rewrites a run of byte tokens that turns out invalid (random ids
    # make many): without holding text after a byte token, windows cut such runs.
    if holds:
        cut = 0
        for seed in range(60):
            rng = random.Random(seed)
            ids = random_ids(rng, vocab_size, holds)
            text = IncrementalText(decode)
            cut += any(text.update(ids[:n]) != decode(ids[:n]) or text.whole for n in range(1, len(ids) + 1))
        assert cut > 0
    # Updates decode a few tokens, not the output so far (two windows a token: context and all;
    # a run of byte tokens stays in one window until a token of the vocabulary follows it).
    assert sum(windows) / len(windows) < 6


def test_the_sentencepiece_style_decoder_strips_a_windows_leading_space():
    # Why a window decodes its context too: alone, a token's leading space would be lost.
    _, decode, _ = sentencepiece_style()
    hello, world = 3 + 256 + 1, 3 + 256 + 2  # "\u2581Hello", "\u2581world"
    assert decode([hello, world]) == "Hello world" and decode([world]) == "world"
    text = IncrementalText(decode)
    assert text.update([hello]) == "Hello" and text.update([hello, world]) == "Hello world"


def test_a_decoder_that_rewrites_earlier_text_falls_back_to_whole_decodes():
    words = ["a", "b", "c", "d", "e", "f"]
    decode = lambda ids: "".join(words[i] for i in ids).upper() if 3 in ids else "".join(words[i] for i in ids)  # noqa: E731
    text = IncrementalText(decode)
    ids = [0, 1, 2, 3, 4, 5]
    for n in range(1, len(ids) + 1):
        assert text.update(ids[:n]) == decode(ids[:n])
    assert text.whole


def test_the_engines_stop_strings_match_where_the_whole_text_has_them():
    vocab_size, decode, _ = byte_level()
    engine = SimpleNamespace(detokenize=decode, text_holds=frozenset())  # all _match_stop reads
    for seed in range(40):
        rng = random.Random(seed)
        ids = [rng.randrange(3, 120) for _ in range(60)]  # a small alphabet: stop strings do occur
        whole = decode(ids)
        stops = tuple({whole[i:i + rng.randint(1, 3)] for i in rng.sample(range(len(whole) - 3), 2)})
        sequence = Sequence("r", [1], SamplingParams(stop=stops, max_tokens=100), None, 0)
        for n, token in enumerate(ids, start=1):
            sequence.output_ids.append(token)
            text = decode(ids[:n])
            found = [i for i in (text.find(s) for s in stops) if i >= 0]
            assert LLMEngine._match_stop(engine, sequence) == bool(found), (seed, n)
            if found:
                assert sequence.stop_text_index == min(found)
                break
        else:
            raise AssertionError(f"seed {seed}: no stop string matched, though each is in the text")


def test_the_tokenizer_names_its_byte_fallback_tokens(tmp_path):
    tokenizer, _ = sentencepiece_tokenizer()
    (tmp_path / "sp").mkdir()
    tokenizer.save(str(tmp_path / "sp" / "tokenizer.json"))
    assert RaymoeTokenizer(str(tmp_path / "sp")).byte_fallback_ids == frozenset(range(3, 259))
    (tmp_path / "bl").mkdir()
    write_demo_tokenizer(str(tmp_path / "bl"), 524)
    assert RaymoeTokenizer(str(tmp_path / "bl")).byte_fallback_ids == frozenset()  # byte-level BPE: none
