"""The OpenAI-compatible HTTP endpoint: a Ray Serve deployment with a FastAPI ingress.

This module holds the routes: the OpenAI ones (completions, chat completions, models,
tokenize, detokenize), ``/health``, ``/metrics`` and ``/admin/*``. A replica attaches by name
to a deployment that is already running (actors/attach.py; cluster/serve_app.py builds the
Serve application, and starts the deployment first for ``serve run``), as
:class:`IngressSettings` describes. Per request it validates and tokenizes the body
(engine/api/completions.py; nothing malformed reaches a router) and hands it to the router
relay (actors/router_relay.py: router selection, one subscription per router, failover);
a streamed request's Server-Sent Events are actors/sse.py.
"""

# No `from __future__ import annotations` here: FastAPI reads the route signatures'
# annotations at runtime (a string `Request` would become a query parameter).
import asyncio
import hmac
import itertools
import os
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from ray import serve
from starlette.exceptions import HTTPException as StarletteHTTPException

from raymoe.actors.attach import NAMESPACE, attach_actors
from raymoe.actors.front_door import PROBE_HEADROOM, RETRY_AFTER_S, FrontDoor, FrontDoorPolicy
from raymoe.actors.heap_freeze import freeze_loaded_heap
from raymoe.actors.http_listener import harden_direct_ingress
from raymoe.actors.rank_watch import HEALTHY
from raymoe.actors.router import StepFailure
from raymoe.actors.router_relay import RouterRelay, sequence_id
from raymoe.actors.router_resize import RELAY_REFRESH_S
from raymoe.actors.router_spec import live_router_handles
from raymoe.actors.serving_metrics import ServingMetrics
from raymoe.actors.sse import EventStreamResponse, prepend, stream_events
from raymoe.actors.worker_spec import live_worker_handles
from raymoe.engine.api.completions import (
    Endpoint, ModelLimits, PreparedRequest, prepare_request, response_body,
)
from raymoe.engine.engine import RequestOutput
from raymoe.engine.api.openai_protocol import RequestError, new_id
from raymoe.engine.hf_config import load_model_config
from raymoe.engine.prompt_logprobs import PromptLogprobs
from raymoe.engine.sampling_params import SamplingParams
from raymoe.engine.api.tokenize_api import detokenize_body, tokenize_body
from raymoe.engine.tokenizer import Tokenizer

