"""Continuous batching: decide which sequences run in the next step.

A step is either a prefill of newly admitted sequences (all their uncomputed tokens) or a
decode of every running sequence (one token each). New requests join the running batch at
the next step boundary; finished ones leave it. When the KV cache cannot grow every running
sequence by one token, the most recent arrivals are preempted: their blocks are freed and
they go back to the front of the queue, to be recomputed from their tokens (nothing is lost).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from raymoe.engine.block_manager import BlockManager
from raymoe.engine.sequence import Sequence, SequenceStatus


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 4096


@dataclass(frozen=True)
class ScheduledBatch:
    sequences: list[Sequence]
    is_prefill: bool


class Scheduler:
    def __init__(self, config: SchedulerConfig, blocks: BlockManager):
        self.config = config
        self.blocks = blocks
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, sequence: Sequence) -> None:
        self.waiting.append(sequence)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch | None:
        admitted = self._admit()
        if admitted:
            return ScheduledBatch(admitted, is_prefill=True)
        if not self.running:
            return None
        self._make_room_for_decode()
        return ScheduledBatch(list(self.running), is_prefill=False)

    def finish(self, sequence: Sequence) -> None:
        """Release a finished (or aborted) sequence's blocks and drop it from the queues."""
        self.blocks.free(sequence.block_table)
        sequence.status = SequenceStatus.FINISHED
        if sequence in self.running:
            self.running.remove(sequence)
        elif sequence in self.waiting:
            self.waiting.remove(sequence)

    def _admit(self) -> list[Sequence]:
        admitted: list[Sequence] = []
        budget = self.config.max_num_batched_tokens
        # Keep one block per running sequence in reserve so admission doesn't starve decode.
        reserve = len(self.running)
        while self.waiting and len(self.running) < self.config.max_num_seqs:
            sequence = self.waiting[0]
            tokens = sequence.num_tokens
            if admitted and tokens > budget:
                break
            if not self.blocks.can_allocate(tokens, reserve):
                break
            self.waiting.popleft()
            sequence.block_table = self.blocks.allocate(tokens)
            sequence.num_computed = 0
            sequence.status = SequenceStatus.RUNNING
            self.running.append(sequence)
            admitted.append(sequence)
            budget -= tokens
        return admitted

    def _make_room_for_decode(self) -> None:
        # Every running sequence needs room for one more token; preempt the newest until it fits.
        while True:
            needed = sum(max(0, self.blocks.blocks_needed(s.num_tokens) - len(s.block_table)) for s in self.running)
            if needed <= self.blocks.num_free_blocks or len(self.running) == 1:
                break
            victim = max(self.running, key=lambda s: s.arrival)
            self._preempt(victim)
        for sequence in self.running:
            self.blocks.grow(sequence.block_table, sequence.num_tokens)

    def _preempt(self, sequence: Sequence) -> None:
        self.running.remove(sequence)
        self.blocks.free(sequence.block_table)
        sequence.num_computed = 0
        sequence.status = SequenceStatus.WAITING
        sequence.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(sequence)
