"""Automatic prefix caching: full KV blocks found again by the tokens they hold.

A full block's key is a hash chain: ``hash(parent key, the block's tokens)``, starting from
a root that names the model (its config, dtype and block size). Two sequences whose first
``n * block_size`` tokens agree therefore share the keys of their first ``n`` blocks, and a
later request can take those blocks' keys and values instead of computing them.

The cache here is only the index: key -> block id, plus the blocks nobody references any
more (reference count 0) in least-recently-freed order, which the block manager evicts
first when it needs a block and has no never-cached one left. Reference counts live in the
block manager. Plain Python, no tensors.

Invariants: only full blocks whose keys and values are computed get a key; a block holds at
most one key; a key names at most one block (a second block computed with the same tokens
stays private and is freed as a plain block).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass
from typing import Sequence as Tokens

BlockKey = bytes  # sha256 digest: collisions would hand one request another's keys/values


def root_key(model_identity: str) -> BlockKey:
    """The parent key of every sequence's first block."""
    return hashlib.sha256(b"raymoe-prefix-root\0" + model_identity.encode()).digest()


def chain_keys(token_ids: Tokens[int], block_size: int, num_blocks: int, keys: list[BlockKey],
               root: BlockKey) -> list[BlockKey]:
    """Extend ``keys`` (the keys of the first ``len(keys)`` blocks) to ``num_blocks`` keys.

    Block ``i`` holds ``token_ids[i * block_size:(i + 1) * block_size]``; the caller makes
    sure those tokens exist. Keys already in ``keys`` stay (tokens are only ever appended).
    """
    for index in range(len(keys), num_blocks):
        parent = keys[-1] if keys else root
        tokens = array("q", token_ids[index * block_size:(index + 1) * block_size])
        keys.append(hashlib.sha256(parent + tokens.tobytes()).digest())
    return keys


class PrefixCache:
    """Key <-> block index and the LRU order of cached blocks that nobody references."""

    def __init__(self, root: BlockKey):
        self.root = root
        self._block_of: dict[BlockKey, int] = {}
        self._key_of: dict[int, BlockKey] = {}
        self._evictable: OrderedDict[int, None] = OrderedDict()  # oldest-freed first
        self.num_queried_tokens = 0  # prompt tokens looked up at admission
        self.num_hit_tokens = 0  # of which found in the cache

    @property
    def num_evictable(self) -> int:
        return len(self._evictable)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._block_of)

    def lookup(self, keys: list[BlockKey]) -> list[int]:
        """Blocks holding the longest cached prefix of ``keys`` (changes nothing)."""
        blocks = []
        for key in keys:
            block = self._block_of.get(key)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def key_of(self, block: int) -> BlockKey | None:
        return self._key_of.get(block)

    def insert(self, key: BlockKey, block: int) -> bool:
        """Name ``block`` by ``key``; False (nothing changed) when the key or block is taken."""
        if key in self._block_of or block in self._key_of:
            return False
        self._block_of[key] = block
        self._key_of[block] = key
        return True

    def release(self, block: int) -> bool:
        """``block``'s last reference went; True if it stays cached (evictable), False if it
        holds no key (the caller frees it as a plain block)."""
        if block not in self._key_of:
            return False
        self._evictable[block] = None
        return True

    def reuse(self, block: int) -> None:
        """An evictable block is referenced again (a hit): it is no longer evictable."""
        self._evictable.pop(block, None)

    def is_evictable(self, block: int) -> bool:
        return block in self._evictable

    def evict(self) -> int:
        """Forget the least recently freed unreferenced block and return it for reuse."""
        block, _ = self._evictable.popitem(last=False)
        del self._block_of[self._key_of.pop(block)]
        return block

    def record_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        self.num_queried_tokens += num_tokens
        self.num_hit_tokens += num_hit_tokens

    def stats(self) -> "PrefixCacheStats":
        return PrefixCacheStats(self.num_queried_tokens, self.num_hit_tokens)


@dataclass(frozen=True)
class PrefixCacheStats:
    """Counters since the engine started (zeros when prefix caching is off)."""

    num_queried_tokens: int  # tokens looked up at each admission (a preempted sequence's again)
    num_hit_tokens: int  # of which found there (not computed again)

    @property
    def hit_rate(self) -> float:
        return self.num_hit_tokens / self.num_queried_tokens if self.num_queried_tokens else 0.0
