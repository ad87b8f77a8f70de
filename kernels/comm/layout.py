"""Pure parts of an all-to-all-v, shared by every backend: no cupy, no process group.

Dimension legend: W world size, R rows, E elements per row (product of the row shape).

An all-to-all-v moves rows: this rank's send buffer is [sum(send_counts), *row_shape] with
the rows for peer p contiguous and peers in rank order; the receive buffer has the same
layout over recv_counts. Backends move flat element ranges, computed here once.

The count exchange carries a small header per peer, (count, tag checksum), so that a peer
that entered a different collective is reported as a `CollectiveMismatch` instead of
silently exchanging the wrong data.
"""

from __future__ import annotations

import enum
import functools
import math
import zlib
from dataclasses import dataclass
from typing import Sequence

import torch

from raymoe.kernels.comm.errors import CollectiveMismatch, CommError

COUNT_HEADER_WIDTH = 2  # one header row per peer: (row count, tag checksum)


class NcclDataType(enum.IntEnum):
    """`ncclDataType_t` values from nccl.h (stable across NCCL 2.x)."""

    INT8 = 0
    UINT8 = 1
    INT32 = 2
    UINT32 = 3
    INT64 = 4
    UINT64 = 5
    FLOAT16 = 6
    FLOAT32 = 7
    FLOAT64 = 8
    BFLOAT16 = 9  # NCCL >= 2.10


TORCH_TO_NCCL = {
    torch.int8: NcclDataType.INT8,
    torch.uint8: NcclDataType.UINT8,
    torch.bool: NcclDataType.UINT8,  # one byte per element; moved bit for bit
    torch.int32: NcclDataType.INT32,
    torch.int64: NcclDataType.INT64,
    torch.float16: NcclDataType.FLOAT16,
    torch.float32: NcclDataType.FLOAT32,
    torch.float64: NcclDataType.FLOAT64,
    torch.bfloat16: NcclDataType.BFLOAT16,
}


def nccl_data_type(dtype: torch.dtype) -> NcclDataType:
    """The NCCL data type that moves tensors of `dtype` element by element."""
    if dtype not in TORCH_TO_NCCL:
        supported = ", ".join(str(known) for known in TORCH_TO_NCCL)
        raise TypeError(f"dtype {dtype} has no NCCL equivalent; supported: {supported}")
    return TORCH_TO_NCCL[dtype]


def validate_counts(counts: Sequence[int] | torch.Tensor, world_size: int, *, name: str) -> tuple[int, ...]:
    """Row counts per peer as plain ints: exactly `world_size` of them, none negative."""
    if isinstance(counts, torch.Tensor):
        if counts.dim() != 1 or counts.dtype.is_floating_point or counts.dtype.is_complex:
            raise CommError(f"{name} must be a 1-D integer tensor, got {counts.dtype} {tuple(counts.shape)}")
        counts = counts.tolist()
    values = tuple(counts)
    if len(values) != world_size:
        raise CommError(f"{name} has {len(values)} entries, expected one per rank ({world_size})")
    for peer, value in enumerate(values):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise CommError(f"{name}[{peer}] must be a non-negative int, got {value!r}")
    return values


def row_offsets(counts: Sequence[int]) -> tuple[int, ...]:
    """Exclusive prefix sum: the first row of each peer, then the total. [W + 1]"""
    offsets = [0]
    for count in counts:
        offsets.append(offsets[-1] + count)
    return tuple(offsets)


@dataclass(frozen=True)
class PeerSlice:
    """The flat element ranges exchanged with one peer."""

    peer: int
    send_offset: int  # first element sent to `peer`, in the flat send buffer
    send_numel: int
    recv_offset: int  # first element received from `peer`, in the flat receive buffer
    recv_numel: int


