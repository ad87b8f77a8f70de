"""MLA's latent KV cache with kv_b_proj absorbed, against transformers' expanded form, and
prompt chunks that start after cached context (the case chunked prefill and prefix hits
produce), run through the model directly.

Reference: transformers' DeepseekV3ForCausalLM (eager), which expands every head's keys and
values from the latent; ours keeps ``kv_lora_rank + qk_rope_head_dim`` values per token.
"""

from __future__ import annotations

import argparse
import json
import random
from fractions import Fraction

import pytest
import torch

from raymoe.cluster import plan_cli
from raymoe.engine.engine import EngineConfig, LLMEngine
from raymoe.engine.kv_cache import KVCache
from raymoe.engine.sampling_params import SamplingParams
from raymoe.kernels.attention import AttentionMetadata
from raymoe.engine.hf_config import parse_model_config
from raymoe.moe.model_presets import model_presets
from tiny_models import VOCAB, build_reference_model, write_checkpoint

BLOCK_SIZE = 8


def prompts(seed: int, lengths=(3, 21, 40)) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(4, VOCAB, (n,), generator=generator).tolist() for n in lengths]


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    model = build_reference_model("deepseek_v3")
    path = write_checkpoint(model, str(tmp_path_factory.mktemp("deepseek")))
    return model, path


def expanded_values_per_token(config) -> int:
    """What the cache held before: every head's key (nope + rope) and value, per layer."""
    mla = config.mla
    return config.num_layers * config.num_heads * (mla.qk_nope_head_dim + mla.qk_rope_head_dim + mla.v_head_dim)


def test_the_same_budget_holds_more_tokens_by_the_expanded_over_latent_ratio(deepseek):
    _, path = deepseek
    probe = LLMEngine.from_pretrained(path, EngineConfig(dtype="float32", block_size=BLOCK_SIZE))
    config, mla = probe.config, probe.config.mla
    latent_bytes = KVCache.bytes_per_token(config, torch.float32)
    expanded_bytes = expanded_values_per_token(config) * 4
    # The per-token size is the latent and the roped key, per layer, exactly.
    assert latent_bytes == config.num_layers * (mla.kv_lora_rank + mla.qk_rope_head_dim) * 4
    ratio = Fraction(config.num_heads * (mla.qk_nope_head_dim + mla.qk_rope_head_dim + mla.v_head_dim),
                     mla.kv_lora_rank + mla.qk_rope_head_dim)
    assert Fraction(expanded_bytes, latent_bytes) == ratio
    # The cache allocates what it counts.
    allocated = sum(t.numel() * t.element_size() for t in probe.cache.tensors)
    assert allocated == latent_bytes * probe.cache.num_blocks * probe.cache.block_size
    # The same kv_cache_bytes, before and now (whole blocks).
    budget = 64 * BLOCK_SIZE * latent_bytes
    engine = LLMEngine.from_pretrained(path, EngineConfig(dtype="float32", block_size=BLOCK_SIZE,
                                                          kv_cache_bytes=budget))
    now = engine.kv_cache_capacity_tokens
    before = budget // (expanded_bytes * BLOCK_SIZE) * BLOCK_SIZE
    assert now == budget // (latent_bytes * BLOCK_SIZE) * BLOCK_SIZE == 64 * BLOCK_SIZE
    print(f"\nkv_cache_bytes={budget}: expanded per-head K/V {before} tokens ({expanded_bytes} B/token), "
          f"latent {now} tokens ({latent_bytes} B/token): {float(ratio):.3f}x per token "
          f"(H (nope + rope + v) / (kv_lora_rank + rope) = {ratio})")
    deepseek_v3 = parse_model_config({"max_position_embeddings": 163840, **model_presets()["DeepSeek-V3"]})
    full_ratio = Fraction(expanded_values_per_token(deepseek_v3), deepseek_v3.kv_cache_values_per_token)
    print(f"DeepSeek-V3: {deepseek_v3.kv_cache_values_per_token // deepseek_v3.num_layers} values per token "
          f"and layer instead of {expanded_values_per_token(deepseek_v3) // deepseek_v3.num_layers}: "
          f"{float(full_ratio):.1f}x the tokens")
    assert full_ratio == Fraction(128 * (128 + 64 + 128), 512 + 64)


