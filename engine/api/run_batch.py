"""Offline batch inference in the OpenAI batch file format (as vLLM's run-batch reads it).

Input lines: ``{"custom_id", "method": "POST", "url": "/v1/completions", "body": {...}}``.
Output lines, in input order: ``{"id", "custom_id", "response": {"status_code",
"request_id", "body"}, "error"}``. A line that cannot be served gets its 4xx response and
the rest of the batch goes on.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from typing import IO, Any, Protocol

from raymoe.engine.api.completions import Endpoint, ModelLimits, PreparedRequest, prepare_request, response_body
from raymoe.engine.engine import RequestOutput
from raymoe.engine.api.openai_protocol import RequestError, new_id
from raymoe.engine.prompt_logprobs import PromptLogprobs
from raymoe.engine.sampling_params import SamplingParams
from raymoe.engine.tokenizer import Tokenizer


class BatchEngine(Protocol):
    """What run-batch needs from an engine: the in-process one, or a cluster's routers."""

    def run(self, requests: list[tuple[str, list[int], SamplingParams]], on_finish) -> None: ...

    def score_prompts(self, prompts: list[list[int]], num_top: int) -> list[PromptLogprobs]: ...


def read_batch(lines: IO[str]) -> list[dict[str, Any]]:
    items = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as error:
            raise ValueError(f"line {number} is not valid JSON: {error}") from None
        if not isinstance(item, dict) or "custom_id" not in item or "body" not in item:
            raise ValueError(f"line {number}: expected an object with custom_id, method, url and body")
        items.append(item)
    return items


def run_batch(items: list[dict[str, Any]], engine: BatchEngine, tokenizer: Tokenizer | None, limits: ModelLimits,
              progress: IO[str] | None = None, show_progress: bool = True) -> list[dict[str, Any]]:
    """Serve every item; returns the output lines (dicts) in input order.

    Progress goes to ``progress`` (default: the current ``sys.stderr``) unless ``show_progress`` is false.
    """
    if show_progress and progress is None:
        progress = sys.stderr
    results: dict[int, dict[str, Any]] = {}
    pending: dict[int, _Pending] = {}
    owner: dict[str, tuple[int, int]] = {}  # sequence id -> (item index, sequence index)
    requests = []
    for index, item in enumerate(items):
        request_id = new_id("batch")
        try:
            if str(item.get("method", "POST")).upper() != "POST":
                raise RequestError(f"unsupported method {item.get('method')!r}; only POST", param="method")
            endpoint = Endpoint.parse(item.get("url", Endpoint.COMPLETIONS.value))
            request = prepare_request(endpoint, item["body"], tokenizer, limits)
        except RequestError as error:
            results[index] = _line(item, request_id, error.status, error.body())
            continue
        sequences = request.sequences()
        scores = None if request.score_top is None else engine.score_prompts(request.prompts, request.score_top)
        pending[index] = _Pending(request_id, request, [None] * len(sequences), scores)
        for k, sequence in enumerate(sequences):
            owner[f"{request_id}-{k}"] = (index, k)
            requests.append((f"{request_id}-{k}", request.prompts[sequence.prompt_index], sequence.params))
    reporter = _Progress(len(pending), progress)

    def finish(index: int) -> None:
        entry = pending.pop(index)
        body = response_body(entry.request, entry.outputs, tokenizer, entry.request_id, limits.name, entry.scores)
        results[index] = _line(items[index], entry.request_id, 200, body)
        reporter.advance()

    def on_finish(output: RequestOutput) -> None:
        index, k = owner[output.request_id]
        pending[index].outputs[k] = output
        if all(o is not None for o in pending[index].outputs):
            finish(index)

    for index in [i for i, entry in pending.items() if not entry.outputs]:  # echo only: nothing to generate
        finish(index)
    if requests:
        engine.run(requests, on_finish)
    reporter.close()
    return [results[i] for i in range(len(items))]


@dataclass
class _Pending:
    """An item whose sequences are running: its outputs in ``sequences()`` order as they finish."""

    request_id: str
    request: PreparedRequest
    outputs: list[RequestOutput | None]
    scores: list[PromptLogprobs] | None


def _line(item: dict[str, Any], request_id: str, status: int, body: dict[str, Any]) -> dict[str, Any]:
    return {
        "id": new_id("batch-out"),
        "custom_id": item.get("custom_id"),
        "response": {"status_code": status, "request_id": request_id, "body": body},
        "error": None,
    }


class _Progress:
    """``done/total`` on one refreshed stderr line, at most a few times a second."""

    def __init__(self, total: int, stream: IO[str] | None):
        self.total, self.done, self.stream = total, 0, stream
        self.started = self.last = time.monotonic()

    def advance(self) -> None:
        self.done += 1
        now = time.monotonic()
        if self.stream is not None and (now - self.last > 0.25 or self.done == self.total):
            self.last = now
            rate = self.done / max(now - self.started, 1e-9)
            self.stream.write(f"\rrun-batch: {self.done}/{self.total} requests ({rate:.1f} req/s)")
            self.stream.flush()

    def close(self) -> None:
        if self.stream is not None and self.total:
            self.stream.write("\n")
            self.stream.flush()
