"""The exchange every backend shares, written once over a two-method transport.

Dimension legend: W world size (ranks), R rows, H row width (any trailing row shape).

A backend (gloo, NCCL) supplies only the transport: ``_post`` issues a batch of point-to-point
sends and receives (buffers are moved bit for bit, as bytes) and ``_wait`` waits for that
batch under a deadline, raising a :class:`CommError` that names the collective's tag and,
where it can tell, the peer. Everything else lives here, once:

- per-pair message numbering: the k-th message from rank a to rank b carries the number k
  on both sides, so collectives that involve only some ranks (routers among themselves;
  routers and workers) never confuse each other's messages;
- the state machine: open -> (broken by a failure | closed | aborted); a broken or closed
  communicator refuses every later collective, and ``abort()`` never races a thread that is
  issuing messages (one lock around issuing and tearing down);
- the collectives built on it: counts (with a tag checksum, so ranks in different
  collectives are told apart), all-to-all-v of rows, barrier, and ``transfer`` (any set of
  sends and receives: the expert-parallel exchange uses it directly);
- the rest of kernels/comm/base.py's interface: ``mark_broken``, and ``run_native`` /
  ``native_failure`` for a transport without native routines (``native_routines`` False: the
  sockets transport overrides all three).

Invariant: the ranks of a collective call it in the same order with the same tag.
"""

from __future__ import annotations

import threading
from typing import Any, Sequence

import torch

from raymoe.kernels.comm.base import Deadline, validate_group, validate_timeout
from raymoe.kernels.comm.errors import CommClosedError, CommError
from raymoe.kernels.comm.layout import (
    AllToAllLayout,
    pack_count_header,
    plan_all_to_all,
    plan_payload,
    unpack_count_header,
)


