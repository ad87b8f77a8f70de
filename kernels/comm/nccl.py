"""NCCL communicator through `cupy.cuda.nccl`, for GPU ranks (one rank per GPU).

Invariant: all ranks must call collectives in the same order with the same tag, or they
hang; the deadline turns that hang into an error. NCCL cannot say which peer is missing
(a group of sends and receives completes as a whole), so a timeout names no peer.

A process that is an NCCL rank owns its GPU: one communicator per device per group.
cupy is imported inside functions only, so this module imports on CPU-only machines.

This module is only the transport under kernels/comm/p2p.py: each batch of messages is
`groupStart()`, one send or recv per message (as bytes), `groupEnd()`, issued on a
dedicated non-blocking stream, under a lock that `abort()` also takes. Ordering with torch is explicit: the dedicated stream
first waits for an event recorded on torch's current stream (so the send buffer is
ready), and the host then waits, polling an event, until the group finished or the
deadline passed (so the returned tensor is complete and the deadline is enforced).
"""

from __future__ import annotations

import threading
import time
from typing import Sequence

import torch

from raymoe.kernels.comm.base import Deadline, validate_group, validate_timeout
from raymoe.kernels.comm.errors import RECOVERY_HINT, CollectiveTimeout, CommError
from raymoe.kernels.comm.layout import NcclDataType
from raymoe.kernels.comm.p2p import Message, PointToPointCommunicator

POLL_INTERVAL_S = 0.00002  # host sleep between completion checks while a group runs
MINIMUM_WATCHDOG_S = 0.01
UINT8 = int(NcclDataType.UINT8)  # every message moves as bytes
NCCL_UNIQUE_ID_BYTES = 128


def nccl_unique_id() -> tuple[int, ...]:
    """A fresh NCCL unique id, as a tuple of 128 ints that can travel through Ray.

    Call it on rank 0's process: NCCL's bootstrap root listens in the calling process,
    which must stay alive until every rank has created its communicator.
    """
    _, nccl = import_cupy_nccl()
    return tuple(nccl.get_unique_id())


def import_cupy_nccl():
    """(cupy, cupy.cuda.nccl), imported on first use, with a clear error when missing."""
    hint = "the NCCL communicator needs cupy with NCCL: pip install 'raymoe[gpu]' (cupy-cuda12x)"
    try:
        import cupy
        from cupy.cuda import nccl
    except ImportError as error:
        raise ImportError(f"{hint}; import failed: {error}") from error
    if not getattr(nccl, "available", False):  # cupy imports, but found no libnccl
        raise ImportError(f"{hint}; cupy is installed but cannot load the NCCL library")
    return cupy, nccl


def validate_unique_id(unique_id: Sequence[int]) -> tuple[int, ...]:
    values = tuple(unique_id)
    if len(values) != NCCL_UNIQUE_ID_BYTES or not all(isinstance(value, int) for value in values):
        raise ValueError(f"an NCCL unique id is {NCCL_UNIQUE_ID_BYTES} ints, got {len(values)} values")
    return values


