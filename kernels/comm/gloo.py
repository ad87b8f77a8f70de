"""Gloo communicator over `torch.distributed`, for CPU ranks.

Invariant: all ranks must call collectives in the same order with the same tag, or they
hang; the deadline turns that hang into an error. This module is only the transport: one
gloo send/recv per message (kernels/comm/p2p.py builds every collective on it), so that
when the deadline passes this rank knows which peer's message never came and can name it.

The process group is an object this class owns (no default global group), so several
communicators can coexist in one process, e.g. the replacement built after a failure.
"""

from __future__ import annotations

import datetime
import ipaddress

import torch
import torch.distributed as distributed

from raymoe.kernels.comm.base import Deadline, validate_group, validate_timeout
from raymoe.kernels.comm.errors import CollectiveTimeout, CommError, PeerLostError
from raymoe.kernels.comm.p2p import Message, PointToPointCommunicator
from raymoe.kernels.comm.store import first_line, open_store

MINIMUM_WAIT_S = 0.001  # a zero timeout means "the group default" to c10d: never pass one
GLOO_TAG_MODULUS = 2**31  # gloo message tags are 32-bit


class GlooCommunicator(PointToPointCommunicator):
    """One rank of a gloo group: the transport under `PointToPointCommunicator`."""

    backend_name = "gloo"

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
        super().__init__(rank=rank, world_size=world_size, timeout_s=timeout_s)
        self.group_name = group_name
        self._store = store  # rank 0 hosts the rendezvous server: keep it alive with the group
        self._process_group = process_group

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
        bind_host: str | None = None,
    ) -> "GlooCommunicator":
        """Joins the group whose rendezvous server rank 0 hosts at host:port.

        Rank 0's store listens on `host` only (never on every interface); each rank's gloo
        connections bind to `bind_host` (its own node's address; default: `host` when that is
        a loopback address, else gloo's default device). `group_name` should carry the
        group's secret: keys live under it, so a client that does not know it finds nothing.
        Blocks until all `world_size` ranks have joined, at most `timeout_s`.
        """
        validate_group(rank, world_size)
        timeout_s = validate_timeout(timeout_s)
        timeout = datetime.timedelta(seconds=timeout_s)
        try:
            store = open_store(rank, world_size, host, port, timeout_s)
            options = distributed.ProcessGroupGloo._Options()
            options._timeout = timeout
            options._devices = [_gloo_device(bind_host or host)]
            process_group = distributed.ProcessGroupGloo(
                distributed.PrefixStore(group_name, store), rank, world_size, options
            )
        except (RuntimeError, OSError) as error:
            raise CommError(
                f"rank {rank} could not join gloo group {group_name!r} of {world_size} ranks "
                f"at {host}:{port} within {timeout_s:.1f} s: {first_line(error)}"
            ) from error
        communicator = cls(
            rank=rank,
            world_size=world_size,
            timeout_s=timeout_s,
            group_name=group_name,
            store=store,
            process_group=process_group,
        )
        return communicator

    def _check_device(self, tensor: torch.Tensor, tag: str) -> None:
        if tensor.device.type != "cpu":
            raise CommError(f"collective {tag!r}: gloo moves CPU tensors, got one on {tensor.device}")

    def _teardown(self, abort: bool) -> None:
        process_group, self._process_group, self._store = self._process_group, None, None
        if abort and process_group is not None:
            try:
                process_group.abort()
            except RuntimeError:
                pass  # best effort: the group is dropped either way

    def _post(self, sends: list[Message], recvs: list[Message], tag: str) -> list:
        """Receives first, in rank order (so a missing peer is found first), then sends."""
        pending = []
        for message in sorted(recvs, key=lambda m: m.peer):
            pending.append((message.peer, self._issue(self._process_group.recv, message, tag)))
        for message in sends:
            pending.append((message.peer, self._issue(self._process_group.send, message, tag)))
        return pending

    def _wait(self, pending: list, deadline: Deadline, tag: str) -> None:
        for peer, work in pending:
            try:
                work.wait(datetime.timedelta(seconds=max(deadline.remaining_s(), MINIMUM_WAIT_S)))
            except RuntimeError as error:
                self._fail(error, peer, deadline, tag)

    def _issue(self, operation, message: Message, tag: str) -> distributed.Work:
        """Starts one send or recv; a broken connection to the peer fails right here."""
        try:
            return operation([message.buffer], message.peer, message.number % GLOO_TAG_MODULUS)
        except RuntimeError as error:
            self._fail(error, message.peer, None, tag)

    def _fail(self, error: RuntimeError, peer: int, deadline: Deadline | None, tag: str) -> None:
        """Raises the CommError for `peer`'s failed message, and marks this communicator broken."""
        if (deadline is not None and deadline.has_expired()) or "timed out" in str(error).lower():
            failure: CommError = CollectiveTimeout(
                tag=tag, timeout_s=deadline.timeout_s if deadline else self.timeout_s, peer=peer,
                world_size=self.world_size,
            )
        else:
            failure = PeerLostError(
                tag=tag, peer=peer, world_size=self.world_size, detail=first_line(error)
            )
        raise self._broken(failure) from error


def _gloo_device(host: str) -> distributed.ProcessGroupGloo.Device:
    """The network device gloo binds: loopback when the group lives on this host only."""
    try:
        is_loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        is_loopback = host == "localhost"
    if is_loopback:
        return distributed.ProcessGroupGloo.create_device(hostname=host)
    return distributed.ProcessGroupGloo.create_default_device()