@dataclass(frozen=True)
class AllToAllLayout:
    """Where each peer's rows sit in the flat send and receive buffers."""

    send_counts: tuple[int, ...]  # [W] rows
    recv_counts: tuple[int, ...]  # [W] rows
    row_shape: tuple[int, ...]
    peers: tuple[PeerSlice, ...]  # [W], in rank order

    @property
    def row_numel(self) -> int:
        return math.prod(self.row_shape)

    @property
    def send_rows(self) -> int:
        return sum(self.send_counts)

    @property
    def recv_rows(self) -> int:
        return sum(self.recv_counts)

    def recv_shape(self) -> tuple[int, ...]:
        return (self.recv_rows, *self.row_shape)

    def byte_offsets(self, peer: int, element_size: int) -> tuple[int, int]:
        """(send, recv) byte offsets of `peer`'s ranges, for pointer arithmetic."""
        peer_slice = self.peers[peer]
        return peer_slice.send_offset * element_size, peer_slice.recv_offset * element_size


def plan_all_to_all(
    send_counts: Sequence[int] | torch.Tensor,
    recv_counts: Sequence[int] | torch.Tensor,
    row_shape: Sequence[int],
) -> AllToAllLayout:
    """The element ranges of an all-to-all-v, from per-peer row counts and the row shape."""
    if len(send_counts) != len(recv_counts):
        raise CommError(
            f"send_counts has {len(send_counts)} entries but recv_counts has {len(recv_counts)}"
        )
    world_size = len(send_counts)
    sends = validate_counts(send_counts, world_size, name="send_counts")
    recvs = validate_counts(recv_counts, world_size, name="recv_counts")
    row_numel = math.prod(row_shape)
    send_starts, recv_starts = row_offsets(sends), row_offsets(recvs)
    peers = tuple(
        PeerSlice(
            peer=peer,
            send_offset=send_starts[peer] * row_numel,
            send_numel=sends[peer] * row_numel,
            recv_offset=recv_starts[peer] * row_numel,
            recv_numel=recvs[peer] * row_numel,
        )
        for peer in range(world_size)
    )
    return AllToAllLayout(sends, recvs, tuple(row_shape), peers)


def plan_payload(
    send: torch.Tensor, send_counts: Sequence[int], recv_counts: Sequence[int], world_size: int
) -> AllToAllLayout:
    """Validates a payload against its counts and returns its layout."""
    if send.dim() < 1:
        raise CommError("send must have a leading row dimension, got a 0-d tensor")
    validate_counts(send_counts, world_size, name="send_counts")
    validate_counts(recv_counts, world_size, name="recv_counts")
    layout = plan_all_to_all(send_counts, recv_counts, tuple(send.shape[1:]))
    if send.shape[0] != layout.send_rows:
        raise CommError(
            f"send has {send.shape[0]} rows but send_counts sum to {layout.send_rows}"
        )
    return layout


@functools.lru_cache(maxsize=4096)  # a few tags per layer, checked every step
def tag_checksum(tag: str) -> int:
    """A checksum of the tag that is the same in every process (unlike the salted hash())."""
    return zlib.crc32(tag.encode("utf-8"))


def pack_count_header(send_counts: Sequence[int] | torch.Tensor, tag: str, world_size: int) -> torch.Tensor:
    """The count-exchange payload: one (count, tag checksum) row per peer. [W, 2] int64"""
    counts = validate_counts(send_counts, world_size, name="send_counts")
    header = torch.empty((world_size, COUNT_HEADER_WIDTH), dtype=torch.int64)
    header[:, 0] = torch.tensor(counts, dtype=torch.int64)
    header[:, 1] = tag_checksum(tag)
    return header


def unpack_count_header(received: torch.Tensor, tag: str, world_size: int) -> torch.Tensor:
    """Checks each peer's tag and returns the counts it sends to this rank. [W] int64 CPU

    received: [W, 2] int64, row p as sent by peer p.
    """
    if tuple(received.shape) != (world_size, COUNT_HEADER_WIDTH):
        raise CommError(f"count header has shape {tuple(received.shape)}, expected ({world_size}, 2)")
    received = received.cpu()
    expected = tag_checksum(tag)
    for peer, checksum in enumerate(received[:, 1].tolist()):
        if checksum != expected:
            raise CollectiveMismatch(tag=tag, peer=peer, world_size=world_size)
    counts = received[:, 0].clone()
    if bool((counts < 0).any()):
        raise CommError(f"collective {tag!r} received negative counts {counts.tolist()}")
    return counts