class NcclCommunicator(PointToPointCommunicator):
    """One GPU rank of an NCCL group: the transport under `PointToPointCommunicator`."""

    backend_name = "nccl"

    def __init__(
        self,
        *,
        rank: int,
        world_size: int,
        timeout_s: float,
        device: torch.device,
        nccl_comm,
        stream,
    ) -> None:
        super().__init__(rank=rank, world_size=world_size, timeout_s=timeout_s)
        self.device = device
        self._nccl_comm = nccl_comm  # cupy.cuda.nccl.NcclCommunicator; None once torn down
        self._stream = stream  # cupy.cuda.Stream(non_blocking=True), used by this group only
        self._closed = nccl_comm is None

    @classmethod
    def create(
        cls,
        rank: int,
        world_size: int,
        unique_id: Sequence[int],
        timeout_s: float,
        device: torch.device | int | None = None,
    ) -> "NcclCommunicator":
        """Joins the group named by `unique_id` (from `nccl_unique_id()` on rank 0).

        device: this rank's GPU; defaults to torch's current CUDA device. Blocks until all
        ranks have joined; NCCL's own bootstrap timeout applies here, not `timeout_s`
        (the factory's warm-up barrier then connects every pair under `timeout_s`).
        """
        cupy, nccl = import_cupy_nccl()
        validate_group(rank, world_size)
        timeout_s = validate_timeout(timeout_s)
        unique_id = validate_unique_id(unique_id)
        device = cuda_device(device)
        try:
            with cupy.cuda.Device(device.index):
                nccl_comm = nccl.NcclCommunicator(world_size, unique_id, rank)
                stream = cupy.cuda.Stream(non_blocking=True)
        except Exception as error:  # cupy raises NcclError, and KeyError for codes it does not know
            raise CommError(f"rank {rank} could not join the NCCL group of {world_size} ranks: "
                            f"{type(error).__name__}: {error}") from error
        return cls(
            rank=rank,
            world_size=world_size,
            timeout_s=timeout_s,
            device=device,
            nccl_comm=nccl_comm,
            stream=stream,
        )

    @property
    def transport_device(self) -> torch.device:
        return self.device

    def _check_device(self, tensor: torch.Tensor, tag: str) -> None:
        if tensor.device != self.device:
            raise CommError(f"collective {tag!r}: this NCCL rank moves tensors on {self.device}, got {tensor.device}")

    def _teardown(self, abort: bool) -> None:
        nccl_comm, self._nccl_comm = self._nccl_comm, None
        if nccl_comm is None:
            return
        try:
            nccl_comm.abort() if abort else nccl_comm.destroy()
        except Exception:  # best effort: the handle is dropped either way
            pass

    def _post(self, sends: list[Message], recvs: list[Message], tag: str):
        """Steps: 1. order after torch's stream, 2. one group of sends/receives, watched."""
        cupy, nccl = import_cupy_nccl()
        deadline = Deadline(self.timeout_s)
        with cupy.cuda.Device(self.device.index):
            # 1. The dedicated stream waits for work already queued on torch's current stream.
            torch_stream = cupy.cuda.ExternalStream(torch.cuda.current_stream(self.device).cuda_stream)
            inputs_ready = cupy.cuda.Event(disable_timing=True)
            inputs_ready.record(torch_stream)
            self._stream.wait_event(inputs_ready)
            # 2. Messages between a pair are matched in issue order; bytes move as uint8.
            # The first contact of a pair connects inside groupEnd and can hang: a watchdog
            # aborts the communicator if the group is not issued before the deadline.
            watchdog = threading.Timer(max(deadline.remaining_s(), MINIMUM_WATCHDOG_S), self._watchdog, (tag,))
            watchdog.daemon = True
            watchdog.start()
            try:
                nccl.groupStart()
                try:
                    for message in sends:
                        self._nccl_comm.send(message.buffer.data_ptr(), message.buffer.numel(), UINT8,
                                             message.peer, self._stream.ptr)
                    for message in recvs:
                        self._nccl_comm.recv(message.buffer.data_ptr(), message.buffer.numel(), UINT8,
                                             message.peer, self._stream.ptr)
                finally:
                    nccl.groupEnd()
            except Exception as error:  # NcclError, or KeyError from older cupy for new codes
                raise self._broken(CommError(
                    f"collective {tag!r}: NCCL failed to issue the group ({type(error).__name__}: {error}). "
                    f"{RECOVERY_HINT}")) from error
            finally:
                watchdog.cancel()
            finished = cupy.cuda.Event(disable_timing=True)
            finished.record(self._stream)
            # Even if the wait gives up, torch must not reuse these buffers before the
            # dedicated stream is done with them.
            comm_stream = torch.cuda.ExternalStream(self._stream.ptr, device=self.device)
            for message in [*sends, *recvs]:
                message.buffer.record_stream(comm_stream)
        return finished

    def _watchdog(self, tag: str) -> None:
        """Runs on a timer thread while the issuing thread may be stuck in groupEnd: abort
        the handle directly (the issue lock is held by that thread) so that groupEnd returns."""
        self._broken(CollectiveTimeout(tag=tag, timeout_s=self.timeout_s, peer=None, world_size=self.world_size))
        nccl_comm = self._nccl_comm
        if nccl_comm is not None:
            try:
                nccl_comm.abort()
            except Exception:
                pass
            self._nccl_comm = None
            self._closed = True

    def _wait(self, finished, deadline: Deadline, tag: str) -> None:
        """Wait on the host, polling, so the deadline holds; the result is complete on return."""
        while not finished.done:
            if self._closed or self._nccl_comm is None:
                raise self._broken(CommError(f"collective {tag!r}: the communicator was aborted while waiting. "
                                             f"{RECOVERY_HINT}"))
            if deadline.has_expired():
                failure = self._broken(CollectiveTimeout(
                    tag=tag, timeout_s=deadline.timeout_s, peer=None, world_size=self.world_size))
                self.abort()  # unblocks the kernels of this group so the GPU is usable again
                raise failure
            try:
                self._nccl_comm.check_async_error()
            except Exception as error:  # NcclError (a peer's connection broke), KeyError (old cupy)
                failure = self._broken(CommError(
                    f"collective {tag!r}: NCCL reported an asynchronous error ({type(error).__name__}: {error}); "
                    f"a peer may have died. {RECOVERY_HINT}"))
                self.abort()
                raise failure from error
            time.sleep(POLL_INTERVAL_S)


def cuda_device(device: torch.device | int | None) -> torch.device:
    """This rank's GPU as a torch device with an index (torch's current one by default)."""
    if device is None:
        return torch.device("cuda", torch.cuda.current_device())
    if isinstance(device, int):
        return torch.device("cuda", device)
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"an NCCL rank needs a CUDA device, got {device}")
    return torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)
