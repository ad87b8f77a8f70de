"""Both sides of the exchange in Python: every message through the communicator's ``transfer``.
It runs on every transport (gloo, NCCL, sockets), dtype and device; engine/exchange/native_sides.py
is its twin for float32 CPUs over sockets.

Legend: T tokens, k experts per token, D hidden, S a worker's local slots, R routers, W workers
in the group, N rows, Sp a worker's pool rows (its S slots and spare rows).

A worker here runs its experts one of two ways, chosen once when it joins (``_run_experts``):
- float32 on a CPU with the native kernels and no expert threads, over a transport that lends
  native code nothing (gloo; over sockets the native layer runs instead): ``raymoe_run_rows``,
  the native layer's own experts call, on the rows as they came (plan, gather, experts and
  per-row sums in one call);
- everywhere else (expert threads: ``cpu.worker_threads`` > 1; GPUs; bf16; shapes the kernel
  does not take): engine/experts.py::run_rows, whose grouped SwiGLU picks its kernel
  (kernels/expert_mlp.py).
Both give the same bits where both apply (tests/kernels/test_native_cpu.py).
"""

from __future__ import annotations

import time
from concurrent.futures import Executor
from dataclasses import replace

import torch

from raymoe.engine.exchange.sides import PendingExchange, RouterExchange, WorkerExchange, WorkerLayerResult, to_device
from raymoe.engine.experts import run_assignments, run_rows
from raymoe.kernels import native_cpu
from raymoe.kernels.comm.base import Communicator
from raymoe.kernels.comm.errors import CollectiveMismatch, CommError
from raymoe.kernels.comm.wire import (
    HEADER_CHECKSUM,
    HEADER_EPOCH,
    HEADER_FIELDS,
    HEADER_KIND,
    HEADER_MARK,
    HEADER_ROWS,
    KIND_IDLE,
    KIND_SPLIT,
    KIND_STEP,
    TRAILER,
    TRAILER_BYTES,
    GroupLayout,
    Part,
    header_width,
    layer_tags,
)

native_run_rows = native_cpu.run_rows  # (a module name: benchmarks/served_phases_hook.py times it)


class PythonRouterExchange(RouterExchange):
    """A router's side, each layer's messages through ``comm.transfer``."""

    def _transfer_layer(self, pending: PendingExchange, parts: Part) -> None:
        tag, checksum, _, _ = layer_tags(pending.layer)
        S = self.slots_per_worker
        counts, slot_counts = pending.counts, pending.slot_counts
        sends, recvs = [], []
        if parts & Part.SEND:
            # Every worker's header in one tensor, one row each (one non-blocking copy from pinned
            # memory on a GPU: no host sync).
            headers = to_device(torch.tensor([[counts[worker], checksum, pending.epoch, pending.kind,
                                               *slot_counts[worker * S:(worker + 1) * S]]
                                              for worker in self._rank_of_worker], dtype=torch.int64), self.device)
            start = 0
            for index, (worker, rank) in enumerate(self._rank_of_worker.items()):
                count = counts[worker]
                sends.append((rank, headers[index]))
                if count:
                    sends.append((rank, pending.packed[start:start + count]))
                start += count
        if parts & Part.RECEIVE:
            row_bytes = self.combine_row_bytes
            back = self.rows_back(counts, slot_counts)
            offset = 0
            for worker, rank in self._rank_of_worker.items():
                size = back[worker] * row_bytes + TRAILER_BYTES
                recvs.append((rank, pending.received[offset:offset + size]))
                offset += size
        # A send alone needs no host wait (on NCCL torch's stream waits for it; the rows stay
        # alive in ``pending`` until the sums are received, which cannot complete before it).
        self.comm.transfer(sends, recvs, tag=tag, wait=bool(recvs))

    def _exchange_empty(self, layers: range, epoch: int, first_kind: int, tag: str, timeout_s: float) -> torch.Tensor:
        ranks = self._worker_ranks
        headers = torch.zeros(len(layers) * len(ranks), header_width(self.slots_per_worker), dtype=torch.int64)
        headers[:, HEADER_EPOCH], headers[:, HEADER_KIND] = epoch, KIND_STEP
        headers[:len(ranks), HEADER_KIND] = first_kind
        for index, layer in enumerate(layers):
            headers[index * len(ranks):(index + 1) * len(ranks), HEADER_CHECKSUM] = layer_tags(layer)[1]
        received = torch.empty(len(layers) * len(ranks), TRAILER_BYTES, dtype=torch.uint8, device=self.device)
        headers = to_device(headers, self.device)
        sends, recvs = [], []
        for index in range(len(layers)):
            for position, rank in enumerate(ranks):
                row = index * len(ranks) + position
                sends.append((rank, headers[row]))
                recvs.append((rank, received[row]))
        self.comm.transfer(sends, recvs, tag=tag, timeout_s=timeout_s)
        return received


