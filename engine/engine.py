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
from raymoe.engine.kv_cache import KVCache
from raymoe.engine.model import MoEModel
from raymoe.engine.prefill_pacer import PrefillPacer
from raymoe.engine.prefix_cache import PrefixCache, PrefixCacheStats, root_key
from raymoe.engine.sampler import sample
from raymoe.engine.sampling_params import SamplingParams
from raymoe.engine.scheduler import ScheduledBatch, Scheduler, SchedulerConfig
from raymoe.engine.sequence import FinishReason, Sequence
from raymoe.engine.structured_output import GrammarCompiler
from raymoe.engine.weights import load_dense_weights, load_expert_stack, validate_checkpoint
from raymoe.kernels.attention import AttentionMetadata
from raymoe.moe.capacity import CapacityConfig
from raymoe.moe.model_config import ModelConfig, load_model_config

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
    ) -> "LLMEngine":
        """Load a checkpoint; with ``experts=None`` every expert is loaded into this process."""
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
        return cls(config, MoEModel(config, weights, experts), engine_config, dtype, detokenize, grammar)

    # ---- requests ------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        if request_id in self._sequences:
            raise ValueError(f"request id {request_id!r} is already in use")
        self.validate_prompt(prompt_token_ids, params)
        bad = [t for t, _ in params.logit_bias if t >= self.config.vocab_size]
        if bad:
            raise ValueError(f"logit_bias token ids {bad[:5]} are outside the vocabulary [0, {self.config.vocab_size})")
        grammar = None
        if params.structured is not None:
            if self.grammar is None:
                raise ValueError("response_format is not available: this engine has no grammar compiler (it needs "
                                 "the checkpoint's tokenizer.json and the xgrammar package)")
            grammar = self.grammar.new_state(params.structured)
        generator = None  # unseeded rows draw from the device's default generator, in one batch
        if not params.is_greedy and params.seed is not None:
            generator = torch.Generator(device=self.device).manual_seed(params.seed)
        sequence = Sequence(request_id, list(prompt_token_ids), params, generator, next(self._arrivals))
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
        ``num_computed`` on; its blocks already hold room for them) and advance ``num_computed``."""
        input_ids: list[int] = []
        positions: list[int] = []
        for sequence, count in zip(sequences, num_new_tokens):
            start = sequence.num_computed
            input_ids.extend(sequence.token_ids()[start:start + count])
            positions.extend(range(start, start + count))
        metadata = AttentionMetadata.build(
            num_new_tokens,
            [s.num_computed + count for s, count in zip(sequences, num_new_tokens)],
            [s.block_table for s in sequences],
            self.blocks.block_size,
        )
        device = self.device
        with torch.inference_mode():
            hidden = self.model.forward(
                torch.tensor(input_ids, dtype=torch.int64, device=device),
                torch.tensor(positions, dtype=torch.int64, device=device),
                _to_device(metadata, device),
                self.cache,
            )
        for sequence, count in zip(sequences, num_new_tokens):
            sequence.num_computed += count
        return hidden

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
        text = self.detokenize(sequence.output_ids)
        found = [i for i in (text.find(s) for s in sequence.params.stop) if i >= 0]
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
        """Logits at every position of each prompt, ``[len, V]`` float32: one prefill batch
        per group of prompts the KV cache holds at once.

        Runs beside in-flight requests: its blocks are returned at once. When the cache lacks
        room, the newest in-flight sequences are preempted (recomputed later, as in a step).
        """
        sequences = [Sequence(f"score-{i}", list(p), SamplingParams(), None, -1) for i, p in enumerate(prompts)]
        for sequence in sequences:
            self.validate_prompt(sequence.prompt_ids, SamplingParams(max_tokens=1))
        logits: list[torch.Tensor] = []
        for group in self._score_groups(sequences):
            self.scheduler.free_blocks(sum(self.blocks.blocks_needed(s.num_tokens) for s in group))
            try:
                for sequence in group:
                    self.blocks.grow(sequence.block_table, sequence.num_tokens)
                hidden = self._run(group, [s.num_tokens for s in group])
                logits.extend(self.model.logits(hidden).cpu().split([s.num_tokens for s in group]))
            finally:
                for sequence in group:
                    self.blocks.free(sequence.block_table)
        return logits

    def _score_groups(self, sequences: list[Sequence]) -> list[list[Sequence]]:
        """Consecutive groups whose blocks fit in the KV cache together."""
        groups: list[list[Sequence]] = [[]]
        used = 0
        for sequence in sequences:
            needed = self.blocks.blocks_needed(sequence.num_tokens)
            if groups[-1] and used + needed > self.blocks.num_blocks:
                groups.append([])
                used = 0
            groups[-1].append(sequence)
            used += needed
        return groups


def _grammar_compiler(model_dir: str, config: ModelConfig) -> GrammarCompiler | None:
    """The checkpoint vocabulary's grammar compiler; None without tokenizer.json or xgrammar
    (structured requests are then refused with a 400)."""
    try:
        return GrammarCompiler.from_model_dir(model_dir, config.vocab_size, list(config.eos_token_ids))
    except ImportError:
        LOG.warning("xgrammar is not installed: response_format (structured output) is refused")
        return None


def _to_device(metadata: AttentionMetadata, device: torch.device) -> AttentionMetadata:
    if device.type == "cpu":
        return metadata
    return AttentionMetadata(**{k: v.to(device) for k, v in vars(metadata).items()})
