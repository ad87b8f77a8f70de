"""Server-Sent Events for a streamed completion: the ``data:`` framing and the stream of one
request's events.

:func:`stream_events` runs a request's sequences (through the router relay,
actors/router_relay.py) and merges their outputs into one stream: an echo chunk per choice
first (when asked, with the prompt's logprobs), then each sequence's pieces as they come,
tagged with its choice index (engine/api/stream_choices.py keeps the pieces adding up to the
final text), then the usage chunk (when asked) and ``[DONE]``. A failure after the first
event is an error event; one before any event is yielded as the :class:`StepFailure` itself,
so the ingress answers it as a plain error response.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any, AsyncIterator, Callable

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from raymoe.actors.router import StepFailure
from raymoe.actors.router_relay import RouterRelay, sequence_id
from raymoe.engine.api.completions import Endpoint, PreparedRequest
from raymoe.engine.api.openai_protocol import RequestError
from raymoe.engine.api.stream_choices import StreamedChoice
from raymoe.engine.api.tool_calls import decode_keeping
from raymoe.engine.sampling_params import SamplingParams
from raymoe.engine.tokenizer import Tokenizer

LOG = logging.getLogger("raymoe.ingress")
DONE = "data: [DONE]\n\n"


def event(body: dict[str, Any]) -> str:
    """One event: ``body`` as JSON on a ``data:`` line."""
    return f"data: {json.dumps(body)}\n\n"


def chunk(request_id: str, chat: bool, model: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
    """A streamed chunk object of a chat or text completion."""
    return {"id": request_id, "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time()), "model": model, "choices": choices}


class EventStreamResponse(StreamingResponse):
    """A ``text/event-stream`` response that always closes its events when it ends.

    Starlette abandons the body iterator when the client goes away while a chunk is being
    sent (the send is cancelled, or raises): the iterator then sits at its ``yield`` until
    the garbage collector finalizes it, and the request's sequences keep generating for
    nobody (seen: 4 of 200 abandoned streams ran to their full length, uncounted). Here the
    iterator is closed in a task of its own the moment the response ends, whatever ended it,
    so :func:`stream_events` counts the request and aborts its sequences at once."""

    closing: set[asyncio.Task] = set()  # held until done (the loop keeps only weak references)

    def __init__(self, content: AsyncIterator[str], headers: dict[str, str] | None = None):
        super().__init__(content, media_type="text/event-stream", headers=headers)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            # A task of its own: this one may be cancelled, and every await in it with it.
            task = asyncio.ensure_future(_close(self.body_iterator))
            self.closing.add(task)
            task.add_done_callback(self.closing.discard)


async def _close(events: AsyncIterator[str]) -> None:
    try:
        await events.aclose()
    except Exception:  # the response is gone: nobody else would hear of it
        LOG.exception("closing an event stream failed")


async def prepend(first: str | None, rest: AsyncIterator[str]) -> AsyncIterator[str]:
    """``first`` (already taken from ``rest``), then the rest of ``rest``."""
    try:
        if first is not None:
            yield first
        async for item in rest:
            yield item
    finally:
        await rest.aclose()


async def stream_events(prepared: PreparedRequest, request_id: str, arrived: float, relay: RouterRelay,
                        tokenizer: Tokenizer | None, model: str,
                        finish: Callable[[int], None]) -> AsyncIterator[str | StepFailure]:
    """Server-sent events: an echo chunk per choice first (when asked), then each
    sequence's pieces as they come, tagged with its choice index, then usage and [DONE].

    ``finish(status)`` is called once at the end, before any await (when the client went away
    this task is being cancelled): 200, the failure's status, 400 for a refusal before any
    event, 499 when the client went away, 500 when streaming itself failed."""
    chat = prepared.endpoint is Endpoint.CHAT
    keep = prepared.chat.keep_tokens if prepared.chat else {}
    decode = ((lambda ids: decode_keeping(tokenizer.decode, ids, keep)) if tokenizer
              else (lambda ids: ""))
    sequences = prepared.sequences()
    choices = [StreamedChoice(i, prepared, tokenizer, decode)
               for i in range(len(prepared.prompts) * prepared.n)]
    status = 499  # unless it ends one of the ways below: the client went away
    merged: asyncio.Queue = asyncio.Queue()
    pumps: list[asyncio.Task] = []
    sent_any = False  # whether an event went out (after that, a failure is an error event)
    try:
        failure = None
        if prepared.echo:
            scores = None
            if prepared.score_top is not None:
                scores = await relay.score(prepared.prompts, prepared.score_top, request_id)
                if isinstance(scores, StepFailure):
                    failure, scores = scores, None
            if failure is None:
                sent_any = True
                yield event(chunk(request_id, chat, model, [
                    c.echo(scores[i // prepared.n] if scores else None) for i, c in enumerate(choices)]))
        if failure is None:
            pumps = [asyncio.ensure_future(_pump(
                relay, k, prepared.prompts[s.prompt_index], s.params, sequence_id(request_id, k, len(sequences)),
                arrived, merged)) for k, s in enumerate(sequences)]
        running = len(pumps)
        while running and failure is None:
            index, output = await merged.get()
            if output is None:  # that sequence's stream ended
                running -= 1
            elif isinstance(output, StepFailure):
                failure = output
            else:
                sent_any = True
                yield event(chunk(request_id, chat, model, [choices[index].update(output)]))
        if failure is not None and failure.status == 400 and not sent_any:
            status = 400  # refused before any event: the ingress answers it as a 400 response
            yield failure
            return
        if failure is not None:
            status = failure.status
            LOG.warning("request %s failed: %s", request_id, failure.message)
            error = RequestError(f"the request failed: {failure.public} (request id {request_id})",
                                 status=failure.status, error_type="server_error",
                                 code="step_failed" if failure.status == 503 else "internal_error")
            yield event(error.body())
        else:
            status = 200
            if prepared.include_usage:
                sent = sum(c.sent_tokens for c in choices)
                usage = {"prompt_tokens": prepared.num_prompt_tokens, "completion_tokens": sent,
                         "total_tokens": prepared.num_prompt_tokens + sent}
                yield event(dict(chunk(request_id, chat, model, []), usage=usage))
        yield DONE
    except Exception:
        status = 500
        LOG.exception("request %s: streaming failed", request_id)
        raise
    finally:
        # Counted before any await: when the client went away this task is being cancelled,
        # and Starlette's cancel scope cancels every await in here again.
        finish(status)
        for pump in pumps:  # a sequence still running (the client went away) is aborted
            pump.cancel()
        await asyncio.gather(*pumps, return_exceptions=True)


async def _pump(relay: RouterRelay, index: int, prompt_ids: list[int], params: SamplingParams, request_id: str,
                arrived: float, merged: asyncio.Queue) -> None:
    """Sequence ``index``'s outputs into ``merged`` as ``(index, output)``, then ``(index, None)``."""
    deltas = relay.deltas(prompt_ids, params, request_id, arrived)
    try:
        async for output in deltas:
            merged.put_nowait((index, output))
    finally:
        await deltas.aclose()
        merged.put_nowait((index, None))
