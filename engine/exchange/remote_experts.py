"""The expert backend of a router: plan on the activations' device, run experts on workers.

Same ``forward`` as :class:`~raymoe.engine.experts.LocalExperts`; the engine cannot tell them
apart. Because every router of a deployment steps together over one group, a step is framed:
the router calls :meth:`begin_step`, runs its engine step (or nothing, when it has no work),
then :meth:`complete_step`, which exchanges zero rows for every MoE layer the step did not
reach, so that every rank issues the same messages whatever happened on this router.

A step may run in two micro-batches (``begin_step(micro_batches=2)``, agreed by every router):
then each MoE layer has two exchanges, numbered ``2 * layer + micro_batch``, the first of the
step's headers says ``KIND_SPLIT``, and the engine ping-pongs its two halves
(engine/model.py::MoEModel.forward_micro_batches): :meth:`start` sends one half's rows and
returns at once, so the router runs the other half's attention while the workers run these
experts, and :meth:`finish` takes the sums back. A router whose batch does not split (one
sequence, a scoring forward) runs :meth:`forward`, which sends the other half's exchange empty.

On a float32 CPU over sockets (no capacity drops, every worker in the group) :meth:`forward`
hands each layer to the native side whole (:meth:`_moe_layer`: plan to combine in one call);
elsewhere it plans here (numpy or the native planner on a CPU, torch on a GPU) around the
exchange (:meth:`_send`, :meth:`_receive`), as :meth:`start` and :meth:`finish` always do.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from raymoe.engine.exchange.ep_exchange import RouterExchange
from raymoe.engine.exchange.sides import PendingExchange
from raymoe.engine.telemetry import LayerTraffic, Telemetry
from raymoe.kernels import native_cpu
from raymoe.kernels.comm.errors import CommError
from raymoe.kernels.comm.wire import KIND_SPLIT, KIND_STEP, RowFormat
from raymoe.moe.capacity import CapacityConfig, OverflowPolicy, keep_mask
from raymoe.moe.exchange_plan import ExchangePlan, plan_exchange, plan_exchange_on_host
from raymoe.moe.placement import PlacementTable


@dataclass
class ExpertHandle:
    """One layer's exchange of one micro-batch, from :meth:`RemoteExperts.start` to its finish."""

    moe_layer: int
    plan: ExchangePlan
    kept: torch.Tensor | None
    topk_ids: torch.Tensor
    hidden: torch.Tensor
    pending: PendingExchange | None = None
    out: torch.Tensor | None = None
    traffic: LayerTraffic | None = None


