"""Both sides of the exchange in one native call per layer (kernels/csrc/cpu_exchange.c through
kernels/native_exchange.py): float32 and bfloat16 CPUs (a router's whole layer in one call: float32) over a transport that lends native code its
connections (``comm.native_routines``: the sockets transport). The messages, their numbering and
the errors are engine/exchange/python_sides.py's, so a group may mix the two
(tests/engine/test_ep_native_layer.py). A router may go further and hand the native side the
gate's choices instead of a plan (``NativeRouterExchange.moe_layer``): plan, packed rows,
messages, combine and the trailers' checks in one call (``raymoe_router_moe_layer``), where
every worker of the placement is in the group.

Legend: R routers, W workers in the group, S a worker's local slots, Ne placement epochs served.

A native call returns a status (kernels/comm/wire.py's ``STATUSES`` says which error each
becomes): the transport's own go to ``comm.native_failure``, the exchange's are raised here, and
either way the communicator is broken (the call stopped partway through the layer's messages).
"""

from __future__ import annotations

import array
import time
from concurrent.futures import Executor

import torch

from raymoe.engine.exchange.sides import PendingExchange, RouterExchange, WorkerExchange, WorkerLayerResult
from raymoe.engine.telemetry import LayerTraffic
from raymoe.kernels import native_exchange
from raymoe.kernels.comm.base import Communicator
from raymoe.kernels.comm.errors import CollectiveMismatch, CommError
from raymoe.kernels.comm.wire import (
    HEADER_KIND,
    HEADER_MARK,
    TRAILER_BYTES,
    GroupLayout,
    Info,
    LayerFlag,
    Part,
    Status,
    header_width,
    layer_tags,
    row_bytes,
)

# (plain ints: read on every layer)
_DONE, _IDLE, _HEADERS_READ = int(Status.DONE), int(Status.IDLE), int(Status.HEADERS_READ)
_PLAN, _CHECKSUM = int(Status.PLAN), int(Status.CHECKSUM)
_ROWS, _ASSIGNMENTS, _COMPUTE_NS = int(Info.ROWS), int(Info.ASSIGNMENTS), int(Info.COMPUTE_NS)
_HEADERS_GIVEN, _HEADERS_ONLY, _FIRST_LAYER = (int(LayerFlag.HEADERS_GIVEN), int(LayerFlag.HEADERS_ONLY),
                                               int(LayerFlag.FIRST_LAYER))