class Message:
    """One buffer sent to, or received from, one peer. ``number`` is set by the communicator.
    (A plain slotted class: one is made per message, several per MoE layer.)"""

    __slots__ = ("peer", "buffer", "number")

    def __init__(self, peer: int, buffer: torch.Tensor, number: int = -1) -> None:
        self.peer = peer
        self.buffer = buffer  # flat uint8, contiguous; moved as bytes
        self.number = number

    def __repr__(self) -> str:
        return f"Message(peer={self.peer}, bytes={self.buffer.numel()}, number={self.number})"


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor (no copy)."""
    if tensor.dtype == torch.uint8 and tensor.dim() == 1:
        if not tensor.is_contiguous():
            raise CommError("a message buffer must be contiguous (a flat uint8 tensor with gaps was given)")
        return tensor
    return tensor.view(-1).view(torch.uint8)


class PointToPointCommunicator:
    """The shared state machine and collectives; subclasses implement ``_post``/``_wait``/``_teardown``."""

    backend_name = "p2p"
    native_routines = False  # whether run_native lends native code this transport (sockets.py: yes)
    # Whether ``transfer(..., wait=False)`` can leave the wait to the device (NCCL: torch's stream
    # waits on the group's completion event). Host transports (gloo, sockets) move the bytes on
    # the host, so they always wait there.
    device_ordered = False

    def __init__(self, *, rank: int, world_size: int, timeout_s: float) -> None:
        validate_group(rank, world_size)
        self.rank = rank
        self.world_size = world_size
        self.timeout_s = validate_timeout(timeout_s)
        self._sent = [0] * world_size  # messages sent to each peer so far
        self._received = [0] * world_size  # messages received from each peer so far
        self._failure: CommError | None = None
        self._closed = False
        self._issue_lock = threading.Lock()  # issuing messages vs tearing the transport down

    # ---- the transport (subclasses) -------------------------------------------------------
    def _post(self, sends: list[Message], recvs: list[Message], tag: str) -> Any:
        raise NotImplementedError

    def _wait(self, pending: Any, deadline: Deadline, tag: str) -> None:
        raise NotImplementedError

    def _teardown(self, abort: bool) -> None:
        raise NotImplementedError

    def _order_after(self, pending: Any, deadline: Deadline, tag: str) -> None:
        """``device_ordered`` transports: make later device work wait for ``pending`` without
        the host waiting (``transfer(..., wait=False)``)."""
        raise NotImplementedError

    def _check_device(self, tensor: torch.Tensor, tag: str) -> None:
        raise NotImplementedError

    # ---- state ----------------------------------------------------------------------------
    @property
    def usable(self) -> bool:
        return not self._closed and self._failure is None

    def _check_usable(self, tag: str) -> None:
        if self._closed:
            raise CommClosedError(tag)
        if self._failure is not None:
            raise CommError(
                f"collective {tag!r} called on a communicator broken by an earlier failure "
                f"({self._failure}); abort() it and build a new one"
            )

    def _broken(self, failure: CommError) -> CommError:
        """Marks this communicator unusable because of ``failure`` (returned, for ``raise``)."""
        if self._failure is None:
            self._failure = failure
        return failure

    def mark_broken(self, failure: CommError) -> CommError:
        """Marks this communicator unusable because of a failure found above the transport (a
        message whose bytes arrived but whose contents the exchange refused, leaving the
        message stream at an unknown point); returns ``failure``."""
        return self._broken(failure)

    def run_native(self, peers: list[int], tag: str, routine) -> Any:
        """This transport lends native code nothing (``native_routines`` is False)."""
        raise CommError(f"collective {tag!r}: the {self.backend_name} transport runs no native routines")

    def native_failure(self, status: int, info: Any, peers: list[int], tag: str, timeout_s: float) -> CommError | None:
        """None: no status is this transport's (it runs no native routines)."""
        return None

    def close(self) -> None:
        with self._issue_lock:
            if not self._closed:
                self._closed = True
                self._teardown(abort=False)

    def abort(self) -> None:
        """Best-effort tear down after a failure; safe from any thread, at any time."""
        with self._issue_lock:
            if not self._closed:
                self._closed = True
                self._teardown(abort=True)

    # ---- the one primitive every collective uses ------------------------------------------
    def transfer(
        self,
        sends: Sequence[tuple[int, torch.Tensor]],
        recvs: Sequence[tuple[int, torch.Tensor]],
        *,
        tag: str,
        timeout_s: float | None = None,
        wait: bool = True,
    ) -> None:
        """Send ``sends`` and fill ``recvs`` (``(peer, tensor)`` pairs), then wait for all.

        Tensors must be contiguous; a message to or from this rank is a local copy. The k-th
        message between two ranks must have the same size on both sides. ``timeout_s``
        overrides the communicator's deadline for this call (e.g. an idle wait).

        ``wait=False``: the caller needs the result on the device only (rows the experts read,
        sums sent back), so a ``device_ordered`` transport (NCCL) makes torch's current stream
        wait for the batch instead of the host: no host sync. The batch's failure or hang then
        surfaces at the next waited transfer of this communicator (its messages are issued on
        one stream, in order, so that one cannot complete first), under that one's deadline.
        Host transports wait anyway.
        """
        self._check_usable(tag)
        deadline = Deadline(self.timeout_s if timeout_s is None else timeout_s)
        rank, sent, received = self.rank, self._sent, self._received
        local_sends: dict[int, torch.Tensor] = {}
        remote_sends, remote_recvs = [], []
        for peer, tensor in sends:
            if peer == rank:
                local_sends[peer] = tensor
                continue
            self._check_peer(peer, tag)
            self._check_device(tensor, tag)
            remote_sends.append(Message(peer, as_bytes(tensor), sent[peer]))
            sent[peer] += 1
        for peer, tensor in recvs:
            if peer == rank:
                source = local_sends.get(peer)
                if source is None or source.numel() * source.element_size() != tensor.numel() * tensor.element_size():
                    raise CommError(f"collective {tag!r}: rank {self.rank} receives from itself what it did not send")
                as_bytes(tensor).copy_(as_bytes(source))
                continue
            self._check_peer(peer, tag)
            self._check_device(tensor, tag)
            remote_recvs.append(Message(peer, as_bytes(tensor), received[peer]))
            received[peer] += 1
        if not remote_sends and not remote_recvs:
            return
        with self._issue_lock:
            self._check_usable(tag)
            pending = self._post(remote_sends, remote_recvs, tag)
        if wait or not self.device_ordered:
            self._wait(pending, deadline, tag)
        else:
            self._order_after(pending, deadline, tag)

    def _check_peer(self, peer: int, tag: str) -> None:
        if not 0 <= peer < self.world_size:
            raise CommError(f"collective {tag!r}: peer {peer} is not a rank of this group of {self.world_size}")

    # ---- collectives over every rank --------------------------------------------------------
    def exchange_counts(self, send_counts: torch.Tensor, *, tag: str) -> torch.Tensor:
        self._check_usable(tag)
        header = pack_count_header(send_counts, tag, self.world_size)  # [W, 2] int64, CPU
        received = self._all_to_all(header.to(self.transport_device), plan_all_to_all(
            [1] * self.world_size, [1] * self.world_size, (header.shape[1],)), tag)
        return unpack_count_header(received.cpu(), tag, self.world_size)

    def exchange_payload(
        self, send: torch.Tensor, send_counts: Sequence[int], recv_counts: Sequence[int], *, tag: str,
    ) -> torch.Tensor:
        self._check_usable(tag)
        layout = plan_payload(send, send_counts, recv_counts, self.world_size)
        self._check_device(send, tag)
        return self._all_to_all(send, layout, tag)

    def barrier(self, *, tag: str) -> None:
        # A count exchange is a barrier: it completes once every peer has entered it.
        self.exchange_counts(torch.zeros(self.world_size, dtype=torch.int64), tag=tag)

    def _all_to_all(self, send: torch.Tensor, layout: AllToAllLayout, tag: str) -> torch.Tensor:
        send = send.contiguous()
        recv = torch.empty(layout.recv_shape(), dtype=send.dtype, device=send.device)
        flat_send, flat_recv = send.view(-1), recv.view(-1)
        sends, recvs = [], []
        for peer_slice in layout.peers:
            if peer_slice.send_numel:
                sends.append((peer_slice.peer, flat_send[peer_slice.send_offset:
                                                         peer_slice.send_offset + peer_slice.send_numel]))
            if peer_slice.recv_numel:
                recvs.append((peer_slice.peer, flat_recv[peer_slice.recv_offset:
                                                         peer_slice.recv_offset + peer_slice.recv_numel]))
        self.transfer(sends, recvs, tag=tag)
        return recv

    @property
    def transport_device(self) -> torch.device:
        return torch.device("cpu")
