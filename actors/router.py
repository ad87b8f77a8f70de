"""The router actor: owns its requests, the dense weights, the KV cache and the gate.

It runs the in-process engine's loop on a background thread with
:class:`~raymoe.engine.exchange.remote_experts.RemoteExperts` as the expert backend, in lockstep with
every other router over the deployment's one expert-parallel group (this router is rank
``router_index``): each turn the routers agree whether anyone has work, then each runs its
engine step (or zero rows, when it has none) through every MoE layer's dispatch and combine.
No Ray call per step. Requests arrive through actor calls and their tokens stream back as
they are sampled. Operators find each as ``{deployment}-router-{r}`` (Ray namespace
``raymoe``): ``raymoe status --address HOST:PORT`` lists every router's pid, node, liveness,
requests in flight and last failure (docs/DEPLOY.md, section 4, also for Ray's own tools).

Before a router can join the group its constructor warms every kernel its first step would
otherwise compile or load (FlashInfer's attention modules, the native CPU kernels, cuBLAS's
handle: :meth:`Router._warm_up`), so the deadline of the group's first step counts from a warm
router, not from a JIT compile.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Any, Iterator

import ray
import torch

from raymoe.engine.engine import EngineConfig, LLMEngine, RequestOutput
from raymoe.actors.cpu_affinity import pin_current_thread
from raymoe.actors.delta_channel import ChannelAddress, DeltaChannelServer
from raymoe.actors.devices import actor_cuda_device
from raymoe.actors.heap_freeze import freeze_loaded_heap
from raymoe.actors.progress_slot import ProgressSlot
from raymoe.engine.exchange.ep_exchange import GroupLayout, RouterExchange, router_exchange
from raymoe.engine.host_memory import allocator_in_use
from raymoe.engine.prompt_logprobs import PromptLogprobs
from raymoe.engine.exchange.remote_experts import RemoteExperts
from raymoe.engine.sampling_params import SamplingParams
from raymoe.engine.telemetry import Telemetry
from raymoe.engine.tokenizer import Tokenizer
from raymoe.kernels import huge_pages, native_cpu
from raymoe.kernels.attention_flashinfer import warm_up_attention
from raymoe.kernels.comm import CommBackend, CommError, make_communicator, new_rendezvous
from raymoe.engine.hf_config import load_model_config
from raymoe.moe.placement import PlacementTable

RECOVERY_TIMEOUT_S = 600.0
RECOVERY_ATTEMPTS = 3  # a router asks this many times for a recovery that fails part-way
RECOVERY_RETRY_PAUSE_S = 1.0
RECENT_FAILURES = 8  # info()'s recent_failures keeps this many
# Failures a rebuilt communicator group fixes: a peer that died, froze or broke the group.
RECOVERABLE = (CommError, ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError,
               ray.exceptions.ActorUnavailableError)
# Idle routers re-check for work after IDLE_MIN_S, doubling up to IDLE_MAX_S (the most a new
# request waits for the other routers to join its first step); every TICK_ROUNDS idle rounds
# (a lone router: every TICK_S) the workers hear that no step is coming.
IDLE_MIN_S = 0.0005
IDLE_MAX_S = 0.016
TICK_ROUNDS = 32
TICK_S = 0.5
NOT_JOINED_WAIT_S = 0.05


def _is_error(error: BaseException, name: str) -> bool:
    """Whether ``error`` (or, for a remote call's error, its cause) is of the class ``name``."""
    cause = getattr(error, "cause", None)
    return any(type(e).__name__ == name or any(c.__name__ == name for c in type(e).__mro__)
               for e in (error, cause) if e is not None)


def idle_wait_s(num_routers: int, idle_rounds: int) -> float | None:
    """How long a router without work waits (or until work arrives) before its next agreement
    round, after ``idle_rounds`` rounds in a row in which nobody stepped: a lone router up to
    TICK_S; one of several not at all right after a group step (another router, which has work,
    is likely waiting in the agreement for it already: a wait here would hold up that router's
    step), then IDLE_MIN_S doubling each idle round up to IDLE_MAX_S."""
    if num_routers == 1:
        return TICK_S
    if idle_rounds == 0:
        return None
    return min(IDLE_MIN_S * 2 ** min(idle_rounds - 1, 8), IDLE_MAX_S)
IDLE_SUBSCRIBER_WAIT_S = 1.0  # a subscriber stream re-checks for shutdown this often


@dataclass(frozen=True)
class TokenDelta:
    """What one step added to one request: sent back to the caller as it happens."""

    request_id: str
    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[Any]
    finished: bool
    finish_reason: str | None
    stop_text_index: int | None
    num_prompt_tokens: int


@dataclass
class ScoreJob:
    prompts: list[list[int]]
    num_top: int | None = None  # alternatives per position (score_prompts); None: every position's logits
    scoring: Any = None  # the engine's PromptScoring, once started: one forward per group step
    result: Any = None
    error: Exception | None = None
    done: threading.Event = field(default_factory=threading.Event)


@dataclass
class PendingGroup:
    """A group this router joined beside the one it serves (``Router.prepare_switch``): its
    exchange, the placement served with it, and set once the step loop switched to it."""
    exchange: RouterExchange
    table: PlacementTable
    generation: int
    num_routers: int
    switched: threading.Event = field(default_factory=threading.Event)


@dataclass(frozen=True)
class StepFailure:
    """The request failed (its step, or it alone); the caller gets this instead of tokens.

    ``message`` is for the server's log (it may hold internal detail); ``public`` is what a
    client may be told; ``status`` the HTTP status that fits (503: retry; 500: it failed).
    """

    request_id: str
    message: str
    public: str = "the server could not run this request's step; retry shortly"
    status: int = 503


class Router:
    def __init__(
        self,
        router_id: str,
        model_dir: str,
        engine_config: EngineConfig,
        placement: dict[str, Any],
        workers: list[Any],
        backend: str,
        timeout_s: float,
        router_index: int = 0,
        num_routers: int = 1,
        threads: int | None = None,
        pin_core: int | None = None,
    ):
        if threads:  # CPU routers: intra-op threads of the dense part (cluster config `cpu`)
            torch.set_num_threads(threads)
        self.router_id = router_id
        self.pin_core = pin_core  # the core index the step thread pins itself to (actors/cpu_affinity.py)
        self.pinned_core: int | None = None  # the core it took
        self.router_index = router_index
        self.num_routers = num_routers
        self.group_routers = num_routers  # routers in the group joined last (recovery may leave one out)
        self.workers = workers
        self.backend = CommBackend(backend).resolve()
        self.timeout_s = timeout_s
        self.placement = PlacementTable.from_dict(placement)
        config = load_model_config(model_dir)
        self.config = config
        if engine_config.device == "cuda":
            engine_config = replace(engine_config, device=str(actor_cuda_device()))
        self.telemetry = Telemetry(self.placement.num_layers, self.placement.num_slots, self.placement.num_workers,
                                   num_experts=self.placement.num_experts)
        tokenizer = Tokenizer(model_dir) if os.path.isfile(os.path.join(model_dir, "tokenizer.json")) else None
        self.experts = RemoteExperts(self.placement, config.top_k, engine_config.capacity, self.telemetry)
        self.micro_batch_min_seqs = engine_config.micro_batch_min_seqs
        self.engine = LLMEngine.from_pretrained(
            model_dir, engine_config, experts=self.experts, detokenize=tokenizer.decode if tokenizer else None,
            text_holds=tokenizer.byte_fallback_ids if tokenizer else frozenset(),
        )
        self.device = self.engine.device
        self.experts.device = self.device
        self.experts.set_placement(self.placement)  # index tables on the engine's device
        # Every JIT now, before join() can be called: the group's first step must not wait for it.
        self.warm_up = self._warm_up()
        self._lock = threading.Lock()  # guards the engine: steps, adds, aborts, scoring
        self._wake = threading.Condition()  # guards the inbox below; wakes the idle step thread
        self._incoming: list[tuple[str, list[int], SamplingParams, list[int]]] = []  # (.., resumed tokens)
        self._aborts: list[str] = []
        # request id -> (where its deltas go, whether that is a subscriber's per-step batch queue)
        self._queues: dict[str, tuple[queue.Queue, bool]] = {}
        self._subscribers: dict[str, queue.Queue] = {}
        self._channel: DeltaChannelServer | None = None  # started by the first delta_channel() call
        self._score_jobs: list[ScoreJob] = []
        self._scored_last = False  # the last group step ran a scoring forward (they alternate with steps)
        self._stopped = False
        self._thread: threading.Thread | None = None
        self.supervisor: Any = None  # the controller: rebuilds the group when a peer fails
        self.comm_generation = 0
        self.recoveries = 0
        # The last few step failures, oldest first (info()'s last_failure is the newest): a recovery's
        # own retry can fail again (a replacement peer still warming up), and the failure that
        # started it must not be lost under the later one.
        self.recent_failures: deque[dict[str, Any]] = deque(maxlen=RECENT_FAILURES)
        self.idle_rounds = 0
        # Every turn of the step loop counts here, where the controller's rank watch reads it
        # without this process's GIL (actors/progress_slot.py): a router whose calls go
        # unanswered while it steps (an overloaded machine) is busy, not wedged.
        self.progress = ProgressSlot()
        self.generated_tokens = 0  # tokens this router sampled since start (aborted requests' too)
        # The controller's migration mark (mark_migration) and the last one this router's idle
        # ticks carried: a new one is sent in an idle tick the routers agree on (_step_loop).
        self.migration_mark = self._mark_sent = 0
        # A group formed beside the one in service (prepare_switch), switched to after the next
        # idle tick the routers agree on (a re-include's make-before-break; actors/recovery.py).
        self._pending: PendingGroup | None = None
        self.huge_pages = huge_pages.report(f"router {self.router_id}")  # its dense layers (kernels/huge_pages.py)
        self.frozen_objects = freeze_loaded_heap()  # last: what loading built lives as long as this actor

    def _warm_up(self) -> dict[str, Any]:
        """Run once what compiles or loads kernels on first use, outside any group: the
        attention backend's plan and run for a prompt, a chunk after cached context and a
        decode batch (FlashInfer JIT-compiles its modules there), the native CPU kernels'
        build (float32 on the CPU), and on CUDA a matmul in the model's dtype (cuBLAS creates
        its handle and workspace on the first one). Returns what ran (``info()["warm_up"]``)."""
        started = time.perf_counter()
        engine, device = self.engine, self.device
        report: dict[str, Any] = {"attention": warm_up_attention(engine.model.attention, engine.cache.layer(0),
                                                                 engine.blocks.block_size, engine.dtype, device)}
        if device.type == "cpu" and engine.dtype == torch.float32:
            reason = native_cpu.unavailable_reason()  # builds and loads the library on its first call
            report["native_cpu"] = "loaded" if reason is None else f"unavailable: {reason}"
        if device.type == "cuda":
            probe = torch.randn(16, 64, device=device).to(engine.dtype)
            (probe @ probe.T).sum().item()  # cuBLAS handle and workspace; one sync, at start-up
            report["cublas"] = "initialised"
        report["seconds"] = time.perf_counter() - started
        return report

    # ---- the deployment's expert-parallel group ---------------------------------------
    def rendezvous(self) -> Any:
        """A fresh rendezvous for the group; made on the router that will be its rank 0."""
        host = ray.util.get_node_ip_address()
        return new_rendezvous(self.backend, host=host, group_name="raymoe-ep")

    def join(self, rendezvous: Any, generation: int = 0, participants: list[int] | None = None,
             rank: int | None = None, num_routers: int | None = None) -> None:
        """Join the group with ``participants`` (worker indices, in rank order after the routers;
        default all) as router rank ``rank`` of ``num_routers`` (default: ``router_index`` of all
        of them; recovery leaves a lost router out until it is back). Blocks until every rank
        joined (warm-up barrier)."""
        members = tuple(range(len(self.workers))) if participants is None else tuple(participants)
        rank = self.router_index if rank is None else rank
        num_routers = self.num_routers if num_routers is None else num_routers
        exchange = self._connect(rendezvous, GroupLayout(num_routers, members), rank,
                                 self.experts.placement)  # the placement in service
        self._drop_pending()  # a group built instead of the one prepared beside the old
        with self._lock:
            self.experts.exchange = exchange
            self.group_routers = num_routers
            self.comm_generation = generation
            self.idle_rounds = 0
        with self._wake:
            self._wake.notify_all()
        if self._thread is None:
            self._thread = threading.Thread(target=self._step_loop, name=f"{self.router_id}-steps", daemon=True)
            self._thread.start()

    def _connect(self, rendezvous: Any, layout: GroupLayout, rank: int, placement: PlacementTable) -> RouterExchange:
        """Join a group as router ``rank`` of ``layout`` (blocks until every rank joined): this
        router's side of it, sized for ``placement``."""
        comm = make_communicator(self.backend, rendezvous, rank=rank, world_size=layout.world_size,
                                 timeout_s=self.timeout_s, device=self.device if self.device.type == "cuda" else None,
                                 bind_host=ray.util.get_node_ip_address())
        return router_exchange(comm, layout, rank, placement.num_workers, placement.slots_per_worker,
                               self.config.top_k, self.config.hidden_size, self.engine.dtype, self.device)

    def abort_comm(self) -> None:
        self._drop_pending()
        exchange, self.experts.exchange = self.experts.exchange, None
        if exchange is not None:
            exchange.comm.abort()

    # ---- make-before-break: a new group formed beside the one in service -----------------
    def prepare_switch(self, rendezvous: Any, generation: int, participants: list[int], rank: int,
                       num_routers: int, placement: dict[str, Any]) -> None:
        """Join a new group (``join``'s arguments) beside the one in service, to serve it with
        ``placement``: the step loop goes on over the old group meanwhile and switches, placement
        and group together at one step boundary, right after the next idle tick that every router
        sends in the same round (the controller's ``mark_migration`` starts one; it gives the
        mark only once every router and worker has prepared). Blocks until every rank of the new
        group joined. CPU transports only: on NCCL a communicator made beside live collectives
        can deadlock (the controller rebuilds NCCL groups with every rank stopped)."""
        if self.backend is CommBackend.NCCL:
            raise RuntimeError("a new NCCL group is never formed beside a live one; the controller stops every rank")
        table = PlacementTable.from_dict(placement)
        pending = PendingGroup(self._connect(rendezvous, GroupLayout(num_routers, tuple(participants)), rank, table),
                               table, generation, num_routers)
        with self._wake:
            old, self._pending = self._pending, pending
        if old is not None:
            old.exchange.comm.abort()

    def wait_switched(self, generation: int, timeout_s: float) -> bool:
        """Whether the step loop switched to the group of ``generation`` (prepared with
        ``prepare_switch``) within ``timeout_s``; False also when it was dropped meanwhile."""
        pending = self._pending
        if pending is None or pending.generation != generation:
            return self.comm_generation == generation and self.experts.exchange is not None
        return pending.switched.wait(timeout_s)

    def _drop_pending(self) -> None:
        with self._wake:
            pending, self._pending = self._pending, None
        if pending is not None and not pending.switched.is_set():
            pending.exchange.comm.abort()

    def _switch_to_pending(self, old: RouterExchange) -> bool:
        """(Step loop, right after an agreed idle tick.) Serve the prepared group, with its
        placement, from the next round on; the old group's communicator is closed. Whether
        there was one to switch to."""
        with self._wake:
            pending = self._pending
        if pending is None:
            return False
        with self._lock:
            if self._pending is not pending or self.experts.exchange is not old:  # dropped or stopped meanwhile
                return False
            table = pending.table
            if table.num_slots != self.experts.placement.num_slots:
                self.telemetry.resize(table.num_slots, table.num_workers)
            self.experts.set_placement(table)
            self.experts.exchange = pending.exchange
            self.group_routers = pending.num_routers
            self.comm_generation = pending.generation
            self.idle_rounds = 0
        with self._wake:
            if self._pending is pending:
                self._pending = None
        pending.switched.set()
        old.comm.close()
        return True

    def set_supervisor(self, supervisor: Any) -> None:
        self.supervisor = supervisor

    # ---- the step loop ----------------------------------------------------------------
    def _has_work(self) -> bool:
        return bool(self._score_jobs) or self.engine.has_unfinished()

    def _pending_work(self) -> bool:
        return bool(self._incoming) or bool(self._aborts) or self._has_work()

    def _drain_inbox(self) -> None:
        """Requests and aborts that arrived since the last step enter the engine here, on the
        step thread (engine lock held): callers never wait for a step to finish."""
        with self._wake:
            incoming, self._incoming = self._incoming, []
            aborts, self._aborts = self._aborts, []
        for request_id, prompt_ids, params, resume_ids in incoming:
            try:
                self.engine.add_request(request_id, prompt_ids, params, resume_output_ids=resume_ids)
            except Exception as error:  # validated at submit; e.g. a duplicate id: it alone fails
                self._deliver([StepFailure(request_id, f"{type(error).__name__}: {error}",
                                           public="the router refused this request", status=500)])
        for request_id in aborts:
            self.engine.abort_request(request_id)

    def _step_loop(self) -> None:
        """One group step per turn, in lockstep with every other router of the deployment.

        Routers first agree whether anyone has work (one flag each, routers only). A router
        without work agrees at once after a group step (see :func:`idle_wait_s`); once nobody
        has had work, each waits a little (longer the longer it stays idle, at once when work arrives),
        and every ``TICK_ROUNDS`` idle rounds they tell the workers so (an idle tick), which
        keeps the workers' deadline for the next step from expiring in a quiet deployment.
        """
        self.pinned_core = pin_current_thread(self.pin_core)
        while True:
            self.progress.tick()
            with self._wake:
                if self._stopped:
                    return
                if self.experts.exchange is None:
                    self._wake.wait(NOT_JOINED_WAIT_S)
                    continue
                wait_s = None if self._pending_work() or self.migration_mark != self._mark_sent \
                    else idle_wait_s(self.group_routers, self.idle_rounds)
                if wait_s is not None:
                    self._wake.wait(wait_s)
                    if self._stopped:
                        return
            with self._lock:
                self._drain_inbox()
            exchange, has_work = self.experts.exchange, self._has_work()
            if exchange is None:
                continue
            step_started = time.monotonic()
            failure, outputs = None, []
            mark = self.migration_mark
            try:
                # A new migration mark goes out first, in an idle tick every router sends in the
                # same round (the agreement says whether any router has one): the workers run the
                # copy queued under it right after that tick (actors/expert_worker.py).
                step, tick, split = exchange.agree_round(has_work, mark != self._mark_sent,
                                                         split=self._wants_micro_batches())
                if tick:
                    exchange.idle_tick(mark)
                    self._mark_sent = mark
                    if self._pending is not None and self._switch_to_pending(exchange):
                        continue  # every router switched after this tick; the workers too (its mark)
                if not step:
                    self.idle_rounds += 1
                    if not tick and (self.group_routers == 1 or self.idle_rounds % TICK_ROUNDS == 0):
                        exchange.idle_tick(mark)
                    continue
                self.idle_rounds = 0
                with self._lock:
                    outputs = self._group_step(has_work, 2 if split else 1)
            except Exception as error:
                if not isinstance(error, RECOVERABLE) and self.experts.exchange is exchange:
                    with self._lock:  # not the group's failure: every request in flight hears why
                        self._fail_all(f"{type(error).__name__}: {error}")
                    continue
                # A peer died or froze, or the group was taken down under this step (a resize or
                # a recovery aborts it from another thread; whatever that raised follows from it):
                # recover outside the lock, then the step runs again.
                failure = error
                self.recent_failures.append({"error": f"{type(error).__name__}: {error}",
                                             "after_s": time.monotonic() - step_started, "time": time.time()})
            if failure is not None:
                self._recover(failure, exchange)
            if outputs:
                self.generated_tokens += sum(len(output.new_token_ids) for output in outputs)
                self._deliver([self._delta(output) for output in outputs])

    def _wants_micro_batches(self) -> bool:
        """Whether this router asks for the next step in two ping-ponged micro-batches: it holds at
        least ``engine.micro_batch_min_seqs`` running sequences (0: never). Any router asking
        splits the step for all (each runs its own batch in halves, or one half and an empty one)."""
        least = self.micro_batch_min_seqs
        return least > 0 and len(self.engine.scheduler.running) >= least

    def set_micro_batch_min_seqs(self, least: int) -> None:
        """Change ``engine.micro_batch_min_seqs`` while serving (from the next step; 0: never):
        benchmarks/bench_micro_batches.py compares on and off in one deployment."""
        if least < 0:
            raise ValueError(f"micro_batch_min_seqs must be >= 0, not {least}")
        self.micro_batch_min_seqs = least

    def _group_step(self, has_work: bool, micro_batches: int = 1) -> list[RequestOutput]:
        """This router's share of one group step (engine lock held): one forward of the oldest
        scoring job (at most the token budget: engine.PromptScoring), an engine step, or nothing;
        then zero rows for the MoE layers it did not reach. While requests are in flight,
        scoring forwards and engine steps take turns. ``micro_batches``: as the routers agreed."""
        self.experts.begin_step(micro_batches)
        outputs: list[RequestOutput] = []
        error: Exception | None = None
        job = None
        if self._score_jobs and (not self._scored_last or not self.engine.has_unfinished()):
            job = self._score_jobs[0]
        finished = False
        try:
            if job is not None:
                if job.scoring is None:
                    job.scoring = self.engine.start_scoring(job.prompts, job.num_top)
                if not job.scoring.done:  # (no prompts: done at once)
                    job.scoring.step()
                if job.scoring.done:
                    job.scoring.close()
                    job.result = (job.scoring.logits() if job.num_top is None
                                  else job.scoring.prompt_logprobs())
                    finished = True
            elif has_work:
                outputs = self.engine.step()
        except RECOVERABLE:
            raise  # a scoring job keeps its place and its state: its forward runs again after recovery
        except Exception as caught:  # fails the requests, but the group must still see this step
            error = caught
            if job is not None:
                job.error, finished = caught, True
                if job.scoring is not None:
                    job.scoring.close()
        self._scored_last = job is not None
        self.experts.complete_step()
        if finished:
            self._score_jobs.remove(job)
            job.done.set()
        if error is not None and job is None:
            raise error
        return outputs

    def _recover(self, failure: BaseException, exchange: RouterExchange) -> None:
        """The failed step's sequences keep their state; once the supervisor has rebuilt the
        group (restarting dead workers), the loop simply runs the step again.

        Only ``exchange``, the one that failed, is aborted: the supervisor may already have
        joined this router to a new group (it aborts routers itself when it rebuilds), and
        aborting that one would break the new group for every peer. Then there is nothing to
        ask for either: the next step runs on the new group."""
        with self._lock:  # join() installs a new exchange under this lock
            newer = self.experts.exchange is not None and self.experts.exchange is not exchange
            if self.experts.exchange is exchange:
                self.experts.exchange = None
            generation = self.comm_generation
        exchange.comm.abort()
        if newer:
            return
        for attempt in range(1, RECOVERY_ATTEMPTS + 1):
            try:
                if self.supervisor is None:
                    raise RuntimeError("no supervisor to recover with")
                ray.get(self.supervisor.recover.remote(generation), timeout=RECOVERY_TIMEOUT_S)
                self.recoveries += 1
                return
            except Exception as error:
                # A recovery that failed part-way (a survivor lost in the middle of it) is asked
                # for again: it starts over from who answers now. Not a step that fails the same
                # way after every rebuild, nor one that ran out of time: those fail what is in flight.
                final = (attempt == RECOVERY_ATTEMPTS or _is_error(error, "RepeatedStepFailure")
                         or isinstance(error, ray.exceptions.GetTimeoutError))
                if not final:
                    time.sleep(RECOVERY_RETRY_PAUSE_S)
                    if self.experts.exchange is not None:  # joined to a new group meanwhile
                        return
                    continue
                with self._lock:
                    self._fail_all(f"{type(failure).__name__}: {failure}; recovery failed ({attempt} "
                                   f"attempt{'s' if attempt > 1 else ''}): {type(error).__name__}: {error}")
                return

    @staticmethod
    def _delta(output: RequestOutput) -> TokenDelta | StepFailure:
        if output.error is not None:  # this sequence alone failed; its batch went on
            return StepFailure(output.request_id, output.error, public=output.error, status=500)
        return TokenDelta(
            output.request_id, output.new_token_ids, output.new_logprobs,
            output.output_top_logprobs[-len(output.new_token_ids):], output.finished,
            output.finish_reason, output.stop_text_index, output.num_prompt_tokens,
        )

    def _deliver(self, items: list[TokenDelta | StepFailure]) -> None:
        """Hand one step's items to their requests: a per-request queue gets each item, a
        subscriber gets all of its requests' items of the step as one batch."""
        batches: dict[int, tuple[queue.Queue, list]] = {}
        for item in items:
            entry = self._queues.get(item.request_id)
            if entry is None:
                continue
            target, batched = entry
            if not batched:
                target.put(item)
                continue
            batches.setdefault(id(target), (target, []))[1].append(item)
            if isinstance(item, StepFailure) or item.finished:
                self._queues.pop(item.request_id, None)
        for target, batch in batches.values():
            target.put(batch)

    def _fail_all(self, message: str) -> None:
        for request_id in list(self._queues):
            self.engine.abort_request(request_id)
        self._deliver([StepFailure(request_id, message) for request_id in list(self._queues)])

    # ---- requests ---------------------------------------------------------------------
    def generate(self, requests: list[tuple[str, list[int], SamplingParams]]) -> list[RequestOutput | StepFailure]:
        """Run ``requests`` to completion (batched with everything else in flight)."""
        targets = [self._submit(*request) for request in requests]
        finals: list[RequestOutput | StepFailure] = []
        for (request_id, prompt_ids, params), target in zip(requests, targets):
            tokens, logprobs, tops = [], [], []
            while True:
                item = target.get()
                if isinstance(item, StepFailure):
                    finals.append(item)
                    break
                tokens += item.token_ids
                logprobs += item.logprobs
                tops += item.top_logprobs
                if item.finished:
                    finals.append(RequestOutput(
                        request_id, item.token_ids, item.logprobs, True, item.finish_reason,
                        item.num_prompt_tokens, tokens, logprobs, tops, item.stop_text_index,
                    ))
                    break
            self._forget(request_id)
        return finals

    def abort(self, request_id: str) -> None:
        """Stop ``request_id`` at the next step boundary (its blocks freed); returns at once."""
        self._forget(request_id)
        with self._wake:
            self._aborts.append(request_id)
            self._wake.notify()

    def _submit(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                target: queue.Queue | None = None, resume_ids: list[int] | None = None) -> queue.Queue:
        batched = target is not None
        target = queue.Queue() if target is None else target
        self.engine.validate_prompt(prompt_ids, params)  # a bad request is refused to its caller
        if params.structured is not None and self.engine.grammar is not None:
            # Compile its grammar here, on the caller's thread (cached): compiling against a large
            # vocabulary takes long enough to stall every sequence if the step thread did it.
            self.engine.grammar.compile(params.structured)
        with self._wake:
            self._queues[request_id] = (target, batched)
            self._incoming.append((request_id, prompt_ids, params, list(resume_ids or ())))
            self._wake.notify()
        return target

    # ---- subscribers: one stream per caller (an ingress replica), one item per step ----
    def submit(self, subscriber: str, request_id: str, prompt_ids: list[int], params: SamplingParams,
               resume_ids: list[int] | None = None) -> None:
        """Add a request whose deltas go to ``subscriber``'s stream (see :meth:`subscribe`).
        ``resume_ids``: the tokens it already produced on a router that was lost (stream
        migration): it continues after them, and only later tokens come back."""
        self._submit(request_id, prompt_ids, params, self._subscriber_queue(subscriber), resume_ids)

    def subscribe(self, subscriber: str) -> Iterator[list[TokenDelta | StepFailure]]:
        """Every delta of ``subscriber``'s requests, one list per step (all of them at once
        when the caller fell behind): one streamed item per step, however many requests."""
        target = self._subscriber_queue(subscriber)
        try:
            while not self._stopped:
                try:
                    batch = target.get(timeout=IDLE_SUBSCRIBER_WAIT_S)
                except queue.Empty:
                    continue
                while True:
                    try:
                        batch += target.get_nowait()
                    except queue.Empty:
                        break
                yield batch
        finally:  # the subscriber is gone (its ingress replica died): nobody reads these requests
            self._abort_queue(target)

    def delta_channel(self) -> ChannelAddress:
        """Where a subscriber connects for its deltas over a socket instead of :meth:`subscribe`
        (actors/delta_channel.py: one frame a step, without Ray's cost per streamed item)."""
        with self._wake:
            if self._channel is None:
                self._channel = DeltaChannelServer(
                    ray.util.get_node_ip_address(), self._attach_channel, self._detach_channel, lambda: self._stopped,
                    self._channel_submit, self.abort,
                    slow=lambda params: params.structured is not None and self.engine.grammar is not None,
                    prepare=lambda params: self.engine.grammar.compile(params.structured))  # cached for _submit
            return self._channel.address

    def _attach_channel(self, subscriber: str) -> queue.Queue:
        # A fresh queue: a writer of an earlier connection of this subscriber (broken, its requests
        # already moved by the ingress) keeps the old one and can take nothing meant for this one.
        with self._wake:
            target = self._subscribers[subscriber] = queue.Queue()
            return target

    def _detach_channel(self, subscriber: str, target: queue.Queue) -> None:
        self._abort_queue(target)
        with self._wake:
            if self._subscribers.get(subscriber) is target:
                del self._subscribers[subscriber]

    def _channel_submit(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                        resume_ids: list[int] | None, target: queue.Queue) -> None:
        """:meth:`submit` for a request that came over the delta channel: a refusal goes back
        as its first item (status 400), like the ValueError a Ray call would raise."""
        try:
            self._submit(request_id, prompt_ids, params, target, resume_ids)
        except ValueError as error:  # validate_prompt: e.g. its KV never fits
            target.put([StepFailure(request_id, str(error), public=str(getattr(error, "cause", error)), status=400)])
        except Exception as error:  # noqa: BLE001 (the caller must hear of it; nothing else would tell it)
            target.put([StepFailure(request_id, f"submitting it failed: {type(error).__name__}: {error}",
                                    public="the server could not start this request; retry", status=500)])

    def _abort_queue(self, target: queue.Queue) -> None:
        """Abort every request whose deltas go to ``target`` (its reader is gone)."""
        if not self._stopped:
            for request_id, (queue_, _) in list(self._queues.items()):
                if queue_ is target:
                    self.abort(request_id)

    def _subscriber_queue(self, subscriber: str) -> queue.Queue:
        with self._wake:  # not the engine lock: a submit must not wait for a step to end
            return self._subscribers.setdefault(subscriber, queue.Queue())

    def _forget(self, request_id: str) -> None:
        self._queues.pop(request_id, None)

    def score(self, prompts: list[list[int]], num_top: int | None = None) -> list[torch.Tensor] | list[PromptLogprobs]:
        """Logits at every prompt position (``num_top=None``; tests, debugging), else each
        prompt's logprobs (:meth:`score_prompts`): computed over the group's steps, one forward
        of at most the token budget per step."""
        job = ScoreJob(prompts, num_top)
        with self._wake:
            self._score_jobs.append(job)
            self._wake.notify()
        if not job.done.wait(RECOVERY_TIMEOUT_S):
            raise TimeoutError(f"scoring did not finish within {RECOVERY_TIMEOUT_S:.0f} s")
        if job.error is not None:
            raise job.error
        return job.result

    def score_prompts(self, prompts: list[list[int]], num_top: int) -> list[PromptLogprobs]:
        """Each prompt's token logprobs with ``num_top`` alternatives per position (echo,
        prompt_logprobs): reduced here as each forward's logits are computed (never a prompt's
        ``[L, V]``), so ``L * (num_top + 1)`` numbers travel, not ``L * V``."""
        return self.score(prompts, num_top)

    def num_unfinished(self) -> int:
        return len(self._queues)

    def get_telemetry(self) -> dict[str, Any]:
        scheduler = self.engine.scheduler
        prefix = self.engine.prefix_cache_stats()
        blocks = self.engine.blocks
        return dict(self.telemetry.snapshot(), **self.requests_held(), generated_tokens=self.generated_tokens,
                    prefix_cache_queries=prefix.num_queried_tokens, prefix_cache_hits=prefix.num_hit_tokens,
                    kv_cache_capacity_tokens=self.engine.kv_cache_capacity_tokens,
                    kv_cache_usage=1.0 - blocks.num_free_blocks / blocks.num_blocks,
                    num_preemptions=scheduler.num_preemptions)

    def requests_held(self) -> dict[str, Any]:
        """The running and waiting sequences and the queue-time histogram: the part of
        ``get_telemetry`` the autoscaler reads every interval, without its step ring's copy."""
        scheduler = self.engine.scheduler
        return {"requests_running": len(scheduler.running), "requests_waiting": len(scheduler.waiting),
                "queue_time": scheduler.queue_times.snapshot()}

    def expert_loads_since(self, cursor: int) -> tuple[int, Any]:
        return self.telemetry.expert_loads_since(cursor)

    def set_placement(self, placement: dict[str, Any]) -> int:
        """Switch to a new placement at the next step boundary; returns once switched."""
        table = PlacementTable.from_dict(placement)
        with self._lock:  # the step loop holds it for a whole step
            if table.num_slots != self.experts.placement.num_slots:  # a resize: more or fewer workers
                self.telemetry.resize(table.num_slots, table.num_workers)
            self.experts.set_placement(table)
        return table.epoch

    def mark_migration(self, mark: int) -> None:
        """Carry migration ``mark`` in this router's idle ticks from now on, the first one sent
        at once (actors/expert_worker.py: a copy queued under a mark runs on every worker right
        after the first tick that carries it; the controller marks only once every worker queued it)."""
        with self._wake:
            self.migration_mark = mark
            self._wake.notify_all()

    def placement_epoch(self) -> int:
        return self.experts.placement.epoch

    def info(self) -> dict[str, Any]:
        return {"router": self.router_id, "pid": os.getpid(), "node_id": ray.get_runtime_context().get_node_id(),
                "threads": threading.active_count(), "compute_threads": torch.get_num_threads(),
                "pinned_core": self.pinned_core, "allocator": allocator_in_use(),
                "niceness": os.nice(0),
                "recoveries": self.recoveries, "comm_generation": self.comm_generation,
                "last_failure": self.recent_failures[-1] if self.recent_failures else None,
                "recent_failures": list(self.recent_failures),
                "warm_up": self.warm_up,
                "generated_tokens": self.generated_tokens, "micro_batched_steps": self.experts.micro_batched_steps,
                "ping_pong_steps": self.experts.ping_pongs, "frozen_objects": self.frozen_objects,
                "huge_pages": self.huge_pages,  # resident weights and of them on 2 MiB pages, after loading
                "delta_channels": self._channel.connections if self._channel else 0}

    def shutdown(self) -> None:
        with self._wake:
            self._stopped = True
            self._wake.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=10)
        if self._channel is not None:
            self._channel.close()
        self.progress.close()
        exchange, self.experts.exchange = self.experts.exchange, None
        if exchange is not None:
            exchange.comm.close()
