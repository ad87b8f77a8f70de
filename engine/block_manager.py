"""KV-cache block bookkeeping: plain Python, no tensors.

A sequence whose first ``n`` tokens have cache room owns ``ceil(n / block_size)`` blocks,
listed in its block table. Each block has a reference count: the sequences whose tables
hold it. With a :class:`~raymoe.engine.prefix_cache.PrefixCache`, full computed blocks are
also named by the tokens they hold, so a new sequence can start from blocks another one
computed (a *hit*: its table begins with them, their count goes up, they are not computed
again). A block whose count drops to 0 is free: a plain one goes back to the free list, a
named one stays cached (evictable) until a block is needed and no plain one is left, oldest
first (LRU).

Invariant: a sequence writes keys/values only at its positions ``>= num_computed``, and a
shared block is always full and computed, so no sequence ever writes into a shared block.
"""

from __future__ import annotations

from raymoe.engine.prefix_cache import PrefixCache, chain_keys
from raymoe.engine.sequence import Sequence


class OutOfBlocks(RuntimeError):
    """No free KV-cache block; the scheduler preempts instead of failing."""


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, cache: PrefixCache | None = None):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.cache = cache
        self._free = list(range(num_blocks - 1, -1, -1))  # plain free blocks; pop() hands out low ids first
        self._ref_counts = [0] * num_blocks

    # ---- queries -----------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks nobody references: plain free ones plus cached (evictable) ones."""
        return len(self._free) + (self.cache.num_evictable if self.cache else 0)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def ref_count(self, block: int) -> int:
        return self._ref_counts[block]

    def can_grow(self, block_table: list[int], num_tokens: int, reserve: int = 0) -> bool:
        """Whether ``block_table`` can grow to hold ``num_tokens`` tokens, leaving ``reserve`` free."""
        return self.blocks_needed(num_tokens) - len(block_table) + reserve <= self.num_free_blocks

    # ---- prefix hits -------------------------------------------------------------------
    def match_prefix(self, sequence: Sequence) -> list[int]:
        """Cached blocks holding the longest prefix of ``sequence``'s tokens (changes no count).

        Only full blocks, and never the block of the last token: that token is always
        computed, so its logits exist to sample from.
        """
        if self.cache is None:
            return []
        usable = (sequence.num_tokens - 1) // self.block_size
        keys = chain_keys(sequence.token_ids(), self.block_size, usable, sequence.block_keys, self.cache.root)
        return self.cache.lookup(keys[:usable])

    def blocks_to_admit(self, hits: list[int], num_tokens: int) -> int:
        """Free blocks an admission starting from ``hits`` and holding ``num_tokens`` takes."""
        revived = sum(1 for block in hits if self._ref_counts[block] == 0)
        return max(self.blocks_needed(num_tokens) - len(hits), 0) + revived

    def admit(self, sequence: Sequence, hits: list[int]) -> None:
        """Start ``sequence``'s (empty) block table with the cached blocks ``hits``."""
        if sequence.block_table:
            raise RuntimeError(f"sequence {sequence.request_id} already holds blocks")
        for block in hits:
            if self._ref_counts[block] == 0:
                self.cache.reuse(block)
            self._ref_counts[block] += 1
        sequence.block_table = list(hits)
        sequence.num_computed = len(hits) * self.block_size
        sequence.num_cached_blocks = len(hits)
        if self.cache is not None:
            self.cache.record_lookup(sequence.num_tokens, sequence.num_computed)

    def cache_computed(self, sequence: Sequence) -> None:
        """Offer ``sequence``'s full, computed blocks to the prefix cache (after a step)."""
        if self.cache is None:
            return
        num_full = sequence.num_computed // self.block_size
        if num_full <= sequence.num_cached_blocks:
            return
        keys = chain_keys(sequence.token_ids(), self.block_size, num_full, sequence.block_keys, self.cache.root)
        for index in range(sequence.num_cached_blocks, num_full):
            self.cache.insert(keys[index], sequence.block_table[index])  # no-op if that key is cached already
        sequence.num_cached_blocks = num_full

    # ---- allocation --------------------------------------------------------------------
    def grow(self, block_table: list[int], num_tokens: int) -> None:
        """Extend ``block_table`` in place so it can hold ``num_tokens`` tokens."""
        extra = self.blocks_needed(num_tokens) - len(block_table)
        if extra > self.num_free_blocks:
            raise OutOfBlocks(f"need {extra} more blocks, {self.num_free_blocks} free")
        for _ in range(extra):
            block_table.append(self._take())

    def free(self, block_table: list[int]) -> None:
        """Drop one reference to every block of ``block_table`` and empty it.

        Tail blocks are released first, so the LRU order evicts a sequence's last blocks
        (the least likely to be shared) before its first ones.
        """
        for block in reversed(block_table):
            self._ref_counts[block] -= 1
            if self._ref_counts[block] == 0 and not (self.cache is not None and self.cache.release(block)):
                self._free.append(block)
        block_table.clear()

    def _take(self) -> int:
        if self._free:
            block = self._free.pop()
        else:
            block = self.cache.evict()  # grow checked that one is evictable
        self._ref_counts[block] = 1
        return block
