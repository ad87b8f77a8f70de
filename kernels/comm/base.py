"""The communicator interface of expert-parallel dispatch/combine, and its deadline.

Dimension legend: W world size (ranks), R rows, H row width (any trailing row shape).

Invariant: all ranks must call collectives in the same order with the same tag, or they
hang. The deadline (`timeout_s`) turns that hang into an error: `CollectiveTimeout`
naming the tag and, where the backend can tell, the peer still missing. After any
`CommError` the communicator is unusable: call `abort()` and build a new one.

A new backend is a new class with these methods, never a flag on an existing one.
"""

from __future__ import annotations

import time
from typing import Protocol, Sequence, runtime_checkable

import torch



@runtime_checkable
class Communicator(Protocol):
    """One rank's handle on a group of `world_size` ranks.

    Every collective method takes a `tag`, a human-readable label such as
    "layer 3 dispatch" that appears in every error the call raises.
    """

    rank: int
    world_size: int
    timeout_s: float

    def exchange_counts(self, send_counts: torch.Tensor, *, tag: str) -> torch.Tensor:
        """All-to-all of row counts.

        send_counts: [W] int64 on CPU, rows this rank sends to each peer.
        Returns recv_counts: [W] int64 on CPU, rows each peer sends to this rank.
        Also checks that every peer is in the collective with the same tag.
        """
        ...

    def exchange_payload(
        self,
        send: torch.Tensor,
        send_counts: Sequence[int],
        recv_counts: Sequence[int],
        *,
        tag: str,
    ) -> torch.Tensor:
        """All-to-all-v of rows.

        send: [sum(send_counts), *row_shape], rows for peer p contiguous, peers in rank order.
        Returns [sum(recv_counts), *row_shape], rows from peer p contiguous in rank order,
        with the dtype and device of `send`.
        """
        ...

    def barrier(self, *, tag: str) -> None:
        """Returns once every rank has entered the barrier with this tag."""
        ...

    def close(self) -> None:
        """Releases the group. Idempotent; afterwards every collective raises CommClosedError."""
        ...

    def abort(self) -> None:
        """Best-effort tear down after a failure, so that a new communicator can be built."""
        ...


class Deadline:
    """The point in time by which a collective must have completed."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.expires_at = time.monotonic() + timeout_s

    def remaining_s(self) -> float:
        """Seconds left, never negative."""
        return max(0.0, self.expires_at - time.monotonic())

    def has_expired(self) -> bool:
        return time.monotonic() >= self.expires_at


def validate_timeout(timeout_s: float) -> float:
    """Every collective has a deadline: a timeout must be a positive, finite number."""
    if not isinstance(timeout_s, (int, float)) or not (0 < timeout_s < float("inf")):
        raise ValueError(f"timeout_s must be a positive finite number of seconds, got {timeout_s!r}")
    return float(timeout_s)


def validate_group(rank: int, world_size: int) -> None:
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if not isinstance(rank, int) or not (0 <= rank < world_size):
        raise ValueError(f"rank must be an int in [0, {world_size}), got {rank!r}")
