"""The router actor: owns its requests, the dense weights, the KV cache and the gate.

It runs the in-process engine's loop on a background thread with
:class:`~raymoe.engine.remote_experts.RemoteExperts` as the expert backend: every step asks
each expert worker to serve that step, then walks the layers, dispatching and combining over
the router's communicator group (rank 0 = this router). Requests arrive through actor calls
and their tokens stream back as they are sampled. Operators find it as ``Router`` in
``ray list actors``.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, Iterator

import ray
import torch

from raymoe.engine.engine import EngineConfig, LLMEngine, RequestOutput
from raymoe.engine.remote_experts import RemoteExperts
from raymoe.engine.sampling_params import SamplingParams
from raymoe.engine.telemetry import Telemetry
from raymoe.engine.tokenizer import Tokenizer
from raymoe.kernels.comm import CommBackend, CommError, make_communicator, new_rendezvous
from raymoe.moe.model_config import load_model_config
from raymoe.moe.placement import PlacementTable

# A worker that answers late still has to be waited for at the end of a step, but never longer
# than the collectives' own deadline plus this slack.
STEP_WAIT_SLACK_S = 5.0
RECOVERY_TIMEOUT_S = 600.0
# Failures a rebuilt communicator group fixes: a peer that died, froze or broke the group.
RECOVERABLE = (CommError, ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError,
               ray.exceptions.ActorUnavailableError)
IDLE_WAIT_S = 0.5  # the step thread re-checks for shutdown this often when idle


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


@dataclass(frozen=True)
class StepFailure:
    """The step that carried the request failed; the caller gets this instead of tokens."""

    request_id: str
    message: str


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
    ):
        self.router_id = router_id
        self.workers = workers
        self.backend = CommBackend(backend).resolve()
        self.timeout_s = timeout_s
        self.placement = PlacementTable.from_dict(placement)
        config = load_model_config(model_dir)
        self.telemetry = Telemetry(self.placement.num_layers, self.placement.num_slots, self.placement.num_workers,
                                   num_experts=self.placement.num_experts)
        self.experts = RemoteExperts(
            self.placement, config.top_k, engine_config.capacity, self._start_step, self._finish_step, self.telemetry
        )
        tokenizer = Tokenizer(model_dir) if os.path.isfile(os.path.join(model_dir, "tokenizer.json")) else None
        self.engine = LLMEngine.from_pretrained(
            model_dir, engine_config, experts=self.experts, detokenize=tokenizer.decode if tokenizer else None
        )
        self._pending: list[Any] = []
        self._lock = threading.Lock()  # guards the engine: steps, adds, aborts, scoring
        self._work = threading.Condition(self._lock)
        self._queues: dict[str, queue.Queue] = {}
        self._stopped = False
        self._thread: threading.Thread | None = None
        self.supervisor: Any = None  # the controller: rebuilds groups when a peer fails
        self.comm_generation = 0
        self.recoveries = 0
        self.last_failure: dict[str, Any] | None = None

    # ---- communicator group ---------------------------------------------------------
    def rendezvous(self) -> Any:
        """A fresh rendezvous for this router's group; made here because rank 0 runs here."""
        host = ray.util.get_node_ip_address()
        return new_rendezvous(self.backend, host=host, group_name=f"raymoe-{self.router_id}")

    def join(self, rendezvous: Any, generation: int = 0, participants: list[int] | None = None) -> None:
        """Join a group as rank 0 with ``participants`` (worker indices, rank order; default all)."""
        device = torch.device("cuda", 0) if self.backend is CommBackend.NCCL else None
        members = list(range(len(self.workers))) if participants is None else list(participants)
        self.experts.comm = make_communicator(
            self.backend, rendezvous, rank=0, world_size=1 + len(members), timeout_s=self.timeout_s, device=device
        )
        self.experts.participants = members
        self.comm_generation = generation
        if self._thread is None:
            self._thread = threading.Thread(target=self._step_loop, name=f"{self.router_id}-steps", daemon=True)
            self._thread.start()

    def abort_comm(self) -> None:
        if self.experts.comm is not None:
            self.experts.comm.abort()
            self.experts.comm = None

    def set_supervisor(self, supervisor: Any) -> None:
        self.supervisor = supervisor

    def _start_step(self, epoch: int) -> None:
        members = self.experts.participants
        members = range(len(self.workers)) if members is None else members
        self._pending = [self.workers[w].serve_step.remote(self.router_id, epoch) for w in members]

    def _finish_step(self) -> list[dict[str, Any]]:
        pending, self._pending = self._pending, []
        return ray.get(pending, timeout=self.timeout_s + STEP_WAIT_SLACK_S)

    # ---- the step loop ----------------------------------------------------------------
    def _step_loop(self) -> None:
        while True:
            failure = None
            with self._work:
                while not self._stopped and not self.engine.has_unfinished():
                    self._work.wait(IDLE_WAIT_S)
                if self._stopped:
                    return
                step_started = time.monotonic()
                try:
                    outputs = self.engine.step()
                except RECOVERABLE as error:  # a peer died or froze: recover outside the lock
                    failure, outputs = error, []
                    self.last_failure = {"error": f"{type(error).__name__}: {error}",
                                         "after_s": time.monotonic() - step_started, "time": time.time()}
                except Exception as error:  # anything else: every request in flight hears why
                    self._fail_all(f"{type(error).__name__}: {error}")
                    continue
            if failure is not None:
                self._recover(failure)
            for output in outputs:
                self._deliver(output)

    def _recover(self, failure: BaseException) -> None:
        """The failed step's sequences keep their state; once the supervisor has rebuilt the
        groups (restarting dead workers), the loop simply runs the step again."""
        self._pending = []
        try:
            if self.supervisor is None:
                raise RuntimeError("no supervisor to recover with")
            ray.get(self.supervisor.recover.remote(self.comm_generation), timeout=RECOVERY_TIMEOUT_S)
            self.recoveries += 1
        except Exception as error:  # recovery itself failed: give up on what is in flight
            with self._work:
                self._fail_all(f"{type(failure).__name__}: {failure}; recovery failed: {type(error).__name__}: {error}")

    def _deliver(self, output: RequestOutput) -> None:
        target = self._queues.get(output.request_id)
        if target is None:
            return
        target.put(TokenDelta(
            output.request_id, output.new_token_ids, output.new_logprobs,
            output.output_top_logprobs[-len(output.new_token_ids):], output.finished,
            output.finish_reason, output.stop_text_index, output.num_prompt_tokens,
        ))

    def _fail_all(self, message: str) -> None:
        for request_id in list(self._queues):
            self.engine.abort_request(request_id)
            self._queues[request_id].put(StepFailure(request_id, message))

    # ---- requests ---------------------------------------------------------------------
    def stream(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> Iterator[Any]:
        """Add a request and yield its :class:`TokenDelta` items as steps produce them."""
        target = self._submit(request_id, prompt_ids, params)
        try:
            while True:
                item = target.get()
                yield item
                if isinstance(item, StepFailure) or item.finished:
                    return
        finally:
            self._forget(request_id)

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
        with self._lock:
            self.engine.abort_request(request_id)
        self._forget(request_id)

    def _submit(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> queue.Queue:
        target: queue.Queue = queue.Queue()
        with self._work:
            self.engine.add_request(request_id, prompt_ids, params)
            self._queues[request_id] = target
            self._work.notify()
        return target

    def _forget(self, request_id: str) -> None:
        self._queues.pop(request_id, None)

    def score(self, prompts: list[list[int]]) -> list[torch.Tensor]:
        with self._lock:
            return self.engine.score(prompts)

    def num_unfinished(self) -> int:
        return len(self._queues)

    def get_telemetry(self) -> dict[str, Any]:
        return self.telemetry.snapshot()

    def expert_loads_since(self, cursor: int) -> tuple[int, Any]:
        return self.telemetry.expert_loads_since(cursor)

    def set_placement(self, placement: dict[str, Any]) -> int:
        """Switch to a new placement at the next step boundary; returns once switched."""
        table = PlacementTable.from_dict(placement)
        with self._lock:  # the step loop holds it for a whole step
            self.experts.set_placement(table)
        return table.epoch

    def placement_epoch(self) -> int:
        return self.experts.placement.epoch

    def info(self) -> dict[str, Any]:
        return {"router": self.router_id, "pid": os.getpid(), "node_id": ray.get_runtime_context().get_node_id(),
                "recoveries": self.recoveries, "comm_generation": self.comm_generation,
                "last_failure": self.last_failure}

    def shutdown(self) -> None:
        with self._work:
            self._stopped = True
            self._work.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=10)
        if self.experts.comm is not None:
            self.experts.comm.close()