class NativeRouterExchange(RouterExchange):
    """A router's side: each layer's headers, rows, sums and trailers in one native call."""

    def __init__(self, comm: Communicator, layout: GroupLayout, router_index: int, num_workers: int,
                 slots_per_worker: int, top_k: int, hidden_size: int, dtype: torch.dtype, device: torch.device):
        super().__init__(comm, layout, router_index, num_workers, slots_per_worker, top_k, hidden_size, dtype, device)
        self._workers_in_rank_order = array.array("q", self._rank_of_worker)
        self._scratch: tuple[torch.Tensor, ...] | None = None  # moe_layer's, grown as needed
        self._scratch_tokens = 0
        # moe_layer's outputs besides the sums: counts [W + W*S], rows sent, expert seconds, info
        self._moe_outputs = (array.array("q", bytes(8 * (num_workers + num_workers * slots_per_worker))),
                             array.array("q", (0,)), array.array("d", (0.0,)), native_exchange.new_info())

    def _transfer_layer(self, pending: PendingExchange, parts: Part) -> None:
        counts, slot_counts = array.array("q", pending.counts), array.array("q", pending.slot_counts)
        if self.format.per_assignment and parts & Part.RECEIVE:
            # What comes back is each worker's assignments, not its rows: the receive is its own call,
            # sized by them (raymoe_router_layer reads ``counts[w]`` replies of combine_row_bytes).
            if parts & Part.SEND:
                self._router_layer(pending, Part.SEND, counts, slot_counts)
            back = array.array("q", self.rows_back(pending.counts, pending.slot_counts))
            self._router_layer(pending, Part.RECEIVE, back, slot_counts)
            return
        self._router_layer(pending, parts, counts, slot_counts)

    def _router_layer(self, pending: PendingExchange, parts: Part, counts: array.array,
                      slot_counts: array.array) -> None:
        tag, checksum, _, _ = layer_tags(pending.layer)
        timeout_s = self.comm.timeout_s
        self._run(tag, "raymoe_router_layer", timeout_s, lambda fds, wake, numbers, sent, info: (
            native_exchange.router_layer(
                fds, self._workers_in_rank_order, wake, numbers, sent, counts, slot_counts, self.slots_per_worker,
                pending.epoch, checksum, pending.kind, int(parts), pending.packed, self.format.row_bytes,
                pending.received, self.combine_row_bytes, timeout_s, info)))

    def moe_layer_applies(self) -> bool:
        """Whether :meth:`moe_layer` takes this group's layers: every worker of the placement in
        the group (the rows' order is the workers'), and a sum back per row (float32)."""
        return self._whole_group and not self.format.per_assignment

    def moe_layer(self, layer: int, topk_ids: torch.Tensor, topk_weights: torch.Tensor, log2phy: torch.Tensor,
                  logcnt: torch.Tensor, hidden: torch.Tensor, epoch: int,
                  kind: int) -> tuple[torch.Tensor, list[int], list[int], LayerTraffic]:
        """A whole MoE layer in one native call (:meth:`moe_layer_applies`; float32 CPU, no
        capacity drops, no micro-batches): plan, pack, send, receive and combine, where
        :meth:`exchange` takes a Python plan and a dozen small tensor calls around its transfer.
        The messages, the plan and the output's bits are the same (tests/engine/test_ep_native_layer.py).
        Returns ``(out [T, D], send_counts [W], slot_counts [W*S], traffic)``."""
        started = time.perf_counter()
        tokens, k = topk_ids.shape
        width = hidden.shape[1]
        workers, slots, n = self.num_workers, self.slots_per_worker, len(self._worker_ranks)
        ids = topk_ids if topk_ids.dtype == torch.int64 and topk_ids.is_contiguous() else \
            topk_ids.to(torch.int64).contiguous()
        weights = topk_weights if topk_weights.dtype == torch.float32 and topk_weights.is_contiguous() else \
            topk_weights.to(torch.float32).contiguous()
        hidden = hidden.contiguous()
        scratch = self._moe_scratch(tokens, k, width, n)
        counts, rows, expert_seconds, info = self._moe_outputs  # (filled by the call; read before the next)
        out = torch.empty(tokens, width, dtype=torch.float32)
        tag, checksum, combine_tag, combine_checksum = layer_tags(layer)
        timeout_s = self.comm.timeout_s
        status = self.comm.run_native(self._worker_ranks, tag, lambda fds, wake, numbers, sent: (
            native_exchange.router_moe_layer(
                array.array("q", (tokens, k, log2phy.shape[0], log2phy.shape[1], slots, workers, width, n, epoch,
                                  checksum, kind, max(1, int(timeout_s * 1e9)), wake, combine_checksum)),
                ids, weights, log2phy, logcnt, hidden, fds, self._workers_in_rank_order, numbers, sent, counts,
                rows, out, expert_seconds, scratch, info)))
        if status != _DONE:
            if status == _PLAN:  # nothing was sent: the group stays usable
                raise ValueError("a gate's expert, or the placement's replica or slot for it, is out of range")
            if status == _CHECKSUM:  # a sum of another layer: the ranks called collectives in different orders
                raise self.comm.mark_broken(CollectiveMismatch(tag=combine_tag, peer=self._worker_ranks[info[0]],
                                                               world_size=self.layout.world_size))
            error = self.comm.native_failure(status, info, self._worker_ranks, tag, timeout_s)
            raise error if error is not None else ValueError(
                f"raymoe_router_moe_layer refused its arguments (status {status}): a bug")
        self.checked_expert_s += expert_seconds[0]  # (its trailers are checked: read_trailers adds it)
        counts = counts.tolist()
        send_counts, slot_counts = counts[:workers], counts[workers:]
        num_rows = int(rows[0])
        traffic = LayerTraffic(rows_per_worker=send_counts,
                               bytes_sent=self._headers_bytes + num_rows * self.format.row_bytes,
                               bytes_received=num_rows * self.combine_row_bytes + n * TRAILER_BYTES,
                               dispatch_s=0.0, exchange_s=time.perf_counter() - started)
        return out, send_counts, slot_counts, traffic

    def _moe_scratch(self, tokens: int, k: int, width: int, n: int) -> tuple[torch.Tensor, ...]:
        """:meth:`moe_layer`'s scratch (slot, row_token, packed, received), grown to the largest
        batch seen and kept (a decode step's layers reuse it)."""
        scratch = self._scratch
        if scratch is None or self._scratch_tokens < tokens:
            room = self._scratch_tokens = max(tokens, 1)
            most = room * self.num_workers
            scratch = self._scratch = (
                torch.empty(room * k, dtype=torch.int64), torch.empty(most, dtype=torch.int64),
                torch.empty(most * row_bytes(width, k), dtype=torch.uint8),
                torch.empty(room * n * width * 4 + n * TRAILER_BYTES, dtype=torch.uint8))
        return scratch

    def _exchange_empty(self, layers: range, epoch: int, first_kind: int, tag: str, timeout_s: float) -> torch.Tensor:
        # one native call: no Python wake-up per trailer
        received = torch.empty(len(layers) * len(self._worker_ranks), TRAILER_BYTES, dtype=torch.uint8)
        checksums = array.array("q", [layer_tags(layer)[1] for layer in layers])
        self._run(tag, "raymoe_router_empty_layers", timeout_s, lambda fds, wake, numbers, sent, info: (
            native_exchange.router_empty_layers(fds, wake, numbers, sent, checksums, self.slots_per_worker, epoch,
                                                first_kind, received, timeout_s, info)))
        return received

    def _run(self, tag: str, name: str, timeout_s: float, routine) -> None:
        """``routine(fds, wake, received_numbers, sent, info)``, a native call over every worker's
        socket with a deadline of ``timeout_s``, under the communicator's issue lock; its failure
        raised as the Python path's."""
        info = native_exchange.new_info()
        ranks = self._worker_ranks
        status = self.comm.run_native(ranks, tag, lambda fds, wake, numbers, sent: routine(fds, wake, numbers, sent,
                                                                                           info))
        if status != _DONE:
            error = self.comm.native_failure(status, info, ranks, tag, timeout_s)
            raise error if error is not None else ValueError(f"{name} refused its arguments (status {status}): a bug")


