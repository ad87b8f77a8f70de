"""The sampler's cost per token: greedy, filtered random, penalised, and grammar-constrained.

Runs ``sample()`` on random ``[B, V]`` logits (B = 1 and 32) as the engine does each step,
and for constrained rows also advances each row's grammar with its sampled token (what
``_postprocess`` does). The vocabulary is a byte-level BPE trained here to ``--vocab``
entries (nothing can be downloaded); the schema is a small object with strings, numbers,
an enum array. Also compares the two grammar libraries' mask cost per token (xgrammar,
used by raymoe, vs llguidance) along the same sampled outputs.

    python benchmarks/bench_sampler.py [--vocab 32000] [--steps 50] [--device cpu] [--threads N]
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from common import machine_description
from raymoe.engine.sampler import sample
from raymoe.engine.sampling_params import SamplingParams
from raymoe.engine.sequence import Sequence
from raymoe.engine.structured_output import GrammarCompiler, StructuredOutput, fill_bitmask

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "email": {"type": "string"},
        "tags": {"type": "array", "items": {"enum": ["alpha", "beta", "gamma"]}},
        "score": {"type": "number"},
    },
    "required": ["name", "age", "email", "tags", "score"],
    "additionalProperties": False,
}
EOS = 0


def build_tokenizer(vocab_size: int) -> Tokenizer:
    """Byte-level BPE over a synthetic corpus of words, numbers and JSON-ish punctuation."""
    rng = random.Random(0)
    syllables = [a + b for a in "bcdfghklmnprstvwz" for b in "aeiouy"] + list("aeiou")
    words = ["".join(rng.choice(syllables) for _ in range(rng.randint(1, 4))) for _ in range(40000)]
    lines = []
    for _ in range(20000):
        picked = rng.sample(words, 8)
        lines.append(" ".join(picked) + f' {{"{picked[0]}": {rng.randint(0, 99999)}, "{picked[1]}": "{picked[2]}"}}.')
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(lines, trainer=trainer)
    return tokenizer


def rows(batch: int, params: SamplingParams, compiler: GrammarCompiler | None, prompt_len: int, vocab: int):
    made = []
    for i in range(batch):
        sequence = Sequence(f"r{i}", [random.randrange(vocab) for _ in range(prompt_len)], params, None, 0)
        if params.structured is not None:
            sequence.grammar = compiler.new_state(params.structured)
        made.append(sequence)
    return made


def time_steps(batch: int, vocab: int, params: SamplingParams, compiler, steps: int, device: torch.device,
               peaked: bool = False):
    """(fastest, median) seconds per step of sample() (+ advancing grammars), after one
    warm-up step. On a shared machine the fastest step is the uncontended cost. ``peaked``:
    64 tokens hold ~98% of the mass (a trained model's shape; the random logits' nucleus
    spans thousands of tokens, the sampler's worst case for top-p)."""
    sequences = rows(batch, params, compiler, 256, vocab)
    logits = torch.randn(batch, vocab, device=device) * 3
    if peaked:
        logits[:, :64] += 10
    spent = []
    for step in range(steps + 1):
        started = time.perf_counter()
        tokens, _, _ = sample(logits, sequences, (EOS,))
        for i, (sequence, token) in enumerate(zip(sequences, tokens)):
            sequence.output_ids.append(token)
            if sequence.grammar is not None:
                assert sequence.grammar.accept(token), "the mask let a forbidden token through"
                if sequence.grammar.is_terminated:  # a finished object: start another
                    sequence.grammar = compiler.new_state(params.structured)
        if device.type == "cuda":
            torch.cuda.synchronize()
        if step:
            spent.append(time.perf_counter() - started)
    return min(spent), statistics.median(spent)


def mask_costs(tokenizer_json: str, vocab: int, batch: int, steps: int, compiler: GrammarCompiler) -> dict[str, float]:
    """Seconds per token (fastest step) to fill the mask, xgrammar vs llguidance, along the same outputs
    (sampled uniformly among allowed tokens)."""
    import llguidance
    import llguidance.torch
    import xgrammar

    output = StructuredOutput.json_schema(SCHEMA)
    xg_states = [compiler.new_state(output) for _ in range(batch)]
    ll_tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab, eos_token=EOS)
    grammar = llguidance.LLMatcher.grammar_from_json_schema(
        SCHEMA, defaults={"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "})
    ll_matchers = [llguidance.LLMatcher(ll_tokenizer, grammar) for _ in range(batch)]
    executor = llguidance.LLExecutor()
    generator = torch.Generator().manual_seed(0)
    xg_time, ll_time = [], []
    for step in range(steps + 1):  # the first step warms both up
        xg_mask = xgrammar.allocate_token_bitmask(batch, vocab)
        started = time.perf_counter()
        fill_bitmask(xg_mask, list(range(batch)), xg_states)
        xg_spent = time.perf_counter() - started
        ll_mask = llguidance.torch.allocate_token_bitmask(batch, vocab)
        started = time.perf_counter()
        llguidance.torch.fill_next_token_bitmask_par(executor, [(m, i) for i, m in enumerate(ll_matchers)], ll_mask)
        ll_spent = time.perf_counter() - started
        if step:
            xg_time.append(xg_spent)
            ll_time.append(ll_spent)
        logits = torch.zeros(batch, vocab)  # uniform over what both allow
        xgrammar.apply_token_bitmask_inplace(logits, xg_mask)
        xgrammar.apply_token_bitmask_inplace(logits, ll_mask)
        tokens = torch.multinomial(torch.softmax(logits, -1), 1, generator=generator).squeeze(1).tolist()
        for i, token in enumerate(tokens):
            assert xg_states[i].accept(token) and ll_matchers[i].consume_token(token), "libraries disagree"
            if xg_states[i].is_terminated:
                xg_states[i] = compiler.new_state(output)
                ll_matchers[i] = llguidance.LLMatcher(ll_tokenizer, grammar)
    return {"xgrammar": min(xg_time) / batch, "llguidance": min(ll_time) / batch}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    parser.add_argument("--no-library-comparison", action="store_true")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    random.seed(0)
    torch.manual_seed(0)
    print(machine_description())
    tokenizer = build_tokenizer(args.vocab)
    vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    with tempfile.TemporaryDirectory() as folder:
        tokenizer.save(f"{folder}/tokenizer.json")
        started = time.perf_counter()
        compiler = GrammarCompiler.from_model_dir(folder, vocab, [EOS])
        setup = time.perf_counter() - started
        started = time.perf_counter()
        compiler.compile(StructuredOutput.json_schema(SCHEMA))
        compile_time = time.perf_counter() - started
        with open(f"{folder}/tokenizer.json", encoding="utf-8") as handle:
            tokenizer_json = handle.read()
    print(f"vocabulary {vocab}, device {device}; grammar compiler set-up {setup * 1e3:.0f} ms, "
          f"schema compile {compile_time * 1e3:.1f} ms (then cached)")
    structured = StructuredOutput.json_schema(SCHEMA)
    cases = {
        "greedy": SamplingParams(max_tokens=10**6, temperature=0.0),
        "T=1": SamplingParams(max_tokens=10**6, temperature=1.0),
        "T=1 top_k=50 top_p=0.9": SamplingParams(max_tokens=10**6, temperature=1.0, top_k=50, top_p=0.9),
        "T=1 top_p=0.9 (flat logits)": SamplingParams(max_tokens=10**6, temperature=1.0, top_p=0.9),
        "T=1 top_p=0.9 (peaked logits)": SamplingParams(max_tokens=10**6, temperature=1.0, top_p=0.9),
        "T=1 + 3 penalties + bias": SamplingParams(max_tokens=10**6, temperature=1.0, presence_penalty=0.5,
                                                   frequency_penalty=0.5, repetition_penalty=1.2,
                                                   logit_bias=tuple((t, 1.0) for t in range(1, 51))),
        "T=1 json_schema": SamplingParams(max_tokens=10**6, temperature=1.0, structured=structured),
        "greedy json_schema": SamplingParams(max_tokens=10**6, temperature=0.0, structured=structured),
    }
    print("us per token, fastest step (median step)")
    print(f"{'case':30s} {'B=1':>16s} {'B=32':>16s}")
    results = {}
    for name, params in cases.items():
        timings = [(b, time_steps(b, vocab, params, compiler, args.steps, device, "peaked" in name)) for b in (1, 32)]
        results[name] = [fastest / b * 1e6 for b, (fastest, _) in timings]
        cells = [f"{fastest / b * 1e6:7.1f} ({median / b * 1e6:6.1f})" for b, (fastest, median) in timings]
        print(f"{name:30s} {cells[0]:>16s} {cells[1]:>16s}")
    for name in ("T=1 json_schema", "T=1 + 3 penalties + bias"):
        ratio = [results[name][i] / results["T=1"][i] for i in (0, 1)]
        print(f"{name} vs T=1: x{ratio[0]:.2f} at B=1, x{ratio[1]:.2f} at B=32")
    if not args.no_library_comparison:
        for batch in (1, 32):
            costs = mask_costs(tokenizer_json, vocab, batch, args.steps, compiler)
            print(f"mask fill per token, B={batch}: " + ", ".join(f"{k} {v * 1e6:.1f} us" for k, v in costs.items()))


if __name__ == "__main__":
    main()
