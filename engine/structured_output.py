"""What a request's output must match (a JSON object, a JSON schema, a regular expression),
and the grammar machinery that enforces it while sampling.

Legend: B sequences in the step, V vocabulary, Vw = ceil(V / 32) bitmask words, Bg the rows
with a grammar.

``StructuredOutput`` is the request-side description: frozen and hashable, it keys the
compiled-grammar cache. Enforcement uses xgrammar (chosen over llguidance by measured cost per
token, see benchmarks/bench_sampler.py): ``GrammarCompiler`` compiles a description once per
model vocabulary; each sequence holds a ``GrammarState`` advanced with every accepted token;
each step ``mask_logits`` fills one ``[B, Vw]`` token bitmask at the Bg constrained rows (on
the CPU, in parallel over rows) and applies it to the logits on their device. A finished
grammar allows only the stop tokens, so it ends in EOS.

JSON is generated without free whitespace (``", "`` and ``": "`` separators): free whitespace
lets a weak or sampled model spin in blanks until max_tokens. Strings bounded by
minLength/maxLength are given an equivalent pattern without control characters: xgrammar
0.2's length-bounded strings admit raw control bytes, which strict JSON parsers refuse.
"""

from __future__ import annotations

import collections
import enum
import json
import os
import re
import threading
from dataclasses import dataclass
from typing import Any

import torch

MAX_SPEC_CHARS = 1 << 16  # 64 Ki characters of schema or pattern: far beyond real response formats
CACHE_SIZE = 256  # compiled grammars kept per model (least recently used evicted)


class StructuredKind(enum.Enum):
    JSON_OBJECT = "json_object"  # any JSON object
    JSON_SCHEMA = "json_schema"  # JSON matching ``spec``, a JSON Schema
    REGEX = "regex"  # text matching ``spec``, a regular expression


@dataclass(frozen=True)
class StructuredOutput:
    kind: StructuredKind
    spec: str = ""  # the schema as canonical JSON text, or the pattern; empty for JSON_OBJECT

    @classmethod
    def json_object(cls) -> StructuredOutput:
        return cls(StructuredKind.JSON_OBJECT)

    @classmethod
    def json_schema(cls, schema: str | dict[str, Any]) -> StructuredOutput:
        """``schema`` as a dict or its JSON text; raises ValueError("response_format ...")."""
        if isinstance(schema, str):
            if len(schema) > MAX_SPEC_CHARS:
                raise ValueError(f"response_format json_schema is {len(schema)} characters; at most {MAX_SPEC_CHARS}")
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as error:
                raise ValueError(f"response_format json_schema is not valid JSON: {error}") from None
        if not isinstance(schema, dict):
            raise ValueError(f"response_format json_schema must be a JSON object, got {type(schema).__name__}")
        try:
            # Key order kept: the grammar writes properties in the schema's order.
            text = json.dumps(schema, separators=(",", ":"), allow_nan=False)
        except (TypeError, ValueError) as error:
            raise ValueError(f"response_format json_schema cannot be written as JSON: {error}") from None
        if len(text) > MAX_SPEC_CHARS:
            raise ValueError(f"response_format json_schema is {len(text)} characters; at most {MAX_SPEC_CHARS}")
        output = cls(StructuredKind.JSON_SCHEMA, text)
        _check_compiles(output)
        return output

    @classmethod
    def regex(cls, pattern: str) -> StructuredOutput:
        if not isinstance(pattern, str) or not pattern:
            raise ValueError("response_format regex must be a non-empty string")
        if len(pattern) > MAX_SPEC_CHARS:
            raise ValueError(f"response_format regex is {len(pattern)} characters; at most {MAX_SPEC_CHARS}")
        try:
            re.compile(pattern)
        except re.error as error:
            raise ValueError(f"response_format regex is not a valid regular expression: {error}") from None
        output = cls(StructuredKind.REGEX, pattern)
        _check_compiles(output)
        return output


