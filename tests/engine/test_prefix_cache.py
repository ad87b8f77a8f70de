"""Automatic prefix caching: parity with transformers when prompts share a long prefix (on
every architecture), the hit counters, and the block manager's reference counts and LRU
eviction against hand-built expectations."""

from __future__ import annotations

import pytest
import torch

from raymoe.engine.block_manager import BlockManager
from raymoe.engine.engine import EngineConfig, LLMEngine
from raymoe.engine.prefix_cache import PrefixCache, root_key
from raymoe.engine.sampling_params import SamplingParams
from raymoe.engine.scheduler import SchedulerConfig
from raymoe.engine.sequence import Sequence
from tiny_models import ARCHITECTURES, VOCAB, build_reference_model, write_checkpoint

BLOCK = 8
PREFIX = 45  # 5 full blocks and 5 tokens of a sixth
NEW_TOKENS = 5
LOGITS_TOLERANCE = 1e-4


def shared_prefix_prompts(seed: int, suffix_lengths=(7, 12, 3, 20)) -> list[list[int]]:
    """Prompts of one ``PREFIX``-token prefix and suffixes whose first tokens all differ."""
    generator = torch.Generator().manual_seed(seed)
    prefix = torch.randint(4, VOCAB, (PREFIX,), generator=generator).tolist()
    return [prefix + [10 + i] + torch.randint(4, VOCAB, (n - 1,), generator=generator).tolist()
            for i, n in enumerate(suffix_lengths)]


@pytest.fixture(scope="module", params=ARCHITECTURES)
def reference(request, tmp_path_factory):
    arch = request.param
    model = build_reference_model(arch)
    path = write_checkpoint(model, str(tmp_path_factory.mktemp(arch)))
    engine = LLMEngine.from_pretrained(path, EngineConfig(
        dtype="float32", block_size=BLOCK, keep_logits=True, scheduler=SchedulerConfig(max_num_batched_tokens=32)))
    return arch, model, engine


def test_prefix_hits_match_transformers(reference):
    arch, model, engine = reference
    prompts = shared_prefix_prompts(1)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    before = engine.prefix_cache_stats()
    # The first request computes the prefix; the others join while it decodes, one of them
    # a step later than the rest, so hits and fresh chunks share steps.
    outputs: dict[str, list] = {}
    engine.add_request(f"{arch}-0", prompts[0], params)
    for step in range(100):
        if step == 3:
            engine.add_request(f"{arch}-1", prompts[1], params)
            engine.add_request(f"{arch}-2", prompts[2], params)
        if step == 4:
            engine.add_request(f"{arch}-3", prompts[3], params)
        for output in engine.step():
            outputs.setdefault(output.request_id, []).append(output)
        if step > 4 and not engine.has_unfinished():
            break
    stats = engine.prefix_cache_stats()
    # Requests 1-3 each found the prefix's 5 full blocks; request 0 found nothing.
    assert stats.num_hit_tokens - before.num_hit_tokens == 3 * 5 * BLOCK, arch
    assert stats.num_queried_tokens - before.num_queried_tokens == sum(map(len, prompts)), arch
    with torch.no_grad():
        for index, prompt in enumerate(prompts):
            steps = outputs[f"{arch}-{index}"]
            tokens = steps[-1].output_token_ids
            assert len(tokens) == NEW_TOKENS
            reference_logits = model(input_ids=torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1]
            diff = (torch.stack([s.logits for s in steps]) - reference_logits).abs().max().item()
            assert diff < LOGITS_TOLERANCE, f"{arch} request {index}: logits differ by {diff}"
            assert tokens == reference_logits.argmax(dim=-1).tolist(), f"{arch} request {index}"
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks


def test_a_repeated_prompt_recomputes_only_its_last_token(reference):
    arch, model, engine = reference
    prompt = shared_prefix_prompts(2, (19,))[0][:4 * BLOCK]  # exactly 4 full blocks
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    first = engine.generate([prompt], params)[0]
    before = engine.prefix_cache_stats()
    again = engine.generate([prompt], params)[0]
    after = engine.prefix_cache_stats()
    # The last block is computed again (its last token's logits are needed): 3 blocks hit.
    assert after.num_hit_tokens - before.num_hit_tokens == 3 * BLOCK
    assert again.output_token_ids == first.output_token_ids
    assert (again.logits - first.logits).abs().max().item() < LOGITS_TOLERANCE


def test_prefix_caching_off_finds_nothing(tiny_mixtral_dir):
    engine = LLMEngine.from_pretrained(tiny_mixtral_dir, EngineConfig(dtype="float32", block_size=BLOCK,
                                                                       enable_prefix_caching=False))
    prompts = shared_prefix_prompts(3)
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    engine.generate(prompts[:1], params)
    engine.generate(prompts[1:], params)
    stats = engine.prefix_cache_stats()
    assert (stats.num_queried_tokens, stats.num_hit_tokens, stats.hit_rate) == (0, 0, 0.0)
    assert engine.kv_cache_capacity_tokens == engine.blocks.num_blocks * BLOCK


