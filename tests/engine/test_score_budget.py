"""score() within the token budget (issue 34, item 6): echo and prompt logprobs run as forwards
of at most ``max_num_batched_tokens`` tokens, and keep only each position's logprob, rank and
top N, never a prompt's ``[L, V]`` logits.

References: the same engine with a budget and a KV cache large enough for one forward of every
prompt (what score() did before), reduced by ``prompt_logprobs`` (what the routers did), and
transformers' forward. The memory bound runs in a subprocess, whose peak resident memory sees
torch's allocations (tracemalloc does not).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

if __name__ == "__main__":  # the memory test's child process: tiny_models is in tests/
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from raymoe.cluster import procfs
from raymoe.engine import prompt_logprobs as prompt_logprobs_module
from raymoe.engine.engine import EngineConfig, LLMEngine
from raymoe.engine.prompt_logprobs import prompt_logprobs
from raymoe.engine.sampling_params import SamplingParams
from raymoe.engine.scheduler import SchedulerConfig
from tiny_models import VOCAB, build_reference_model, write_checkpoint

# Mixed lengths: 1 and 2 (nothing or one position to score), exactly one and just over a
# budget of 16, several prompts longer than every budget below (up to 150 tokens).
LENGTHS = (1, 2, 9, 57, 23, 70, 33, 16, 17, 150, 5)
TOP = 5
LOGPROB_TOLERANCE = 1e-5  # chunked vs one forward: float rounding only (measured ~1e-6)
HF_TOLERANCE = 1e-4


def make_prompts(seed: int = 0, lengths=LENGTHS) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(4, VOCAB, (n,), generator=generator).tolist() for n in lengths]


def engine_with(path: str, budget: int, kv_tokens: int | None = None, **overrides) -> LLMEngine:
    kv = {} if kv_tokens is None else {"kv_cache_bytes": kv_tokens * 3 * 2 * 2 * 16 * 4}  # tiny mixtral: 768 B/token
    config = dict(dtype="float32", block_size=8, enable_prefix_caching=False,
                  scheduler=SchedulerConfig(max_num_batched_tokens=budget), **kv)
    config.update(overrides)
    return LLMEngine.from_pretrained(path, EngineConfig(**config))


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Many small forwards: with the 2 cores shared, torch's thread pool waits more than it works."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def unchunked(tiny_mixtral_dir):
    """The old behaviour: every prompt in one forward, its [L, V] logits reduced afterwards."""
    engine = engine_with(tiny_mixtral_dir, 100_000)
    prompts = make_prompts()
    logits = engine.score(prompts)
    return prompts, logits, [prompt_logprobs(row, prompt, TOP) for row, prompt in zip(logits, prompts)]


def record_forwards(engine: LLMEngine) -> tuple[list[int], list[int]]:
    """Tokens of every forward and rows of every vocabulary projection the engine runs."""
    tokens, rows = [], []
    run, logits = engine._run, engine.model.logits

    def recording_run(sequences, counts):
        tokens.append(sum(counts))
        return run(sequences, counts)

    def recording_logits(hidden):
        rows.append(hidden.shape[0])
        return logits(hidden)

    engine._run, engine.model.logits = recording_run, recording_logits
    return tokens, rows


def assert_same_scores(ours, expected, tolerance=LOGPROB_TOLERANCE):
    assert len(ours) == len(expected)
    for a, b in zip(ours, expected):
        assert len(a.token_logprobs) == len(b.token_logprobs)
        assert a.token_logprobs[0] is None and a.ranks[0] is None and a.top[0] is None
        assert a.ranks == b.ranks
        assert a.token_logprobs[1:] == pytest.approx(b.token_logprobs[1:], abs=tolerance)
        for x, y in zip(a.top[1:], b.top[1:]):
            assert [t for t, _ in x] == [t for t, _ in y]
            assert [v for _, v in x] == pytest.approx([v for _, v in y], abs=tolerance)


@pytest.mark.parametrize("budget, kv_tokens", [(16, None), (7, None), (16, 160), (64, 200)])
def test_chunked_scores_equal_one_forward(tiny_mixtral_dir, unchunked, budget, kv_tokens):
    """Small budgets (many forwards, prompts over several), and KV caches that hold the longest
    prompt and little more (a forward then stops early: its prompts' blocks must fit)."""
    prompts, logits, expected = unchunked
    engine = engine_with(tiny_mixtral_dir, budget, kv_tokens)
    tokens, rows = record_forwards(engine)
    ours = engine.score_prompts(prompts, TOP)
    assert_same_scores(ours, expected)
    assert max(tokens) <= budget and max(rows) <= budget  # never more than [budget, V] logits
    assert sum(tokens) == sum(LENGTHS) and len(tokens) >= -(-sum(LENGTHS) // budget)
    assert sum(rows) == sum(n - 1 for n in LENGTHS)  # only positions that predict a prompt token
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks  # every block given back
    # score() (full logits, for tests) runs the same forwards.
    for ours_logits, want in zip(engine.score(prompts), logits):
        assert ours_logits.shape == want.shape
        assert (ours_logits - want).abs().max().item() < LOGPROB_TOLERANCE
    # Fewer alternatives, or none: the same positions, trimmed.
    assert_same_scores(engine.score_prompts(prompts, 2), [s.trimmed(2) for s in expected])
    none = engine.score_prompts(prompts[:4], 0)
    assert [s.top for s in none] == [[None, *[[]] * (n - 1)] for n in LENGTHS[:4]]


def test_chunked_scores_equal_transformers(tiny_mixtral_dir):
    """echo / prompt_logprobs numbers of a budget-16 engine against transformers' forward."""
    model = build_reference_model("mixtral")  # the weights of tiny_mixtral_dir
    prompts = make_prompts(1, (3, 40, 70))
    ours = engine_with(tiny_mixtral_dir, 16).score_prompts(prompts, TOP)
    with torch.no_grad():
        for prompt, score in zip(prompts, ours):
            hf = torch.log_softmax(model(input_ids=torch.tensor([prompt])).logits[0, :-1].double(), dim=-1)
            targets = torch.tensor(prompt[1:])
            chosen = hf.gather(1, targets[:, None])[:, 0]
            assert score.token_logprobs[1:] == pytest.approx(chosen.tolist(), abs=HF_TOLERANCE)
            ranks = (hf > chosen[:, None]).sum(1) + 1
            close = ((hf - chosen[:, None]).abs() < HF_TOLERANCE).sum(1) > 1  # a near-tie may rank either way
            assert [r for r, c in zip(score.ranks[1:], close) if not c] == ranks[~close].tolist()
            values, _ = torch.topk(hf, TOP, dim=-1)
            ours = torch.tensor([[v for _, v in top] for top in score.top[1:]], dtype=torch.float64)
            assert (ours - values).abs().max().item() < HF_TOLERANCE


def test_scoring_takes_turns_with_requests_in_flight(tiny_mixtral_dir, unchunked):
    """As a router runs it: one scoring forward, then one engine step, while requests generate;
    in a cache so small that scoring preempts them. Both come out as they do alone."""
    prompts, _, expected = unchunked
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    requests = make_prompts(7, (30, 12, 45))
    alone = [o.output_token_ids for o in engine_with(tiny_mixtral_dir, 16).generate(requests, params)]
    engine = engine_with(tiny_mixtral_dir, 16, kv_tokens=176)
    for i, prompt in enumerate(requests):
        engine.add_request(f"r{i}", prompt, params)
    engine.step()
    scoring = engine.start_scoring(prompts, TOP)
    outputs: dict[str, list[int]] = {}
    while not scoring.done or engine.has_unfinished():
        if not scoring.done:
            scoring.step()
        for output in engine.step():
            if output.finished:
                outputs[output.request_id] = output.output_token_ids
    scoring.close()
    assert_same_scores(scoring.prompt_logprobs(), expected)
    assert engine.scheduler.num_preemptions > 0  # the cache was tight: scoring took in-flight blocks
    assert [outputs[f"r{i}"] for i in range(len(requests))] == alone
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks


def test_a_failed_forward_runs_again(tiny_mixtral_dir, unchunked):
    """A forward that raises (a router's expert exchange failing) leaves the scoring as it was:
    the router recovers and calls step() again, and the scores are those of a clean run."""
    prompts, _, expected = unchunked
    engine = engine_with(tiny_mixtral_dir, 16, kv_tokens=176)
    forward, calls = engine.model.forward, [0]

    def flaky(*args):
        calls[0] += 1
        if calls[0] in (3, 9, 10):  # mid-prompt, and twice in a row
            raise ConnectionError("peer died")
        return forward(*args)

    engine.model.forward = flaky
    scoring = engine.start_scoring(prompts, TOP)
    failures = 0
    while not scoring.done:
        try:
            scoring.step()
        except ConnectionError:
            failures += 1
    scoring.close()
    assert failures == 3
    assert_same_scores(scoring.prompt_logprobs(), expected)
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks


def test_closing_a_scoring_part_way_gives_its_blocks_back(tiny_mixtral_dir):
    engine = engine_with(tiny_mixtral_dir, 16)
    scoring = engine.start_scoring(make_prompts(), TOP)
    for _ in range(5):
        scoring.step()
    assert engine.blocks.num_free_blocks < engine.blocks.num_blocks
    scoring.close()
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.start_scoring([[1, 2], [VOCAB]], TOP)  # refused before any forward
    assert engine.score_prompts([], TOP) == [] and engine.score([]) == []


def test_prompt_logprobs_in_row_blocks_is_the_same_bits(monkeypatch, unchunked):
    """prompt_logprobs (over logits that exist) reduces row blocks; each row's numbers are
    those of one whole-prompt log_softmax, bit for bit."""
    prompts, logits, expected = unchunked
    monkeypatch.setattr(prompt_logprobs_module, "ROWS_PER_BLOCK", 7)
    assert [prompt_logprobs(row, prompt, TOP) for row, prompt in zip(logits, prompts)] == expected
    prompt, row = prompts[9], logits[9]
    whole = torch.log_softmax(row[:-1].float(), dim=-1)
    chosen = whole.gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]
    assert expected[9].token_logprobs[1:] == chosen.tolist()
    assert expected[9].ranks[1:] == ((whole > chosen[:, None]).sum(1) + 1).tolist()


# ---- the memory bound ------------------------------------------------------------------------
# 64 prompts x 1,000 tokens, echo with logprobs through run-batch's request path, in a subprocess
# on a tiny model with a 4,096-token vocabulary and a budget of 256 tokens. Before: every prompt's
# [1000, V] float32 logits at once (64 x 1000 x 4096 x 4 B = 1.05 GB, measured 1.3-2.2 GB of
# growth). Now: one forward's [<= 256, V] at a time; what remains is the answer itself, a few
# Python objects per position and alternative. The bound: a few [budget, V] float32 blocks, the
# answer's objects (generously 512 B per number it holds), and 32 MiB for the rest.
MEMORY_PROMPTS, MEMORY_LENGTH, MEMORY_VOCAB, MEMORY_BUDGET, MEMORY_TOP = 64, 1000, 4096, 256, 1


def memory_bound(num_tokens: int) -> int:
    return 4 * MEMORY_BUDGET * MEMORY_VOCAB * 4 + num_tokens * (MEMORY_TOP + 1) * 512 + (32 << 20)


@pytest.fixture(scope="module")
def large_vocab_dir(tmp_path_factory) -> str:
    model = build_reference_model("mixtral", vocab_size=MEMORY_VOCAB, max_position_embeddings=1024)
    return write_checkpoint(model, str(tmp_path_factory.mktemp("large-vocab")))


def measure(model_dir: str, path: str, num_prompts: int) -> dict:
    """Run the child below; returns its peak resident memory growth while answering."""
    env = dict(os.environ, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0")
    result = subprocess.run([sys.executable, __file__, model_dir, path, str(num_prompts)], env=env,
                            capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux's peak-RSS reset")
def test_echo_logprobs_of_64_long_prompts_stay_within_the_budget(large_vocab_dir):
    num_tokens = MEMORY_PROMPTS * MEMORY_LENGTH
    assert memory_bound(num_tokens) < num_tokens * MEMORY_VOCAB * 4 // 4  # no room for [T, V], by far
    bounded = measure(large_vocab_dir, "bounded", MEMORY_PROMPTS)
    assert bounded["growth"] <= memory_bound(num_tokens), bounded
    # The measurement sees torch's allocations: the old path (every prompt's [L, V] logits, then
    # reduced, as the routers did) over a quarter of the prompts grows by at least their logits.
    control = measure(large_vocab_dir, "full-logits", MEMORY_PROMPTS // 4)
    assert control["growth"] >= MEMORY_PROMPTS // 4 * MEMORY_LENGTH * MEMORY_VOCAB * 4, control
    print(f"peak RSS growth: {bounded['growth'] / 2**20:.0f} MiB for {MEMORY_PROMPTS} prompts within the budget; "
          f"{control['growth'] / 2**20:.0f} MiB for {MEMORY_PROMPTS // 4} prompts through full logits")


def _child(model_dir: str, path: str, num_prompts: int) -> None:
    """Answer one echo + logprobs batch item over ``num_prompts`` x 1,000 tokens; print the peak
    resident memory growth while answering (Linux: VmHWM, reset just before)."""
    from raymoe.engine.api.completions import ModelLimits
    from raymoe.engine.api.run_batch import run_batch

    torch.set_num_threads(1)
    engine = LLMEngine.from_pretrained(model_dir, EngineConfig(
        dtype="float32", enable_prefix_caching=False, kv_cache_bytes=16 << 20,
        scheduler=SchedulerConfig(max_num_batched_tokens=MEMORY_BUDGET)))

    class Scores:  # run-batch's engine, scoring as the routers do
        def __init__(self, path: str):
            self.path = path

        def score_prompts(self, prompts, num_top):
            if self.path == "bounded":
                return engine.score_prompts(prompts, num_top)
            return [prompt_logprobs(row, prompt, num_top) for row, prompt in zip(engine.score(prompts), prompts)]

    generator = torch.Generator().manual_seed(0)

    def items(count: int) -> list[dict]:
        prompts = [torch.randint(4, MEMORY_VOCAB, (MEMORY_LENGTH,), generator=generator).tolist()
                   for _ in range(count)]
        return [{"custom_id": "echo", "method": "POST", "url": "/v1/completions",
                 "body": {"prompt": prompts, "echo": True, "logprobs": MEMORY_TOP, "max_tokens": 0}}]

    limits = ModelLimits("tiny", MEMORY_VOCAB, engine.max_model_len)
    run_batch(items(2), Scores("bounded"), None, limits, show_progress=False)  # warm-up: code paths, allocator
    work = items(num_prompts)
    before = procfs.resident_bytes()
    procfs.reset_peak_resident()  # the peak (VmHWM) starts again from the current resident memory
    (line,) = run_batch(work, Scores(path), None, limits, show_progress=False)
    growth = procfs.memory_kib("self", ("VmHWM",))["VmHWM"] * 1024 - before
    choices = line["response"]["body"]["choices"]
    assert len(choices) == num_prompts
    assert all(len(c["logprobs"]["token_logprobs"]) == MEMORY_LENGTH for c in choices)
    print(json.dumps({"growth": growth, "before": before}))


if __name__ == "__main__":
    _child(sys.argv[1], sys.argv[2], int(sys.argv[3]))
