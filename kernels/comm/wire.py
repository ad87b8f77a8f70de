"""What travels between the ranks of the expert-parallel group, defined once: the one table
the Python exchange (engine/exchange/), the sockets transport (kernels/comm/sockets.py) and
the native exchange (kernels/csrc/cpu_exchange.c, through kernels/native_exchange.py) read.

Legend: T tokens, k experts per token, D hidden, S a worker's local slots, R routers, W workers
in the group, N rows.

The C side takes these numbers from here too: the native library is compiled with a header
generated from :data:`C_CONSTANTS` (kernels/native_library.py), and reports back what it was
built with, which the loader and tests/kernels/test_native_cpu.py compare with this module.

- **Group layout** (:class:`GroupLayout`): ranks ``0 .. R-1`` are the routers, rank ``R + i``
  is worker ``participants[i]``.
- **Frame** (:data:`FRAME`): every message on a stream transport is a 16-byte frame (int64
  message number: the k-th message between two ranks carries k; int64 byte count) and then
  its bytes.
- **Per MoE layer**, two exchanges:

  1. dispatch, router -> worker: a header of ``HEADER_FIELDS + S`` int64 (rows, tag checksum,
     placement epoch, kind, then the assignments of each of the worker's S local slots), then,
     if rows > 0, the rows in :class:`RowFormat` (D activations, k int32 local slots, k float32
     gate weights; slot -1: that position runs nowhere on this worker);
  2. combine, worker -> router: the rows' weighted sums (D activations each), then the
     :data:`TRAILER` (float64 expert seconds, int64 combine tag checksum).

  A step in two micro-batches (engine/model.py::MoEModel.forward_micro_batches) has two
  exchanges a layer, numbered ``2 * layer + half`` (the tags and checksums are the exchange's
  number); its first header is of kind ``KIND_SPLIT``, every later one ``KIND_STEP``.

  A header of kind ``KIND_IDLE`` in the first layer's place says "no step" (an *idle
  tick*). Its epoch field (:data:`HEADER_MARK`) carries the router's migration mark (0:
  none): at the first tick that carries a mark, every worker runs the expert copy queued
  under it right there, between two EP collectives, so copies and the EP exchange are ordered
  the same way on every rank (actors/expert_worker.py).
- **Native statuses** (:class:`Status`, :data:`STATUSES`): what a native routine of the
  exchange returns, who turns it into which error, with details in an ``Info`` array.
"""

from __future__ import annotations

import enum
import functools
import struct
from dataclasses import dataclass

import torch

from raymoe.kernels.comm.layout import tag_checksum

# ---- the transport's frame ------------------------------------------------------------------
FRAME = struct.Struct("<qq")  # message number, bytes (sockets.py and cpu_exchange.c)


# ---- the group --------------------------------------------------------------------------------
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


# ---- a dispatched row -------------------------------------------------------------------------
SLOT_DTYPE = torch.int32  # a row's local slot at each of its k positions
WEIGHT_DTYPE = torch.float32  # a row's gate weight at each of its k positions
SLOT_BYTES = 4
WEIGHT_BYTES = 4


def row_bytes(hidden_size: int, top_k: int, activation_bytes: int = 4) -> int:
    """Bytes of one dispatched row of ``hidden_size`` activations of ``activation_bytes`` each
    (float32 by default: the native path's) and ``top_k`` positions."""
    return hidden_size * activation_bytes + (SLOT_BYTES + WEIGHT_BYTES) * top_k