# ---- the block manager alone: hand-built expectations ---------------------------------
def sequence(name: str, tokens: list[int]) -> Sequence:
    return Sequence(name, list(tokens), SamplingParams(), None, 0)


def computed(blocks: BlockManager, seq: Sequence) -> Sequence:
    """Admit ``seq`` from its cache hits, pretend a step computed all its tokens, cache them."""
    blocks.admit(seq, blocks.match_prefix(seq))
    blocks.grow(seq.block_table, seq.num_tokens)
    seq.num_computed = seq.num_tokens
    blocks.cache_computed(seq)
    return seq


def test_shared_blocks_are_reference_counted_and_never_written():
    blocks = BlockManager(num_blocks=8, block_size=4, cache=PrefixCache(root_key("test")))
    a = computed(blocks, sequence("a", range(10)))  # blocks 0, 1 full; block 2 holds 2 tokens
    assert a.block_table == [0, 1, 2]
    b = sequence("b", [*range(8), 99, 98, 97])  # shares a's two full blocks, then differs
    hits = blocks.match_prefix(b)
    assert hits == [0, 1]
    blocks.admit(b, hits)
    blocks.grow(b.block_table, b.num_tokens)
    # b computes from token 8 on, into blocks of its own: the shared ones are full and computed.
    assert b.num_computed == 8 and b.block_table[:2] == [0, 1] and b.block_table[2] not in a.block_table
    assert [blocks.ref_count(i) for i in range(4)] == [2, 2, 1, 1]
    assert blocks.num_free_blocks == 4
    blocks.free(a.block_table)
    assert [blocks.ref_count(i) for i in range(4)] == [1, 1, 0, 1]
    blocks.free(b.block_table)
    assert all(blocks.ref_count(i) == 0 for i in range(8)) and blocks.num_free_blocks == 8
    assert blocks.cache.num_cached_blocks == 2  # a's two full blocks; partial blocks never are


def test_lru_eviction_forgets_the_least_recently_freed_blocks_first():
    blocks = BlockManager(num_blocks=4, block_size=4, cache=PrefixCache(root_key("test")))
    old = computed(blocks, sequence("old", [1] * 4 + [2] * 4 + [3]))  # full blocks 0, 1; partial 2
    assert old.block_table == [0, 1, 2]
    blocks.free(old.block_table)  # tail first: 2 is plain again; 1 then 0 become evictable
    new = computed(blocks, sequence("new", [5] * 4 + [6]))  # no hit: takes plain blocks 2 and 3
    assert new.block_table == [2, 3]
    blocks.free(new.block_table)  # 3 plain; 2 evictable, the most recently freed
    assert blocks.num_free_blocks == 4 and blocks.cache.num_cached_blocks == 3
    # Two blocks: the plain block 3, then the least recently freed cached block, 1.
    taker = sequence("taker", [7] * 8)
    blocks.grow(taker.block_table, 8)
    assert taker.block_table == [3, 1]
    assert blocks.cache.num_cached_blocks == 2
    assert blocks.match_prefix(sequence("old-again", [1] * 4 + [2] * 4 + [3])) == [0]  # its chain breaks at 1
    assert blocks.match_prefix(sequence("new-again", [5] * 4 + [6])) == [2]
    # A hit on an evictable block takes it out of the LRU: it cannot be evicted under its user.
    user = sequence("user", [5] * 4 + [8])
    blocks.admit(user, blocks.match_prefix(user))
    blocks.grow(user.block_table, user.num_tokens)  # the last free block: 0 (evicted)
    assert user.block_table == [2, 0] and blocks.num_free_blocks == 0
    assert blocks.match_prefix(sequence("old-again", [1] * 4 + [2] * 4 + [3])) == []
    blocks.free(taker.block_table)
    blocks.free(user.block_table)
    assert blocks.num_free_blocks == 4 and all(blocks.ref_count(b) == 0 for b in range(4))


def test_keys_chain_over_the_whole_prefix_and_the_model():
    blocks = BlockManager(num_blocks=8, block_size=4, cache=PrefixCache(root_key("model-a")))
    computed(blocks, sequence("a", [1, 2, 3, 4, 5, 6, 7, 8, 0]))
    # The same second block after a different first block is a different key.
    assert blocks.match_prefix(sequence("b", [9, 2, 3, 4, 5, 6, 7, 8, 0])) == []
    assert blocks.match_prefix(sequence("c", [1, 2, 3, 4, 5, 6, 7, 8, 0])) == [0, 1]
    other_model = BlockManager(num_blocks=8, block_size=4, cache=PrefixCache(root_key("model-b")))
    seq = sequence("e", [1, 2, 3, 4, 5, 6, 7, 8, 0])
    blocks.match_prefix(seq)
    other = sequence("f", [1, 2, 3, 4, 5, 6, 7, 8, 0])
    other_model.match_prefix(other)
    assert seq.block_keys and other.block_keys and set(seq.block_keys).isdisjoint(other.block_keys)
