"""The ingress' relay to the routers: which router takes a request, how its tokens come back,
and what happens when a router is lost.

- **Selection** (:meth:`RouterRelay.pick`): the router with the fewest of this replica's
  requests in flight (the lowest index among equals), avoiding those that already failed the
  request, among those taking requests (a router resize adds routers and retires the highest:
  :meth:`RouterRelay.set_routers`, which the ingress calls when the controller reports a change).
- **Subscription**: one connection per router and replica, made before the first request goes
  there: the delta channel (actors/delta_channel.py, ``serve.delta_channel``, the default), a
  socket that carries this replica's submits and aborts to the router and one frame a router
  step back with every delta of its requests; or (``serve.delta_channel: false``) Ray's
  stream ``Router.subscribe``, one item a step, with each submit and abort a Ray call. A task
  per router hands each delta to its request. When the connection breaks, every request
  waiting on that router hears so (:class:`RouterLost`); the next request connects again.
- **Migration** (:meth:`RouterRelay.deltas`, :meth:`RouterRelay.score`): when a router is
  lost, each of its requests moves to a live router. One that had produced no token starts
  over; one that had continues there after the tokens it produced (``Router.submit``'s
  ``resume_ids``: prompt and those tokens prefilled, its penalties, grammar and seeded random
  stream standing past them), so the client's stream goes on with no token repeated or
  missing, and greedy and seeded outputs equal a run without the failure. A request moves at
  most ``max_migrations`` times (``serve.max_migrations``); past that, or with no router left
  to try, it ends with an error event. Scoring a prompt moves to another router likewise.

The relay counts what it sees in the replica's :class:`ServingMetrics` (time to first token,
inter-token latency, time per output token, output tokens, finish reasons).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, AsyncIterator

import ray

from raymoe.actors.delta_channel import DeltaChannel
from raymoe.actors.router import StepFailure
from raymoe.actors.serving_metrics import ServingMetrics
from raymoe.engine.api.openai_protocol import new_id
from raymoe.engine.engine import RequestOutput
from raymoe.engine.prompt_logprobs import PromptLogprobs
from raymoe.engine.sampling_params import SamplingParams

LOG = logging.getLogger("raymoe.ingress")
ROUTER_LOST = (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError)
RETRY_PAUSE_S = 0.5  # before moving a request back to a router that already lost it (all have: one may be restarting)


class RouterLost(Exception):
    """Put in a request's queue (and raised there) when the subscription of its router broke."""

    def __init__(self, cause: BaseException):
        super().__init__(f"{type(cause).__name__}: {cause}")
        self.cause = cause


class ChannelUnreachable(ConnectionError):
    """A router's delta channel could not be opened (its port unreachable from this replica)."""


def sequence_id(request_id: str, index: int, count: int) -> str:
    """The engine request id of sequence ``index`` of ``count`` that one body fans out into."""
    return request_id if count == 1 else f"{request_id}-{index}"