def _check_compiles(output: StructuredOutput) -> None:
    """Refuse, when the request arrives, a schema or pattern the grammar library cannot enforce
    (vocabulary-independent: the engine compiles it against its vocabulary later). Without
    xgrammar only the JSON Schema check runs; the engine then refuses structured requests."""
    try:
        import xgrammar
    except ImportError:
        xgrammar = None

    if output.kind is StructuredKind.JSON_SCHEMA:
        schema = json.loads(output.spec)
        try:
            import jsonschema
        except ImportError:  # a Ray dependency, so normally present; xgrammar still checks below
            jsonschema = None
        if jsonschema is not None:
            try:
                jsonschema.validators.validator_for(schema).check_schema(schema)
            except jsonschema.SchemaError as error:
                raise ValueError(f"response_format json_schema is not a valid JSON Schema: {error.message}") from None
    if xgrammar is None:
        return
    try:
        if output.kind is StructuredKind.JSON_SCHEMA:
            xgrammar.Grammar.from_json_schema(_enforceable_schema(output.spec), any_whitespace=False)
        elif output.kind is StructuredKind.REGEX:
            xgrammar.Grammar.from_regex(output.spec)
    except Exception as error:  # xgrammar raises RuntimeError with its converter's message
        raise ValueError(f"response_format {output.kind.value} cannot be enforced: {_reason(error)}") from None


_LITERAL_KEYS = frozenset({"enum", "const", "default", "examples"})  # their values are data, not schemas


def _enforceable_schema(spec: str) -> str:
    """``spec`` with each length-bounded string schema (no pattern or format of its own) given
    the pattern ``^[^"\\<control>]{min,max}$``: the same strings, minus raw control bytes."""

    def visit(node: Any) -> Any:
        if isinstance(node, list):
            return [visit(item) for item in node]
        if not isinstance(node, dict):
            return node
        node = {key: value if key in _LITERAL_KEYS else visit(value) for key, value in node.items()}
        bounded = "minLength" in node or "maxLength" in node
        if node.get("type") == "string" and bounded and not {"pattern", "format", "enum", "const"} & node.keys():
            low, high = int(node.get("minLength", 0)), node.get("maxLength")
            node["pattern"] = f'^[^"\\\\\\x00-\\x1f]{{{low},{"" if high is None else int(high)}}}$'
            node.pop("minLength", None)  # now in the pattern (xgrammar would warn and drop them)
            node.pop("maxLength", None)
        return node

    return json.dumps(visit(json.loads(spec)), separators=(",", ":"))


def _reason(error: Exception) -> str:
    """xgrammar's message without its ``[hh:mm:ss] /path/file.cc:123:`` prefix."""
    text = re.sub(r"^\[[\d:]+\]\s+\S+:\d+:\s*", "", str(error).strip())
    return (text or type(error).__name__)[:300]


