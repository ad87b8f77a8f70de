"""The exchange's two sides as one interface each: what a router and a worker call, and the
parts both implementations share (engine/exchange/python_sides.py: the messages through the
communicator's ``transfer``; engine/exchange/native_sides.py: each layer in one native call).
engine/exchange/ep_exchange.py picks one implementation per side once, when the group is joined.

Legend: T tokens, k experts per token, D hidden, S a worker's local slots, R routers, W workers
in the group, N rows.

The messages themselves (header, rows, sums, trailer, kinds, frame) are kernels/comm/wire.py's;
both implementations send exactly those, in the same order, so a group may mix them.
"""

from __future__ import annotations

import struct
import time
from abc import ABC, abstractmethod
from concurrent.futures import Executor
from dataclasses import dataclass

import torch

from raymoe.engine.experts import combine_assignments, combine_partials
from raymoe.engine.telemetry import LayerTraffic
from raymoe.kernels.comm.base import Communicator
from raymoe.kernels.comm.errors import CollectiveMismatch, CommError
from raymoe.kernels.comm.layout import tag_checksum
from raymoe.kernels.comm.wire import (
    KIND_IDLE,
    KIND_STEP,
    TRAILER_BYTES,
    GroupLayout,
    Part,
    RowFormat,
    header,
    header_width,
    layer_tag,
    layer_tags,
)
from raymoe.moe.exchange_plan import ExchangePlan


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``host`` (a tensor the host just built: headers, flags, a trailer) on ``device`` without a
    host sync: on CUDA it is copied into pinned memory and sent with ``non_blocking=True`` (torch's
    pinned allocator keeps the buffer until the copy is done); elsewhere the same call is a no-op
    (pinning needs a GPU). A blocking ``.to(device)`` from pageable memory would wait for the
    stream: tests/engine/test_ep_host_syncs.py counts it."""
    if device.type == "cuda" and not host.is_pinned():
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


class RouterExchange(ABC):
    """A router's side of every layer of every step, over the deployment's one group.

    Subclasses move one layer's messages (:meth:`_transfer_layer`) and a step's layers without
    rows (:meth:`_exchange_empty`); planning the buffers, combining, the trailers, idle ticks
    and the routers' agreement are written once here."""

    def __init__(self, comm: Communicator, layout: GroupLayout, router_index: int, num_workers: int,
                 slots_per_worker: int, top_k: int, hidden_size: int, dtype: torch.dtype, device: torch.device):
        self.comm = comm
        self.slots_per_worker = slots_per_worker
        self._trailers: list[tuple[int, int, torch.Tensor]] = []  # (layer, rank, 16 bytes), read once a step
        self.checked_expert_s = 0.0  # expert seconds of layers whose trailers were checked already (this step)
        self.layout = layout
        self.router_index = router_index
        self.num_workers = num_workers  # workers of the placement (the group may hold fewer)
        self.format = RowFormat(hidden_size, top_k, dtype)
        self.top_k, self.hidden_size, self.dtype, self.device = top_k, hidden_size, dtype, device
        self.combine_row_bytes = self.format.activation_bytes
        self._rank_of_worker = {w: layout.worker_rank(i) for i, w in enumerate(layout.participants)}
        self._whole_group = set(self._rank_of_worker) == set(range(num_workers))  # no worker of the plan missing
        self._worker_ranks = list(self._rank_of_worker.values())
        self._headers_bytes = len(self._rank_of_worker) * 8 * header_width(slots_per_worker)

    def exchange(self, layer: int, plan: ExchangePlan | None, hidden: torch.Tensor | None, epoch: int,
                 kind: int = KIND_STEP) -> tuple[torch.Tensor | None, LayerTraffic]:
        """Dispatch ``plan``'s rows of ``hidden`` and combine their sums: ``[T, D]`` routed output.

        ``plan`` None: this router has nothing this step (zero rows to every worker). ``kind``:
        the header's (``KIND_SPLIT`` in a micro-batched step's first exchange).
        """
        pending = self._prepare(layer, plan, hidden, epoch, kind)
        self._transfer_layer(pending, Part.SEND | Part.RECEIVE)
        pending.exchange_s = time.perf_counter() - pending.packed_at
        return self._combine(pending)

    def send(self, layer: int, plan: ExchangePlan | None, hidden: torch.Tensor | None, epoch: int,
             kind: int = KIND_STEP) -> "PendingExchange":
        """The first half of :meth:`exchange`: the headers and rows go out; :meth:`receive` (after
        other work: the other micro-batch's attention) takes the sums back. Between the two, send
        nothing more to these workers (the micro-batch schedule receives one exchange before it
        sends the next: a worker then never blocks sending sums to a router that is sending it rows)."""
        pending = self._prepare(layer, plan, hidden, epoch, kind)
        self._transfer_layer(pending, Part.SEND)
        pending.exchange_s = time.perf_counter() - pending.packed_at
        return pending

    def receive(self, pending: "PendingExchange") -> tuple[torch.Tensor | None, LayerTraffic]:
        """The second half of :meth:`exchange` for ``pending`` (from :meth:`send`)."""
        waited = time.perf_counter()
        self._transfer_layer(pending, Part.RECEIVE)
        pending.exchange_s += time.perf_counter() - waited  # the exchange's time: the send's and the receive's
        return self._combine(pending)

    def _prepare(self, layer: int, plan: ExchangePlan | None, hidden: torch.Tensor | None, epoch: int,
                 kind: int) -> "PendingExchange":
        """Everything one layer's messages need: headers' counts, the packed rows, one receive
        buffer for every worker's sums (or assignments' outputs) and trailer, in worker order."""
        started = time.perf_counter()
        S = self.slots_per_worker
        if plan is not None:
            counts, slot_counts = plan.send_counts, plan.slot_counts
        else:
            counts, slot_counts = [0] * self.num_workers, [0] * (self.num_workers * S)
        if not self._whole_group:
            outside = [w for w, n in enumerate(counts) if n and w not in self._rank_of_worker]
            if outside:
                raise CommError(f"layer {layer}: the plan sends rows to workers {outside}, which are not in the group")
        packed = None
        if plan is not None and plan.num_rows:
            packed = plan.packed  # the planner's packed rows, where it packed them
            if packed is None:
                packed = self.format.pack(hidden.index_select(0, plan.row_token), plan.row_slots,
                                          plan.row_weights)  # [N, row_bytes]
        back = self.rows_back(counts, slot_counts)
        row_bytes = self.combine_row_bytes
        total = sum(back[worker] for worker in self._rank_of_worker)
        received = torch.empty(total * row_bytes + len(self._rank_of_worker) * TRAILER_BYTES, dtype=torch.uint8,
                               device=self.device)
        sums = []
        offset = 0
        for worker, rank in self._rank_of_worker.items():
            count = back[worker]
            if count:
                sums.append(received[offset:offset + count * row_bytes])
            size = count * row_bytes + TRAILER_BYTES
            self._trailers.append((layer, rank, received[offset + size - TRAILER_BYTES:offset + size]))
            offset += size
        return PendingExchange(layer, epoch, kind, plan, hidden, counts, slot_counts, packed, received, sums, total,
                               started, time.perf_counter())

    def _combine(self, pending: "PendingExchange") -> tuple[torch.Tensor | None, LayerTraffic]:
        plan, sums, total = pending.plan, pending.sums, pending.total
        out = None
        if plan is not None:
            if sums:
                partial = (sums[0] if len(sums) == 1 else torch.cat(sums)).view(self.dtype).view(total, -1)
                if self.format.per_assignment:
                    out = self._combine_assignments(plan, partial)
                else:
                    out = combine_partials(plan.num_tokens, plan.row_token, partial,
                                           min(self.top_k, len(self._rank_of_worker)))
            else:
                out = pending.hidden.new_zeros(plan.num_tokens, self.hidden_size)
        counts = pending.counts
        traffic = LayerTraffic(
            rows_per_worker=list(counts),
            bytes_sent=self._headers_bytes + sum(counts[w] for w in self._rank_of_worker) * self.format.row_bytes,
            bytes_received=pending.received.numel(),
            dispatch_s=pending.packed_at - pending.started,
            exchange_s=pending.exchange_s,
        )
        return out, traffic

    def rows_back(self, counts: list[int], slot_counts: list[int]) -> list[int]:
        """Rows each worker sends back: one per dispatched row (``counts``), or one per assignment,
        its slots' counts (:attr:`RowFormat.per_assignment`)."""
        if not self.format.per_assignment:
            return counts
        S = self.slots_per_worker
        return [sum(slot_counts[worker * S:(worker + 1) * S]) for worker in range(len(counts))]

    def _combine_assignments(self, plan: ExchangePlan, outputs: torch.Tensor) -> torch.Tensor:
        """``[T, D]`` from the workers' ``outputs: [A, D]``, each assignment's, in the order the
        plan's rows list them (worker-major, then row, then position)."""
        k = self.top_k
        assigned = (plan.row_slots >= 0).reshape(-1)  # [N * k]
        # the assigned (row, position) indices in order, without a host sync: A is known
        index = torch.argsort(assigned.logical_not().to(torch.uint8), stable=True)[:outputs.shape[0]]
        flat = plan.row_token.index_select(0, torch.div(index, k, rounding_mode="floor")) * k + index % k
        weights = plan.row_weights.reshape(-1).index_select(0, index)
        return combine_assignments(plan.num_tokens, k, flat, outputs, weights)

    @abstractmethod
    def _transfer_layer(self, pending: "PendingExchange", parts: Part) -> None:
        """One layer's messages (``parts``: the send half, the receive half or both): to each
        worker of the group (rank order) its header (``pending.counts``, ``pending.slot_counts``:
        the plan's, over every worker of the placement; ``pending.kind``) and its rows of
        ``pending.packed`` (worker-major), then from each its sums and trailer into
        ``pending.received``."""

    def exchange_empty(self, layers: range, epoch: int, first_kind: int = KIND_STEP) -> None:
        """Zero rows to every worker for each of ``layers``: a router with nothing this step, or
        the layers its step did not reach. Every layer's header goes out at once, then every
        trailer is read: the workers find this router's headers waiting instead of each layer
        waiting for its round trip of the layer before (with routers on other cores, a
        cross-core wake-up per layer on every worker's path), as :meth:`exchange` with no plan
        would, layer by layer. The workers see the same messages in the same order. The wait
        has the deadline of that many layers (each layer's own, as before, one after the other).
        ``first_kind``: the first header's kind (``KIND_SPLIT`` where a micro-batched step begins)."""
        if not layers:
            return
        ranks = self._worker_ranks
        first, last = layers[0], layers[-1]
        tag = layer_tag(first, "dispatch") if first == last else f"layers {first}-{last} dispatch (no rows)"
        received = self._exchange_empty(layers, epoch, first_kind, tag, self.comm.timeout_s * len(layers))
        for index, layer in enumerate(layers):
            for position, rank in enumerate(ranks):
                self._trailers.append((layer, rank, received[index * len(ranks) + position]))

    @abstractmethod
    def _exchange_empty(self, layers: range, epoch: int, first_kind: int, tag: str, timeout_s: float) -> torch.Tensor:
        """Every layer's header without rows to each worker (the first of ``first_kind``, the
        others ``KIND_STEP``), then every trailer: returns them, ``[layers * W, TRAILER_BYTES]``
        uint8, layer-major."""

    def read_trailers(self) -> float:
        """The step's expert seconds (sum over layers of the slowest worker), checking every
        combine's tag; one host read for the whole step."""
        trailers, self._trailers = self._trailers, []
        checked, self.checked_expert_s = self.checked_expert_s, 0.0
        if not trailers:
            return checked
        raw = torch.stack([t for _, _, t in trailers]).view(torch.int64).tolist()  # [n, 2], one host read
        per_layer: dict[int, float] = {}
        for (layer, rank, _), (second_bits, checksum) in zip(trailers, raw):
            second = struct.unpack("<d", struct.pack("<q", second_bits))[0]
            _, _, combine_tag, expected = layer_tags(layer)
            if checksum != expected:
                raise CollectiveMismatch(tag=combine_tag, peer=rank, world_size=self.layout.world_size)
            per_layer[layer] = max(per_layer.get(layer, 0.0), second)
        return checked + sum(per_layer.values())

    def idle_tick(self, mark: int = 0) -> None:
        """Tell every worker that no step comes now (in the first layer's place). ``mark``: this
        router's migration mark, in the header's epoch field (wire.HEADER_MARK; 0: none)."""
        tag = layer_tag(0, "dispatch")
        self.comm.transfer([(rank, header(0, tag, mark, KIND_IDLE, [0] * self.slots_per_worker, self.device))
                            for rank in self._rank_of_worker.values()], [], tag=tag)

    def agree_to_step(self, active: bool, timeout_s: float | None = None) -> bool:
        """Routers only: does any router have work this step? (one flag to and from each router)."""
        return self.agree_round(active, False, timeout_s)[0]

    def agree_round(self, active: bool, tick: bool, timeout_s: float | None = None,
                    split: bool = False) -> tuple[bool, bool, bool]:
        """Routers only: does any router have work this step, does any want an idle tick sent
        first (a new migration mark to deliver), and does any want the step in two micro-batches
        (``split``: then every router runs it so)? One int to and from each router, as
        ``agree_to_step``; every router gets the same three answers."""
        if self.layout.num_routers == 1:
            return active, tick, split
        tag = "step begin"
        mine = to_device(torch.tensor([int(active) | int(tick) << 1 | int(split) << 2, tag_checksum(tag)],
                                      dtype=torch.int64), self.device)
        others = [rank for rank in self.layout.router_ranks if rank != self.router_index]
        received = torch.empty(len(others), 2, dtype=torch.int64, device=self.device)
        self.comm.transfer([(rank, mine) for rank in others], [(rank, received[i]) for i, rank in enumerate(others)],
                           tag=tag, timeout_s=timeout_s)
        flags = received.tolist()  # the step's one host read of the flags (after the transfer's wait)
        for rank, (_, checksum) in zip(others, flags):
            if checksum != tag_checksum(tag):
                raise CollectiveMismatch(tag=tag, peer=rank, world_size=self.layout.world_size)
        return (active or any(flag & 1 for flag, _ in flags), tick or any(flag & 2 for flag, _ in flags),
                split or any(flag & 4 for flag, _ in flags))


