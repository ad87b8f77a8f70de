"""Streamed text and stop strings: the whole output decoded at every token (before) against
engine/incremental_text.py's windows (now), per token at a given output length.

One byte-level BPE tokenizer (the demo tokenizer the benchmarks' checkpoints ship: the
`tokenizers` library's ByteLevel decoder, as GPT-2 / Qwen / DeepSeek checkpoints use) and the
ids of a real English text (docs/ARCHITECTURE.md, encoded). For each output length n, the
microseconds one more token costs: a whole decode of n ids (what TextStream.update and the
engine's stop-string check each did per token) against one IncrementalText update, and the total
for streaming n tokens both ways (both decoders' texts are checked equal at every token).

    python benchmarks/bench_detokenize.py [--lengths 64,512,2048,8192]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

from common import machine_description
from raymoe.engine.demo_tokenizer import write_demo_tokenizer
from raymoe.engine.incremental_text import IncrementalText
from raymoe.engine.tokenizer import Tokenizer

HERE = os.path.dirname(os.path.abspath(__file__))


def per_call_us(function, repeats: int) -> float:
    started = time.perf_counter()
    for _ in range(repeats):
        function()
    return 1e6 * (time.perf_counter() - started) / repeats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default="64,512,2048,8192", help="output lengths, comma-separated")
    args = parser.parse_args()
    lengths = [int(n) for n in args.lengths.split(",")]
    with tempfile.TemporaryDirectory() as path:
        write_demo_tokenizer(path, 524)
        tokenizer = Tokenizer(path)
        with open(os.path.join(HERE, "..", "docs", "ARCHITECTURE.md"), encoding="utf-8") as f:
            ids = tokenizer.encode(f.read(), add_special_tokens=False)
        while len(ids) < max(lengths) + 1:
            ids += ids
        print(f"machine: {machine_description()}; byte-level BPE, English text ids")
        print(f"{'tokens':>7} {'whole decode us/token':>22} {'incremental us/token':>21} {'ratio':>6} "
              f"{'stream whole ms':>16} {'stream incremental ms':>22}")
        for n in lengths:
            head, longer = ids[:n], ids[:n + 1]  # (the engine and the stream pass their growing list: no copy)
            text, grown = IncrementalText(tokenizer.decode), []
            for token in head:  # streamed there token by token, as a sequence gets there
                grown.append(token)
                text.update(grown)
            whole_us = per_call_us(lambda: tokenizer.decode(longer), max(3, 20000 // n))
            state = [text.settled, text.tail, text.prefix, text.read]

            def one_more():
                text.settled, text.tail, text.prefix, text.read = state
                text.update(longer)
            incremental_us = per_call_us(one_more, 2000)
            # The whole stream of n tokens, both ways, texts checked equal at every token.
            grown: list[int] = []
            started = time.perf_counter()
            wholes = [tokenizer.decode(grown) for token in ids[:n] if not grown.append(token)]
            whole_s = time.perf_counter() - started
            stream, grown = IncrementalText(tokenizer.decode), []
            started = time.perf_counter()
            texts = [stream.update(grown) for token in ids[:n] if not grown.append(token)]
            incremental_s = time.perf_counter() - started
            assert texts == wholes, "the incremental text differs from the whole decode"
            print(f"{n:>7} {whole_us:22.1f} {incremental_us:21.1f} {whole_us / incremental_us:6.1f} "
                  f"{1e3 * whole_s:16.1f} {1e3 * incremental_s:22.1f}", flush=True)


if __name__ == "__main__":
    main()
