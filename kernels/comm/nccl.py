"""NCCL communicator through `cupy.cuda.nccl`, for GPU ranks (one rank per GPU).

Invariant: all ranks must call collectives in the same order with the same tag, or they
hang; the deadline turns that hang into an error. NCCL cannot say which peer is missing
(a group of sends and receives completes as a whole), so a timeout names no peer.

A process that is an NCCL rank owns its GPU: one communicator per device per group.
cupy is imported inside functions only, so this module imports on CPU-only machines.

Each all-to-all-v is `groupStart()`, one send/recv pair per peer, `groupEnd()`, issued on
a dedicated non-blocking stream. Ordering with torch is explicit: the dedicated stream
first waits for an event recorded on torch's current stream (so the send buffer is
ready), and the host then waits, polling an event, until the group finished or the
deadline passed (so the returned tensor is complete and the deadline is enforced).
"""

from __future__ import annotations

import time
from typing import Sequence

import torch

from raymoe.kernels.comm.base import Deadline, ensure_usable, validate_group, validate_timeout
from raymoe.kernels.comm.errors import RECOVERY_HINT, CollectiveTimeout, CommError
from raymoe.kernels.comm.layout import (
    COUNT_HEADER_WIDTH,
    AllToAllLayout,
    nccl_data_type,
    pack_count_header,
    plan_all_to_all,
    plan_payload,
    unpack_count_header,
)

POLL_INTERVAL_S = 0.0002  # host sleep between completion checks while a group runs
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


class NcclCommunicator:
    """One GPU rank of an NCCL group; see `Communicator` for the method contracts."""

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
        self.rank = rank
        self.world_size = world_size
        self.timeout_s = timeout_s
        self.device = device
        self._nccl_comm = nccl_comm  # cupy.cuda.nccl.NcclCommunicator; None once closed
        self._stream = stream  # cupy.cuda.Stream(non_blocking=True), used by this group only
        self._failure: CommError | None = None

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
        ranks have joined; NCCL's own bootstrap timeout applies here, not `timeout_s`.
        """
        cupy, nccl = import_cupy_nccl()
        validate_group(rank, world_size)
        timeout_s = validate_timeout(timeout_s)
        unique_id = validate_unique_id(unique_id)
        device = cuda_device(device)
        with cupy.cuda.Device(device.index):
            nccl_comm = nccl.NcclCommunicator(world_size, unique_id, rank)
            stream = cupy.cuda.Stream(non_blocking=True)
        return cls(
            rank=rank,
            world_size=world_size,
            timeout_s=timeout_s,
            device=device,
            nccl_comm=nccl_comm,
            stream=stream,
        )

    def exchange_counts(self, send_counts: torch.Tensor, *, tag: str) -> torch.Tensor:
        self._check_usable(tag)
        header = pack_count_header(send_counts, tag, self.world_size).to(self.device)  # [W, 2]
        ones = [1] * self.world_size
        received = self._all_to_all(header, plan_all_to_all(ones, ones, (COUNT_HEADER_WIDTH,)), tag)
        return unpack_count_header(received.cpu(), tag, self.world_size)

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
        if send.device != self.device:
            raise CommError(
                f"collective {tag!r}: this NCCL rank moves tensors on {self.device}, got {send.device}"
            )
        return self._all_to_all(send, layout, tag)

    def barrier(self, *, tag: str) -> None:
        # A count exchange is a barrier: no rank's group completes before every peer joined it.
        self.exchange_counts(torch.zeros(self.world_size, dtype=torch.int64), tag=tag)

    def _check_usable(self, tag: str) -> None:
        ensure_usable(self._nccl_comm is None, self._failure, tag)

    def close(self) -> None:
        nccl_comm, self._nccl_comm = self._nccl_comm, None
        if nccl_comm is not None:
            nccl_comm.destroy()

    def abort(self) -> None:
        nccl_comm, self._nccl_comm = self._nccl_comm, None
        if nccl_comm is not None:
            try:
                nccl_comm.abort()
            except RuntimeError:
                pass  # best effort: the handle is dropped either way

    def _all_to_all(self, send: torch.Tensor, layout: AllToAllLayout, tag: str) -> torch.Tensor:
        """Steps: 1. order after torch's stream, 2. issue the group, 3. wait until the deadline."""
        cupy, nccl = import_cupy_nccl()
        deadline = Deadline(self.timeout_s)
        data_type = int(nccl_data_type(send.dtype))
        element_size = send.element_size()
        send = send.contiguous()
        recv = torch.empty(layout.recv_shape(), dtype=send.dtype, device=self.device)
        with cupy.cuda.Device(self.device.index):
            # 1. The dedicated stream waits for work already queued on torch's current stream.
            torch_stream = cupy.cuda.ExternalStream(torch.cuda.current_stream(self.device).cuda_stream)
            inputs_ready = cupy.cuda.Event(disable_timing=True)
            inputs_ready.record(torch_stream)
            self._stream.wait_event(inputs_ready)
            # 2. One send/recv pair per peer (self included), fused into one group.
            nccl.groupStart()
            try:
                for peer_slice in layout.peers:
                    send_offset, recv_offset = layout.byte_offsets(peer_slice.peer, element_size)
                    if peer_slice.send_numel > 0:
                        self._nccl_comm.send(
                            send.data_ptr() + send_offset, peer_slice.send_numel, data_type,
                            peer_slice.peer, self._stream.ptr,
                        )
                    if peer_slice.recv_numel > 0:
                        self._nccl_comm.recv(
                            recv.data_ptr() + recv_offset, peer_slice.recv_numel, data_type,
                            peer_slice.peer, self._stream.ptr,
                        )
            finally:
                nccl.groupEnd()
            finished = cupy.cuda.Event(disable_timing=True)
            finished.record(self._stream)
            # Even if the wait below gives up, torch must not reuse these buffers before
            # the dedicated stream is done with them.
            comm_stream = torch.cuda.ExternalStream(self._stream.ptr, device=self.device)
            send.record_stream(comm_stream)
            recv.record_stream(comm_stream)
            # 3. Wait on the host so the deadline holds; the result is complete on return.
            self._wait(finished, deadline, tag)
        return recv

    def _wait(self, finished, deadline: Deadline, tag: str) -> None:
        while not finished.done:
            if deadline.has_expired():
                self._failure = CollectiveTimeout(
                    tag=tag, timeout_s=self.timeout_s, peer=None, world_size=self.world_size
                )
                self.abort()  # unblocks the kernels of this group so the GPU is usable again
                raise self._failure
            try:
                self._nccl_comm.check_async_error()
            except RuntimeError as error:  # cupy's NcclError: e.g. a peer's connection broke
                self._failure = CommError(
                    f"collective {tag!r}: NCCL reported an asynchronous error ({error}); "
                    f"a peer may have died. {RECOVERY_HINT}"
                )
                self.abort()
                raise self._failure from error
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
