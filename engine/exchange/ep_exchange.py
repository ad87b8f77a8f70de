"""The expert-parallel exchange of one MoE layer, both sides in one place.

Legend: T tokens, k experts per token, D hidden, R routers, W workers in the group, N rows.

One group per deployment: ranks ``0 .. R-1`` are the routers, rank ``R + i`` is worker
``participants[i]``. Routers step together (a router with nothing to run sends zero rows), so
every rank issues the same messages in the same order and each worker runs one grouped GEMM
over every router's rows. Per MoE layer, two exchanges:

1. dispatch, router -> worker: a header (rows, tag checksum, placement epoch, kind, then the
   assignments for each of the worker's S local slots), then, if rows > 0, the rows, each packed as ``D`` activations + k int32 local slots + k
   float32 gate weights (slot -1: that position runs nowhere on this worker);
2. combine, worker -> router: the rows' weighted sums, then a trailer (expert seconds, tag
   checksum). The router knows the row count, so it posts these receives together with its
   dispatch sends: one round trip per layer on the router.

The worker reads the header first (its one host sync per layer on a GPU: the slot counts in
it size the grouped GEMM), then the rows. The router's one host sync per layer is its plan's
counts; it reads the trailers once per step.
A header of kind IDLE in the first layer's place says "no step": routers send it now and
then while nobody has work, so a worker waiting for a step never waits past its deadline
for a live group. Every wait has a deadline that names the layer and, where the backend can
tell, the rank. Nothing here imports Ray.
"""

from __future__ import annotations

import array
import functools
import struct
import time
from concurrent.futures import Executor
from dataclasses import dataclass

import torch

from raymoe.engine.experts import combine_partials, run_rows
from raymoe.engine.telemetry import LayerTraffic
from raymoe.kernels import native_cpu
from raymoe.kernels.comm.errors import CollectiveMismatch, CommError
from raymoe.kernels.comm.layout import tag_checksum
from raymoe.kernels.comm.p2p import PointToPointCommunicator
from raymoe.kernels.comm.sockets import SocketCommunicator
from raymoe.moe.exchange_plan import ExchangePlan

native_run_rows = native_cpu.run_rows  # (a module name: benchmarks/served_phases_hook.py times it)
HEADER_FIELDS = 4  # rows, tag checksum, epoch, kind; then the assignments of each local slot
KIND_STEP = 1
KIND_IDLE = 2
TRAILER = struct.Struct("=dq")  # float64 expert seconds, int64 tag checksum (native order, as tensor views read it)
TRAILER_BYTES = TRAILER.size


@dataclass(frozen=True)
class GroupLayout:
    """Who is which rank in the deployment's one expert-parallel group."""

    num_routers: int
    participants: tuple[int, ...]  # worker indices in the group, in rank order

    @property
    def world_size(self) -> int:
        return self.num_routers + len(self.participants)

    def worker_rank(self, position: int) -> int:
        return self.num_routers + position

    @property
    def worker_ranks(self) -> list[int]:
        return [self.num_routers + i for i in range(len(self.participants))]

    @property
    def router_ranks(self) -> list[int]:
        return list(range(self.num_routers))


@dataclass(frozen=True)
class RowFormat:
    """One dispatched row on the wire: D activations, then k int32 slots, then k float32 weights."""

    hidden_size: int
    top_k: int
    dtype: torch.dtype

    @property
    def activation_bytes(self) -> int:  # also the bytes of one combined row
        return self.hidden_size * torch.empty(0, dtype=self.dtype).element_size()

    @property
    def row_bytes(self) -> int:
        return self.activation_bytes + 8 * self.top_k


def layer_tag(layer: int, what: str) -> str:
    return f"layer {layer} {what}"


