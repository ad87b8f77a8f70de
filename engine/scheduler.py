"""Continuous batching with chunked prefill: decide which tokens run in the next step.

Every step spends at most ``max_num_batched_tokens`` tokens, in this order:

1. decodes: every running sequence whose tokens are all computed but its newest one;
2. prompts being computed: the next chunk of each (as much as the budget has left);
3. new admissions from the queue (first come, first served), starting from the longest
   prefix the prefix cache holds, with a first chunk of whatever budget is left.

So a long prompt is spread over steps and never stalls the running decodes for its whole
prefill. While sequences decode, prompts' tokens are further held to the pacer's allowance
(engine/prefill_pacer.py: sized from measured step costs so a step takes about
``prefill_step_slowdown`` times a decode-only step). A sequence samples a token only in the step that computes its last token. Each
scheduled sequence's block table grows to hold the tokens it computes; when the cache has
no block left, the newest running sequence not yet scheduled is preempted (its blocks
freed, back to the front of the queue, recomputed later from its tokens: nothing is lost,
and with the prefix cache its full blocks are usually found again). A sequence older than
every candidate preempts itself, or a prompt computes a smaller chunk. No step crashes for
want of blocks.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from raymoe.engine.block_manager import BlockManager
from raymoe.engine.latency_histogram import LatencyHistogram
from raymoe.engine.prefill_pacer import DEFAULT_PREFILL_STEP_SLOWDOWN, check_slowdown
from raymoe.engine.sequence import Sequence, SequenceStatus

# Tokens per step when the config leaves it open: small on a CPU, where a step's time grows
# with its tokens from a few hundred on; larger on a GPU, where it stays flat much longer.
DEFAULT_MAX_NUM_BATCHED_TOKENS = {"cpu": 512, "cuda": 2048}


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None  # None: DEFAULT_MAX_NUM_BATCHED_TOKENS for the device
    # While sequences decode, a step with prompt chunks aims at this many times a decode-only
    # step (engine/prefill_pacer.py); 0: prompts take the whole token budget.
    prefill_step_slowdown: float = DEFAULT_PREFILL_STEP_SLOWDOWN

    def __post_init__(self) -> None:
        check_slowdown(self.prefill_step_slowdown)
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")

    def token_budget(self, device_type: str) -> int:
        if self.max_num_batched_tokens is not None:
            return self.max_num_batched_tokens
        return DEFAULT_MAX_NUM_BATCHED_TOKENS.get(device_type, DEFAULT_MAX_NUM_BATCHED_TOKENS["cuda"])


@dataclass(frozen=True)
class ScheduledBatch:
    sequences: list[Sequence]
    num_new_tokens: list[int]  # tokens each sequence computes this step, from its num_computed on

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)


class Scheduler:
    def __init__(self, config: SchedulerConfig, blocks: BlockManager, token_budget: int):
        self.config = config
        self.blocks = blocks
        self.token_budget = token_budget
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order
        self.num_preemptions = 0  # since start
        self.queue_times = LatencyHistogram()  # each sequence's wait from arrival to its first admission

    def add(self, sequence: Sequence) -> None:
        self.waiting.append(sequence)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self, prefill_allowance: int | None = None) -> ScheduledBatch | None:
        """The next step's batch. ``prefill_allowance``: the most prompt tokens (chunks and
        admissions) the step computes when it also decodes (engine/prefill_pacer.py); None: the
        token budget alone bounds them."""
        budget = self.token_budget
        decoding = any(s.num_new_tokens == 1 for s in self.running)
        # Tokens prompts (chunks and admissions) may compute this step: paced while others decode.
        prompt_budget = min(budget, max(1, prefill_allowance)) if decoding and prefill_allowance is not None else budget
        scheduled: dict[Sequence, int] = {}  # insertion-ordered: the step's flat batch
        preemptions = self.num_preemptions
        # Steps 1 and 2: decodes first, then the running prompts' next chunks, oldest first.
        for sequence in sorted(self.running, key=lambda s: (s.num_new_tokens > 1, s.arrival)):
            is_prompt = sequence.num_new_tokens > 1
            if budget == 0 or (is_prompt and prompt_budget == 0):
                break
            if sequence.status is not SequenceStatus.RUNNING:  # preempted by an older one above
                continue
            limit = min(budget, prompt_budget) if is_prompt else budget
            count = self._make_room(sequence, min(sequence.num_new_tokens, limit), scheduled)
            if count:
                scheduled[sequence] = count
                budget -= count
                if is_prompt:
                    prompt_budget -= count
        # Step 3: admissions, unless this step had to preempt (the cache is full).
        preempted = self.num_preemptions > preemptions
        while (not preempted and budget and prompt_budget and self.waiting
               and len(self.running) < self.config.max_num_seqs):
            count = self._admit(self.waiting[0], min(budget, prompt_budget))
            if not count:
                break
            sequence = self.waiting.popleft()
            self.running.append(sequence)
            if sequence.queue_time is None:  # a preempted sequence's readmission is not a new wait
                sequence.queue_time = time.monotonic() - sequence.arrival_time
                self.queue_times.observe(sequence.queue_time)
            scheduled[sequence] = count
            budget -= count
            prompt_budget -= count
        if not scheduled:
            return None
        return ScheduledBatch(list(scheduled), list(scheduled.values()))

    def computed(self, batch: ScheduledBatch) -> None:
        """The batch ran (every sequence's num_computed advanced): offer its new full blocks
        to the prefix cache."""
        for sequence in batch.sequences:
            self.blocks.cache_computed(sequence)

    def finish(self, sequence: Sequence) -> None:
        """Release a finished (or aborted) sequence's blocks and drop it from the queues."""
        self.blocks.free(sequence.block_table)
        sequence.status = SequenceStatus.FINISHED
        if sequence in self.running:
            self.running.remove(sequence)
        elif sequence in self.waiting:
            self.waiting.remove(sequence)

    def free_blocks(self, num_blocks: int) -> None:
        """Preempt the newest running sequences until ``num_blocks`` blocks are free (for work
        outside the schedule, such as scoring; ``num_blocks`` <= the cache's blocks)."""
        while self.blocks.num_free_blocks < num_blocks and self.running:
            self._preempt(max(self.running, key=lambda s: s.arrival))

    # ---- internals ---------------------------------------------------------------------
    def _make_room(self, sequence: Sequence, count: int, scheduled: dict[Sequence, int]) -> int:
        """Grow ``sequence``'s blocks for ``count`` more tokens, preempting newer running
        sequences not yet scheduled; returns the tokens it may compute (0: it was preempted)."""
        blocks = self.blocks
        while not blocks.can_grow(sequence.block_table, sequence.num_computed + count):
            candidates = [s for s in self.running if s is not sequence and s not in scheduled]
            victim = max(candidates, key=lambda s: s.arrival, default=None)
            if victim is not None and victim.arrival > sequence.arrival:
                self._preempt(victim)
                continue
            room = (len(sequence.block_table) + blocks.num_free_blocks) * blocks.block_size - sequence.num_computed
            if count > 1 and room > 0:  # a prompt's chunk shrinks to the room there is
                count = room
                break
            self._preempt(sequence)
            return 0
        blocks.grow(sequence.block_table, sequence.num_computed + count)
        return count

    def _admit(self, sequence: Sequence, budget: int) -> int:
        """Admit ``sequence`` with its first chunk if the cache has room; returns that chunk's
        size (0: not admitted). One free block per running sequence stays in reserve, so
        admissions do not starve the decodes."""
        blocks = self.blocks
        hits = blocks.match_prefix(sequence)
        start = len(hits) * blocks.block_size
        count = min(sequence.num_tokens - start, budget)
        spare = blocks.num_free_blocks - len(self.running) - blocks.blocks_to_admit(hits, start)
        count = min(count, (len(hits) + spare) * blocks.block_size - start)
        if count <= 0:
            return 0
        blocks.admit(sequence, hits)
        blocks.grow(sequence.block_table, start + count)
        sequence.status = SequenceStatus.RUNNING
        return count

    def _preempt(self, sequence: Sequence) -> None:
        self.running.remove(sequence)
        self.blocks.free(sequence.block_table)
        sequence.num_computed = 0
        sequence.num_cached_blocks = 0
        sequence.status = SequenceStatus.WAITING
        sequence.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(sequence)
