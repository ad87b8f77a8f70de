"""Communicators for expert-parallel dispatch/combine: exchange counts, exchange payload
(all-to-all-v), barrier, close, abort. Three transports behind one small interface:
`GlooCommunicator` (torch.distributed, CPU), `SocketCommunicator` (a stream socket per pair,
CPU) and `NcclCommunicator` (cupy.cuda.nccl, GPU).

All ranks must call collectives in the same order with the same tag, or they hang; every
collective has a deadline that turns the hang into a `CollectiveTimeout`.
"""

from raymoe.kernels.comm.base import Communicator
from raymoe.kernels.comm.errors import (
    CollectiveMismatch,
    CollectiveTimeout,
    CommClosedError,
    CommError,
    PeerLostError,
)
from raymoe.kernels.comm.factory import (
    CommBackend,
    GlooRendezvous,
    NcclRendezvous,
    SocketRendezvous,
    make_communicator,
    new_rendezvous,
)
from raymoe.kernels.comm.gloo import GlooCommunicator
from raymoe.kernels.comm.nccl import NcclCommunicator, nccl_unique_id
from raymoe.kernels.comm.sockets import SocketCommunicator

__all__ = [
    "CollectiveMismatch",
    "CollectiveTimeout",
    "CommBackend",
    "CommClosedError",
    "CommError",
    "Communicator",
    "GlooCommunicator",
    "GlooRendezvous",
    "NcclCommunicator",
    "NcclRendezvous",
    "PeerLostError",
    "SocketCommunicator",
    "SocketRendezvous",
    "make_communicator",
    "new_rendezvous",
    "nccl_unique_id",
]
