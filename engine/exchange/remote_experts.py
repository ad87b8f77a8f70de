"""The expert backend of a router: plan on the activations' device, run experts on workers.

Same ``forward`` as :class:`~raymoe.engine.experts.LocalExperts`; the engine cannot tell them
apart. Because every router of a deployment steps together over one group, a step is framed:
the router calls :meth:`begin_step`, runs its engine step (or nothing, when it has no work),
then :meth:`complete_step`, which exchanges zero rows for every MoE layer the step did not
reach, so that every rank issues the same messages whatever happened on this router.
"""

from __future__ import annotations

import time

import torch

from raymoe.engine.exchange.ep_exchange import RouterExchange
from raymoe.engine.telemetry import Telemetry
from raymoe.kernels import native_cpu
from raymoe.kernels.comm.errors import CommError
from raymoe.kernels.comm.wire import RowFormat
from raymoe.moe.capacity import CapacityConfig, OverflowPolicy, keep_mask
from raymoe.moe.exchange_plan import ExchangePlan, plan_exchange, plan_exchange_on_host
from raymoe.moe.placement import PlacementTable


class RemoteExperts:
    def __init__(self, placement: PlacementTable, top_k: int, capacity: CapacityConfig, telemetry: Telemetry,
                 device: torch.device = torch.device("cpu")):
        self.placement = placement
        self.top_k = top_k
        self.capacity = capacity
        self.telemetry = telemetry
        self.device = device
        self.exchange: RouterExchange | None = None  # set when the router joins the group
        self._step_exchange: RouterExchange | None = None
        self._tables = self._index_tables(placement)
        self._cursor = 0  # the next MoE layer this step exchanges
        self._real = False  # whether this step carried any of this router's tokens
        self._step_started = 0.0
        self._moe_seconds = 0.0
        self._row_format: RowFormat | None = None  # the native planner's rows (set on its first layer)

    def _index_tables(self, placement: PlacementTable) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [
            (torch.tensor(placement.log2phy[layer], device=self.device),
             torch.tensor(placement.logcnt[layer], device=self.device))
            for layer in range(placement.num_layers)
        ]

    def set_placement(self, placement: PlacementTable) -> None:
        """Switch to a new placement. Call it between steps only (the router holds its engine
        lock): a step never sees two placements, and every worker already serves its epoch."""
        if placement.epoch < self.placement.epoch:
            raise ValueError(f"placement epoch {placement.epoch} is older than the current {self.placement.epoch}")
        self.placement = placement
        self._tables = self._index_tables(placement)

    # ---- step framing -------------------------------------------------------------------
    def begin_step(self) -> None:
        if self.exchange is None:  # a CommError, so the router waits for the supervisor's rebuild
            raise CommError("the router is not joined with its expert workers (no communicator)")
        self._step_exchange = self.exchange  # the whole step uses one group, even if the
        # supervisor swaps or aborts it meanwhile (an aborted one fails with a CommError)
        self._cursor = 0
        self._real = False
        self._step_started = time.perf_counter()
        self._moe_seconds = 0.0
        self.telemetry.begin_step(self._step_started)  # forget a step that failed part-way (it is being retried)

    def complete_step(self) -> None:
        """Exchange zero rows for the layers this step did not reach (all at once); record the step."""
        self._step_exchange.exchange_empty(range(self._cursor, self.placement.num_layers), self.placement.epoch)
        self._cursor = self.placement.num_layers
        expert_s = self._step_exchange.read_trailers()
        if self._real:
            total = time.perf_counter() - self._step_started
            self.telemetry.end_step(total - self._moe_seconds, expert_s, self.placement.epoch,
                                    self.placement.phy2log)

    def forward(
        self, moe_layer: int, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> torch.Tensor:
        if self._step_exchange is None:
            raise CommError("the router is not joined with its expert workers (no communicator)")
        if moe_layer != self._cursor:
            raise RuntimeError(f"MoE layer {moe_layer} out of order: this step is at layer {self._cursor} "
                               "(one forward per step; begin_step() first)")
        started = time.perf_counter()
        placement = self.placement
        log2phy, logcnt = self._tables[moe_layer]
        kept = None if self.capacity.policy is OverflowPolicy.NONE else keep_mask(topk_ids, placement.num_experts, self.capacity)
        if topk_ids.device.type == "cpu" and native_cpu.plan_applies(hidden):  # plan and packed rows: one call
            plan = self._plan_native(topk_ids, topk_weights, kept, log2phy, logcnt, hidden)
        elif topk_ids.device.type == "cpu":  # the host is the device: numpy plans in half the time
            plan = plan_exchange_on_host(topk_ids, topk_weights, kept, placement.log2phy[moe_layer],
                                         placement.logcnt[moe_layer], placement.slots_per_worker, placement.num_workers)
        else:
            plan = plan_exchange(topk_ids, topk_weights, kept, log2phy, logcnt, placement.slots_per_worker,
                                 placement.num_workers)
        out, traffic = self._step_exchange.exchange(moe_layer, plan, hidden, placement.epoch)
        self._record(moe_layer, topk_ids, plan, kept, log2phy, traffic, hidden)
        self._cursor += 1
        self._real = True
        self._moe_seconds += time.perf_counter() - started
        return out

    def _plan_native(self, topk_ids, topk_weights, kept, log2phy, logcnt, hidden) -> ExchangePlan:
        """``plan_exchange_on_host``'s plan, bit for bit, with the rows packed for the wire, in one
        native call (float32 on a CPU with raymoe's native kernels)."""
        placement = self.placement
        slot, send_counts, slot_counts, row_token, packed = native_cpu.plan_pack(
            topk_ids, topk_weights, kept, log2phy, logcnt, placement.slots_per_worker, placement.num_workers, hidden)
        row_format = self._row_format
        if row_format is None or row_format.hidden_size != hidden.shape[1] or row_format.top_k != topk_ids.shape[1]:
            row_format = self._row_format = RowFormat(hidden.shape[1], topk_ids.shape[1], hidden.dtype)
        row_slots, row_weights = row_format.positions(packed)
        return ExchangePlan(topk_ids.shape[0], placement.num_workers, slot, send_counts, slot_counts, row_token,
                            row_slots, row_weights, packed)

    def _record(self, layer, topk_ids, plan, kept, log2phy, traffic, hidden) -> None:
        """Per-layer counts, as they are: the plan's per-slot counts (host ints) become logical
        expert loads once a step (Telemetry.end_step); drops under a capacity policy stay a
        device tensor (no host sync here; Telemetry reads them once a step)."""
        placement = self.placement
        dropped = None
        if kept is not None:
            home = torch.div(log2phy[topk_ids, 0], placement.slots_per_worker, rounding_mode="floor")
            dropped = torch.bincount(torch.where(kept, placement.num_workers, home).reshape(-1),
                                     minlength=placement.num_workers + 1)[:placement.num_workers]
        self.telemetry.record_layer(layer, plan.slot_counts, dropped, traffic, hidden.shape[1] * hidden.element_size(),
                                    8 * self.top_k, hidden.shape[0])