@functools.lru_cache(maxsize=None)
def layer_tags(layer: int) -> tuple[str, int, str, int]:
    """A layer's dispatch tag and its checksum, then its combine tag and its checksum (made once
    per layer: both sides use them every step)."""
    dispatch, combine = layer_tag(layer, "dispatch"), layer_tag(layer, "combine")
    return dispatch, tag_checksum(dispatch), combine, tag_checksum(combine)


def _header(rows: int, tag: str, epoch: int, kind: int, slot_counts: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor([rows, tag_checksum(tag), epoch, kind, *slot_counts], dtype=torch.int64).to(device)


class RouterExchange:
    """A router's side of every layer of every step, over the deployment's one group."""

    def __init__(self, comm: PointToPointCommunicator, layout: GroupLayout, router_index: int,
                 num_workers: int, slots_per_worker: int, top_k: int, hidden_size: int, dtype: torch.dtype,
                 device: torch.device):
        self.comm = comm
        self.slots_per_worker = slots_per_worker
        self._trailers: list[tuple[int, int, torch.Tensor]] = []  # (layer, rank, 16 bytes), read once a step
        self.layout = layout
        self.router_index = router_index
        self.num_workers = num_workers  # workers of the placement (the group may hold fewer)
        self.format = RowFormat(hidden_size, top_k, dtype)
        self.top_k, self.hidden_size, self.dtype, self.device = top_k, hidden_size, dtype, device
        self.combine_row_bytes = self.format.activation_bytes
        self._rank_of_worker = {w: layout.worker_rank(i) for i, w in enumerate(layout.participants)}
        self._whole_group = set(self._rank_of_worker) == set(range(num_workers))  # no worker of the plan missing
        # float32 CPU routers on the sockets transport with the native kernels: a layer's sends
        # and receives in one native call (kernels/csrc/cpu_exchange.c)
        self._native = isinstance(comm, SocketCommunicator) and native_cpu.exchange_applies(dtype, device)
        self._worker_ranks = list(self._rank_of_worker.values())
        self._workers_in_rank_order = array.array("q", self._rank_of_worker)

    def exchange(self, layer: int, plan: ExchangePlan | None, hidden: torch.Tensor | None,
                 epoch: int) -> tuple[torch.Tensor | None, LayerTraffic]:
        """Dispatch ``plan``'s rows of ``hidden`` and combine their sums: ``[T, D]`` routed output.

        ``plan`` None: this router has nothing this step (zero rows to every worker).
        """
        started = time.perf_counter()
        tag, checksum, _, _ = layer_tags(layer)
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
                rows = hidden.index_select(0, plan.row_token)  # [N, D]
                packed = torch.cat([rows.view(torch.uint8), plan.row_slots.view(torch.uint8),
                                    plan.row_weights.view(torch.uint8)], dim=1)  # [N, row_bytes]
        # One receive buffer for every worker's sums and trailer, in worker order.
        row_bytes = self.combine_row_bytes
        total = sum(counts[worker] for worker in self._rank_of_worker)
        received = torch.empty(total * row_bytes + len(self._rank_of_worker) * TRAILER_BYTES, dtype=torch.uint8,
                               device=self.device)
        sums = []
        offset = 0
        for worker, rank in self._rank_of_worker.items():
            count = counts[worker]
            if count:
                sums.append(received[offset:offset + count * row_bytes])
            size = count * row_bytes + TRAILER_BYTES
            self._trailers.append((layer, rank, received[offset + size - TRAILER_BYTES:offset + size]))
            offset += size
        packed_at = time.perf_counter()
        if self._native:  # headers, rows, sums and trailers in one native call (kernels/csrc/cpu_exchange.c)
            self._native_transfer(tag, checksum, epoch, counts, slot_counts, packed, received)
            headers_bytes = len(self._rank_of_worker) * 8 * (HEADER_FIELDS + S)
        else:
            # Every worker's header in one tensor, one row each (one host-to-device copy on a GPU).
            headers = torch.tensor([[counts[worker], checksum, epoch, KIND_STEP,
                                     *slot_counts[worker * S:(worker + 1) * S]]
                                    for worker in self._rank_of_worker], dtype=torch.int64)
            if self.device.type != "cpu":
                headers = headers.to(self.device)
            headers_bytes = headers.numel() * 8
            sends, recvs = [], []
            start = offset = 0
            for index, (worker, rank) in enumerate(self._rank_of_worker.items()):
                count = counts[worker]
                sends.append((rank, headers[index]))
                if count:
                    sends.append((rank, packed[start:start + count]))
                size = count * row_bytes + TRAILER_BYTES
                recvs.append((rank, received[offset:offset + size]))
                start += count
                offset += size
            self.comm.transfer(sends, recvs, tag=tag)
        exchanged_at = time.perf_counter()
        out = None
        if plan is not None:
            if sums:
                partial = (sums[0] if len(sums) == 1 else torch.cat(sums)).view(self.dtype).view(total, -1)
                out = combine_partials(plan.num_tokens, plan.row_token, partial,
                                       min(self.top_k, len(self._rank_of_worker)))
            else:
                out = hidden.new_zeros(plan.num_tokens, self.hidden_size)
        traffic = LayerTraffic(
            rows_per_worker=list(counts),
            bytes_sent=headers_bytes + total * self.format.row_bytes,
            bytes_received=received.numel(),
            dispatch_s=packed_at - started,
            exchange_s=exchanged_at - packed_at,
        )
        return out, traffic

    def exchange_empty(self, layers: range, epoch: int) -> None:
        """Zero rows to every worker for each of ``layers``: a router with nothing this step, or
        the layers its step did not reach. Every layer's header goes out at once, then every
        trailer is read (one call): the workers find this router's headers waiting instead of
        each layer waiting for its round trip of the layer before (with routers on other cores,
        a cross-core wake-up per layer on every worker's path), as :meth:`exchange` with no
        plan would, layer by layer. The workers see the same messages in the same order. The wait
        has the deadline of that many layers (each layer's own, as before, one after the other)."""
        if not layers:
            return
        S, ranks = self.slots_per_worker, self._worker_ranks
        first, last = layers[0], layers[-1]
        tag = layer_tag(first, "dispatch") if first == last else f"layers {first}-{last} dispatch (no rows)"
        timeout_s = self.comm.timeout_s * len(layers)
        if self._native:  # one native call: no Python wake-up per trailer
            received = torch.empty(len(layers) * len(ranks), TRAILER_BYTES, dtype=torch.uint8)
            checksums = array.array("q", [layer_tags(layer)[1] for layer in layers])
            self._run_native(tag, "raymoe_router_empty_layers", timeout_s, lambda fds, wake, numbers, sent, info: (
                native_cpu.router_empty_layers(fds, wake, numbers, sent, checksums, S, epoch, received, timeout_s,
                                               info)))
            for index, layer in enumerate(layers):
                for position, rank in enumerate(ranks):
                    self._trailers.append((layer, rank, received[index * len(ranks) + position]))
            return
        headers = torch.zeros(len(layers) * len(ranks), HEADER_FIELDS + S, dtype=torch.int64)
        headers[:, 2], headers[:, 3] = epoch, KIND_STEP
        for index, layer in enumerate(layers):
            headers[index * len(ranks):(index + 1) * len(ranks), 1] = layer_tags(layer)[1]
        received = torch.empty(len(layers) * len(ranks), TRAILER_BYTES, dtype=torch.uint8, device=self.device)
        if self.device.type != "cpu":
            headers = headers.to(self.device)
        sends, recvs = [], []
        for index, layer in enumerate(layers):
            for position, rank in enumerate(ranks):
                row = index * len(ranks) + position
                sends.append((rank, headers[row]))
                recvs.append((rank, received[row]))
                self._trailers.append((layer, rank, received[row]))
        self.comm.transfer(sends, recvs, tag=tag, timeout_s=timeout_s)

    def _native_transfer(self, tag: str, checksum: int, epoch: int, counts: list[int], slot_counts: list[int],
                         packed: torch.Tensor | None, received: torch.Tensor) -> None:
        """The layer's sends and receives in one native call: each worker's header and rows out,
        its sums and trailer into ``received``."""
        timeout_s = self.comm.timeout_s
        self._run_native(tag, "raymoe_router_layer", timeout_s, lambda fds, wake, numbers, sent, info: (
            native_cpu.router_layer(
                fds, self._workers_in_rank_order, wake, numbers, sent, array.array("q", counts),
                array.array("q", slot_counts), self.slots_per_worker, epoch, checksum, packed, self.format.row_bytes,
                received, self.combine_row_bytes, timeout_s, info)))

    def _run_native(self, tag: str, name: str, timeout_s: float, routine) -> None:
        """``routine(fds, wake, received_numbers, sent, info)``, a native call over every worker's
        socket with a deadline of ``timeout_s``, under the communicator's issue lock; its failure
        raised as the Python path's."""
        info = array.array("q", bytes(8 * native_cpu.INFO_FIELDS))
        ranks = self._worker_ranks
        status = self.comm.run_native(ranks, tag, lambda fds, wake, numbers, sent: routine(fds, wake, numbers, sent,
                                                                                           info))
        if status != native_cpu.LAYER_DONE:
            error = self.comm.native_failure(status, info, ranks, tag, timeout_s)
            raise error if error is not None else ValueError(f"{name} refused its arguments (status {status}): a bug")

    def read_trailers(self) -> float:
        """The step's expert seconds (sum over layers of the slowest worker), checking every
        combine's tag; one host read for the whole step."""
        trailers, self._trailers = self._trailers, []
        if not trailers:
            return 0.0
        raw = torch.stack([t for _, _, t in trailers]).view(torch.int64).tolist()  # [n, 2], one host read
        per_layer: dict[int, float] = {}
        for (layer, rank, _), (second_bits, checksum) in zip(trailers, raw):
            second = struct.unpack("<d", struct.pack("<q", second_bits))[0]
            _, _, combine_tag, expected = layer_tags(layer)
            if checksum != expected:
                raise CollectiveMismatch(tag=combine_tag, peer=rank, world_size=self.layout.world_size)
            per_layer[layer] = max(per_layer.get(layer, 0.0), second)
        return sum(per_layer.values())

    def idle_tick(self) -> None:
        """Tell every worker that no step comes now (in the first layer's place)."""
        tag = layer_tag(0, "dispatch")
        self.comm.transfer([(rank, _header(0, tag, 0, KIND_IDLE, [0] * self.slots_per_worker, self.device))
                            for rank in self._rank_of_worker.values()], [], tag=tag)

    def agree_to_step(self, active: bool, timeout_s: float | None = None) -> bool:
        """Routers only: does any router have work this step? (one flag to and from each router)."""
        if self.layout.num_routers == 1:
            return active
        tag = "step begin"
        mine = torch.tensor([int(active), tag_checksum(tag)], dtype=torch.int64).to(self.device)
        others = [rank for rank in self.layout.router_ranks if rank != self.router_index]
        received = [torch.empty(2, dtype=torch.int64, device=self.device) for _ in others]
        self.comm.transfer([(rank, mine) for rank in others], list(zip(others, received)), tag=tag,
                           timeout_s=timeout_s)
        flags = torch.stack(received).cpu() if received else torch.zeros(0, 2, dtype=torch.int64)
        for rank, (_, checksum) in zip(others, flags.tolist()):
            if checksum != tag_checksum(tag):
                raise CollectiveMismatch(tag=tag, peer=rank, world_size=self.layout.world_size)
        return active or bool(flags[:, 0].any())


@dataclass(frozen=True)
class WorkerLayerResult:
    rows: int
    assignments: int
    compute_s: float


class WorkerExchange:
    """A worker's side: receive every router's rows, run the experts once, send the sums back."""

    def __init__(self, comm: PointToPointCommunicator, layout: GroupLayout, slots_per_worker: int, hidden_size: int,
                 top_k: int, dtype: torch.dtype, device: torch.device, executor: Executor | None = None):
        self.comm = comm
        self.executor = executor  # CPU: threads that run some experts meanwhile (kernels/expert_mlp.py)
        self.slots_per_worker = slots_per_worker
        self.layout = layout
        self.format = RowFormat(hidden_size, top_k, dtype)
        self.top_k, self.hidden_size, self.dtype, self.device = top_k, hidden_size, dtype, device
        self.row_bytes, self.activation_bytes = self.format.row_bytes, self.format.activation_bytes
        self._identity = list(range(slots_per_worker))  # pool rows when no expert is staged
        self._probe = torch.empty(1, hidden_size, dtype=dtype, device=device)  # the rows' dtype and device
        # float32 CPU workers on the sockets transport with the native kernels: a layer's headers,
        # rows, experts and sums in one native call (kernels/csrc/cpu_exchange.c)
        self._native = (isinstance(comm, SocketCommunicator) and executor is None
                        and native_cpu.exchange_applies(dtype, device))
        self._routers = layout.router_ranks

    def receive_headers(self, layer: int, timeout_s: float | None = None) -> list[list[int]] | None:
        """One header per router (host ints), or None for an idle tick (no step now)."""
        if self._native:
            headers = self._native_layer(layer, None, None, None, None, timeout_s)
            width = HEADER_FIELDS + self.slots_per_worker
            return None if headers is None else [headers[r * width:(r + 1) * width].tolist()
                                                 for r in range(len(self._routers))]
        tag, expected, _, _ = layer_tags(layer)
        width = HEADER_FIELDS + self.slots_per_worker
        received = torch.empty(self.layout.num_routers, width, dtype=torch.int64, device=self.device)
        self.comm.transfer([], [(rank, received[rank]) for rank in self.layout.router_ranks], tag=tag,
                           timeout_s=timeout_s)
        headers = received.tolist()  # the worker's one host sync per layer: sizes
        kinds = set()
        for rank, (_, checksum, _, kind, *_) in enumerate(headers):
            if checksum != expected:
                raise CollectiveMismatch(tag=tag, peer=rank, world_size=self.layout.world_size)
            kinds.add(kind)
        if kinds == {KIND_IDLE} and layer == 0:
            return None
        if kinds != {KIND_STEP}:
            raise CommError(f"collective {tag!r}: routers disagree on whether this is a step (kinds {sorted(kinds)})")
        return headers

    def serve_layer(self, layer: int, headers: list[list[int]] | None, w13: torch.Tensor, w2: torch.Tensor,
                    pool_rows: dict[int, tuple[list[int], torch.Tensor]]) -> WorkerLayerResult:
        """Rows from every router in one batch. ``headers``: this layer's, where they were read
        already (a step's first layer: they tell a step from an idle tick), else None (read
        here). ``pool_rows[epoch]``: the pool row of each local slot, as host ints and as a
        device tensor."""
        if self._native and native_cpu.experts_apply(self._probe, w13, w2):
            return self._native_layer(layer, headers, w13, w2, pool_rows)
        if headers is None:
            headers = self.receive_headers(layer)
            if headers is None:
                raise CommError(f"collective {layer_tags(layer)[0]!r}: an idle tick inside a step")
        tag = layer_tags(layer)[0]
        counts = [header[0] for header in headers]
        epochs = [header[2] for header in headers]
        total = sum(counts)
        pool_counts = [0] * w13.shape[0]
        for header, epoch in zip(headers, epochs):
            if header[0]:
                if epoch not in pool_rows:
                    raise RuntimeError(f"layer {layer}: a router uses placement epoch {epoch}, which this worker "
                                       f"does not serve (it serves {sorted(pool_rows)})")
                for slot, assigned in enumerate(header[HEADER_FIELDS:]):
                    pool_counts[pool_rows[epoch][0][slot]] += assigned
        payload = torch.empty(total, self.row_bytes, dtype=torch.uint8, device=self.device)
        recvs, start = [], 0
        for rank, count in enumerate(counts):
            if count:
                recvs.append((rank, payload[start:start + count]))
            start += count
        self.comm.transfer([], recvs, tag=tag)
        started = time.perf_counter()
        k = self.top_k
        if total and self.executor is None and native_cpu.experts_apply(self._probe, w13, w2):
            # float32 on a CPU with the native kernels: plan, gather, experts and per-row sums in one call
            used = [(count, epoch) for count, epoch in zip(counts, epochs) if count]
            maps = (pool_rows[used[0][1]][1].view(1, -1) if len(used) == 1
                    else torch.stack([pool_rows[epoch][1] for _, epoch in used]))
            assignments = sum(pool_counts)
            message = None
            if len(counts) == 1:  # one router: the sums go straight into the message that carries them back
                message = torch.empty(total * self.activation_bytes + TRAILER_BYTES, dtype=torch.uint8)
            partial = native_run_rows(payload, k, maps, [count for count, _ in used], w13, w2, assignments,
                                      out=None if message is None else message[:-TRAILER_BYTES].view(torch.float32))
            return self._send_sums(layer, counts, total, partial, assignments, time.perf_counter() - started, message)
        rows = payload[:, :self.activation_bytes].view(self.dtype)  # [N, D]
        slots = payload[:, self.activation_bytes:self.activation_bytes + 4 * k].view(torch.int32)  # [N, k]
        weights = payload[:, self.activation_bytes + 4 * k:].view(torch.float32)  # [N, k]
        pools, start = [], 0
        for count, epoch in zip(counts, epochs):
            if count:
                segment = slots[start:start + count].long()
                if pool_rows[epoch][0] == self._identity:  # slot s is pool row s (nothing staged): as is
                    pools.append(segment)
                else:
                    pools.append(torch.where(segment >= 0, pool_rows[epoch][1][segment.clamp(min=0)], -1))
            start += count
        if total:
            row_pool = pools[0] if len(pools) == 1 else torch.cat(pools)
            partial, assignments = run_rows(rows, row_pool, weights, w13, w2, pool_counts, self.executor)
        else:
            partial, assignments = torch.empty(0, self.hidden_size, dtype=self.dtype, device=self.device), 0
        return self._send_sums(layer, counts, total, partial, assignments, time.perf_counter() - started)

    def _native_layer(self, layer: int, headers: list[list[int]] | None, w13: torch.Tensor | None,
                      w2: torch.Tensor | None, pool_rows: dict[int, tuple[list[int], torch.Tensor]] | None,
                      timeout_s: float | None = None):
        """One native call (kernels/csrc/cpu_exchange.c): with ``w13`` None, only this layer's
        headers (returned flat, or None for an idle tick); else the whole layer, reading the
        headers unless given. Errors as the Python path raises them."""
        dispatch_tag, dispatch_checksum, combine_tag, combine_checksum = layer_tags(layer)
        width = HEADER_FIELDS + self.slots_per_worker
        comm, routers = self.comm, self._routers
        if headers is not None:
            flat = array.array("q", [value for header in headers for value in header])
            flags = native_cpu.LAYER_HEADERS_GIVEN
        else:
            flat = array.array("q", bytes(8 * width * len(routers)))
            flags = native_cpu.LAYER_FIRST if layer == 0 else 0
        if w13 is None:
            flags |= native_cpu.LAYER_HEADERS_ONLY
            epochs, maps = array.array("q"), None
        else:
            epochs = array.array("q", pool_rows)
            maps = (pool_rows[epochs[0]][1] if len(epochs) == 1
                    else torch.stack([pool_rows[epoch][1] for epoch in epochs]))
        timeout_s = comm.timeout_s if timeout_s is None else timeout_s
        info = array.array("q", bytes(8 * native_cpu.INFO_FIELDS))
        status = comm.run_native(routers, dispatch_tag, lambda fds, wake, received, sent: native_cpu.worker_layer(
            fds, wake, received, sent, flat, self.slots_per_worker, flags, dispatch_checksum, combine_checksum,
            epochs, maps, w13, w2, self.hidden_size, self.top_k, timeout_s, info))
        if status == native_cpu.LAYER_DONE:
            return WorkerLayerResult(rows=info[native_cpu.INFO_ROWS], assignments=info[native_cpu.INFO_ASSIGNMENTS],
                                     compute_s=info[native_cpu.INFO_COMPUTE_NS] * 1e-9)
        if status == native_cpu.LAYER_IDLE:
            return None
        if status == native_cpu.LAYER_HEADERS_READ:
            return flat
        peer = info[native_cpu.INFO_PEER]
        error = comm.native_failure(status, info, routers, combine_tag if info[native_cpu.INFO_SENDING] else dispatch_tag,
                                    timeout_s)
        if error is None:
            if status == native_cpu.LAYER_CHECKSUM:
                error = CollectiveMismatch(tag=dispatch_tag, peer=routers[peer], world_size=self.layout.world_size)
            elif status == native_cpu.LAYER_KINDS:
                kinds = sorted({flat[r * width + 3] for r in range(len(routers))})
                error = CommError(f"collective {dispatch_tag!r}: routers disagree on whether this is a step "
                                  f"(kinds {kinds})")
            elif status == native_cpu.LAYER_EPOCH:
                error = RuntimeError(f"layer {layer}: a router uses placement epoch {info[native_cpu.INFO_A]}, "
                                     f"which this worker does not serve (it serves {sorted(pool_rows)})")
            elif status == -3:
                error = ValueError("a dispatched row names a local slot or pool row outside this worker's")
            elif status == -4:
                error = ValueError("the routers' headers announced assignments that their rows do not hold")
            else:
                error = ValueError(f"raymoe_worker_layer refused its arguments (status {status}): a bug")
            # the call stopped partway through the layer's messages: nothing later can follow them
            comm.mark_broken(error if isinstance(error, CommError) else CommError(f"{dispatch_tag!r}: {error}"))
        raise error

    def _send_sums(self, layer: int, counts: list[int], total: int, partial: torch.Tensor, assignments: int,
                   compute_s: float, message: torch.Tensor | None = None) -> WorkerLayerResult:
        """Each router's rows of ``partial``, then the trailer (expert seconds, tag checksum).
        ``message``: one router's buffer whose first bytes already hold ``partial``."""
        _, _, combine_tag, combine_checksum = layer_tags(layer)
        trailer = TRAILER.pack(compute_s, combine_checksum)
        sends = []
        if message is not None or (self.device.type == "cpu" and len(counts) == 1):  # sums, then trailer: one buffer
            if message is None:
                message = torch.empty(total * self.activation_bytes + TRAILER_BYTES, dtype=torch.uint8)
                if total:
                    message[:-TRAILER_BYTES].view(self.dtype).view(total, -1).copy_(partial)
            message[-TRAILER_BYTES:].numpy()[:] = memoryview(trailer)
            sends.append((0, message))
        else:
            trailer = torch.frombuffer(bytearray(trailer), dtype=torch.uint8).to(self.device)
            partial_bytes = partial.contiguous().view(torch.uint8) if total else None
            start = 0
            for rank, count in enumerate(counts):
                body = partial_bytes[start:start + count].reshape(-1) if count else trailer[:0]
                sends.append((rank, torch.cat([body, trailer])))
                start += count
        self.comm.transfer(sends, [], tag=combine_tag)
        return WorkerLayerResult(rows=total, assignments=assignments, compute_s=compute_s)
