"""The expert worker actor: one expert-parallel rank (one GPU, or one CPU slot).

It holds the weights of its physical slots for every MoE layer, read straight from the
checkpoint (only its own experts), joins one communicator group per router, and serves a
router's step when asked: for every MoE layer, receive rows, run its slots, send sums back
(engine/ep_exchange.py). Operators find it as ``ExpertWorker`` in ``ray list actors``.
"""

from __future__ import annotations

import os
from typing import Any

import ray
import torch

from raymoe.engine.checkpoint import Checkpoint
from raymoe.engine.engine import resolve_dtype
from raymoe.engine.ep_exchange import worker_exchange
from raymoe.engine.weights import load_expert_stack
from raymoe.kernels.comm import CommBackend, make_communicator
from raymoe.kernels.comm.base import Communicator
from raymoe.moe.model_config import load_model_config
from raymoe.moe.placement import PlacementTable


class ExpertWorker:
    def __init__(self, worker: int, model_dir: str, dtype: str, device: str, placement: dict[str, Any]):
        self.worker = worker
        self.config = load_model_config(model_dir)
        self.device = torch.device("cuda", 0) if device == "cuda" else torch.device("cpu")
        self.dtype = resolve_dtype(dtype, self.config, self.device)
        self.placement = PlacementTable.from_dict(placement)
        checkpoint = Checkpoint(model_dir)
        self.w13: list[torch.Tensor] = []
        self.w2: list[torch.Tensor] = []
        for moe_layer, layer in enumerate(self.config.moe_layers):
            experts = self.placement.worker_experts(moe_layer, worker)
            w13, w2 = load_expert_stack(checkpoint, self.config, layer, experts, self.dtype, self.device)
            self.w13.append(w13)
            self.w2.append(w2)
        self.comms: dict[str, Communicator] = {}

    def info(self) -> dict[str, Any]:
        return {
            "worker": self.worker,
            "pid": os.getpid(),
            "node_id": ray.get_runtime_context().get_node_id(),
            "experts": [self.placement.worker_experts(layer, self.worker) for layer in range(self.placement.num_layers)],
        }

    def join(self, router_id: str, backend: str, rendezvous: Any, world_size: int, timeout_s: float) -> None:
        """Join ``router_id``'s group as rank ``1 + worker``; blocks until every rank joined."""
        self.comms[router_id] = make_communicator(
            CommBackend(backend), rendezvous, rank=1 + self.worker, world_size=world_size,
            timeout_s=timeout_s, device=self.device if self.device.type == "cuda" else None,
        )

    def serve_step(self, router_id: str) -> dict[str, list]:
        """Serve every MoE layer of one of ``router_id``'s steps, in order."""
        comm = self.comms[router_id]
        rows, assignments, compute_s = [], [], []
        with torch.inference_mode():
            for moe_layer in range(self.placement.num_layers):
                result = worker_exchange(
                    comm, self.w13[moe_layer], self.w2[moe_layer], self.config.hidden_size,
                    self.config.top_k, self.dtype, self.device, moe_layer,
                )
                rows.append(result.rows)
                assignments.append(result.assignments)
                compute_s.append(result.compute_s)
        return {"worker": self.worker, "rows": rows, "assignments": assignments, "compute_s": compute_s}

    def shutdown(self) -> None:
        for comm in self.comms.values():
            comm.close()
        self.comms.clear()