@dataclass(frozen=True)
class RowFormat:
    """One dispatched row on the wire: D activations, then k int32 slots, then k float32 weights
    (``[N, row_bytes]`` uint8 for N rows). A combined row is D activations: in float32 one per
    dispatched row (its positions' weighted sum), in every other dtype one per assignment
    (:attr:`per_assignment`)."""

    hidden_size: int
    top_k: int
    dtype: torch.dtype

    @property
    def activation_bytes(self) -> int:  # also the bytes of one combined row
        return self.hidden_size * self.dtype.itemsize

    @property
    def row_bytes(self) -> int:
        return row_bytes(self.hidden_size, self.top_k, self.dtype.itemsize)

    @property
    def per_assignment(self) -> bool:
        """Whether a worker sends back each assignment's expert output, unweighted, in (row, position)
        order, for the router to combine in position order in float32 (engine/experts.py::
        combine_assignments, as the in-process engine does): in bfloat16 or float16, a worker's own
        sums would be rounded before the router adds them, and where the experts ran would change
        the bits. In float32 a worker sends its rows' weighted sums (a row per dispatched row:
        fewer bytes)."""
        return self.dtype != torch.float32

    def pack(self, rows: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """``[N, D]`` activations, ``[N, k]`` int32 slots, ``[N, k]`` float32 weights -> ``[N, row_bytes]``."""
        return torch.cat([rows.view(torch.uint8), slots.view(torch.uint8), weights.view(torch.uint8)], dim=1)

    def unpack(self, packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``[N, row_bytes]`` -> views of its activations ``[N, D]``, slots and weights ``[N, k]``."""
        return (packed[:, :self.activation_bytes].view(self.dtype), *self.positions(packed))

    def positions(self, packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``[N, row_bytes]`` -> views of its slots and weights ``[N, k]`` (the activations left alone)."""
        activations = self.activation_bytes
        slots_end = activations + SLOT_BYTES * self.top_k
        return packed[:, activations:slots_end].view(SLOT_DTYPE), packed[:, slots_end:].view(WEIGHT_DTYPE)


# ---- the dispatch header and the combine trailer ------------------------------------------
HEADER_ROWS, HEADER_CHECKSUM, HEADER_EPOCH, HEADER_KIND = range(4)  # int64 fields, then S slot counts
HEADER_FIELDS = 4
KIND_STEP = 1  # a layer of a step
KIND_IDLE = 2  # no step now (in the first layer's place only)
KIND_SPLIT = 3  # a step in two micro-batches (in the first exchange's place only; KIND_STEP after it)
HEADER_MARK = HEADER_EPOCH  # an idle tick's epoch field: the router's migration mark (0: none)
TRAILER = struct.Struct("=dq")  # float64 expert seconds, int64 tag checksum (native order, as tensor views read it)
TRAILER_BYTES = TRAILER.size


def header_width(slots: int) -> int:
    """int64 values in a dispatch header to a worker of ``slots`` local slots."""
    return HEADER_FIELDS + slots


def layer_tag(layer: int, what: str) -> str:
    return f"layer {layer} {what}"


@functools.lru_cache(maxsize=None)
def layer_tags(layer: int) -> tuple[str, int, str, int]:
    """A layer's dispatch tag and its checksum, then its combine tag and its checksum (made once
    per layer: both sides use them every step)."""
    dispatch, combine = layer_tag(layer, "dispatch"), layer_tag(layer, "combine")
    return dispatch, tag_checksum(dispatch), combine, tag_checksum(combine)


def header(rows: int, tag: str, epoch: int, kind: int, slot_counts: list[int], device: torch.device) -> torch.Tensor:
    """One dispatch header as an int64 tensor on ``device``."""
    return torch.tensor([rows, tag_checksum(tag), epoch, kind, *slot_counts], dtype=torch.int64).to(device)


# ---- the native routines of the exchange (kernels/csrc/cpu_exchange.c) ----------------------
class LayerFlag(enum.IntFlag):
    """raymoe_worker_layer's flags."""

    HEADERS_GIVEN = 1  # the headers were read by an earlier call (HEADERS_ONLY)
    HEADERS_ONLY = 2  # read and check this layer's headers, nothing else
    FIRST_LAYER = 4  # an idle tick from every router is allowed here
    BF16 = 8  # bfloat16 rows; each assignment's output goes back (RowFormat.per_assignment)
    AMX = 16  # with BF16: the experts on AMX's kernels (kernels/native_bf16.py::instructions)


class Part(enum.IntFlag):
    """raymoe_router_layer's ``parts``: which half of a layer's exchange the call runs."""

    SEND = 1  # the headers and rows
    RECEIVE = 2  # the sums and trailers


class Info(enum.IntEnum):
    """The fields of a native routine's ``info`` array (int64 x ``INFO_FIELDS``)."""

    PEER = 0  # the index (into the routine's peers) of the rank to blame, else -1
    A, B, C, D = 1, 2, 3, 4  # details: see STATUSES
    ROWS = 5  # DONE: rows served
    ASSIGNMENTS = 6  # DONE: assignments run
    COMPUTE_NS = 7  # DONE: expert nanoseconds
    SENDING = 8  # 1 when the failure happened sending


INFO_FIELDS = len(Info)


class Status(enum.IntEnum):
    """What a native routine of the exchange returns (raymoe_run_rows's own statuses included)."""

    DONE = 0
    IDLE = 1
    HEADERS_READ = 2
    SHAPE = -1  # raymoe_run_rows: a shape it does not take (a bug above it)
    MEMORY_ROWS = -2  # raymoe_run_rows: out of memory
    BAD_SLOT = -3  # a dispatched row names a local slot or pool row outside the worker's
    ASSIGNMENTS = -4  # the headers announced assignments the rows do not hold
    TIMEOUT = -10
    LOST = -11
    FRAME = -12
    CHECKSUM = -13
    KINDS = -14
    EPOCH = -15
    ABORTED = -16
    MEMORY = -17
    ARGUMENTS = -18
    PLAN = -19  # raymoe_router_moe_layer: a gate's expert, or the placement's replica or slot for it, out of range


@dataclass(frozen=True)
class StatusFacts:
    """Who turns a status into which error, and what its ``info`` holds."""

    raised_by: str  # "-" (not an error), "transport" (the communicator's native_failure), "exchange" or "bug"
    error: str  # the error it becomes
    info: str  # what info[A..D] hold


# statuses -> errors: the one table (the transport's rows: SocketCommunicator.native_failure; the
# exchange's: engine/exchange/native.py). Every failure breaks the communicator: the call stopped
# partway through the layer's messages, and nothing later can follow them.
STATUSES: dict[Status, StatusFacts] = {
    Status.DONE: StatusFacts("-", "-", "ROWS, ASSIGNMENTS, COMPUTE_NS"),
    Status.IDLE: StatusFacts("-", "- (an idle tick: no step now)", "-"),
    Status.HEADERS_READ: StatusFacts("-", "- (the headers checked out)", "-"),
    Status.TIMEOUT: StatusFacts("transport", "CollectiveTimeout naming PEER", "-"),
    Status.LOST: StatusFacts("transport", "PeerLostError naming PEER", "A: errno, or 0 for a closed connection"),
    Status.FRAME: StatusFacts("transport", "CommError: the ranks called collectives in different orders",
                              "A, B: the number and size got; C, D: those expected"),
    Status.ABORTED: StatusFacts("transport", "CommClosedError", "-"),
    Status.CHECKSUM: StatusFacts("exchange", "CollectiveMismatch naming PEER", "A: the checksum got"),
    Status.KINDS: StatusFacts("exchange", "CommError: routers disagree on whether this is a step", "-"),
    Status.EPOCH: StatusFacts("exchange", "RuntimeError: an epoch the worker does not serve", "A: the epoch"),
    Status.BAD_SLOT: StatusFacts("exchange", "ValueError: a slot or pool row outside the worker's", "-"),
    Status.ASSIGNMENTS: StatusFacts("exchange", "ValueError: headers and rows disagree on assignments", "-"),
    Status.SHAPE: StatusFacts("bug", "ValueError: refused its arguments", "-"),
    Status.MEMORY_ROWS: StatusFacts("bug", "ValueError: refused its arguments (out of memory)", "-"),
    Status.MEMORY: StatusFacts("bug", "ValueError: refused its arguments (out of memory)", "-"),
    Status.ARGUMENTS: StatusFacts("bug", "ValueError: refused its arguments", "-"),
    Status.PLAN: StatusFacts("exchange", "ValueError: a gate's expert, or its replica or slot, out of range "
                             "(nothing was sent)", "-"),
}

# The numbers the C side is compiled with (a generated header, kernels/native_library.py) and
# reports back (raymoe_constants): every one of them is defined above.
C_CONSTANTS: dict[str, int] = {
    "FRAME_BYTES": FRAME.size,
    "HEADER_FIELDS": HEADER_FIELDS,
    "HEADER_ROWS": HEADER_ROWS,
    "HEADER_CHECKSUM": HEADER_CHECKSUM,
    "HEADER_EPOCH": HEADER_EPOCH,
    "HEADER_KIND": HEADER_KIND,
    "KIND_STEP": KIND_STEP,
    "KIND_IDLE": KIND_IDLE,
    "KIND_SPLIT": KIND_SPLIT,
    "TRAILER_BYTES": TRAILER_BYTES,
    "SLOT_BYTES": SLOT_BYTES,
    "WEIGHT_BYTES": WEIGHT_BYTES,
    **{f"FLAG_{flag.name}": int(flag) for flag in LayerFlag},
    **{f"PART_{part.name}": int(part) for part in Part},
    **{f"STATUS_{status.name}": int(status) for status in Status},
    **{f"INFO_{field.name}": int(field) for field in Info},
    "INFO_FIELDS": INFO_FIELDS,
}
