"""The communicator interface: what raymoe's callers actually call, and the deadline.

Dimension legend: W world size (ranks), R rows, H row width (any trailing row shape).

Who calls what (and nothing else is declared here):

- the data plane, the expert-parallel exchange (engine/exchange/): ``transfer`` (any batch of
  point-to-point sends and receives under one deadline), and where the transport lends its
  connections to native code (``native_routines``: the sockets transport) ``run_native`` and
  ``native_failure``; ``mark_broken`` when the exchange refuses what arrived; ``timeout_s``,
  ``rank``, ``world_size``;
- the control plane: ``exchange_payload`` (a migration's all-to-all-v of expert weights,
  actors/expert_worker.py), ``barrier`` (every join's warm-up, kernels/comm/factory.py),
  ``close`` and ``abort`` (actors, on shutdown and after a failure).

Invariant: all ranks must call collectives in the same order with the same tag, or they
hang. The deadline (`timeout_s`) turns that hang into an error: `CollectiveTimeout`
naming the tag and, where the backend can tell, the peer still missing. After any
`CommError` the communicator is unusable: call `abort()` and build a new one.

Every transport implements it through kernels/comm/p2p.py::PointToPointCommunicator (gloo,
sockets, NCCL). A new backend is a new class with these methods, never a flag on an existing one.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Protocol, Sequence, runtime_checkable

import torch

from raymoe.kernels.comm.errors import CommError


@runtime_checkable
class Communicator(Protocol):
    """One rank's handle on a group of `world_size` ranks.

    Every collective method takes a `tag`, a human-readable label such as
    "layer 3 dispatch" that appears in every error the call raises.
    """

    rank: int
    world_size: int
    timeout_s: float
    native_routines: bool  # whether run_native lends native code this transport's connections

    # ---- the data plane -----------------------------------------------------------------
    def transfer(self, sends: Sequence[tuple[int, torch.Tensor]], recvs: Sequence[tuple[int, torch.Tensor]], *,
                 tag: str, timeout_s: float | None = None, wait: bool = True) -> None:
        """Send ``sends`` and fill ``recvs`` (``(peer, tensor)`` pairs, contiguous tensors), then
        wait for all under one deadline (``timeout_s``, else the communicator's). The k-th
        message between two ranks has the same size on both sides. ``wait=False``: the caller
        needs the result on the device only; a device-ordered transport (NCCL) then orders
        torch's stream after the batch instead of waiting on the host (kernels/comm/p2p.py)."""
        ...

    def run_native(self, peers: list[int], tag: str, routine: Callable[..., Any]) -> Any:
        """Runs ``routine(fds, wake_fd, recv_numbers, send_numbers)``: native code that moves
        this transport's framed messages to and from ``peers`` itself, under the lock that
        issuing messages holds (kernels/comm/sockets.py). A transport without native routines
        (``native_routines`` False) raises `CommError`."""
        ...

    def native_failure(self, status: int, info: Any, peers: list[int], tag: str,
                       timeout_s: float) -> CommError | None:
        """The error a native routine's transport status stands for (kernels/comm/wire.py's
        ``STATUSES``), this communicator marked broken by it; None for a status that is not
        the transport's."""
        ...

    def mark_broken(self, failure: CommError) -> CommError:
        """Marks this communicator unusable because of a failure found above the transport;
        returns ``failure``."""
        ...

    # ---- the control plane --------------------------------------------------------------
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