class NativeWorkerExchange(WorkerExchange):
    """A worker's side: each layer's headers, rows, experts and sums in one native call."""

    def __init__(self, comm: Communicator, layout: GroupLayout, slots_per_worker: int, hidden_size: int,
                 top_k: int, dtype: torch.dtype, device: torch.device, executor: Executor | None = None):
        if executor is not None:
            raise ValueError("the native layer runs its experts on the calling thread: no executor")
        super().__init__(comm, layout, slots_per_worker, hidden_size, top_k, dtype, device, executor)
        self._pool_cache: dict[int, tuple] = {}  # id(pool_rows) -> (pool_rows, epochs, maps): _pool_maps

    def receive_headers(self, layer: int, timeout_s: float | None = None) -> list[list[int]] | None:
        headers = self._layer(layer, None, None, None, None, timeout_s)
        width = header_width(self.slots_per_worker)
        return None if headers is None else [headers[r * width:(r + 1) * width].tolist()
                                             for r in range(len(self._routers))]

    def serve_layer(self, layer: int, headers: list[list[int]] | None, w13: torch.Tensor, w2: torch.Tensor,
                    pool_rows: dict[int, tuple[list[int], torch.Tensor]]) -> WorkerLayerResult:
        return self._layer(layer, headers, w13, w2, pool_rows)

    def _layer(self, layer: int, headers: list[list[int]] | None, w13: torch.Tensor | None,
               w2: torch.Tensor | None, pool_rows: dict[int, tuple[list[int], torch.Tensor]] | None,
               timeout_s: float | None = None):
        """One native call (kernels/csrc/cpu_exchange.c): with ``w13`` None, only this layer's
        headers (returned flat, or None for an idle tick); else the whole layer, reading the
        headers unless given. Errors as the Python path raises them."""
        dispatch_tag, dispatch_checksum, combine_tag, combine_checksum = layer_tags(layer)
        width = header_width(self.slots_per_worker)
        comm, routers = self.comm, self._routers
        if headers is not None:
            flat = array.array("q", [value for fields in headers for value in fields])
            flags = _HEADERS_GIVEN
        else:
            flat = array.array("q", bytes(8 * width * len(routers)))
            flags = _FIRST_LAYER if layer == 0 else 0
        if w13 is None:
            flags |= _HEADERS_ONLY
            epochs, maps = array.array("q"), None
        else:
            epochs, maps = self._pool_maps(pool_rows)
        timeout_s = comm.timeout_s if timeout_s is None else timeout_s
        info = native_exchange.new_info()
        status = comm.run_native(routers, dispatch_tag, lambda fds, wake, received, sent: native_exchange.worker_layer(
            fds, wake, received, sent, flat, self.slots_per_worker, flags, dispatch_checksum, combine_checksum,
            epochs, maps, w13, w2, self.hidden_size, self.top_k, timeout_s, info))
        if status == _DONE:
            return WorkerLayerResult(rows=info[_ROWS], assignments=info[_ASSIGNMENTS],
                                     compute_s=info[_COMPUTE_NS] * 1e-9)
        if status == _IDLE:  # (the headers were read into ``flat``: each router's mark is there)
            self.tick_marks = [flat[r * width + HEADER_MARK] for r in range(len(routers))]
            return None
        if status == _HEADERS_READ:
            return flat
        error = comm.native_failure(status, info, routers, combine_tag if info[Info.SENDING] else dispatch_tag,
                                    timeout_s)
        if error is None:
            error, failure = self._exchange_error(status, info, layer, flat, width, pool_rows)
            # the call stopped partway through the layer's messages: nothing later can follow them
            comm.mark_broken(failure)
        raise error

    def _pool_maps(self, pool_rows: dict[int, tuple[list[int], torch.Tensor]]) -> tuple[array.array, torch.Tensor]:
        """The epochs served (int64) and their pool rows ``[Ne, S]`` for the native call, made once
        per ``pool_rows`` (the serving loop passes each layer the same dict while the placement
        holds; a new placement is a new dict)."""
        cached = self._pool_cache.get(id(pool_rows))
        if cached is not None and cached[0] is pool_rows:
            return cached[1], cached[2]
        epochs = array.array("q", pool_rows)
        maps = (pool_rows[epochs[0]][1] if len(epochs) == 1
                else torch.stack([pool_rows[epoch][1] for epoch in epochs])).contiguous()
        if len(self._pool_cache) >= 256:  # placements gone by: their dicts are not passed again
            self._pool_cache.clear()
        self._pool_cache[id(pool_rows)] = (pool_rows, epochs, maps)
        return epochs, maps

    def _exchange_error(self, status: int, info: array.array, layer: int, flat: array.array, width: int,
                        pool_rows) -> tuple[Exception, CommError]:
        """The error of a status that is the exchange's, not the transport's (wire.STATUSES), and
        the communicator failure it is (the error itself where it is one)."""
        dispatch_tag, routers = layer_tags(layer)[0], self._routers
        if status == Status.CHECKSUM:
            error = CollectiveMismatch(tag=dispatch_tag, peer=routers[info[Info.PEER]],
                                       world_size=self.layout.world_size)
            return error, error
        if status == Status.KINDS:
            kinds = sorted({flat[r * width + HEADER_KIND] for r in range(len(routers))})
            error = CommError(f"collective {dispatch_tag!r}: routers disagree on whether this is a step "
                              f"(kinds {kinds})")
            return error, error
        if status == Status.EPOCH:
            error = RuntimeError(f"layer {layer}: a router uses placement epoch {info[Info.A]}, which this worker "
                                 f"does not serve (it serves {sorted(pool_rows)})")
        elif status == Status.BAD_SLOT:
            error = ValueError("a dispatched row names a local slot or pool row outside this worker's")
        elif status == Status.ASSIGNMENTS:
            error = ValueError("the routers' headers announced assignments that their rows do not hold")
        else:
            error = ValueError(f"raymoe_worker_layer refused its arguments (status {status}): a bug")
        return error, CommError(f"{dispatch_tag!r}: {error}")