class RemoteExperts:
    # A whole layer in one native call where it applies (_one_call); False (on the class or an
    # instance): always the Python plan around the exchange (the same messages and bits:
    # tests/engine/test_ep_native_layer.py, tests/actors/test_expert_parallel.py).
    one_call_layers = True

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
        self._cursor = 0  # the next exchange of this step (its MoE layer, times 2 in a split step)
        self._real = False  # whether this step carried any of this router's tokens
        self._step_started = 0.0
        self._moe_seconds = 0.0
        self._row_format: RowFormat | None = None  # the native planner's rows (set on its first layer)
        self.micro_batches = 1  # this step's (begin_step)
        self.micro_batched_steps = 0  # steps begun in two micro-batches
        self.ping_pongs = 0  # of those, steps whose own batch ran in two halves (start/finish)
        self._in_flight: ExpertHandle | None = None  # sent and not yet received (micro-batches)

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
    def begin_step(self, micro_batches: int = 1) -> None:
        """Frame a step. ``micro_batches``: 2 when the routers agreed to split it (every router
        then numbers its exchanges so, whatever its own batch)."""
        if self.exchange is None:  # a CommError, so the router waits for the supervisor's rebuild
            raise CommError("the router is not joined with its expert workers (no communicator)")
        if micro_batches not in (1, 2):
            raise ValueError(f"micro_batches must be 1 or 2, not {micro_batches}")
        self._step_exchange = self.exchange  # the whole step uses one group, even if the
        # supervisor swaps or aborts it meanwhile (an aborted one fails with a CommError)
        self.micro_batches = micro_batches
        self.micro_batched_steps += micro_batches == 2
        self._in_flight = None
        self._cursor = 0
        self._real = False
        self._step_started = time.perf_counter()
        self._moe_seconds = 0.0
        self.telemetry.begin_step(self._step_started)  # forget a step that failed part-way (it is being retried)

    def complete_step(self) -> None:
        """Exchange zero rows for the layers this step did not reach (all at once); record the step."""
        if self._in_flight is not None:  # a step that stopped between a micro-batch's two halves
            self._receive(self._in_flight)
        exchanges = self.placement.num_layers * self.micro_batches
        self._step_exchange.exchange_empty(range(self._cursor, exchanges), self.placement.epoch, self._kind(self._cursor))
        self._cursor = exchanges
        expert_s = self._step_exchange.read_trailers()
        if self._real:
            total = time.perf_counter() - self._step_started
            self.telemetry.end_step(total - self._moe_seconds, expert_s, self.placement.epoch,
                                    self.placement.phy2log)

    def _kind(self, index: int) -> int:
        """The header kind of exchange ``index``: a split step says so in its first."""
        return KIND_SPLIT if index == 0 and self.micro_batches == 2 else KIND_STEP

    def _check_order(self, index: int, moe_layer: int) -> None:
        if self._step_exchange is None:
            raise CommError("the router is not joined with its expert workers (no communicator)")
        if index != self._cursor:
            raise RuntimeError(f"MoE layer {moe_layer} out of order: this step is at exchange {self._cursor} "
                               f"({self.micro_batches} micro-batch(es) a layer; one forward per step; "
                               "begin_step() first)")

    def forward(
        self, moe_layer: int, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> torch.Tensor:
        """The whole batch's routed output in one exchange; in a split step the other
        micro-batch's exchange of this layer goes out empty right after."""
        index = moe_layer * self.micro_batches
        self._check_order(index, moe_layer)
        if self._one_call(hidden, topk_ids):
            out = self._moe_layer(index, moe_layer, hidden, topk_ids, topk_weights)
        else:
            out = self._receive(self._send(index, moe_layer, hidden, topk_ids, topk_weights))
        if self.micro_batches == 2:
            started = time.perf_counter()
            self._step_exchange.exchange_empty(range(index + 1, index + 2), self.placement.epoch)
            self._cursor += 1
            self._moe_seconds += time.perf_counter() - started
        return out

    def _one_call(self, hidden: torch.Tensor, topk_ids: torch.Tensor) -> bool:
        """Whether this layer goes in one native call (NativeRouterExchange.moe_layer: float32 on
        the CPU over the sockets transport, every worker in the group, no capacity drops)."""
        if not self.one_call_layers or self.capacity.policy is not OverflowPolicy.NONE:
            return False
        applies = getattr(self._step_exchange, "moe_layer_applies", None)
        return (applies is not None and applies() and topk_ids.device.type == "cpu"
                and native_cpu.plan_applies(hidden))

    def _moe_layer(self, index: int, moe_layer: int, hidden, topk_ids, topk_weights) -> torch.Tensor:
        """The layer's plan, rows, exchange and combine in one native call; recorded as
        :meth:`_record` records the others."""
        started = time.perf_counter()
        log2phy, logcnt = self._tables[moe_layer]
        out, _, slot_counts, traffic = self._step_exchange.moe_layer(
            index, topk_ids, topk_weights, log2phy, logcnt, hidden, self.placement.epoch, self._kind(index))
        self._cursor += 1
        self._real = True
        self.telemetry.record_layer(moe_layer, slot_counts, None, traffic, hidden.shape[1] * hidden.element_size(),
                                    8 * self.top_k, hidden.shape[0])
        self._moe_seconds += time.perf_counter() - started
        return out

    def start(self, moe_layer: int, micro_batch: int, hidden: torch.Tensor, topk_ids: torch.Tensor,
              topk_weights: torch.Tensor) -> "ExpertHandle":
        """Send micro-batch ``micro_batch``'s rows of ``moe_layer`` and return without waiting for
        their sums (:meth:`finish` takes them). The exchange sent before it is received first: a
        worker then never blocks sending sums to a router that is sending it rows."""
        if self.micro_batches != 2 or micro_batch not in (0, 1):
            raise RuntimeError(f"start(micro_batch={micro_batch}) in a step of {self.micro_batches} micro-batch(es)")
        index = 2 * moe_layer + micro_batch
        self._check_order(index, moe_layer)
        self.ping_pongs += index == 0
        if self._in_flight is not None:
            self._receive(self._in_flight)
        handle = self._send(index, moe_layer, hidden, topk_ids, topk_weights, wait=False)
        self._in_flight = handle
        return handle

    def finish(self, handle: "ExpertHandle") -> torch.Tensor:
        """The routed output ``[T, D]`` of a :meth:`start`."""
        if handle.out is None:
            self._receive(handle)
        return handle.out

    def _send(self, index: int, moe_layer: int, hidden, topk_ids, topk_weights, wait: bool = True) -> "ExpertHandle":
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
        exchange = self._step_exchange
        handle = ExpertHandle(moe_layer, plan, kept, topk_ids, hidden)
        if wait:
            handle.out, handle.traffic = exchange.exchange(index, plan, hidden, placement.epoch, self._kind(index))
        else:
            handle.pending = exchange.send(index, plan, hidden, placement.epoch, self._kind(index))
        self._cursor += 1
        self._real = True
        self._moe_seconds += time.perf_counter() - started
        return handle

    def _receive(self, handle: "ExpertHandle") -> torch.Tensor:
        started = time.perf_counter()
        if handle.pending is not None:
            pending, handle.pending = handle.pending, None
            if self._in_flight is handle:
                self._in_flight = None
            handle.out, handle.traffic = self._step_exchange.receive(pending)
        self._record(handle.moe_layer, handle.topk_ids, handle.plan, handle.kept, self._tables[handle.moe_layer][0],
                     handle.traffic, handle.hidden)
        self._moe_seconds += time.perf_counter() - started
        return handle.out

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
