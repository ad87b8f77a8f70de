"""The router actor: owns its requests, the dense weights, the KV cache and the gate.

It runs the in-process engine's loop with :class:`~raymoe.engine.remote_experts.RemoteExperts`
as the expert backend: at each step it asks every expert worker to serve the step, then walks
the layers, dispatching and combining over its communicator group (rank 0 = this router).
Operators find it as ``Router`` in ``ray list actors``.
"""

from __future__ import annotations

import os
import threading
from typing import Any

import ray
import torch

from raymoe.engine.engine import EngineConfig, LLMEngine, RequestOutput
from raymoe.engine.remote_experts import RemoteExperts
from raymoe.engine.sampling_params import SamplingParams
from raymoe.engine.telemetry import Telemetry
from raymoe.engine.tokenizer import Tokenizer
from raymoe.kernels.comm import CommBackend, make_communicator, new_rendezvous
from raymoe.moe.model_config import load_model_config
from raymoe.moe.placement import PlacementTable

# A worker that answers late still has to be waited for at the end of a step, but never longer
# than the collectives' own deadline plus this slack.
STEP_WAIT_SLACK_S = 5.0


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
        self.telemetry = Telemetry(self.placement.num_layers, self.placement.num_slots, self.placement.num_workers)
        self.experts = RemoteExperts(
            self.placement, config.top_k, engine_config.capacity, self._start_step, self._finish_step, self.telemetry
        )
        tokenizer = Tokenizer(model_dir) if os.path.isfile(os.path.join(model_dir, "tokenizer.json")) else None
        self.engine = LLMEngine.from_pretrained(
            model_dir, engine_config, experts=self.experts, detokenize=tokenizer.decode if tokenizer else None
        )
        self._pending: list[Any] = []
        self._lock = threading.Lock()

    # ---- communicator group ---------------------------------------------------------
    def rendezvous(self) -> Any:
        """A fresh rendezvous for this router's group; made here because rank 0 runs here."""
        host = ray.util.get_node_ip_address()
        return new_rendezvous(self.backend, host=host, group_name=f"raymoe-{self.router_id}")

    def join(self, rendezvous: Any) -> None:
        device = torch.device("cuda", 0) if self.backend is CommBackend.NCCL else None
        self.experts.comm = make_communicator(
            self.backend, rendezvous, rank=0, world_size=1 + len(self.workers), timeout_s=self.timeout_s, device=device
        )

    def _start_step(self) -> None:
        self._pending = [worker.serve_step.remote(self.router_id) for worker in self.workers]

    def _finish_step(self) -> list[dict[str, Any]]:
        pending, self._pending = self._pending, []
        return ray.get(pending, timeout=self.timeout_s + STEP_WAIT_SLACK_S)

    # ---- requests ---------------------------------------------------------------------
    def generate(self, requests: list[tuple[str, list[int], SamplingParams]]) -> list[RequestOutput]:
        """Run ``requests`` to completion (continuous batching among them); outputs in order."""
        with self._lock:
            for request_id, prompt_ids, params in requests:
                self.engine.add_request(request_id, prompt_ids, params)
            finals: dict[str, RequestOutput] = {}
            while len(finals) < len(requests):
                for output in self.engine.step():
                    if output.finished:
                        finals[output.request_id] = output
            return [finals[request_id] for request_id, _, _ in requests]

    def score(self, prompts: list[list[int]]) -> list[torch.Tensor]:
        with self._lock:
            return self.engine.score(prompts)

    def get_telemetry(self) -> dict[str, Any]:
        return self.telemetry.snapshot()

    def info(self) -> dict[str, Any]:
        return {"router": self.router_id, "pid": os.getpid(), "node_id": ray.get_runtime_context().get_node_id()}

    def shutdown(self) -> None:
        if self.experts.comm is not None:
            self.experts.comm.close()
