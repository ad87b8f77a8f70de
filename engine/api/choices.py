"""A request's choices: the sequences it generates (``n``, ``best_of``, one seed each), the
ones it returns, and their logprobs in OpenAI's layouts.

A request with P prompts, ``n`` choices and ``best_of`` B generates P * B sequences, in
order (prompt 0's B, then prompt 1's, ...), and returns P * n choices: choice
``p * n + i`` is the i-th best (highest cumulative logprob) of prompt p's B sequences.
"""

from __future__ import annotations

import codecs
import hashlib
from dataclasses import dataclass, replace
from typing import Any

from raymoe.engine.engine import RequestOutput
from raymoe.engine.prompt_logprobs import PromptLogprobs
from raymoe.engine.sampling_params import SamplingParams
from raymoe.engine.tokenizer import Tokenizer

MIN_LOGPROB = -9999.0  # what -inf is reported as (JSON has no infinity; OpenAI and vLLM do the same)


@dataclass(frozen=True)
class SequenceRequest:
    """One generated sequence of a request."""

    prompt_index: int
    sample_index: int  # 0 .. best_of - 1 within its prompt
    params: SamplingParams


def sample_seed(seed: int | None, sample_index: int) -> int | None:
    """The seed of a prompt's ``sample_index``-th sequence: the request's own for the first,
    a value derived from both for the others, so that choices differ yet repeat exactly.
    Derived from the index within its prompt, so a prompt samples the same in any batch."""
    if seed is None or sample_index == 0:
        return seed
    digest = hashlib.blake2b(f"{seed}/{sample_index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1  # in [0, 2**63)


def sequence_requests(params: SamplingParams, num_prompts: int, best_of: int) -> list[SequenceRequest]:
    return [SequenceRequest(p, i, replace(params, seed=sample_seed(params.seed, i)))
            for p in range(num_prompts) for i in range(best_of)]


def best_outputs(outputs: list[RequestOutput], num_prompts: int, n: int, best_of: int) -> list[RequestOutput]:
    """The ``n`` returned outputs of each prompt, in choice order (see the module docstring)."""
    chosen = []
    for p in range(num_prompts):
        candidates = outputs[p * best_of:(p + 1) * best_of]
        if best_of > n:  # stable: ties keep generation order
            candidates = sorted(candidates, key=lambda o: -sum(o.output_logprobs))
        chosen += candidates[:n]
    return chosen


# ---- logprobs layouts ---------------------------------------------------------------------
@dataclass(frozen=True)
class TokenLogprob:
    """One position of the returned text: its token, logprob (None: the first prompt token)
    and the most likely alternatives there."""

    token: int
    logprob: float | None
    top: list[tuple[int, float]] | None


def output_positions(output: RequestOutput, start: int = 0) -> list[TokenLogprob]:
    return [TokenLogprob(t, lp, top) for t, lp, top in zip(output.output_token_ids[start:],
                                                           output.output_logprobs[start:],
                                                           output.output_top_logprobs[start:])]


def prompt_positions(prompt: list[int], score: PromptLogprobs, num_top: int) -> list[TokenLogprob]:
    return [TokenLogprob(t, lp, None if top is None else top[:num_top])
            for t, lp, top in zip(prompt, score.token_logprobs, score.top)]


def token_bytes(token: int, tokenizer: Tokenizer | None) -> bytes:
    return tokenizer.token_bytes(token) if tokenizer else str(token).encode()


def token_text(token: int, tokenizer: Tokenizer | None) -> str:
    """A token as OpenAI names it: its text, or ``bytes:\\xe2\\x80`` when its bytes are
    only part of a character (so distinct tokens keep distinct names)."""
    data = token_bytes(token, tokenizer)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{byte:02x}" for byte in data)


class TextOffsets:
    """``text_offset``: where each token starts in the returned text, in characters (a
    token inside a multi-byte character is at that character). Carries over stream chunks."""

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.position = 0

    def advance(self, data: bytes) -> int:
        start = self.position
        self.position += len(self._decoder.decode(data))
        return start


def _clamp(logprob: float) -> float:
    return max(logprob, MIN_LOGPROB)


def completion_logprobs(positions: list[TokenLogprob], tokenizer: Tokenizer | None,
                        offsets_state: TextOffsets | None = None) -> dict[str, Any]:
    """OpenAI's completions layout. Each position's ``top_logprobs`` holds its own token and
    the alternatives asked for (so up to logprobs + 1 entries, as OpenAI and vLLM return)."""
    state = offsets_state or TextOffsets()
    tokens, logprobs, tops, offsets = [], [], [], []
    for position in positions:
        text = token_text(position.token, tokenizer)
        tokens.append(text)
        offsets.append(state.advance(token_bytes(position.token, tokenizer)))
        if position.logprob is None:
            logprobs.append(None)
            tops.append(None)
            continue
        logprobs.append(_clamp(position.logprob))
        top = {text: _clamp(position.logprob)}
        for token, logprob in position.top or ():
            top.setdefault(token_text(token, tokenizer), _clamp(logprob))
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(positions: list[TokenLogprob], tokenizer: Tokenizer | None) -> dict[str, Any]:
    """OpenAI's chat layout: ``content``, one entry per token with its text and bytes."""
    def entry(token: int, logprob: float) -> dict[str, Any]:
        return {"token": token_text(token, tokenizer), "logprob": _clamp(logprob),
                "bytes": list(token_bytes(token, tokenizer))}

    return {"content": [dict(entry(p.token, p.logprob), top_logprobs=[entry(t, lp) for t, lp in p.top or ()])
                        for p in positions]}


def vllm_prompt_logprobs(prompt: list[int], score: PromptLogprobs, num_top: int,
                         tokenizer: Tokenizer | None) -> list[dict[str, Any] | None]:
    """vLLM's ``prompt_logprobs``: per prompt token, None for the first, else a map from token
    id to ``{logprob, rank, decoded_token}`` holding the prompt's token and the top ``num_top``."""
    body: list[dict[str, Any] | None] = []
    for token, logprob, rank, top in zip(prompt, score.token_logprobs, score.ranks, score.top):
        if logprob is None:
            body.append(None)
            continue
        entries = {str(token): {"logprob": _clamp(logprob), "rank": rank,
                                "decoded_token": token_text(token, tokenizer)}}
        for place, (alternative, alt_logprob) in enumerate((top or [])[:num_top], 1):
            entries.setdefault(str(alternative), {"logprob": _clamp(alt_logprob), "rank": place,
                                                  "decoded_token": token_text(alternative, tokenizer)})
        body.append(entries)
    return body
