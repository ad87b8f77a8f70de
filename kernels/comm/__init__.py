"""Communicators for expert-parallel dispatch/combine: the interface raymoe calls (base.py:
transfer, run_native, native_failure, mark_broken for the exchange; exchange_payload,
barrier, close, abort for the control plane), three transports behind it
(`GlooCommunicator`: torch.distributed, CPU; `SocketCommunicator`: a stream socket per pair,
CPU; `NcclCommunicator`: cupy.cuda.nccl, GPU), and what travels on the wire between the
exchange's ranks (wire.py).

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
