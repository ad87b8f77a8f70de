"""Gloo communicator over `torch.distributed`, for CPU ranks.

Invariant: all ranks must call collectives in the same order with the same tag, or they
hang; the deadline turns that hang into an error. Each collective is built from per-peer
send/recv pairs, not one all_to_all_single, so that when the deadline passes this rank
knows which peer's message never came and can name it.

The process group is an object this class owns (no default global group), so several
communicators can coexist in one process, e.g. the replacement built after a failure.
"""

from __future__ import annotations

import datetime
import ipaddress
from typing import Sequence

import torch
import torch.distributed as distributed

from raymoe.kernels.comm.base import Deadline, ensure_usable, validate_group, validate_timeout
from raymoe.kernels.comm.errors import CollectiveTimeout, CommError, PeerLostError
from raymoe.kernels.comm.layout import (
    AllToAllLayout,
    pack_count_header,
    plan_all_to_all,
    plan_payload,
    unpack_count_header,
)

MINIMUM_WAIT_S = 0.001  # a zero timeout means "the group default" to c10d: never pass one
GLOO_TAG_MODULUS = 2**31  # gloo message tags are 32-bit


class GlooCommunicator:
    """One rank of a gloo group; see `Communicator` for the method contracts."""

    def __init__(
        self,
        *,
        rank: int,
        world_size: int,
        timeout_s: float,
        group_name: str,
        store: distributed.Store,
        process_group: distributed.ProcessGroupGloo,
    ) -> None:
        self.rank = rank
        self.world_size = world_size
        self.timeout_s = timeout_s
        self.group_name = group_name
        self._store = store  # rank 0 hosts the rendezvous server: keep it alive with the group
        self._process_group = process_group
        self._sequence = 0  # collectives issued; the gloo tag keeps collectives apart
        self._failure: CommError | None = None

    @classmethod
    def create(
        cls,
        rank: int,
        world_size: int,
        host: str,
        port: int,
        timeout_s: float,
        *,
        group_name: str = "raymoe",
    ) -> "GlooCommunicator":
        """Joins the group whose rendezvous server rank 0 hosts at host:port.

        Blocks until all `world_size` ranks have joined, at most `timeout_s`.
        """
        validate_group(rank, world_size)
        timeout_s = validate_timeout(timeout_s)
        timeout = datetime.timedelta(seconds=timeout_s)
        try:
            is_server = rank == 0
            store = distributed.TCPStore(
                host, port, world_size, is_server, timeout=timeout, wait_for_workers=False
            )
            options = distributed.ProcessGroupGloo._Options()
            options._timeout = timeout
            options._devices = [_gloo_device(host)]
            process_group = distributed.ProcessGroupGloo(
                distributed.PrefixStore(group_name, store), rank, world_size, options
            )
        except (RuntimeError, OSError) as error:
            raise CommError(
                f"rank {rank} could not join gloo group {group_name!r} of {world_size} ranks "
                f"at {host}:{port} within {timeout_s:.1f} s: {_first_line(error)}"
            ) from error
        return cls(
            rank=rank,
            world_size=world_size,
            timeout_s=timeout_s,
            group_name=group_name,
            store=store,
            process_group=process_group,
        )

    def exchange_counts(self, send_counts: torch.Tensor, *, tag: str) -> torch.Tensor:
        self._check_usable(tag)
        header = pack_count_header(send_counts, tag, self.world_size)  # [W, 2]
        ones = [1] * self.world_size
        received = self._all_to_all(header, plan_all_to_all(ones, ones, (2,)), tag)
        return unpack_count_header(received, tag, self.world_size)

    def exchange_payload(
        self,
        send: torch.Tensor,
        send_counts: Sequence[int],
        recv_counts: Sequence[int],
        *,
        tag: str,
    ) -> torch.Tensor:
        self._check_usable(tag)
        layout = plan_payload(send, send_counts, recv_counts, self.world_size)
        if send.device.type != "cpu":
            raise CommError(f"collective {tag!r}: gloo moves CPU tensors, got one on {send.device}")
        return self._all_to_all(send, layout, tag)

    def barrier(self, *, tag: str) -> None:
        # A count exchange is a barrier: it returns once every peer's header has arrived,
        # and each peer sends its header only once it has entered the collective.
        self.exchange_counts(torch.zeros(self.world_size, dtype=torch.int64), tag=tag)

    def _check_usable(self, tag: str) -> None:
        ensure_usable(self._process_group is None, self._failure, tag)

    def close(self) -> None:
        self._process_group = None
        self._store = None

    def abort(self) -> None:
        process_group, self._process_group, self._store = self._process_group, None, None
        if process_group is not None:
            try:
                process_group.abort()
            except RuntimeError:
                pass  # best effort: the group is dropped either way

    def _all_to_all(self, send: torch.Tensor, layout: AllToAllLayout, tag: str) -> torch.Tensor:
        """Moves each peer's element range with one send/recv pair, under one deadline."""
        deadline = Deadline(self.timeout_s)
        gloo_tag = self._sequence % GLOO_TAG_MODULUS
        self._sequence += 1
        element_size = send.element_size()
        recv = torch.empty(layout.recv_shape(), dtype=send.dtype)
        # Bytes, not elements: gloo's send/recv then moves any dtype bit for bit.
        send_bytes = send.contiguous().view(-1).view(torch.uint8)
        recv_bytes = recv.view(-1).view(torch.uint8)
        pending = []  # (peer, work): receives first, in rank order, so a missing peer is found
        sends = []
        for peer_slice in layout.peers:
            peer = peer_slice.peer
            send_start, recv_start = layout.byte_offsets(peer, element_size)
            send_size = peer_slice.send_numel * element_size
            recv_size = peer_slice.recv_numel * element_size
            recv_chunk = recv_bytes[recv_start : recv_start + recv_size]
            send_chunk = send_bytes[send_start : send_start + send_size]
            if peer == self.rank:
                recv_chunk.copy_(send_chunk)
                continue
            if recv_size > 0:
                work = self._issue(self._process_group.recv, recv_chunk, peer, gloo_tag, deadline, tag)
                pending.append((peer, work))
            if send_size > 0:
                work = self._issue(self._process_group.send, send_chunk, peer, gloo_tag, deadline, tag)
                sends.append((peer, work))
        for peer, work in pending + sends:
            try:
                work.wait(datetime.timedelta(seconds=max(deadline.remaining_s(), MINIMUM_WAIT_S)))
            except RuntimeError as error:
                self._fail(error, peer, deadline, tag)
        return recv

    def _issue(
        self, operation, chunk: torch.Tensor, peer: int, gloo_tag: int, deadline: Deadline, tag: str
    ) -> distributed.Work:
        """Starts one send or recv; a broken connection to `peer` fails right here."""
        try:
            return operation([chunk], peer, gloo_tag)
        except RuntimeError as error:
            self._fail(error, peer, deadline, tag)

    def _fail(self, error: RuntimeError, peer: int, deadline: Deadline, tag: str) -> None:
        """Raises the CommError for `peer`'s failed message, and marks this communicator broken."""
        if deadline.has_expired() or "timed out" in str(error).lower():
            failure: CommError = CollectiveTimeout(
                tag=tag, timeout_s=self.timeout_s, peer=peer, world_size=self.world_size
            )
        else:
            failure = PeerLostError(
                tag=tag, peer=peer, world_size=self.world_size, detail=_first_line(error)
            )
        self._failure = failure
        raise failure from error


def _gloo_device(host: str) -> distributed.ProcessGroupGloo.Device:
    """The network device gloo binds: loopback when the group lives on this host only."""
    try:
        is_loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        is_loopback = host == "localhost"
    if is_loopback:
        return distributed.ProcessGroupGloo.create_device(hostname=host)
    return distributed.ProcessGroupGloo.create_default_device()


def _first_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return lines[0] if lines else type(error).__name__