class RouterRelay:
    """One ingress replica's requests on the routers ``routers`` (actor handles, by index)."""

    def __init__(self, routers: list[Any], metrics: ServingMetrics, max_migrations: int = 3, channel: bool = True):
        self.routers = list(routers)
        self.serving = len(self.routers)  # routers 0..serving-1 take new requests (set_routers)
        self.metrics = metrics
        self.max_migrations = max_migrations
        self.in_flight = [0] * len(routers)  # this replica's requests on each router
        # One subscription per router carries every delta of this replica's requests, one frame
        # (or Ray item) per step, not one per token per request; a task per router reads it.
        self.subscriber = new_id("ingress")
        self.channel = channel  # the deltas over a socket of their own (serve.delta_channel), else Ray's stream
        self._waiting: dict[str, tuple[int, asyncio.Queue]] = {}  # request id -> (router, its deltas)
        self._subscriptions: dict[int, tuple[asyncio.Task, asyncio.Future]] = {}  # router -> (reader, connected)
        self._channels: dict[int, DeltaChannel] = {}  # router -> its delta channel while connected

    # ---- selection ---------------------------------------------------------------------
    def set_routers(self, routers: list[Any], serving: int) -> None:
        """The routers the controller reports now (a router resize, actors/router_resize.py):
        the first ``serving`` take new requests; the others are leaving and only finish what
        they hold. Handles are replaced by index and never dropped (a request may still be on a
        router that left: its loss moves it), so an index keeps meaning one router name."""
        for index, handle in enumerate(routers):
            if index < len(self.routers):
                self.routers[index] = handle
            else:
                self.routers.append(handle)
                self.in_flight.append(0)
        self.serving = max(1, min(serving, len(routers)))

    def _all_failed(self, failed: set[int]) -> bool:
        return all(index in failed for index in range(self.serving))

    def pick(self, avoid: set[int]) -> int:
        """The router to send a request to (counted in flight until its caller takes it off)."""
        serving = range(self.serving)
        candidates = [i for i in serving if i not in avoid] or list(serving)
        router = min(candidates, key=lambda i: (self.in_flight[i], i))
        self.in_flight[router] += 1
        return router

    # ---- subscription ------------------------------------------------------------------
    async def _subscribed(self, router: int) -> None:
        """``router``'s deltas for this replica are being read (connected first, over the delta
        channel): a request submitted after this returns has its deltas read. Raises
        :class:`RouterLost` when the router cannot be reached."""
        subscription = self._subscriptions.get(router)
        if subscription is None or subscription[0].done():
            ready = asyncio.get_running_loop().create_future()
            task = asyncio.get_running_loop().create_task(self._read_subscription(router, ready))
            subscription = self._subscriptions[router] = (task, ready)
        await asyncio.shield(subscription[1])  # one request going away does not cancel the others' wait

    async def _read_subscription(self, router: int, ready: asyncio.Future) -> None:
        """Read ``router``'s per-step batches and hand each delta to its request. If the router
        is lost, every request waiting on it hears so; the next request subscribes again."""
        handle = self.routers[router]
        channel: DeltaChannel | None = None
        try:
            if self.channel:  # over a socket of its own (actors/delta_channel.py)
                address = await handle.delta_channel.remote()
                try:
                    channel = await DeltaChannel.connect(address, self.subscriber)
                except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError) as error:
                    raise ChannelUnreachable(
                        f"router {router}'s delta channel at {address.host}:{address.port} could not be opened "
                        f"({type(error).__name__}: {error}): the ingress must reach the router's node on its "
                        f"ephemeral ports, or set serve.delta_channel: false") from error
                self._channels[router] = channel
                ready.set_result(None)
                while True:
                    self._hand_out(await channel.read())
            ready.set_result(None)  # Ray's stream: a submit that arrives first finds the same queue
            async for ref in handle.subscribe.options(num_returns="streaming").remote(self.subscriber):
                self._hand_out(await ref)
            lost: BaseException = RuntimeError("the router closed its stream")
        except ROUTER_LOST as error:
            lost = error
        except asyncio.IncompleteReadError:
            lost = RuntimeError("the router closed its delta channel")
        except asyncio.CancelledError:
            raise
        except Exception as error:  # keep serving: the requests on this router fail over like on a loss
            lost = error
            if isinstance(error, ChannelUnreachable):
                LOG.warning("%s", error)
        finally:
            if channel is not None:
                channel.close()
                if self._channels.get(router) is channel:
                    del self._channels[router]
        if not ready.done():
            ready.set_exception(RouterLost(lost))
            ready.exception()  # retrieved: a lost router nobody waited on is not an unhandled error
        for entry in list(self._waiting.values()):
            if entry[0] == router:
                entry[1].put_nowait(RouterLost(lost))

    def _hand_out(self, items: list) -> None:
        for item in items:
            entry = self._waiting.get(item.request_id)
            if entry is not None:
                entry[1].put_nowait(item)

    # ---- migration ---------------------------------------------------------------------
    async def deltas(self, prompt_ids: list[int], params: SamplingParams, request_id: str,
                     arrived: float) -> AsyncIterator[RequestOutput | StepFailure]:
        """The router's token deltas folded into a growing RequestOutput (or a StepFailure).

        If its router is lost, the request moves to another one (at most ``max_migrations``
        times) and continues after the tokens it already produced: the caller sees one
        uninterrupted sequence of deltas.
        """
        failed: set[int] = set()
        router = self.pick(failed)
        finished = False
        migrations = 0
        tokens: list[int] = []  # every token produced so far, over every router it ran on
        logprobs: list[float] = []
        tops: list = []
        last, first = None, 0.0
        attempt = request_id  # the id on the router; a moved request gets a new one (its old router may live on)
        try:
            while True:
                deltas: asyncio.Queue = asyncio.Queue()
                self._waiting[attempt] = (router, deltas)
                try:
                    await self._subscribed(router)
                    channel = self._channels.get(router)
                    if channel is not None:  # a refusal comes back as its first item
                        channel.submit(attempt, prompt_ids, params, list(tokens) or None)
                    else:
                        try:
                            await self.routers[router].submit.remote(self.subscriber, attempt, prompt_ids, params,
                                                                     list(tokens) or None)
                        except ValueError as error:  # its engine refused it (validate_prompt: e.g. its KV never fits)
                            deltas.put_nowait(StepFailure(attempt, str(error), status=400,
                                                          public=str(getattr(error, "cause", error))))
                    while True:
                        item = await deltas.get()
                        if isinstance(item, RouterLost):
                            raise item
                        if isinstance(item, StepFailure) and item.status == 400:  # refused, by either path
                            finished = True
                            yield StepFailure(request_id, item.message, public=item.public, status=400)
                            return
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
                    self._waiting.pop(attempt, None)
                    self._abort(router, attempt)  # if it lives on (only its stream broke), it stops
                    migrations += 1
                    if migrations > self.max_migrations:
                        finished = True
                        self.metrics.count_finished("error")
                        yield StepFailure(request_id, f"the router serving this request was lost after {len(tokens)} "
                                                      f"tokens and it was already moved {self.max_migrations} times "
                                                      f"(serve.max_migrations): {error}",
                                          public=f"the router serving it was lost after {len(tokens)} tokens, and it "
                                                 f"had already been moved {self.max_migrations} times; retry")
                        return
                    self.metrics.migrations.labels(self.metrics.model_name, "true" if tokens else "false").inc()
                    self.in_flight[router] -= 1
                    if self._all_failed(failed):  # every router lost it: give a restart a moment
                        await asyncio.sleep(RETRY_PAUSE_S)
                    router = self.pick(failed)  # it continues there after the tokens it produced
                    attempt = f"{request_id}~{migrations}"
        finally:
            if not finished:  # the client went away (or the caller stopped): free its slot and KV blocks
                self._abort(router, attempt)
                self.metrics.count_finished("abort")
            self._waiting.pop(attempt, None)
            self.in_flight[router] -= 1

    def _abort(self, router: int, attempt: str) -> None:
        channel = self._channels.get(router)
        if channel is not None:
            channel.abort(attempt)
        else:
            self.routers[router].abort.remote(attempt)

    async def score(self, prompts: list[list[int]], num_top: int,
                    request_id: str) -> list[PromptLogprobs] | StepFailure:
        """The prompts' token logprobs, as one scoring step of a router (another one if it is lost)."""
        failed: set[int] = set()
        while True:
            router = self.pick(failed)
            try:
                return await self.routers[router].score_prompts.remote(prompts, num_top)
            except ROUTER_LOST as error:
                failed.add(router)
                if self._all_failed(failed):
                    return StepFailure(request_id, f"every router was lost while scoring: {error}",
                                       public="the routers scoring its prompt were lost; retry")
            except Exception as error:  # e.g. the KV cache could not hold the prompts now
                return StepFailure(request_id, f"scoring failed: {type(error).__name__}: {error}",
                                   public="the server could not score its prompt now; retry shortly")
            finally:
                self.in_flight[router] -= 1
