"""One request's state inside the engine."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from raymoe.engine.sampling_params import SamplingParams
from raymoe.engine.structured_output import GrammarState


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(enum.Enum):
    LENGTH = "length"
    STOP = "stop"
    ABORT = "abort"


@dataclass(eq=False)
class Sequence:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    generator: torch.Generator | None
    arrival: int
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]] | None] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    num_computed: int = 0  # leading tokens whose keys/values are in the cache
    block_keys: list[bytes] = field(default_factory=list)  # prefix-cache keys of its first full blocks
    num_cached_blocks: int = 0  # leading blocks of block_table already offered to the prefix cache
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: FinishReason | None = None
    stop_text_index: int | None = None  # where a matched stop string starts in the output text
    output_text: Any = None  # engine/incremental_text.py's IncrementalText of output_ids (stop strings only)
    num_preemptions: int = 0
    penalty_state: Any = None  # sampler.PenaltyState: token counts on the device, for penalised requests
    grammar: GrammarState | None = None  # where the output stands in its structured-output grammar
    arrival_time: float = field(default_factory=time.monotonic)  # when it was added (seconds, monotonic)
    queue_time: float | None = None  # seconds from arrival to its first admission (None: never admitted yet)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_new_tokens(self) -> int:
        """Tokens this step must feed through the model."""
        return self.num_tokens - self.num_computed

    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def tokens(self, start: int, stop: int) -> list[int]:
        """``token_ids()[start:stop]`` without building the whole list: a decode step reads one
        token of each sequence, and a copy of every token a step cost O(length) per sequence."""
        cut = len(self.prompt_ids)
        if start >= cut:
            return self.output_ids[start - cut:stop - cut]
        if stop <= cut:
            return self.prompt_ids[start:stop]
        return self.prompt_ids[start:] + self.output_ids[:stop - cut]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
