"""The in-process engine: add requests, step, collect outputs.

One step is schedule -> run -> postprocess:

1. the scheduler picks the step's tokens within its token budget: one per decoding
   sequence, then chunks of prompts (a long prompt is spread over several steps);
2. the model runs them as one flat batch and the sampler picks a token for every sequence
   whose tokens are now all computed, from the logits of its last position;
3. outputs are appended, stop conditions checked, finished sequences release their blocks.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable

import torch

from raymoe.engine.block_manager import BlockManager
from raymoe.engine.checkpoint import Checkpoint
from raymoe.engine.experts import ExpertBackend, LocalExperts
from raymoe.engine.host_memory import keep_freed_memory
from raymoe.engine.incremental_text import IncrementalText
from raymoe.engine.kv_cache import KVCache
from raymoe.engine.model import MoEModel
from raymoe.engine.prefill_pacer import PrefillPacer
from raymoe.engine.prefix_cache import PrefixCache, PrefixCacheStats, root_key
from raymoe.engine.prompt_logprobs import PromptLogprobs, reduce_rows
from raymoe.engine.sampler import sample, seeded_generator
from raymoe.engine.sampling_params import SamplingParams
from raymoe.engine.scheduler import ScheduledBatch, Scheduler, SchedulerConfig
from raymoe.engine.sequence import FinishReason, Sequence
from raymoe.engine.structured_output import GrammarCompiler
from raymoe.engine.weights import load_dense_weights, load_expert_stack, validate_checkpoint
from raymoe.kernels.attention import AttentionMetadata
from raymoe.moe.capacity import CapacityConfig
from raymoe.moe.model_config import ModelConfig
from raymoe.engine.hf_config import load_model_config

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


LOG = logging.getLogger("raymoe.engine")


def resolve_dtype(name: str, config: ModelConfig, device: torch.device) -> torch.dtype:
    """``auto`` takes the checkpoint's dtype (float16 becomes float32 on the CPU)."""
    if name == "auto":
        name = config.dtype if config.dtype in _DTYPES else "float32"
        if name == "float16" and device.type == "cpu":
            name = "float32"
    if name not in _DTYPES:
        raise ValueError(f"dtype: expected one of auto, {', '.join(_DTYPES)}; got {name!r}")
    return _DTYPES[name]


@dataclass(frozen=True)
class EngineConfig:
    dtype: str = "auto"
    device: str = "cpu"
    block_size: int = 16
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    kv_cache_bytes: int = 512 * 2**20
    enable_prefix_caching: bool = True  # reuse full KV blocks across requests (engine/prefix_cache.py)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    capacity: CapacityConfig = field(default_factory=CapacityConfig)
    keep_logits: bool = False  # attach each step's logits row to the outputs (tests, debugging)
    # With expert workers: a step runs in two ping-ponged micro-batches when the router holds at
    # least this many running sequences (engine/model.py::forward_micro_batches); 0: never.
    micro_batch_min_seqs: int = 0


@dataclass
class RequestOutput:
    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[float]
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    output_token_ids: list[int]
    output_logprobs: list[float]
    output_top_logprobs: list[list[tuple[int, float]] | None]
    stop_text_index: int | None = None
    logits: torch.Tensor | None = None  # [V], only with EngineConfig.keep_logits
    error: str | None = None  # this sequence failed alone (its sampling or stop check); it is finished


