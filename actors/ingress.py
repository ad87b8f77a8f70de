"""The OpenAI-compatible HTTP endpoint: a Ray Serve deployment with a FastAPI ingress.

The ingress owns the deployment it serves: its constructor starts the expert workers and
routers a cluster config describes (cluster/deploy.py), so they live and die with it. Per
request it validates and tokenizes the body (engine/api/completions.py; nothing malformed
reaches a router), picks the router with the fewest requests in flight, submits it there,
and relays its tokens, as Server-Sent Events when asked. Tokens come back through one
subscription per router (``Router.subscribe``): one Ray item per router step carries every
delta of this replica's requests, and a task per router hands each delta to its request.
"""

# No `from __future__ import annotations` here: FastAPI reads the route signatures'
# annotations at runtime (a string `Request` would become a query parameter).
import asyncio
import hmac
import itertools
import os
import json
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, AsyncIterator

import msgspec
import ray
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from ray import serve
from starlette.exceptions import HTTPException as StarletteHTTPException

from raymoe.actors.front_door import PROBE_HEADROOM, RETRY_AFTER_S, FrontDoor, FrontDoorPolicy, api_key_digests
from raymoe.actors.http_listener import harden_direct_ingress
from raymoe.actors.router import StepFailure
from raymoe.actors.serving_metrics import ServingMetrics
from raymoe.cluster.config import ClusterConfig, parse_cluster_config
from raymoe.engine.api.completions import (
    Endpoint, ModelLimits, PreparedRequest, prepare_request, response_body,
)
from raymoe.engine.engine import RequestOutput
from raymoe.engine.api.openai_protocol import RequestError, new_id
from raymoe.engine.prompt_logprobs import PromptLogprobs
from raymoe.engine.sampling_params import SamplingParams
from raymoe.engine.api.stream_choices import StreamedChoice
from raymoe.engine.api.tokenize_api import detokenize_body, tokenize_body
from raymoe.engine.tokenizer import Tokenizer
from raymoe.engine.api.tool_calls import decode_keeping

LOG = logging.getLogger("raymoe.ingress")
HEALTH_TIMEOUT_S = 5.0
REPLICA_HEADER = "x-raymoe-replica"  # which ingress replica answered (Serve's replica id)
PREPARE_THREADS = 4  # bodies validated, tokenized and templated at once, off the event loop
ROUTER_LOST = (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError)


class RouterLost(Exception):
    """Put in a request's queue (and raised there) when the subscription of its router broke."""

    def __init__(self, cause: BaseException):
        super().__init__(f"{type(cause).__name__}: {cause}")
        self.cause = cause

app = FastAPI(title="raymoe", description="OpenAI-compatible MoE serving with expert parallelism on Ray")
app.add_middleware(FrontDoor)  # keys, content types, docs, CORS, body deadlines (configured per replica)


async def _prepend(first: str | None, rest: AsyncIterator[str]) -> AsyncIterator[str]:
    """``first`` (already taken from ``rest``), then the rest of ``rest``."""
    try:
        if first is not None:
            yield first
        async for event in rest:
            yield event
    finally:
        await rest.aclose()


def error_response(error: RequestError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status)


@app.exception_handler(StarletteHTTPException)
async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
    kind = "not_found" if exc.status_code == 404 else "invalid_request_error"
    return error_response(RequestError(str(exc.detail), status=exc.status_code, error_type=kind))


@app.exception_handler(RequestValidationError)
async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
    return error_response(RequestError(f"invalid request: {exc.errors()}"[:1000]))