@dataclass
class PendingExchange:
    """One layer's exchange between :meth:`RouterExchange.send` and :meth:`RouterExchange.receive`
    (or inside :meth:`RouterExchange.exchange`): what its messages carry and where the sums land.
    It holds ``packed`` until the sums are back, so a device transport never reads freed rows."""

    layer: int
    epoch: int
    kind: int
    plan: ExchangePlan | None
    hidden: torch.Tensor | None
    counts: list[int]
    slot_counts: list[int]
    packed: torch.Tensor | None
    received: torch.Tensor
    sums: list[torch.Tensor]
    total: int
    started: float
    packed_at: float
    exchange_s: float = 0.0  # in its transfers (send and receive), not the work between them


@dataclass(frozen=True)
class WorkerLayerResult:
    rows: int
    assignments: int
    compute_s: float


class WorkerExchange(ABC):
    """A worker's side: receive every router's rows, run the experts once, send the sums back."""

    def __init__(self, comm: Communicator, layout: GroupLayout, slots_per_worker: int, hidden_size: int,
                 top_k: int, dtype: torch.dtype, device: torch.device, executor: Executor | None = None):
        self.comm = comm
        self.executor = executor  # CPU: threads that run some experts meanwhile (kernels/expert_mlp.py)
        self.slots_per_worker = slots_per_worker
        self.layout = layout
        self.format = RowFormat(hidden_size, top_k, dtype)
        self.top_k, self.hidden_size, self.dtype, self.device = top_k, hidden_size, dtype, device
        self.row_bytes, self.activation_bytes = self.format.row_bytes, self.format.activation_bytes
        self._routers = layout.router_ranks
        # The last idle tick's migration mark from each router (wire.HEADER_MARK), in rank order.
        self.tick_marks: list[int] = []

    @abstractmethod
    def receive_headers(self, layer: int, timeout_s: float | None = None) -> list[list[int]] | None:
        """One header per router (host ints), or None for an idle tick (no step now; each
        router's migration mark is then in ``tick_marks``)."""

    @abstractmethod
    def serve_layer(self, layer: int, headers: list[list[int]] | None, w13: torch.Tensor, w2: torch.Tensor,
                    pool_rows: dict[int, tuple[list[int], torch.Tensor]]) -> WorkerLayerResult:
        """Rows from every router in one batch. ``headers``: this layer's, where they were read
        already (a step's first layer: they tell a step from an idle tick), else None (read
        here). ``pool_rows[epoch]``: the pool row of each local slot, as host ints and as a
        device tensor."""
