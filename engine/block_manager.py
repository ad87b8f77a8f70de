"""KV-cache block bookkeeping: plain Python, no tensors.

A sequence of ``n`` tokens owns ``ceil(n / block_size)`` blocks, listed in its block table.
Blocks are allocated when a sequence is admitted or grows into a new block, and freed when
it finishes or is preempted.
"""

from __future__ import annotations


class OutOfBlocks(RuntimeError):
    """No free KV-cache block; the scheduler preempts instead of failing."""


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free = list(range(num_blocks - 1, -1, -1))  # pop() hands out low ids first

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_allocate(self, num_tokens: int, reserve: int = 0) -> bool:
        return self.blocks_needed(num_tokens) + reserve <= len(self._free)

    def allocate(self, num_tokens: int) -> list[int]:
        """A fresh block table for ``num_tokens`` tokens."""
        needed = self.blocks_needed(num_tokens)
        if needed > len(self._free):
            raise OutOfBlocks(f"need {needed} blocks, {len(self._free)} free")
        return [self._free.pop() for _ in range(needed)]

    def grow(self, block_table: list[int], num_tokens: int) -> None:
        """Extend ``block_table`` in place so it can hold ``num_tokens`` tokens."""
        extra = self.blocks_needed(num_tokens) - len(block_table)
        if extra > len(self._free):
            raise OutOfBlocks(f"need {extra} more blocks, {len(self._free)} free")
        block_table.extend(self._free.pop() for _ in range(extra))

    def free(self, block_table: list[int]) -> None:
        self._free.extend(reversed(block_table))
        block_table.clear()
