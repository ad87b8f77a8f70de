"""Choosing a communicator backend and building one rank's communicator.

Two steps, because ranks live in different processes (Ray actors):
  1. once, `new_rendezvous(backend, ...)` makes a small picklable object that names the
     group (gloo: rank 0's host and port; NCCL: the unique id). For NCCL, call it in rank
     0's process: NCCL's bootstrap root runs in the process that made the id.
  2. every rank, `make_communicator(backend, rendezvous, rank=..., ...)` joins the group.
`CommBackend.AUTO` is resolved where the rendezvous is made and carried by it, so that
ranks on different machines cannot resolve it differently.
"""

from __future__ import annotations

import enum
import secrets
from dataclasses import dataclass

import torch

from raymoe.kernels.comm.base import Communicator
from raymoe.kernels.comm.ports import free_port


class CommBackend(enum.Enum):
    AUTO = "auto"  # NCCL when CUDA is available, else sockets
    NCCL = "nccl"
    GLOO = "gloo"
    SOCKETS = "sockets"  # CPU ranks: a stream socket per pair, moved by the calling thread (sockets.py)

    def resolve(self) -> "CommBackend":
        if self is CommBackend.AUTO:
            return CommBackend.NCCL if torch.cuda.is_available() else CommBackend.SOCKETS
        return self


@dataclass(frozen=True)
class StoreRendezvous:
    """The CPU transports' rendezvous (kernels/comm/store.py); the subclass names the backend."""

    host: str  # where rank 0 serves the rendezvous store (that address only)
    port: int
    group_name: str = "raymoe"  # with the secret appended by new_rendezvous: keys live under it


@dataclass(frozen=True)
class GlooRendezvous(StoreRendezvous):
    pass


@dataclass(frozen=True)
class SocketRendezvous(StoreRendezvous):
    pass


@dataclass(frozen=True)
class NcclRendezvous:
    unique_id: tuple[int, ...]  # from nccl_unique_id(), 128 ints


RENDEZVOUS_TYPES = {CommBackend.GLOO: GlooRendezvous, CommBackend.NCCL: NcclRendezvous,
                    CommBackend.SOCKETS: SocketRendezvous}


def new_rendezvous(
    backend: CommBackend,
    *,
    host: str = "127.0.0.1",
    port: int | None = None,
    group_name: str = "raymoe",
) -> GlooRendezvous | NcclRendezvous | SocketRendezvous:
    """A fresh rendezvous for a new group. Call it where rank 0 runs.

    gloo and sockets: `host` must be rank 0's address as the other ranks reach it; `port` defaults to
    a port that is free on this machine now. NCCL: host and port are not used.
    """
    backend = backend.resolve()
    if backend is CommBackend.NCCL:
        from raymoe.kernels.comm.nccl import nccl_unique_id

        return NcclRendezvous(nccl_unique_id())
    # A per-group secret in the store's key prefix: the rendezvous reaches the ranks through Ray
    # (authenticated), and a client of the store that does not know it finds no group.
    kind = SocketRendezvous if backend is CommBackend.SOCKETS else GlooRendezvous
    return kind(host, free_port(host) if port is None else port, f"{group_name}/{secrets.token_hex(16)}")


def make_communicator(
    backend: CommBackend,
    rendezvous: GlooRendezvous | NcclRendezvous | SocketRendezvous,
    *,
    rank: int,
    world_size: int,
    timeout_s: float,
    device: torch.device | int | None = None,
    bind_host: str | None = None,
) -> Communicator:
    """Joins the group named by `rendezvous` as `rank`; blocks until all ranks joined, then
    runs a warm-up barrier (every rank must call this together): NCCL connects pairs lazily
    on first contact, so the barrier makes that first contact now, under the deadline, not
    inside the first real collective.

    device: the GPU of an NCCL rank (torch's current device by default); unused by gloo.
    bind_host: gloo and sockets, the address this rank's connections bind (its node's address).
    """
    backend = backend.resolve()
    expected_type = RENDEZVOUS_TYPES[backend]
    if not isinstance(rendezvous, expected_type):
        raise TypeError(
            f"backend {backend.value} needs a {expected_type.__name__}, got {type(rendezvous).__name__}; "
            f"were the rendezvous and this rank's backend resolved on different machines?"
        )
    if backend is CommBackend.NCCL:
        from raymoe.kernels.comm.nccl import NcclCommunicator

        comm = NcclCommunicator.create(rank, world_size, rendezvous.unique_id, timeout_s, device=device)
    else:
        if backend is CommBackend.SOCKETS:
            from raymoe.kernels.comm.sockets import SocketCommunicator as Transport
        else:
            from raymoe.kernels.comm.gloo import GlooCommunicator as Transport

        comm = Transport.create(
            rank, world_size, rendezvous.host, rendezvous.port, timeout_s, group_name=rendezvous.group_name,
            bind_host=bind_host,
        )
    try:
        comm.barrier(tag="warm-up")
    except Exception:
        comm.abort()
        raise
    return comm