@serve.deployment(name="raymoe", num_replicas=1, max_ongoing_requests=4096 + PROBE_HEADROOM, ray_actor_options={"num_cpus": 0.01})
@serve.ingress(app)
class OpenAIIngress:
    def __init__(self, config: dict[str, Any], admin_token: str | None = None, attach_to: str | None = None,
                 key_digests: tuple[bytes, ...] = ()):
        """``attach_to``: serve the running deployment of that name (``raymoe serve`` starts it
        first; any number of replicas may share it). None: this replica deploys its own (``serve
        run`` with :func:`build_app`), so it lives and dies with it, and there is one replica.
        ``key_digests``: SHA-256 of each API key (:func:`public_config` keeps keys out of ``config``)."""
        from raymoe.cluster.deploy import attach, deploy, engine_config

        self.admin_token = admin_token or None
        self.config: ClusterConfig = parse_cluster_config(config)
        edge = self.config.serve
        harden_direct_ingress(edge.header_timeout_s)  # before Serve starts this replica's listener
        FrontDoor.configure(FrontDoorPolicy(
            key_digests=tuple(key_digests), metrics_need_key=edge.metrics_need_key, enable_docs=edge.enable_docs,
            cors_allow_origins=edge.cors_allow_origins, body_timeout_s=edge.body_timeout_s,
            body_min_bytes_per_s=edge.body_min_bytes_per_s, max_open_requests=edge.max_open_requests,
            max_requests_per_client=edge.max_requests_per_client))
        self.deployment = attach(self.config, attach_to) if attach_to else deploy(self.config, name="raymoe")
        self.owns_deployment = attach_to is None
        model = self.deployment.model_config
        model_dir = self.config.model
        try:
            self.tokenizer: Tokenizer | None = Tokenizer(model_dir)
        except FileNotFoundError:
            self.tokenizer = None
        name = self.config.serve.served_model_name or model_dir.rstrip("/").rsplit("/", 1)[-1]
        max_len = min(engine_config(self.config).max_model_len or model.max_position_embeddings,
                      model.max_position_embeddings)
        self.limits = ModelLimits(name, model.vocab_size, max_len)
        self.metrics = ServingMetrics(self.deployment.placement.slots_per_worker, name)
        self.in_flight = [0] * len(self.deployment.routers)
        # A router batches max_num_seqs requests and queues at most max_queued_per_router more;
        # each replica admits its share of that (it sees only its own requests in flight).
        replicas = self.config.serve.replicas if self.config.serve.autoscaling is None else max(
            1, int(self.config.serve.autoscaling.get("min_replicas", 1)))
        self.admission_limit = -(-(self.config.engine.max_num_seqs + self.config.serve.max_queued_per_router)
                                 // replicas)
        try:
            self.replica = serve.get_replica_context().replica_id.unique_id  # for REPLICA_HEADER
        except Exception:  # outside a Serve replica
            self.replica = str(os.getpid())
        self.created = int(time.time())
        self._ids = itertools.count()
        # One subscription per router carries every delta of this replica's requests, one
        # Ray item per step (not one per token per request); a task per router reads it.
        self.subscriber = new_id("ingress")
        self._waiting: dict[str, tuple[int, asyncio.Queue]] = {}  # request id -> (router, its deltas)
        self._subscriptions: dict[int, asyncio.Task] = {}
        self._prepare_pool = ThreadPoolExecutor(max_workers=PREPARE_THREADS, thread_name_prefix="raymoe-prepare")

    # ---- OpenAI routes -----------------------------------------------------------------
    @app.post("/v1/completions")
    async def completions(self, request: Request) -> Response:
        return await self._serve(request, Endpoint.COMPLETIONS)

    @app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Response:
        return await self._serve(request, Endpoint.CHAT)

    @app.post("/tokenize")
    async def tokenize(self, request: Request) -> Response:
        return await self._tokenizer_route(request, tokenize_body)

    @app.post("/detokenize")
    async def detokenize(self, request: Request) -> Response:
        return await self._tokenizer_route(request, detokenize_body)

    @app.get("/v1/models")
    async def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [
            {"id": self.limits.name, "object": "model", "created": self.created, "owned_by": "raymoe",
             "max_model_len": self.limits.max_model_len}
        ]}

    @app.get("/health")
    async def health(self) -> Response:
        actors = {**{f"router {i}": a for i, a in enumerate(self.deployment.routers)},
                  **{f"worker {i}": a for i, a in enumerate(self.deployment.workers)}}
        answers = await asyncio.gather(*[asyncio.wait_for(a.info.remote(), HEALTH_TIMEOUT_S) for a in actors.values()],
                                       return_exceptions=True)
        # Any actor that does not answer makes the service unhealthy; the reason names each one
        # and why (a frozen actor's TimeoutError has no text of its own).
        failed = [f"{name}: " + (f"no answer within {HEALTH_TIMEOUT_S:g} s" if isinstance(answer, asyncio.TimeoutError)
                                 else f"{type(answer).__name__}: {(str(answer).strip() or 'no detail').splitlines()[0]}")
                  for name, answer in zip(actors, answers) if isinstance(answer, BaseException)]
        if failed:
            return JSONResponse({"status": "unhealthy", "reason": "; ".join(failed)[:500]}, status_code=503)
        return JSONResponse({"status": "ok", "routers": len(self.deployment.routers),
                             "expert_workers": len(self.deployment.workers)},
                            headers={REPLICA_HEADER: self.replica, f"{REPLICA_HEADER}-pid": str(os.getpid())})

    @app.get("/metrics")
    async def metrics(self) -> Response:
        try:
            telemetry = await asyncio.wait_for(
                asyncio.gather(*[r.get_telemetry.remote() for r in self.deployment.routers]), HEALTH_TIMEOUT_S)
        except Exception:  # still expose the request metrics when a router is slow
            telemetry = []
        try:
            controller = await asyncio.wait_for(self.deployment.controller.status.remote(), HEALTH_TIMEOUT_S)
        except Exception:  # serving goes on without a controller; so do the metrics
            controller = None
        return Response(self.metrics.render(list(telemetry), controller), media_type=CONTENT_TYPE_LATEST)

    # ---- admin (token in RAYMOE_ADMIN_TOKEN, sent as a Bearer token) ---------------------
    @app.get("/admin/placement")
    async def admin_placement(self, request: Request) -> Response:
        refusal = self._refuse_admin(request)
        if refusal is not None:
            return refusal
        status = await self.deployment.controller.status.remote()
        return JSONResponse(status)

    @app.post("/admin/rebalance")
    async def admin_rebalance(self, request: Request) -> Response:
        refusal = self._refuse_admin(request)
        if refusal is not None:
            return refusal
        return JSONResponse(await self.deployment.controller.rebalance.remote(True))

    def _refuse_admin(self, request: Request) -> Response | None:
        if self.admin_token is None:
            return error_response(RequestError("admin routes are disabled: start the server with "
                                               "RAYMOE_ADMIN_TOKEN set", status=403, code="admin_disabled"))
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {self.admin_token}".encode()):
            return error_response(RequestError("missing or wrong admin token (Authorization: Bearer ...)",
                                               status=401, error_type="authentication_error", code="invalid_token"))
        return None

    # ---- serving one request -----------------------------------------------------------
    async def _serve(self, request: Request, endpoint: Endpoint) -> Response:
        """One request, with its real status counted once: its 4xx, 499 when the client went
        away, 500/503 when it failed, 200 when it finished."""
        arrived = time.perf_counter()
        label = endpoint.name.lower()
        try:
            body = await self._read_body(request)
            # Tokenizing and rendering the chat template can take long: never on the event loop.
            prepared = await asyncio.get_running_loop().run_in_executor(
                self._prepare_pool, prepare_request, endpoint, body, self.tokenizer, self.limits)
        except RequestError as error:
            self._count(label, error.status)
            return error_response(error)
        request_id = new_id("chatcmpl" if endpoint is Endpoint.CHAT else "cmpl")
        if min(self.in_flight) >= self.admission_limit:  # every router's queue is full
            self._count(label, 503)
            error = RequestError("the server is overloaded; retry shortly", status=503, error_type="server_error",
                                 code="overloaded")
            return JSONResponse(error.body(), status_code=503, headers={"Retry-After": str(RETRY_AFTER_S)})
        self.metrics.prompt_tokens.inc(prepared.num_prompt_tokens)
        if prepared.stream:
            # The first event is awaited before the headers go out, so a request its router
            # refuses (validate_prompt: e.g. its KV can never fit) is a 400, as unstreamed.
            events = self._sse(prepared, request_id, arrived, label)
            try:
                first = await events.__anext__()
            except StopAsyncIteration:
                first = None
            if isinstance(first, StepFailure):  # refused before any event (a 400)
                await events.aclose()
                return self._failure_response(first)
            return StreamingResponse(_prepend(first, events), media_type="text/event-stream",
                                     headers={REPLICA_HEADER: self.replica})
        status = 500
        try:
            result = await self._unless_disconnected(request, self._collect(prepared, request_id, arrived))
            if result is None:  # the client went away: its sequences were aborted
                status = 499
                return Response(status_code=499)
            if isinstance(result, StepFailure):
                status = result.status
                return self._failure_response(result)
            outputs, scores = result
            response = JSONResponse(response_body(prepared, outputs, self.tokenizer, request_id, self.limits.name,
                                                  scores), headers={REPLICA_HEADER: self.replica})
            status = 200
            return response
        finally:
            self._count(label, status)
            self.metrics.e2e.observe(time.perf_counter() - arrived)

    def _count(self, label: str, status: int) -> None:
        self.metrics.count_request(label, status)

    def _failure_response(self, failure: StepFailure) -> JSONResponse:
        """The client hears what it may (never internal exception text); the log has the rest."""
        LOG.warning("request %s failed: %s", failure.request_id, failure.message)
        if failure.status == 400:  # the engine refused the request itself: its text says what to change
            return error_response(RequestError(failure.public))
        kind, code = ("server_error", "step_failed") if failure.status == 503 else ("server_error", "internal_error")
        error = RequestError(f"the request failed: {failure.public} (request id {failure.request_id})",
                             status=failure.status, error_type=kind, code=code)
        headers = {"Retry-After": str(RETRY_AFTER_S)} if failure.status == 503 else None
        return JSONResponse(error.body(), status_code=failure.status, headers=headers)

    async def _tokenizer_route(self, request: Request, handler) -> Response:
        """/tokenize or /detokenize: ``handler(body, tokenizer, limits)`` off the event loop."""
        try:
            body = await self._read_body(request)
            answer = await asyncio.get_running_loop().run_in_executor(
                self._prepare_pool, handler, body, self.tokenizer, self.limits)
        except RequestError as error:
            return error_response(error)
        return JSONResponse(answer, headers={REPLICA_HEADER: self.replica})

    @staticmethod
    def _sequence_id(request_id: str, index: int, count: int) -> str:
        return request_id if count == 1 else f"{request_id}-{index}"

    async def _collect(self, prepared: PreparedRequest, request_id: str, arrived: float
                       ) -> tuple[list[RequestOutput], list[PromptLogprobs] | None] | StepFailure:
        """Every sequence of the request run to its end, and its prompts scored when asked,
        all at once; the first failure fails the request."""
        sequences = prepared.sequences()
        work = [self._collect_one(prepared.prompts[s.prompt_index], s.params,
                                  self._sequence_id(request_id, k, len(sequences)), arrived)
                for k, s in enumerate(sequences)]
        if prepared.score_top is not None:
            work.append(self._score(prepared.prompts, prepared.score_top, request_id))
        results = await asyncio.gather(*work)
        failure = next((r for r in results if isinstance(r, StepFailure)), None)
        if failure is not None:
            return failure
        scores = results.pop() if prepared.score_top is not None else None
        return list(results), scores

    async def _score(self, prompts: list[list[int]], num_top: int,
                     request_id: str) -> list[PromptLogprobs] | StepFailure:
        """The prompts' token logprobs, as one scoring step of a router (another one if it is lost)."""
        failed: set[int] = set()
        while True:
            router = self._pick_router(failed)
            try:
                return await self.deployment.routers[router].score_prompts.remote(prompts, num_top)
            except ROUTER_LOST as error:
                failed.add(router)
                if len(failed) >= len(self.in_flight):
                    return StepFailure(request_id, f"every router was lost while scoring: {error}",
                                       public="the routers scoring its prompt were lost; retry")
            except Exception as error:  # e.g. the KV cache could not hold the prompts now
                return StepFailure(request_id, f"scoring failed: {type(error).__name__}: {error}",
                                   public="the server could not score its prompt now; retry shortly")
            finally:
                self.in_flight[router] -= 1

    async def _collect_one(self, prompt_ids: list[int], params: SamplingParams, request_id: str,
                           arrived: float) -> RequestOutput | StepFailure | None:
        deltas = self._deltas(prompt_ids, params, False, request_id, arrived)
        output = None
        try:
            async for output in deltas:
                if isinstance(output, StepFailure):
                    break
            return output
        finally:
            await deltas.aclose()

    @staticmethod
    async def _unless_disconnected(request: Request, work) -> Any:
        """Run ``work``; if the client disconnects first, cancel it (its sequence is aborted
        at once) and return None."""
        task = asyncio.ensure_future(work)

        async def disconnected() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass

        watcher = asyncio.ensure_future(disconnected())
        try:
            done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:  # the server cancelled the handler: cancel the work too
            task.cancel()
            raise
        finally:
            watcher.cancel()
        if task in done:
            return task.result()
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass
        return None

    async def _read_body(self, request: Request) -> bytes:
        cap = self.config.serve.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > cap:
            raise RequestError(f"the request body exceeds {cap} bytes", status=413, code="body_too_large")
        body = b""
        async for chunk in request.stream():
            body += chunk
            if len(body) > cap:
                raise RequestError(f"the request body exceeds {cap} bytes", status=413, code="body_too_large")
        return body

    def _pick_router(self, avoid: set[int]) -> int:
        candidates = [i for i in range(len(self.in_flight)) if i not in avoid] or list(range(len(self.in_flight)))
        router = min(candidates, key=lambda i: (self.in_flight[i], i))
        self.in_flight[router] += 1
        return router

    def _subscribe(self, router: int) -> None:
        task = self._subscriptions.get(router)
        if task is None or task.done():
            self._subscriptions[router] = asyncio.get_running_loop().create_task(self._read_subscription(router))

    async def _read_subscription(self, router: int) -> None:
        """Read ``router``'s per-step batches and hand each delta to its request. If the router
        is lost, every request waiting on it hears so; the next request subscribes again."""
        handle = self.deployment.routers[router]
        try:
            async for ref in handle.subscribe.options(num_returns="streaming").remote(self.subscriber):
                for item in await ref:
                    entry = self._waiting.get(item.request_id)
                    if entry is not None:
                        entry[1].put_nowait(item)
            lost: BaseException = RuntimeError("the router closed its stream")
        except ROUTER_LOST as error:
            lost = error
        except asyncio.CancelledError:
            raise
        except Exception as error:  # keep serving: the requests on this router fail over like on a loss
            lost = error
        for entry in list(self._waiting.values()):
            if entry[0] == router:
                entry[1].put_nowait(RouterLost(lost))

    async def _deltas(self, prompt_ids: list[int], params: SamplingParams, stream: bool, request_id: str,
                      arrived: float) -> AsyncIterator[RequestOutput | StepFailure]:
        """The router's token deltas folded into a growing RequestOutput (or a StepFailure).

        If the router dies before any token reached the client (always, for a non-streamed
        request), the request starts over on another router; a stream that already sent
        tokens ends with an error instead (the docs say why: tokens cannot be taken back).
        """
        failed: set[int] = set()
        router = self._pick_router(failed)
        finished = False
        try:
            while True:
                tokens, logprobs, tops, last, first = [], [], [], None, 0.0
                deltas: asyncio.Queue = asyncio.Queue()
                self._waiting[request_id] = (router, deltas)
                try:
                    self._subscribe(router)
                    try:
                        await self.deployment.routers[router].submit.remote(
                            self.subscriber, request_id, prompt_ids, params)
                    except ValueError as error:  # its engine refused it (validate_prompt: e.g. its KV never fits)
                        finished = True
                        yield StepFailure(request_id, str(error), public=str(getattr(error, "cause", error)), status=400)
                        return
                    while True:
                        item = await deltas.get()
                        if isinstance(item, RouterLost):
                            raise item
                        if isinstance(item, StepFailure):
                            finished = True
                            self.metrics.count_finished("error")
                            yield item
                            return
                        now = time.perf_counter()
                        if last is None:
                            self.metrics.ttft.observe(now - arrived)
                            first = now
                        else:
                            for _ in item.token_ids:
                                self.metrics.itl.observe((now - last) / len(item.token_ids))
                        last = now
                        tokens += item.token_ids
                        logprobs += item.logprobs
                        tops += item.top_logprobs
                        self.metrics.output_tokens.inc(len(item.token_ids))
                        finished = item.finished
                        if finished:  # counted before the yield: the caller may stop at the last output
                            self.metrics.count_finished(item.finish_reason or "abort")
                            if len(tokens) > 1:
                                self.metrics.tpot.observe((now - first) / (len(tokens) - 1))
                        yield RequestOutput(request_id, item.token_ids, item.logprobs, item.finished,
                                            item.finish_reason, item.num_prompt_tokens, tokens, logprobs, tops,
                                            item.stop_text_index)
                        if item.finished:
                            return
                except (*ROUTER_LOST, RouterLost) as error:
                    failed.add(router)
                    if (stream and tokens) or len(failed) > len(self.in_flight):
                        finished = True
                        self.metrics.count_finished("error")
                        yield StepFailure(request_id, f"the router serving this request was lost after "
                                                      f"{len(tokens)} streamed tokens: {error}",
                                          public=f"the router serving it was lost after {len(tokens)} streamed "
                                                 f"tokens; retry")
                        return
                    self.in_flight[router] -= 1
                    router = self._pick_router(failed)  # nothing reached the client: start over elsewhere
        finally:
            if not finished:  # the client went away (or the caller stopped): free its slot and KV blocks
                self.deployment.routers[router].abort.remote(request_id)
                self.metrics.count_finished("abort")
            self._waiting.pop(request_id, None)
            self.in_flight[router] -= 1

    async def _sse(self, prepared: PreparedRequest, request_id: str, arrived: float,
                   label: str) -> AsyncIterator[str | StepFailure]:
        """Server-sent events: an echo chunk per choice first (when asked), then each
        sequence's pieces as they come, tagged with its choice index, then usage and [DONE]."""
        chat = prepared.endpoint is Endpoint.CHAT
        keep = prepared.chat.keep_tokens if prepared.chat else {}
        decode = ((lambda ids: decode_keeping(self.tokenizer.decode, ids, keep)) if self.tokenizer
                  else (lambda ids: ""))
        sequences = prepared.sequences()
        choices = [StreamedChoice(i, prepared, self.tokenizer, decode)
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
                    scores = await self._score(prepared.prompts, prepared.score_top, request_id)
                    if isinstance(scores, StepFailure):
                        failure, scores = scores, None
                if failure is None:
                    sent_any = True
                    yield self._event(self._chunk(request_id, chat, [
                        c.echo(scores[i // prepared.n] if scores else None) for i, c in enumerate(choices)]))
            if failure is None:
                pumps = [asyncio.ensure_future(self._pump(
                    k, prepared.prompts[s.prompt_index], s.params, self._sequence_id(request_id, k, len(sequences)),
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
                    yield self._event(self._chunk(request_id, chat, [choices[index].update(output)]))
            if failure is not None and failure.status == 400 and not sent_any:
                status = 400  # refused before any event: _serve answers it as a 400 response
                yield failure
                return
            if failure is not None:
                status = failure.status
                LOG.warning("request %s failed: %s", request_id, failure.message)
                error = RequestError(f"the request failed: {failure.public} (request id {request_id})",
                                     status=failure.status, error_type="server_error",
                                     code="step_failed" if failure.status == 503 else "internal_error")
                yield self._event(error.body())
            else:
                status = 200
                if prepared.include_usage:
                    sent = sum(c.sent_tokens for c in choices)
                    usage = {"prompt_tokens": prepared.num_prompt_tokens, "completion_tokens": sent,
                             "total_tokens": prepared.num_prompt_tokens + sent}
                    yield self._event(dict(self._chunk(request_id, chat, []), usage=usage))
            yield "data: [DONE]\n\n"
        except Exception:
            status = 500
            LOG.exception("request %s: streaming failed", request_id)
            raise
        finally:
            # Counted before any await: when the client went away this task is being cancelled,
            # and Starlette's cancel scope cancels every await in here again.
            self._count(label, status)
            self.metrics.e2e.observe(time.perf_counter() - arrived)
            for pump in pumps:  # a sequence still running (the client went away) is aborted
                pump.cancel()
            await asyncio.gather(*pumps, return_exceptions=True)

    async def _pump(self, index: int, prompt_ids: list[int], params: SamplingParams, request_id: str,
                    arrived: float, merged: asyncio.Queue) -> None:
        """Sequence ``index``'s outputs into ``merged`` as ``(index, output)``, then ``(index, None)``."""
        deltas = self._deltas(prompt_ids, params, True, request_id, arrived)
        try:
            async for output in deltas:
                merged.put_nowait((index, output))
        finally:
            await deltas.aclose()
            merged.put_nowait((index, None))

    @staticmethod
    def _event(body: dict[str, Any]) -> str:
        return f"data: {json.dumps(body)}\n\n"

    def _chunk(self, request_id: str, chat: bool, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": request_id, "object": "chat.completion.chunk" if chat else "text_completion",
                "created": int(time.time()), "model": self.limits.name, "choices": choices}


def serve_slots(config: ClusterConfig) -> int:
    """Serve's ``max_ongoing_requests`` for a replica: above the front door's own cap, so the
    probes it never refuses (/health, /metrics) find a slot when the cap is reached."""
    return config.serve.max_open_requests + PROBE_HEADROOM


def public_config(config: ClusterConfig) -> dict[str, Any]:
    """The config as replicas receive it: without API keys or the key file's path (they get digests)."""
    serve_section = msgspec.structs.replace(config.serve, api_keys=(), api_key_file=None)
    return msgspec.structs.replace(config, serve=serve_section).to_dict()


def config_key_digests(config: ClusterConfig, extra_keys: tuple[str, ...] = ()) -> tuple[bytes, ...]:
    """Digests of the config's API keys, its key file's, ``RAYMOE_API_KEY`` and ``extra_keys``
    (raises :class:`raymoe.actors.front_door.ApiKeyError` naming a source that cannot be used)."""
    return api_key_digests((*config.serve.api_keys, *extra_keys), config.serve.api_key_file)


def ingress_app(config: ClusterConfig, admin_token: str | None, attach_to: str,
                key_digests: tuple[bytes, ...] = ()) -> serve.Application:
    """The HTTP ingress of a running deployment: ``serve.replicas`` replicas (or Serve's
    autoscaling, ``serve.autoscaling`` passed through), each attached to it by name."""
    options: dict[str, Any] = {"num_replicas": config.serve.replicas}
    if config.serve.autoscaling is not None:
        options = {"autoscaling_config": dict(config.serve.autoscaling)}
    options["max_ongoing_requests"] = serve_slots(config)
    return OpenAIIngress.options(**options).bind(public_config(config), admin_token, attach_to, key_digests)


def build_app(args: dict[str, Any]) -> serve.Application:
    """App builder for ``serve run`` / ``serve deploy``: ``args`` is a raymoe cluster config.

    ``import_path: raymoe.actors.ingress:build_app`` with the config's fields under ``args``.
    """
    config = parse_cluster_config(dict(args))  # validate here: errors surface before any actor starts
    return OpenAIIngress.options(max_ongoing_requests=serve_slots(config)).bind(
        public_config(config), os.environ.get("RAYMOE_ADMIN_TOKEN"), None,
                              config_key_digests(config))