class LLMEngine:
    def __init__(
        self,
        config: ModelConfig,
        model: MoEModel,
        engine_config: EngineConfig,
        dtype: torch.dtype,
        detokenize: Callable[[list[int]], str] | None = None,
        grammar: GrammarCompiler | None = None,  # the vocabulary's grammar compiler, for structured output
        text_holds: frozenset[int] = frozenset(),  # ids the stop strings' text does not settle after
    ):
        self.config = config
        self.grammar = grammar
        self.model = model
        self.engine_config = engine_config
        self.device = torch.device(engine_config.device)
        if self.device.type == "cpu":
            keep_freed_memory()  # a step's buffers are reused, not page-faulted in anew (engine/host_memory.py)
        self.dtype = dtype
        self.detokenize = detokenize
        self.text_holds = text_holds  # (Tokenizer.byte_fallback_ids: engine/incremental_text.py)
        self.max_model_len = min(engine_config.max_model_len or config.max_position_embeddings,
                                 config.max_position_embeddings)
        block_size = engine_config.block_size
        per_block = KVCache.bytes_per_token(config, dtype) * block_size
        max_blocks = -(-self.max_model_len // block_size) * engine_config.scheduler.max_num_seqs
        num_blocks = min(engine_config.kv_cache_bytes // per_block, max_blocks)
        if num_blocks < 1:
            raise ValueError(f"kv_cache_bytes={engine_config.kv_cache_bytes} holds no KV block ({per_block} bytes "
                             f"for {block_size} tokens of this model); raise engine.kv_cache_bytes")
        if num_blocks * block_size < self.max_model_len:
            LOG.warning("the KV cache holds %d tokens, fewer than the context length %d: requests needing more "
                        "are refused (raise engine.kv_cache_bytes)", num_blocks * block_size, self.max_model_len)
        prefix_cache = None
        if engine_config.enable_prefix_caching:  # blocks computed by another model must never match
            prefix_cache = PrefixCache(root_key(f"{config!r}|{dtype}|{block_size}"))
        self.blocks = BlockManager(num_blocks, block_size, prefix_cache)
        self.cache = KVCache(config, num_blocks, block_size, dtype, self.device)
        self.scheduler = Scheduler(engine_config.scheduler, self.blocks,
                                   engine_config.scheduler.token_budget(self.device.type))
        self.pacer = PrefillPacer(engine_config.scheduler.prefill_step_slowdown, self.scheduler.token_budget)
        self._sequences: dict[str, Sequence] = {}
        self._arrivals = itertools.count()
        self.num_steps = 0
        self.step_seconds = 0.0

    # ---- construction --------------------------------------------------------------
    @classmethod
    def from_pretrained(
        cls,
        model_dir: str,
        engine_config: EngineConfig | None = None,
        experts: ExpertBackend | None = None,
        detokenize: Callable[[list[int]], str] | None = None,
        text_holds: frozenset[int] = frozenset(),
    ) -> "LLMEngine":
        """Load a checkpoint; with ``experts=None`` every expert is loaded into this process.
        ``detokenize`` (and ``text_holds``, its tokenizer's byte-fallback ids) serve stop strings."""
        engine_config = engine_config or EngineConfig()
        config = load_model_config(model_dir)
        device = torch.device(engine_config.device)
        dtype = resolve_dtype(engine_config.dtype, config, device)
        checkpoint = Checkpoint(model_dir)
        validate_checkpoint(checkpoint, config)
        weights = load_dense_weights(checkpoint, config, dtype, device)
        if experts is None:
            stacks = [
                load_expert_stack(checkpoint, config, layer, list(range(config.num_experts)), dtype, device)
                for layer in config.moe_layers
            ]
            experts = LocalExperts([s[0] for s in stacks], [s[1] for s in stacks], engine_config.capacity)
        grammar = _grammar_compiler(model_dir, config)
        return cls(config, MoEModel(config, weights, experts), engine_config, dtype, detokenize, grammar, text_holds)

    # ---- requests ------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    resume_output_ids: Iterable[int] = ()) -> None:
        """Queue a request. ``resume_output_ids``: tokens it already produced elsewhere (a request
        migrated from a lost router): it continues after them as if it had never moved — their
        keys and values are computed with the prompt's, its penalties count them, its grammar and
        its seeded random stream stand past them, and only the tokens after them are output."""
        if request_id in self._sequences:
            raise ValueError(f"request id {request_id!r} is already in use")
        self.validate_prompt(prompt_token_ids, params)
        resumed = list(resume_output_ids)
        if len(resumed) >= params.max_tokens or len(prompt_token_ids) + len(resumed) >= self.max_model_len:
            raise ValueError(f"a resumed request must have tokens left to produce: {len(resumed)} already produced, "
                             f"max_tokens={params.max_tokens}, context {self.max_model_len}")
        bad = [t for t in resumed if not 0 <= t < self.config.vocab_size]
        if bad:
            raise ValueError(f"resumed token ids {bad[:5]} are outside the vocabulary [0, {self.config.vocab_size})")
        bad = [t for t, _ in params.logit_bias if t >= self.config.vocab_size]
        if bad:
            raise ValueError(f"logit_bias token ids {bad[:5]} are outside the vocabulary [0, {self.config.vocab_size})")
        grammar = None
        if params.structured is not None:
            if self.grammar is None:
                raise ValueError("response_format is not available: this engine has no grammar compiler (it needs "
                                 "the checkpoint's tokenizer.json and the xgrammar package)")
            grammar = self.grammar.new_state(params.structured)
            for token in resumed:
                if not grammar.accept(token):
                    raise ValueError(f"resumed token {token} breaks the request's response_format grammar")
        generator = None  # unseeded rows draw from the device's default generator, in one batch
        if not params.is_greedy and params.seed is not None:
            generator = seeded_generator(params.seed, self.device, tokens_sampled=len(resumed))
        sequence = Sequence(request_id, list(prompt_token_ids), params, generator, next(self._arrivals))
        if resumed:  # its earlier logprobs went out with those tokens; placeholders keep the lists aligned
            sequence.output_ids = resumed
            sequence.logprobs = [float("nan")] * len(resumed)
            sequence.top_logprobs = [None] * len(resumed)
        sequence.grammar = grammar
        self._sequences[request_id] = sequence
        self.scheduler.add(sequence)

    def validate_prompt(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError for prompts the engine can never serve (checked before queueing)."""
        if not prompt_token_ids:
            raise ValueError("the prompt is empty")
        bad = [t for t in prompt_token_ids if not 0 <= t < self.config.vocab_size]
        if bad:
            raise ValueError(f"token ids {bad[:5]} are outside the vocabulary [0, {self.config.vocab_size})")
        if len(prompt_token_ids) >= self.max_model_len:
            raise ValueError(
                f"the prompt has {len(prompt_token_ids)} tokens; the context length is {self.max_model_len}"
            )
        total = min(len(prompt_token_ids) + params.max_tokens, self.max_model_len)
        if self.blocks.blocks_needed(total) > self.blocks.num_blocks:
            raise ValueError(
                f"the prompt's {len(prompt_token_ids)} tokens plus max_tokens={params.max_tokens} need {total} tokens "
                f"of KV cache; this engine's cache holds {self.kv_cache_capacity_tokens}: lower max_tokens or "
                f"shorten the prompt (an operator can raise engine.kv_cache_bytes)"
            )

    @property
    def kv_cache_capacity_tokens(self) -> int:
        """Tokens the KV cache holds (all sequences together)."""
        return self.blocks.num_blocks * self.blocks.block_size

    def prefix_cache_stats(self) -> PrefixCacheStats:
        """Prompt tokens looked up in the prefix cache and found there, since start."""
        cache = self.blocks.cache
        return cache.stats() if cache is not None else PrefixCacheStats(0, 0)

    def abort_request(self, request_id: str) -> None:
        sequence = self._sequences.pop(request_id, None)
        if sequence is not None and not sequence.is_finished:
            sequence.finish_reason = FinishReason.ABORT
            self.scheduler.finish(sequence)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- the step ------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        started = time.perf_counter()
        batch = self.scheduler.schedule(self.pacer.prefill_allowance())
        if batch is None:
            return []
        outputs = self._step(batch)
        seconds = time.perf_counter() - started
        self.num_steps += 1
        self.step_seconds += seconds
        num_decodes = sum(1 for count in batch.num_new_tokens if count == 1)
        self.pacer.observe(num_decodes, batch.num_tokens - num_decodes, seconds)
        return outputs

    def _step(self, batch: ScheduledBatch) -> list[RequestOutput]:
        hidden = self._run(batch.sequences, batch.num_new_tokens)  # [T, D]
        self.scheduler.computed(batch)
        # Only sequences whose tokens are now all computed sample; a prompt chunk short of its
        # prompt's end samples nothing.
        ends = itertools.accumulate(batch.num_new_tokens)
        done = [(s, end - 1) for s, end in zip(batch.sequences, ends) if s.num_computed == s.num_tokens]
        if not done:
            return []
        sequences = [s for s, _ in done]
        last_rows = torch.tensor([row for _, row in done])
        # Sampled where the logits are: only the chosen ids and logprobs come to the host.
        logits = self.model.logits(hidden.index_select(0, last_rows.to(hidden.device)))  # [B, V]
        try:
            sampled = list(zip(*sample(logits, sequences, self.config.eos_token_ids)))
        except Exception:  # one sequence's sampling must not fail its batch: sample each alone
            sampled = [self._sample_alone(logits[i:i + 1], sequence) for i, sequence in enumerate(sequences)]
        outputs = []
        for i, (sequence, choice) in enumerate(zip(sequences, sampled)):
            if isinstance(choice, Exception):
                outputs.append(self._fail_sequence(sequence, "sampling", choice))
                continue
            try:
                outputs.append(self._postprocess(sequence, *choice,
                                                 logits[i].cpu() if self.engine_config.keep_logits else None))
            except Exception as error:  # e.g. its stop-string check: it alone fails
                outputs.append(self._fail_sequence(sequence, "checking stop conditions", error))
        return outputs

    def _run(self, sequences: list[Sequence], num_new_tokens: list[int]) -> torch.Tensor:
        """Compute the next ``num_new_tokens[i]`` tokens of each sequence (from its
        ``num_computed`` on; its blocks already hold room for them) and advance ``num_computed``.
        In a step the expert backend runs in two micro-batches, the sequences are cut in two
        contiguous halves of about equal tokens, ping-ponged (``MoEModel.forward_micro_batches``):
        the hidden states come back in the same order."""
        cut = _micro_batch_cut(num_new_tokens) if getattr(self.model.experts, "micro_batches", 1) == 2 else None
        with torch.inference_mode():
            if cut is None:
                hidden = self.model.forward(*self._inputs(sequences, num_new_tokens), self.cache)
            else:
                halves = self.model.forward_micro_batches(self._inputs(sequences[:cut], num_new_tokens[:cut]),
                                                          self._inputs(sequences[cut:], num_new_tokens[cut:]),
                                                          self.cache)
                hidden = torch.cat(halves)
        for sequence, count in zip(sequences, num_new_tokens):
            sequence.num_computed += count
        return hidden

    def _inputs(self, sequences: list[Sequence], num_new_tokens: list[int]):
        """``(input_ids [T], positions [T], attention metadata)`` of these sequences' next tokens, on the device."""
        input_ids: list[int] = []
        positions: list[int] = []
        for sequence, count in zip(sequences, num_new_tokens):
            start = sequence.num_computed
            input_ids.extend(sequence.tokens(start, start + count))
            positions.extend(range(start, start + count))
        metadata = AttentionMetadata.build(
            num_new_tokens,
            [s.num_computed + count for s, count in zip(sequences, num_new_tokens)],
            [s.block_table for s in sequences],
            self.blocks.block_size,
        )
        device = self.device
        return (torch.tensor(input_ids, dtype=torch.int64, device=device),
                torch.tensor(positions, dtype=torch.int64, device=device), _to_device(metadata, device))

    def _postprocess(
        self, sequence: Sequence, token: int, logprob: float, top, logits: torch.Tensor | None
    ) -> RequestOutput:
        sequence.output_ids.append(token)
        sequence.logprobs.append(logprob)
        sequence.top_logprobs.append(top)
        params = sequence.params
        reason = None
        if sequence.grammar is not None and not sequence.grammar.accept(token):
            raise RuntimeError(f"token {token} breaks the request's response_format grammar")
        if (not params.ignore_eos and token in self.config.eos_token_ids) or token in params.stop_token_ids:
            reason = FinishReason.STOP
        elif sequence.grammar is not None and sequence.grammar.is_terminated:  # it ended with its stop token
            reason = FinishReason.STOP
        elif params.stop and self.detokenize is not None and self._match_stop(sequence):
            reason = FinishReason.STOP
        elif len(sequence.output_ids) >= params.max_tokens or sequence.num_tokens >= self.max_model_len:
            reason = FinishReason.LENGTH
        if reason is not None:
            sequence.finish_reason = reason
            self.scheduler.finish(sequence)
            self._sequences.pop(sequence.request_id, None)
        return RequestOutput(
            request_id=sequence.request_id,
            new_token_ids=[token],
            new_logprobs=[logprob],
            finished=reason is not None,
            finish_reason=reason.value if reason else None,
            num_prompt_tokens=len(sequence.prompt_ids),
            output_token_ids=sequence.output_ids,
            output_logprobs=sequence.logprobs,
            output_top_logprobs=sequence.top_logprobs,
            stop_text_index=sequence.stop_text_index,
            logits=logits,
        )

    def _sample_alone(self, logits: torch.Tensor, sequence: Sequence):
        try:
            tokens, logprobs, tops = sample(logits, [sequence], self.config.eos_token_ids)
            return tokens[0], logprobs[0], tops[0]
        except Exception as error:
            return error

    def _fail_sequence(self, sequence: Sequence, stage: str, error: BaseException) -> RequestOutput:
        """Finish ``sequence`` alone with an error (its blocks freed); the internal text stays
        in the server's log, keyed by the request id."""
        LOG.error("request %s failed while %s: %s: %s", sequence.request_id, stage, type(error).__name__, error)
        sequence.finish_reason = FinishReason.ABORT
        self.scheduler.finish(sequence)
        self._sequences.pop(sequence.request_id, None)
        return RequestOutput(
            request_id=sequence.request_id, new_token_ids=[], new_logprobs=[], finished=True,
            finish_reason=None, num_prompt_tokens=len(sequence.prompt_ids), output_token_ids=sequence.output_ids,
            output_logprobs=sequence.logprobs, output_top_logprobs=sequence.top_logprobs,
            error=f"the server failed while {stage} for this request",
        )

    def _match_stop(self, sequence: Sequence) -> bool:
        """Whether the output's text now holds a stop string (``stop_text_index``: where the first
        starts). The text grows by a few tokens' decode a step (engine/incremental_text.py), and
        only its end can hold a new match: one that ends after the text settled so far."""
        if sequence.output_text is None:
            sequence.output_text = IncrementalText(self.detokenize, self.text_holds)
        state = sequence.output_text
        start = max(0, len(state.settled) - max(len(s) for s in sequence.params.stop) + 1)
        text = state.update(sequence.output_ids)
        if state.whole:  # (decoded whole: earlier text may read differently now; search all of it)
            start = 0
        found = [i for i in (text.find(s, start) for s in sequence.params.stop) if i >= 0]
        if found:
            sequence.stop_text_index = min(found)
        return bool(found)

    # ---- conveniences --------------------------------------------------------------
    def generate(self, prompts: Iterable[list[int]], params: SamplingParams | list[SamplingParams]) -> list[RequestOutput]:
        """Run prompts to completion; returns each request's final output, in prompt order."""
        prompts = list(prompts)
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        ids = [f"generate-{next(self._arrivals)}" for _ in prompts]
        for request_id, prompt, p in zip(ids, prompts, params_list):
            self.add_request(request_id, prompt, p)
        final: dict[str, RequestOutput] = {}
        while len(final) < len(ids):
            for output in self.step():
                if output.finished:
                    final[output.request_id] = output
        return [final[i] for i in ids]

    def score(self, prompts: list[list[int]]) -> list[torch.Tensor]:
        """Logits at every position of each prompt, ``[len, V]`` float32 on the host (tests,
        debugging: the result itself is ``len * V`` floats a prompt; echo and prompt logprobs
        take :meth:`score_prompts`, which never holds them). Computed as :meth:`score_prompts` is."""
        return self._scored(prompts, None).logits()

    def score_prompts(self, prompts: list[list[int]], num_top: int) -> list[PromptLogprobs]:
        """Each prompt's token logprobs, ranks and ``num_top`` alternatives per position (echo,
        prompt_logprobs), within the token budget: see :class:`PromptScoring`."""
        return self._scored(prompts, num_top).prompt_logprobs()

    def _scored(self, prompts: list[list[int]], num_top: int | None) -> "PromptScoring":
        """A scoring of ``prompts`` run to its end, its KV blocks given back."""
        scoring = self.start_scoring(prompts, num_top)
        try:
            while not scoring.done:
                scoring.step()
        finally:
            scoring.close()
        return scoring

    def start_scoring(self, prompts: list[list[int]], num_top: int | None) -> "PromptScoring":
        """A scoring of ``prompts`` to advance one forward at a time (:meth:`PromptScoring.step`;
        a router runs one per group step). ``num_top=None``: keep every position's logits."""
        return PromptScoring(self, prompts, num_top)


class PromptScoring:
    """Scores prompts (echo, prompt logprobs) within the engine's token budget.

    Legend: T the tokens of one forward, Tb the token budget (``max_num_batched_tokens``), D
    hidden size, V vocabulary, Na alternatives, Tp a prompt's tokens.

    The prompts' tokens, in order, run as forwards of at most Tb tokens each (a prompt longer
    than Tb is spread over several, its earlier tokens' keys and values in the KV cache, as in
    chunked prefill). After each forward the positions that predict a next prompt token go
    through the vocabulary projection and a float32 log_softmax together, ``[<= Tb, V]``, and only
    the next token's logprob, its rank and the top Na (token, logprob) are kept: no more than
    ``[Tb, V]`` logits ever exist, whatever the prompts. A prompt holds KV blocks from its first
    forward to its last (at most one prompt is part-way between forwards); the blocks a forward
    needs are freed by preempting the newest in-flight sequences, as a step does.

    Runs beside in-flight requests, between steps. A step that raises leaves the scoring as it
    was before it (the prompts keep their blocks): call :meth:`step` again to retry it (a
    router does, after recovering its group), or :meth:`close` to give the blocks back.
    """

    def __init__(self, engine: LLMEngine, prompts: list[list[int]], num_top: int | None):
        self.engine = engine
        self.num_top = num_top
        self.sequences = [Sequence(f"score-{i}", list(p), SamplingParams(), None, -1) for i, p in enumerate(prompts)]
        for sequence in self.sequences:
            engine.validate_prompt(sequence.prompt_ids, SamplingParams(max_tokens=1))
        self._next = 0  # the first prompt not yet computed to its end
        # Per prompt: with num_top, its positions' (logprob, rank, top) so far; else its logits [Tp, V].
        self._chosen: list[list[float | None]] = [[None] for _ in self.sequences]
        self._ranks: list[list[int | None]] = [[None] for _ in self.sequences]
        self._tops: list[list[list[tuple[int, float]] | None]] = [[None] for _ in self.sequences]
        self._logits: list[torch.Tensor | None] = [None] * len(self.sequences)
        self.num_forwards = 0

    @property
    def done(self) -> bool:
        return self._next == len(self.sequences)

    def step(self) -> None:
        """Run the next forward (at most the token budget) and reduce its positions."""
        engine, blocks = self.engine, self.engine.blocks
        pieces = self._next_pieces()  # (prompt index, tokens), in prompt order
        sequences = [self.sequences[index] for index, _ in pieces]
        counts = [count for _, count in pieces]
        starts = [s.num_computed for s in sequences]
        engine.scheduler.free_blocks(sum(blocks.blocks_needed(s.num_computed + count) - len(s.block_table)
                                         for s, count in zip(sequences, counts)))
        try:
            for sequence, count in zip(sequences, counts):
                blocks.grow(sequence.block_table, sequence.num_computed + count)
            hidden = engine._run(sequences, counts)  # [T, D], T <= Tb
            if self.num_top is None:
                self._keep_logits(hidden, pieces, starts)
            else:
                kept = self._reduce(hidden, sequences, counts, starts)
                for (index, _), (chosen, ranks, tops) in zip(pieces, kept):
                    self._chosen[index] += chosen
                    self._ranks[index] += ranks
                    self._tops[index] += tops
        except BaseException:
            for sequence, start in zip(sequences, starts):  # as before this step: it may run again
                sequence.num_computed = start
            raise
        for sequence in sequences:
            if sequence.num_computed == sequence.num_tokens:
                blocks.free(sequence.block_table)
        while not self.done and self.sequences[self._next].num_computed == self.sequences[self._next].num_tokens:
            self._next += 1
        self.num_forwards += 1

    def close(self) -> None:
        """Give back every block this scoring holds (at the end, or to abandon it)."""
        for sequence in self.sequences:
            if sequence.block_table:
                self.engine.blocks.free(sequence.block_table)

    def prompt_logprobs(self) -> list[PromptLogprobs]:
        if not self.done or self.num_top is None:
            raise RuntimeError("prompt_logprobs(): the scoring is not done, or keeps logits")
        return [PromptLogprobs(*lists) for lists in zip(self._chosen, self._ranks, self._tops)]

    def logits(self) -> list[torch.Tensor]:
        if not self.done or self.num_top is not None:
            raise RuntimeError("logits(): the scoring is not done, or keeps logprobs")
        return list(self._logits)

    def _next_pieces(self) -> list[tuple[int, int]]:
        """The next forward's (prompt index, tokens) pieces, in prompt order: at most the token
        budget in all, and no more KV blocks than the cache has (only the first piece's prompt
        may hold blocks already: it was cut short by the previous forward)."""
        blocks = self.engine.blocks
        budget, room = self.engine.scheduler.token_budget, blocks.num_blocks
        pieces: list[tuple[int, int]] = []
        for index in range(self._next, len(self.sequences)):
            sequence = self.sequences[index]
            count = min(sequence.num_tokens - sequence.num_computed, budget,
                        room * blocks.block_size - sequence.num_computed)  # room: blocks it may hold in all
            if count <= 0:
                break
            pieces.append((index, count))
            budget -= count
            room -= blocks.blocks_needed(sequence.num_computed + count)
            if budget == 0 or count < sequence.num_tokens - sequence.num_computed:
                break
        if not pieces:  # validate_prompt: one prompt alone always fits
            raise RuntimeError("scoring found no room for its next prompt")
        return pieces

    def _reduce(self, hidden: torch.Tensor, sequences: list[Sequence], counts: list[int], starts: list[int]
                ) -> list[tuple[list, list, list]]:
        """Positions that predict a next prompt token -> (logprob, rank, top Na) each, per piece."""
        rows: list[int] = []
        targets: list[int] = []
        spans: list[int] = []  # each piece's positions that predict a token, in row order
        offset = 0
        for sequence, count, start in zip(sequences, counts, starts):
            stop = max(min(start + count, sequence.num_tokens - 1), start)  # the last position predicts nothing
            rows.extend(range(offset, offset + stop - start))
            targets.extend(sequence.prompt_ids[start + 1:stop + 1])
            spans.append(stop - start)
            offset += count
        chosen: list[float] = []
        ranks: list[int] = []
        tops: list[list[tuple[int, float]]] = []
        if rows:
            device = hidden.device
            index = torch.tensor(rows, dtype=torch.int64, device=device)
            with torch.inference_mode():
                logits = self.engine.model.logits(hidden.index_select(0, index))  # [<= Tb, V] float32
                chosen, ranks, tops = reduce_rows(logits, torch.tensor(targets, dtype=torch.int64, device=device),
                                                  self.num_top)
        kept, at = [], 0
        for count in spans:
            kept.append((chosen[at:at + count], ranks[at:at + count], tops[at:at + count]))
            at += count
        return kept

    def _keep_logits(self, hidden: torch.Tensor, pieces: list[tuple[int, int]], starts: list[int]) -> None:
        """Copy the forward's logits into each prompt's ``[Tp, V]`` (on the host)."""
        with torch.inference_mode():
            logits = self.engine.model.logits(hidden).cpu()  # [T, V] float32
        offset = 0
        for (index, count), start in zip(pieces, starts):
            if self._logits[index] is None:
                self._logits[index] = torch.empty(self.sequences[index].num_tokens, logits.shape[1])
            self._logits[index][start:start + count] = logits[offset:offset + count]
            offset += count


def _grammar_compiler(model_dir: str, config: ModelConfig) -> GrammarCompiler | None:
    """The checkpoint vocabulary's grammar compiler; None without tokenizer.json or xgrammar
    (structured requests are then refused with a 400)."""
    try:
        return GrammarCompiler.from_model_dir(model_dir, config.vocab_size, list(config.eos_token_ids))
    except ImportError:
        LOG.warning("xgrammar is not installed: response_format (structured output) is refused")
        return None


def _micro_batch_cut(num_new_tokens: list[int]) -> int | None:
    """Where two micro-batches of about equal tokens split a step's sequences (the first
    sequence of the second half), or None for a batch of one sequence."""
    if len(num_new_tokens) < 2:
        return None
    half, total = sum(num_new_tokens) / 2, 0
    for index, count in enumerate(num_new_tokens[:-1]):
        total += count
        if total >= half:
            return index + 1
    return len(num_new_tokens) - 1


def _to_device(metadata: AttentionMetadata, device: torch.device) -> AttentionMetadata:
    if device.type == "cpu":
        return metadata
    return AttentionMetadata(**{k: v.to(device) for k, v in vars(metadata).items()})