LOG = logging.getLogger("raymoe.ingress")
HEALTH_TIMEOUT_S = 5.0
WATCH_TIMEOUT_S = 2.0  # /health asks the controller's rank watch this long before asking each actor
REPLICA_HEADER = "x-raymoe-replica"  # which ingress replica answered (Serve's replica id)
PREPARE_THREADS = 4  # bodies validated, tokenized and templated at once, off the event loop
# Bodies of LARGE_BODY_BYTES or more (a long prompt: seconds of tokenizing at 1 MB/s) take
# turns on a pool of their own, half the replica's cores, so that they never occupy every
# core the event loop and the small requests need (measured: six 900 kB prompts on 4 threads
# of a 2-core machine). Smaller bodies keep PREPARE_THREADS.
LARGE_BODY_BYTES = 64 * 1024
LARGE_PREPARE_THREADS = max(1, len(os.sched_getaffinity(0)) // 2)
LARGE_BODY_NICENESS = 10  # added to a large-body thread's niceness: the event loop goes first


@dataclass(frozen=True)
class IngressSettings:
    """What an ingress replica is told (cluster/serve_app.py builds it from the cluster
    config): the running deployment to attach to, the model it serves, and the edge."""

    deployment: str  # the running deployment's name: its actors are {deployment}-router-{r}, ...
    routers: int
    expert_workers: int
    model: str  # the checkpoint directory (tokenizer, config.json)
    served_model_name: str
    max_model_len: int | None  # engine.max_model_len; None: the model's context
    admission_limit: int  # this replica's requests at once before it answers 503 (its share of the routers' queues)
    max_body_bytes: int
    header_timeout_s: float
    front_door: FrontDoorPolicy  # API key digests, CORS, body deadlines, admission caps
    namespace: str = NAMESPACE
    max_migrations: int = 3  # serve.max_migrations: moves of one request to another router when its router is lost
    delta_channel: bool = True  # serve.delta_channel: the routers' deltas over a socket of their own (else Ray's stream)


def _lower_priority() -> None:
    """This thread (a large body's) yields the CPU to the event loop and the serving ranks:
    ``LARGE_BODY_NICENESS`` more niceness (Linux sets it per thread)."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), LARGE_BODY_NICENESS)
    except (AttributeError, OSError):  # not Linux, or not allowed: the same priority as the loop
        pass


app = FastAPI(title="raymoe", description="OpenAI-compatible MoE serving with expert parallelism on Ray")
app.add_middleware(FrontDoor)  # keys, content types, docs, CORS, body deadlines (configured per replica)


def error_response(error: RequestError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status)


@app.exception_handler(StarletteHTTPException)
async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
    kind = "not_found" if exc.status_code == 404 else "invalid_request_error"
    return error_response(RequestError(str(exc.detail), status=exc.status_code, error_type=kind))


@app.exception_handler(RequestValidationError)
async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
    return error_response(RequestError(f"invalid request: {exc.errors()}"[:1000]))


# Serve runs a replica's user code on an event loop of its own thread by default, so that every
# ASGI message of a streamed response crosses from that loop to the one serving HTTP (a queue and
# a cross-thread wake-up per chunk). raymoe's ingress never blocks its loop (bodies are prepared
# on threads), so it runs on Serve's own loop, as Ray's throughput-optimized mode does: measured
# ~11% less of the replica's CPU per streamed token (docs/BENCHMARKS.md). Ray reads the
# variable when the replica's process starts; the replica's runtime_env sets it there.
# RAYMOE_INGRESS_SEPARATE_LOOP=1 where the deployment is built keeps Serve's default (an A/B:
# benchmarks/bench_ingress_loop.py).
SAME_LOOP_ENV = ({} if os.environ.get("RAYMOE_INGRESS_SEPARATE_LOOP") == "1"
                 else {"RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0"})


@serve.deployment(name="raymoe", num_replicas=1, max_ongoing_requests=4096 + PROBE_HEADROOM,
                  ray_actor_options={"num_cpus": 0.01, "runtime_env": {"env_vars": SAME_LOOP_ENV}})
@serve.ingress(app)
class OpenAIIngress:
    def __init__(self, settings: IngressSettings, admin_token: str | None = None):
        """Serve the running deployment ``settings.deployment`` (``raymoe serve`` starts it
        first, any number of replicas may share it; for ``serve run`` the replica's
        cluster/serve_app.py subclass starts it just before)."""
        self.admin_token = admin_token or None
        self.settings = settings
        harden_direct_ingress(settings.header_timeout_s)  # before Serve starts this replica's listener
        FrontDoor.configure(settings.front_door)
        self.deployment = attach_actors(settings.deployment, settings.routers, settings.expert_workers,
                                        settings.namespace)
        model = load_model_config(settings.model)
        try:
            self.tokenizer: Tokenizer | None = Tokenizer(settings.model)
        except FileNotFoundError:
            self.tokenizer = None
        name = settings.served_model_name
        max_len = min(settings.max_model_len or model.max_position_embeddings, model.max_position_embeddings)
        self.limits = ModelLimits(name, model.vocab_size, max_len)
        self.metrics = ServingMetrics(self.deployment.status["slots_per_worker"], name)
        self.admission_limit = settings.admission_limit
        try:
            self.replica = serve.get_replica_context().replica_id.unique_id  # for REPLICA_HEADER
        except Exception:  # outside a Serve replica
            self.replica = str(os.getpid())
        self.created = int(time.time())
        self._ids = itertools.count()
        self.relay = RouterRelay(self.deployment.routers, self.metrics,  # selection, subscriptions, migration
                                 max_migrations=settings.max_migrations, channel=settings.delta_channel)
        self._router_refresh: asyncio.Task | None = None  # follows a router resize (_refresh_routers)
        self._prepare_pool = ThreadPoolExecutor(max_workers=PREPARE_THREADS, thread_name_prefix="raymoe-prepare")
        self._large_pool = ThreadPoolExecutor(max_workers=LARGE_PREPARE_THREADS, thread_name_prefix="raymoe-prepare-large",
                                              initializer=_lower_priority)
        freeze_loaded_heap()  # last: what loading built lives as long as this replica

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
        """Every router and worker with its state: from the controller's rank watch
        (actors/rank_watch.py: serving, alive, stalled, busy, wedged, dead; its last progress), and
        from asking each actor here, so that one silent now is ``unresponsive`` before the
        watch's limit has passed. 503 when any rank is not serving or alive."""
        ranks, wedged = await self._rank_states()
        failed = [f"{row['rank']}: {row['state']}" + (f" ({row['reason']})" if row.get("reason") else "")
                  for row in ranks if row["state"] not in HEALTHY]
        if failed:
            return JSONResponse({"status": "unhealthy", "reason": "; ".join(failed)[:1000], "ranks": ranks,
                                 "wedged": wedged}, status_code=503)
        return JSONResponse({"status": "ok", "routers": len(self.deployment.routers),
                             "expert_workers": len(self.deployment.workers), "ranks": ranks, "wedged": wedged},
                            headers={REPLICA_HEADER: self.replica, f"{REPLICA_HEADER}-pid": str(os.getpid())})

    async def _rank_states(self) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """Each rank's row, and the wedged ranks the watch found (and killed) lately."""
        actors = {**{f"router {i}": a for i, a in enumerate(self.deployment.routers)},
                  **{f"worker {i}": a for i, a in enumerate(self.deployment.workers)}}

        async def watch() -> dict[str, Any]:
            try:
                return await asyncio.wait_for(self.deployment.controller.rank_states.remote(), WATCH_TIMEOUT_S)
            except Exception:  # no controller now (restarting): the actors' own answers say enough
                return {}

        report, *answers = await asyncio.gather(
            watch(), *[asyncio.wait_for(a.info.remote(), HEALTH_TIMEOUT_S) for a in actors.values()],
            return_exceptions=True)
        report = report if isinstance(report, dict) else {}
        watched = {row["rank"]: row for row in report.get("ranks", [])}
        rows = []
        for name, answer in zip(actors, answers):
            row = dict(watched.get(name) or {"rank": name, "state": "alive", "reason": ""})
            if row["state"] in ("wedged", "dead", "busy"):
                pass  # the watch knows more (and has started recovery, or says why it did not kill it)
            elif isinstance(answer, asyncio.TimeoutError):  # a frozen actor's TimeoutError has no text of its own
                row.update(state="unresponsive", reason=f"no answer within {HEALTH_TIMEOUT_S:g} s")
            elif isinstance(answer, BaseException):
                text = (str(answer).strip() or "no detail").splitlines()[0]
                row.update(state="dead", reason=f"{type(answer).__name__}: {text}")
            elif row.get("pid") is None:
                row["pid"] = answer.get("pid")
            rows.append(row)
        return rows, report.get("wedged", [])

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

    @app.post("/admin/scale")
    async def admin_scale(self, request: Request) -> Response:
        """Grow or shrink the expert pool and/or the router pool while serving: ``{"workers": N}``
        (actors/resize.py), ``{"routers": M}`` (actors/router_resize.py), or both (workers
        first). 200 with the report (both: ``{"resizes": [workers', routers']}``); a refusal
        answers the status its limit names (400, 409, 503)."""
        refusal = self._refuse_admin(request)
        if refusal is not None:
            return refusal
        self._follow_routers()
        try:
            body = await request.json()
        except ValueError:
            body = None
        if not isinstance(body, dict) or (body.get("workers") is None and body.get("routers") is None):
            return error_response(RequestError('expected a JSON object such as {"workers": 3} or {"routers": 2}',
                                               code="invalid_body"))
        timeout_s = body.get("ready_timeout_s")
        if timeout_s is not None and (type(timeout_s) not in (int, float) or not 0 < timeout_s <= 3600):
            return error_response(RequestError('"ready_timeout_s", if given, must be seconds in (0, 3600]',
                                               param="ready_timeout_s"))
        reports = []
        for field_name in ("workers", "routers"):
            size = body.get(field_name)
            if size is None:
                continue
            if type(size) is not int:
                return error_response(RequestError(f'"{field_name}" must be an integer', param=field_name))
            if field_name == "workers":
                report = await self.deployment.controller.resize.remote(size, float(timeout_s or 60.0))
                report.pop("moved", None)
                if report.get("resized"):  # this replica's /health asks the live workers from now on
                    self.deployment.workers = await asyncio.to_thread(live_worker_handles, self.settings.deployment,
                                                                      self.settings.namespace)
            else:
                options = {} if timeout_s is None else {"ready_timeout_s": float(timeout_s)}
                report = await self.deployment.controller.resize_routers.remote(size, **options)
            if "error" in report:
                code = "resize_refused" if report.get("refused") else "resize_failed"
                detail = "" if report.get("refused") else f"; rolled back: {report.get('rolled_back')}"
                return error_response(RequestError(f"{report['error']}{detail}", param=field_name,
                                                   status=report.get("status", 500), code=code))
            reports.append(report)
        return JSONResponse(reports[0] if len(reports) == 1 else {"resizes": reports})

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
    def _follow_routers(self) -> None:
        """Start (once, on this replica's event loop) the task that follows router resizes."""
        if self._router_refresh is None or self._router_refresh.done():
            self._router_refresh = asyncio.get_running_loop().create_task(self._refresh_routers())

    async def _refresh_routers(self) -> None:
        """Every ``RELAY_REFRESH_S``: the routers the controller reports (a resize adds some or
        retires the highest, actors/router_resize.py) become the relay's; a leaving router gets
        no new request from here within that time."""
        while True:
            await asyncio.sleep(RELAY_REFRESH_S)
            try:
                now = await self.deployment.controller.serving_routers.remote()
                if now["routers"] == len(self.deployment.routers) and now["serving"] == self.relay.serving:
                    continue
                handles = await asyncio.to_thread(live_router_handles, self.settings.deployment,
                                                  self.settings.namespace)
                if len(handles) < now["routers"]:
                    continue  # a new router is not named yet: next time
                self.deployment.routers = handles[:now["routers"]]
                self.relay.set_routers(self.deployment.routers, now["serving"])
            except asyncio.CancelledError:
                raise
            except Exception as error:  # the controller restarting: keep the routers known, ask again
                LOG.debug("router refresh: %s: %s", type(error).__name__, error)

    async def _serve(self, request: Request, endpoint: Endpoint) -> Response:
        """One request, with its real status counted once: its 4xx, 499 when the client went
        away, 500/503 when it failed, 200 when it finished."""
        self._follow_routers()
        arrived = time.perf_counter()
        label = endpoint.name.lower()
        try:
            body = await self._read_body(request)
            # Tokenizing and rendering the chat template can take long: never on the event loop.
            prepared = await asyncio.get_running_loop().run_in_executor(
                self._pool_for(body), prepare_request, endpoint, body, self.tokenizer, self.limits)
        except RequestError as error:
            self._count(label, error.status)
            return error_response(error)
        request_id = new_id("chatcmpl" if endpoint is Endpoint.CHAT else "cmpl")
        if min(self.relay.in_flight) >= self.admission_limit:  # every router's queue is full
            self._count(label, 503)
            error = RequestError("the server is overloaded; retry shortly", status=503, error_type="server_error",
                                 code="overloaded")
            return JSONResponse(error.body(), status_code=503, headers={"Retry-After": str(RETRY_AFTER_S)})
        self.metrics.prompt_tokens.inc(prepared.num_prompt_tokens)
        if prepared.stream:
            # The first event is awaited before the headers go out, so a request its router
            # refuses (validate_prompt: e.g. its KV can never fit) is a 400, as unstreamed.
            events = stream_events(prepared, request_id, arrived, self.relay, self.tokenizer, self.limits.name,
                                   lambda status: self._finish(label, status, arrived))
            try:
                first = await events.__anext__()
            except StopAsyncIteration:
                first = None
            if isinstance(first, StepFailure):  # refused before any event (a 400)
                await events.aclose()
                return self._failure_response(first)
            return EventStreamResponse(prepend(first, events), headers={REPLICA_HEADER: self.replica})
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
            self._finish(label, status, arrived)

    def _count(self, label: str, status: int) -> None:
        self.metrics.count_request(label, status)

    def _finish(self, label: str, status: int, arrived: float) -> None:
        """A request's end: its status counted, its end-to-end time observed."""
        self._count(label, status)
        self.metrics.e2e.observe(time.perf_counter() - arrived)

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
                self._pool_for(body), handler, body, self.tokenizer, self.limits)
        except RequestError as error:
            return error_response(error)
        return JSONResponse(answer, headers={REPLICA_HEADER: self.replica})

    async def _collect(self, prepared: PreparedRequest, request_id: str, arrived: float
                       ) -> tuple[list[RequestOutput], list[PromptLogprobs] | None] | StepFailure:
        """Every sequence of the request run to its end, and its prompts scored when asked,
        all at once; the first failure fails the request."""
        sequences = prepared.sequences()
        work = [self._collect_one(prepared.prompts[s.prompt_index], s.params,
                                  sequence_id(request_id, k, len(sequences)), arrived)
                for k, s in enumerate(sequences)]
        if prepared.score_top is not None:
            work.append(self.relay.score(prepared.prompts, prepared.score_top, request_id))
        results = await asyncio.gather(*work)
        failure = next((r for r in results if isinstance(r, StepFailure)), None)
        if failure is not None:
            return failure
        scores = results.pop() if prepared.score_top is not None else None
        return list(results), scores

    async def _collect_one(self, prompt_ids: list[int], params: SamplingParams, request_id: str,
                           arrived: float) -> RequestOutput | StepFailure | None:
        deltas = self.relay.deltas(prompt_ids, params, request_id, arrived)
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

    def _pool_for(self, body: bytes) -> ThreadPoolExecutor:
        """Where a body is validated and tokenized: large ones take turns (LARGE_BODY_BYTES)."""
        return self._large_pool if len(body) >= LARGE_BODY_BYTES else self._prepare_pool

    async def _read_body(self, request: Request) -> bytes:
        cap = self.settings.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > cap:
            raise RequestError(f"the request body exceeds {cap} bytes", status=413, code="body_too_large")
        body = bytearray()  # appended in place: `bytes +=` copied the whole body per chunk
        async for chunk in request.stream():
            body += chunk
            if len(body) > cap:
                raise RequestError(f"the request body exceeds {cap} bytes", status=413, code="body_too_large")
        return bytes(body)
