"""The ctypes face of the exchange's native layer calls (kernels/csrc/cpu_exchange.c): each side's
whole MoE layer of the expert-parallel exchange over the sockets transport in one call.

Legend: R routers, W workers in the group, S a worker's local slots, D hidden, I expert
intermediate, k experts per token, Ne placement epochs a worker serves, N rows.

Each call reads and writes the transport's framed messages itself on the sockets a communicator
lends it (``run_native``, kernels/comm/base.py) and returns a :class:`~raymoe.kernels.comm.wire.Status`
with details in an ``info`` array (``wire.Info``; what each status means and which error it
becomes: ``wire.STATUSES``). engine/exchange/native.py is the only caller. Why in C: at one
decoding sequence a layer's worker side was ~180 us of Python around ~100 us of experts, and the
router's exchange ~100 us; the served step's CPU outside the experts and the dense part fell by
more than half (docs/BENCHMARKS.md).
"""

from __future__ import annotations

import array
import os

import torch

from raymoe.kernels import native_bf16
from raymoe.kernels.comm.wire import INFO_FIELDS, LayerFlag
from raymoe.kernels.native_cpu import packed_experts
from raymoe.kernels.native_library import STATE, unavailable_reason


ENV = "RAYMOE_NATIVE_EXCHANGE"  # "0": the exchange's Python sides, the native kernels still on (docs/CONFIG.md)


def switched_on() -> bool:
    """Whether this process may take the native layer calls (``RAYMOE_NATIVE_EXCHANGE``, default on)."""
    return os.environ.get(ENV, "1").lower() not in ("0", "false", "no", "off")


def _runs_here(device: torch.device) -> bool:
    """The native library loaded and switched on, on the CPU (the transport must lend its sockets
    too: the caller checks that)."""
    return STATE.enabled and device.type == "cpu" and unavailable_reason() is None and switched_on()


