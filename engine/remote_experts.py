"""The expert backend of a router: plan locally, run experts on expert workers.

Same interface as :class:`~raymoe.engine.experts.LocalExperts`; the engine cannot tell them
apart. A step's first MoE layer calls ``start_step`` (the router actor uses it to ask every
worker to serve one step) and its last layer calls ``finish_step`` (wait for the workers and
collect their per-layer results), so workers and router walk the layers in lockstep.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import torch

from raymoe.engine.ep_exchange import router_exchange
from raymoe.engine.experts import plan_layer
from raymoe.engine.telemetry import Telemetry
from raymoe.kernels.comm.base import Communicator
from raymoe.kernels.comm.errors import CommError
from raymoe.moe.capacity import CapacityConfig
from raymoe.moe.placement import PlacementTable


class RemoteExperts:
    def __init__(
        self,
        placement: PlacementTable,
        top_k: int,
        capacity: CapacityConfig,
        start_step: Callable[[int], None],
        finish_step: Callable[[], list[Any]],
        telemetry: Telemetry,
    ):
        self.placement = placement
        self.top_k = top_k
        self.capacity = capacity
        self.start_step = start_step
        self.finish_step = finish_step
        self.telemetry = telemetry
        self.comm: Communicator | None = None
        self.participants: list[int] | None = None  # workers in the group, in rank order (None: all)
        self._tables = self._index_tables(placement)
        self._step_started = 0.0
        self._moe_seconds = 0.0

    @staticmethod
    def _index_tables(placement: PlacementTable) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [
            (torch.tensor(placement.log2phy[layer]), torch.tensor(placement.logcnt[layer]))
            for layer in range(placement.num_layers)
        ]

    def set_placement(self, placement: PlacementTable) -> None:
        """Switch to a new placement. Call it between steps only (the router holds its engine
        lock): a step never sees two placements, and every worker already serves its epoch."""
        if placement.epoch < self.placement.epoch:
            raise ValueError(f"placement epoch {placement.epoch} is older than the current {self.placement.epoch}")
        self.placement = placement
        self._tables = self._index_tables(placement)

    def forward(
        self, moe_layer: int, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> torch.Tensor:
        if self.comm is None:  # a CommError, so the router waits for the supervisor's rebuild
            raise CommError("the router is not joined with its expert workers (no communicator)")
        if moe_layer == 0:
            self._step_started = time.perf_counter()
            self._moe_seconds = 0.0
            self.telemetry.begin_step()  # forget a step that failed part-way (it is being retried)
            self.start_step(self.placement.epoch)
        started = time.perf_counter()
        log2phy, logcnt = self._tables[moe_layer]
        plan = plan_layer(self.placement, moe_layer, topk_ids, topk_weights, self.capacity, log2phy, logcnt)
        out, traffic = router_exchange(self.comm, plan, hidden, self.top_k, moe_layer, self.participants)
        dropped = torch.zeros(self.placement.num_workers, dtype=torch.int64)
        if plan.num_dropped:
            home_worker = log2phy[topk_ids.cpu()[plan.slot < 0], 0] // self.placement.slots_per_worker
            dropped = torch.bincount(home_worker, minlength=self.placement.num_workers)
        kept = topk_ids.cpu()[plan.slot >= 0]
        expert_tokens = torch.bincount(kept, minlength=self.placement.num_experts).numpy()
        self.telemetry.record_layer(moe_layer, plan, traffic, hidden.shape[1] * hidden.element_size(),
                                    dropped.numpy(), expert_tokens)
        self._moe_seconds += time.perf_counter() - started
        if moe_layer == self.placement.num_layers - 1:
            worker_results = self.finish_step()
            total = time.perf_counter() - self._step_started
            self.telemetry.end_step(total - self._moe_seconds, worker_results, self.placement.epoch)
        return out