class GrammarState:
    """One sequence's position in its grammar: advanced with each token it outputs."""

    def __init__(self, matcher: Any, filler: Any):
        self._matcher = matcher
        self._filler = filler  # the compiler's BatchGrammarMatcher: fills a step's bitmask rows in parallel

    def accept(self, token: int) -> bool:
        """False if ``token`` breaks the grammar (the sampler's mask makes that impossible)."""
        return self._matcher.accept_token(token)

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete and its stop token accepted: nothing may follow."""
        return self._matcher.is_terminated()


class GrammarCompiler:
    """Compiles StructuredOutputs against one model's vocabulary, with a cache keyed by them.

    ``vocabulary`` is the tokenizer's entries by id (``tokenizer.json`` spelling, e.g. ``Ġthe``);
    ``vocab_size`` the model's logits width (it may pad past the tokenizer);
    ``stop_token_ids`` the ids that end a finished grammar (the model's EOS).
    """

    def __init__(self, tokenizer_json: str, vocab_size: int, stop_token_ids: list[int]):
        import xgrammar

        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_str(tokenizer_json)
        vocab = tokenizer.get_vocab(with_added_tokens=True)
        entries = [""] * max(max(vocab.values()) + 1, 0)
        for token, token_id in vocab.items():
            entries[token_id] = token
        metadata = xgrammar.TokenizerInfo._detect_metadata_from_hf(tokenizer_json)
        info = xgrammar.TokenizerInfo(entries[:vocab_size], metadata["vocab_type"], vocab_size=vocab_size,
                                      stop_token_ids=list(stop_token_ids),
                                      add_prefix_space=metadata["add_prefix_space"])
        self.vocab_size = vocab_size
        self._compiler = xgrammar.GrammarCompiler(info, max_threads=min(8, os.cpu_count() or 1), cache_enabled=False)
        self._filler = xgrammar.BatchGrammarMatcher(max_threads=min(8, os.cpu_count() or 1))
        self._cache: collections.OrderedDict[StructuredOutput, Any] = collections.OrderedDict()
        self._lock = threading.Lock()  # requests may arrive on several threads

    @classmethod
    def from_model_dir(cls, model_dir: str, vocab_size: int, stop_token_ids: list[int]) -> GrammarCompiler | None:
        """None where the checkpoint has no ``tokenizer.json`` (structured requests are refused)."""
        path = os.path.join(model_dir, "tokenizer.json")
        if not os.path.isfile(path):
            return None
        with open(path, encoding="utf-8") as handle:
            return cls(handle.read(), vocab_size, stop_token_ids)

    def compile(self, output: StructuredOutput) -> Any:
        with self._lock:
            if output in self._cache:
                self._cache.move_to_end(output)
                return self._cache[output]
        try:
            if output.kind is StructuredKind.JSON_OBJECT:
                compiled = self._compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
            elif output.kind is StructuredKind.JSON_SCHEMA:
                compiled = self._compiler.compile_json_schema(_enforceable_schema(output.spec), any_whitespace=False)
            else:
                compiled = self._compiler.compile_regex(output.spec)
        except Exception as error:
            raise ValueError(f"response_format {output.kind.value} cannot be enforced: {_reason(error)}") from None
        with self._lock:
            self._cache[output] = compiled
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled

    @property
    def num_cached(self) -> int:
        return len(self._cache)

    def new_state(self, output: StructuredOutput) -> GrammarState:
        import xgrammar

        return GrammarState(xgrammar.GrammarMatcher(self.compile(output)), self._filler)


def mask_logits(logits: torch.Tensor, rows: list[int], states: list[GrammarState]) -> None:
    """Set to -inf, in place, every token of ``logits: [B, V]`` that row ``rows[i]``'s grammar
    ``states[i]`` forbids next. The ``[B, Vw]`` bitmask is filled on the CPU and moved once to
    the logits' device."""
    import xgrammar

    bitmask = xgrammar.allocate_token_bitmask(logits.shape[0], logits.shape[1])  # all allowed
    fill_bitmask(bitmask, rows, states)
    if logits.device.type != "cpu":
        bitmask = bitmask.pin_memory().to(logits.device, non_blocking=True)
    xgrammar.apply_token_bitmask_inplace(logits, bitmask, vocab_size=logits.shape[1], indices=list(rows))


def fill_bitmask(bitmask: torch.Tensor, rows: list[int], states: list[GrammarState]) -> None:
    """Write row ``rows[i]`` of ``bitmask: [B, Vw]`` int32 (CPU) from ``states[i]``: rows in
    parallel on the compiler's threads, a lone row directly (a thread hand-off costs more)."""
    if len(states) == 1:
        states[0]._matcher.fill_next_token_bitmask(bitmask, rows[0])
    else:
        states[0]._filler.batch_fill_next_token_bitmask([s._matcher for s in states], bitmask, indices=list(rows))