def applies(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether every layer call takes rows of ``dtype`` on ``device``: float32 on the CPU."""
    return dtype == torch.float32 and _runs_here(device)


def router_applies(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether a router's messages (:func:`router_layer`, :func:`router_empty_layers`) take rows of
    ``dtype``: float32, or bfloat16 (bytes to them; :func:`router_moe_layer` stays float32's)."""
    return dtype in (torch.float32, torch.bfloat16) and _runs_here(device)


def worker_applies(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether :func:`worker_layer` takes rows of ``dtype`` on ``device``: float32, or bfloat16 where
    the bfloat16 kernels run here (its experts are theirs; each assignment's output goes back, as
    ``RowFormat.per_assignment`` says)."""
    if dtype == torch.bfloat16:
        return _runs_here(device) and native_bf16.bf16_unavailable_reason() is None
    return applies(dtype, device)


def new_info() -> array.array:
    """A zeroed ``info`` array (int64 x ``INFO_FIELDS``)."""
    return array.array("q", bytes(8 * INFO_FIELDS))


def worker_layer(fds: array.array, wake_fd: int, recv_numbers: array.array, send_numbers: array.array,
                 headers: array.array, slots: int, flags: int, dispatch_checksum: int, combine_checksum: int,
                 epochs: array.array, maps: torch.Tensor | None, w13: torch.Tensor | None, w2: torch.Tensor | None,
                 hidden: int, top_k: int, timeout_s: float, info: array.array) -> int:
    """One MoE layer of a worker in one call: read every router's header and rows, run the
    experts as kernels/native_cpu.py::run_rows does, send each router its sums and trailer (with
    bfloat16 stacks: as engine/experts.py::run_assignments does, each assignment's output back).
    ``fds`` (int32) the routers' sockets in rank order; ``recv_numbers`` / ``send_numbers``
    (int64) the next message numbers, advanced in place; ``headers`` (int64, R x (HEADER_FIELDS
    + S)) read here unless ``flags`` (``wire.LayerFlag``) says given; ``epochs`` (int64) and
    ``maps`` (``[Ne, S]`` int64) the pool row of each local slot per epoch served; ``w13``, ``w2``
    the layer's experts (None with ``HEADERS_ONLY``). Returns the status, details in ``info``.
    Releases the GIL while it runs (native_cpu.experts_apply, or native_bf16.experts_apply, checked
    by the caller)."""
    if w13 is None:
        packed13 = packed2 = maps = None
        pool, intermediate = 0, 0
    else:
        if w13.dtype == torch.bfloat16:  # read where they lie (no packed copy), by the kernels this CPU runs
            packed13, packed2 = w13.contiguous(), w2.contiguous()
            flags |= LayerFlag.BF16 | (LayerFlag.AMX if native_bf16.instructions() == "amx" else 0)
        else:
            packed13, packed2 = packed_experts(w13, w2)
        maps = maps.contiguous()
        pool, intermediate = w13.shape[0], w2.shape[2]
    pointer = lambda tensor: None if tensor is None else tensor.data_ptr()  # noqa: E731
    return STATE.library.raymoe_worker_layer(
        fds.buffer_info()[0], len(fds), wake_fd, recv_numbers.buffer_info()[0], send_numbers.buffer_info()[0],
        headers.buffer_info()[0], slots, flags, dispatch_checksum, combine_checksum, epochs.buffer_info()[0],
        len(epochs), pointer(maps), pointer(packed13), pointer(packed2), pool, hidden, intermediate, top_k,
        max(1, int(timeout_s * 1e9)), info.buffer_info()[0])


def router_layer(fds: array.array, workers: array.array, wake_fd: int, recv_numbers: array.array,
                 send_numbers: array.array, send_counts: array.array, slot_counts: array.array, slots: int,
                 epoch: int, dispatch_checksum: int, kind: int, parts: int, packed: torch.Tensor | None,
                 row_bytes: int, received: torch.Tensor, sum_bytes: int, timeout_s: float, info: array.array) -> int:
    """A router's side of one MoE layer in one call: to each worker (``fds`` int32, ``workers``
    int64: their sockets and worker indices, in rank order) its header (of ``kind``) and its rows
    of ``packed`` (the plan's rows in worker order, ``row_bytes`` each; None with no rows), then
    every worker's sums and trailer into ``received`` (contiguous uint8, in rank order).
    ``send_counts`` / ``slot_counts`` (int64) are the plan's, over every worker of the placement.
    ``parts`` (``wire.Part``): the send half, the receive half, or both. Returns the status
    (``DONE`` or a transport's), details in ``info``; releases the GIL."""
    return STATE.library.raymoe_router_layer(
        fds.buffer_info()[0], workers.buffer_info()[0], len(fds), wake_fd, recv_numbers.buffer_info()[0],
        send_numbers.buffer_info()[0], send_counts.buffer_info()[0], slot_counts.buffer_info()[0], slots, epoch,
        dispatch_checksum, kind, parts, None if packed is None else packed.data_ptr(), row_bytes, received.data_ptr(),
        sum_bytes, max(1, int(timeout_s * 1e9)), info.buffer_info()[0])


def router_moe_layer(params: array.array, ids: torch.Tensor, weights: torch.Tensor, log2phy: torch.Tensor,
                     logcnt: torch.Tensor, hidden: torch.Tensor, fds: array.array, workers: array.array,
                     recv_numbers: array.array, send_numbers: array.array, counts: array.array, rows: array.array,
                     out: torch.Tensor, expert_seconds: array.array, scratch: tuple[torch.Tensor, ...],
                     info: array.array) -> int:
    """A router's whole MoE layer in one call (float32 rows, a sum back per row, both parts): the
    plan and packed rows (as kernels/native_cpu.py::plan_pack), :func:`router_layer`'s messages,
    then the combine into ``out [T, D]`` (as engine/experts.py::combine_partials adds).
    ``params``: int64 T, k, E, R, S, W, D, n, epoch, dispatch checksum, kind, deadline ns, wake fd,
    combine checksum (every worker's trailer is checked against it: ``CHECKSUM`` naming the
    worker). ``counts`` int64 [W + W*S] (send, then slot counts), ``rows`` int64 [1] (rows sent)
    and ``expert_seconds`` (float64 [1]: the slowest worker's) come back filled; ``scratch``:
    slot [T*k], row_token [T*W] int64, packed [T*W*row_bytes], received [T*n*D*4 +
    n*TRAILER_BYTES] uint8. Returns the status (``PLAN``: nothing was sent); releases the GIL."""
    slot, row_token, packed, received = scratch
    return STATE.library.raymoe_router_moe_layer(
        params.buffer_info()[0], ids.data_ptr(), weights.data_ptr(), log2phy.data_ptr(), logcnt.data_ptr(),
        hidden.data_ptr(), fds.buffer_info()[0], workers.buffer_info()[0], recv_numbers.buffer_info()[0],
        send_numbers.buffer_info()[0], counts.buffer_info()[0], rows.buffer_info()[0], out.data_ptr(),
        expert_seconds.buffer_info()[0],
        slot.data_ptr(), row_token.data_ptr(), packed.data_ptr(), received.data_ptr(), info.buffer_info()[0])


def router_empty_layers(fds: array.array, wake_fd: int, recv_numbers: array.array, send_numbers: array.array,
                        dispatch_checksums: array.array, slots: int, epoch: int, first_kind: int,
                        received: torch.Tensor, timeout_s: float, info: array.array) -> int:
    """A router's side of several MoE layers without rows in one call: every layer's header (one
    checksum each in ``dispatch_checksums``, int64; the first of kind ``first_kind``, the others
    ``KIND_STEP``) to each worker (``fds``, in rank order) at once, then every layer's trailer
    from each into ``received`` (contiguous uint8, ``[layers][workers][TRAILER_BYTES]``).
    Statuses and ``info`` as :func:`router_layer`'s; releases the GIL."""
    return STATE.library.raymoe_router_empty_layers(
        fds.buffer_info()[0], len(fds), wake_fd, recv_numbers.buffer_info()[0], send_numbers.buffer_info()[0],
        len(dispatch_checksums), dispatch_checksums.buffer_info()[0], slots, epoch, first_kind, received.data_ptr(),
        max(1, int(timeout_s * 1e9)), info.buffer_info()[0])