class PythonWorkerExchange(WorkerExchange):
    """A worker's side, each layer's messages through ``comm.transfer``; its experts run as
    the module's docstring says, the way chosen once here."""

    def __init__(self, comm: Communicator, layout: GroupLayout, slots_per_worker: int, hidden_size: int,
                 top_k: int, dtype: torch.dtype, device: torch.device, executor: Executor | None = None, *,
                 intermediate_size: int):
        super().__init__(comm, layout, slots_per_worker, hidden_size, top_k, dtype, device, executor)
        self._identity = list(range(slots_per_worker))  # pool rows when no expert is staged
        self._run_experts = (self._run_native if executor is None
                             and native_cpu.experts_fit(dtype, device, hidden_size, intermediate_size)
                             else self._run_torch)

    def receive_headers(self, layer: int, timeout_s: float | None = None) -> list[list[int]] | None:
        tag, expected, _, _ = layer_tags(layer)
        received = torch.empty(self.layout.num_routers, header_width(self.slots_per_worker), dtype=torch.int64,
                               device=self.device)
        self.comm.transfer([], [(rank, received[rank]) for rank in self.layout.router_ranks], tag=tag,
                           timeout_s=timeout_s)
        headers = received.tolist()  # the worker's one host sync per layer: sizes
        kinds = set()
        for rank, fields in enumerate(headers):
            if fields[HEADER_CHECKSUM] != expected:
                raise CollectiveMismatch(tag=tag, peer=rank, world_size=self.layout.world_size)
            kinds.add(fields[HEADER_KIND])
        if kinds == {KIND_IDLE} and layer == 0:
            self.tick_marks = [fields[HEADER_MARK] for fields in headers]
            return None
        if kinds != {KIND_STEP} and not (kinds == {KIND_SPLIT} and layer == 0):  # (a micro-batched step)
            raise CommError(f"collective {tag!r}: routers disagree on whether this is a step (kinds {sorted(kinds)})")
        return headers

    def serve_layer(self, layer: int, headers: list[list[int]] | None, w13: torch.Tensor, w2: torch.Tensor,
                    pool_rows: dict[int, tuple[list[int], torch.Tensor]]) -> WorkerLayerResult:
        if headers is None:
            headers = self.receive_headers(layer)
            if headers is None:
                raise CommError(f"collective {layer_tags(layer)[0]!r}: an idle tick inside a step")
        tag = layer_tags(layer)[0]
        counts = [fields[HEADER_ROWS] for fields in headers]
        epochs = [fields[HEADER_EPOCH] for fields in headers]
        total = sum(counts)
        pool_counts = [0] * w13.shape[0]
        for fields, epoch in zip(headers, epochs):
            if fields[HEADER_ROWS]:
                if epoch not in pool_rows:
                    raise RuntimeError(f"layer {layer}: a router uses placement epoch {epoch}, which this worker "
                                       f"does not serve (it serves {sorted(pool_rows)})")
                for slot, assigned in enumerate(fields[HEADER_FIELDS:]):
                    pool_counts[pool_rows[epoch][0][slot]] += assigned
        payload = torch.empty(total, self.row_bytes, dtype=torch.uint8, device=self.device)
        recvs, start = [], 0
        for rank, count in enumerate(counts):
            if count:
                recvs.append((rank, payload[start:start + count]))
            start += count
        # The experts read the rows on the device: no host wait for them (on NCCL torch's stream
        # waits for the group; a stuck group fails the next layer's header wait, by its deadline).
        self.comm.transfer([], recvs, tag=tag, wait=False)
        started = time.perf_counter()
        if not total:
            partial = torch.empty(0, self.hidden_size, dtype=self.dtype, device=self.device)
            return self._send_sums(layer, counts, total, partial, 0, time.perf_counter() - started)
        if self.format.per_assignment:  # each assignment's output goes back (kernels/comm/wire.py::RowFormat)
            back = [sum(fields[HEADER_FIELDS:]) for fields in headers]
            return self._run_assignments(layer, payload, counts, back, epochs, w13, w2, pool_rows, pool_counts,
                                         started)
        return self._run_experts(layer, payload, counts, epochs, w13, w2, pool_rows, pool_counts, started)

    def _run_native(self, layer, payload, counts, epochs, w13, w2, pool_rows, pool_counts, started):
        """Plan, gather, experts and per-row sums in one native call (``raymoe_run_rows``)."""
        used = [(count, epoch) for count, epoch in zip(counts, epochs) if count]
        maps = (pool_rows[used[0][1]][1].view(1, -1) if len(used) == 1
                else torch.stack([pool_rows[epoch][1] for _, epoch in used]))
        assignments = sum(pool_counts)
        total = payload.shape[0]
        message = None
        if len(counts) == 1:  # one router: the sums go straight into the message that carries them back
            message = torch.empty(total * self.activation_bytes + TRAILER_BYTES, dtype=torch.uint8)
        partial = native_run_rows(payload, self.top_k, maps, [count for count, _ in used], w13, w2, assignments,
                                  out=None if message is None else message[:-TRAILER_BYTES].view(torch.float32))
        return self._send_sums(layer, counts, total, partial, assignments, time.perf_counter() - started, message)

    def _run_torch(self, layer, payload, counts, epochs, w13, w2, pool_rows, pool_counts, started):
        """engine/experts.py::run_rows over the rows, their slots mapped to pool rows per router's epoch."""
        rows, weights, row_pool = self._rows_on_pool(payload, counts, epochs, pool_rows)
        partial, assignments = run_rows(rows, row_pool, weights, w13, w2, pool_counts, self.executor)
        return self._send_sums(layer, counts, payload.shape[0], partial, assignments, time.perf_counter() - started)

    def _run_assignments(self, layer, payload, counts, back, epochs, w13, w2, pool_rows, pool_counts, started):
        """engine/experts.py::run_assignments: each router gets its assignments' outputs (``back``)."""
        rows, _, row_pool = self._rows_on_pool(payload, counts, epochs, pool_rows)
        outputs = run_assignments(rows, row_pool, w13, w2, pool_counts, self.executor)
        assignments = sum(back)
        result = self._send_sums(layer, back, assignments, outputs, assignments, time.perf_counter() - started)
        return replace(result, rows=payload.shape[0])

    def _rows_on_pool(self, payload, counts, epochs, pool_rows):
        """The payload's rows ``[N, D]``, gate weights ``[N, k]`` and the pool row at each position
        (``[N, k]``, -1 where none), each router's slots mapped by its epoch."""
        rows, slots, weights = self.format.unpack(payload)  # [N, D], [N, k], [N, k]
        pools, start = [], 0
        for count, epoch in zip(counts, epochs):
            if count:
                segment = slots[start:start + count].long()
                if pool_rows[epoch][0] == self._identity:  # slot s is pool row s (nothing staged): as is
                    pools.append(segment)
                else:
                    pools.append(torch.where(segment >= 0, pool_rows[epoch][1][segment.clamp(min=0)], -1))
            start += count
        return rows, weights, pools[0] if len(pools) == 1 else torch.cat(pools)

    def _send_sums(self, layer: int, counts: list[int], total: int, partial: torch.Tensor, assignments: int,
                   compute_s: float, message: torch.Tensor | None = None) -> WorkerLayerResult:
        """Each router's rows of ``partial`` (``counts[r]`` of them, ``total`` in all), then the trailer
        (expert seconds, tag checksum). ``message``: one router's buffer whose first bytes already
        hold ``partial``."""
        _, _, combine_tag, combine_checksum = layer_tags(layer)
        trailer = TRAILER.pack(compute_s, combine_checksum)
        sends = []
        if message is not None or (self.device.type == "cpu" and len(counts) == 1):  # sums, then trailer: one buffer
            if message is None:
                message = torch.empty(total * self.activation_bytes + TRAILER_BYTES, dtype=torch.uint8)
                if total:
                    message[:-TRAILER_BYTES].view(self.dtype).view(total, -1).copy_(partial)
            message[-TRAILER_BYTES:].copy_(torch.frombuffer(bytearray(trailer), dtype=torch.uint8))  # (host: no sync)
            sends.append((0, message))
        else:
            trailer = to_device(torch.frombuffer(bytearray(trailer), dtype=torch.uint8), self.device)
            partial_bytes = partial.contiguous().view(torch.uint8) if total else None
            start = 0
            for rank, count in enumerate(counts):
                body = partial_bytes[start:start + count].reshape(-1) if count else trailer[:0]
                sends.append((rank, torch.cat([body, trailer])))
                start += count
        # Nothing on the host needs the sends done (their buffers are kept for the comm stream):
        # no host wait; the next layer's header wait covers them (one stream, in order).
        self.comm.transfer(sends, [], tag=combine_tag, wait=False)
        return WorkerLayerResult(rows=total, assignments=assignments, compute_s=compute_s)