@pytest.mark.parametrize("arch", ["deepseek_v3", "qwen3_moe"])
def test_plan_memory_reports_the_engines_per_token_size(arch, deepseek, tmp_path, capsys):
    path = deepseek[1] if arch == "deepseek_v3" else write_checkpoint(build_reference_model(arch), str(tmp_path))
    engine = LLMEngine.from_pretrained(path, EngineConfig(dtype="float32", block_size=BLOCK_SIZE))
    parser = argparse.ArgumentParser(prog="raymoe")
    plan_cli.add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["plan", "memory", "--model", path, "--gpus", "1", "--kv-bytes-per-value", "4", "--json"])
    assert args.func(args) == 0
    reported = json.loads(capsys.readouterr().out)["kv_cache_bytes_per_token"]
    assert reported == KVCache.bytes_per_token(engine.config, torch.float32)
    assert reported * engine.cache.num_blocks * BLOCK_SIZE == sum(t.numel() * 4 for t in engine.cache.tensors)


def test_prefill_and_greedy_decode_match_transformers(deepseek):
    model, path = deepseek
    engine = LLMEngine.from_pretrained(path, EngineConfig(dtype="float32", block_size=BLOCK_SIZE, keep_logits=True))
    batch = prompts(5)
    with torch.no_grad():
        for prompt, logits in zip(batch, engine.score(batch)):  # prefill: every position
            expected = model(input_ids=torch.tensor([prompt])).logits[0]
            assert (logits - expected).abs().max().item() < 1e-4
    # Decode: three sequences batched, each step's logits against transformers teacher-forced on
    # the same tokens, and the greedy tokens against transformers' own generate.
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(batch):
        engine.add_request(f"r{i}", prompt, params)
    steps: dict[str, list[torch.Tensor]] = {f"r{i}": [] for i in range(len(batch))}
    finals = {}
    for _ in range(200):
        for output in engine.step():
            steps[output.request_id].append(output.logits)
            if output.finished:
                finals[output.request_id] = output.output_token_ids
        if len(finals) == len(batch):
            break
    with torch.no_grad():
        for i, prompt in enumerate(batch):
            tokens = finals[f"r{i}"]
            expected = model.generate(torch.tensor([prompt]), max_new_tokens=12, min_new_tokens=12,
                                      do_sample=False, eos_token_id=None)[0, len(prompt):].tolist()
            assert tokens == expected, f"request {i} diverged"
            reference = model(input_ids=torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1: -1]
            assert (torch.stack(steps[f"r{i}"]) - reference).abs().max().item() < 1e-4


CHUNKED = {
    "deepseek_v3-latent": ("deepseek_v3", {}, 5),
    "mixtral-sliding-window": ("mixtral", {"sliding_window": 6}, 4),
    "qwen3_moe": ("qwen3_moe", {}, 16),
}


@pytest.mark.parametrize("name", sorted(CHUNKED))
def test_prompt_chunks_after_cached_context_match_transformers(name, tmp_path):
    arch, overrides, chunk = CHUNKED[name]
    model = build_reference_model(arch, **overrides)
    engine = LLMEngine.from_pretrained(write_checkpoint(model, str(tmp_path)), EngineConfig(dtype="float32"))
    batch = prompts(7, (37, 23))
    # Each step runs the next chunk of both prompts (the shorter one then sits out), over
    # scattered blocks: every chunk after the first attends to the context cached by earlier steps.
    num_blocks = sum(-(-len(p) // BLOCK_SIZE) for p in batch) + 2
    cache = KVCache(engine.config, num_blocks, BLOCK_SIZE, torch.float32, torch.device("cpu"))
    ids = list(range(num_blocks))
    random.Random(0).shuffle(ids)
    tables, used = [], 0
    for prompt in batch:
        tables.append(ids[used: used + -(-len(prompt) // BLOCK_SIZE)])
        used += len(tables[-1])
    logits: list[list[torch.Tensor]] = [[] for _ in batch]
    with torch.inference_mode():
        for start in range(0, max(len(p) for p in batch), chunk):
            live = [i for i, p in enumerate(batch) if start < len(p)]
            stops = [min(start + chunk, len(batch[i])) for i in live]
            metadata = AttentionMetadata.build([stop - start for stop in stops], stops, [tables[i] for i in live],
                                               BLOCK_SIZE)
            ids_step = torch.tensor([t for i, stop in zip(live, stops) for t in batch[i][start:stop]])
            positions = torch.tensor([p for stop in stops for p in range(start, stop)])
            hidden = engine.model.forward(ids_step, positions, metadata, cache)
            for i, rows in zip(live, engine.model.logits(hidden).split([stop - start for stop in stops])):
                logits[i].append(rows)
    with torch.no_grad():
        for prompt, parts in zip(batch, logits):
            expected = model(input_ids=torch.tensor([prompt])).logits[0]
            diff = (torch.cat(parts) - expected).abs().max().item()
            assert diff < 1e-4, f"{name}: prompt of {len(prompt)} in chunks of {chunk} differs by {diff}"
