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

Aborts are bounded (issue 34, item 4). ``ncclCommAbort`` can itself block (a kernel or a
proxy thread that never ends), and ``abort()`` runs it while holding the lock ``_post``
needs. So every abort of a handle runs on a thread of its own and is waited for at most
``ABORT_BOUND_S`` (cupy releases the GIL inside ``ncclCommAbort``, so the wait is real). Past
the bound the process cannot trust its GPU any more: :data:`on_abort_hung` is called, whose
default ends the process (exit status ``ABORT_HUNG_EXIT_CODE``). A raymoe actor that ends is
what the controller's recovery already replaces: routers and workers run with
``max_restarts=-1``, and ``Controller.recover`` finds a dead worker lost (waits for Ray's
restart, reloads its experts) and a restarted router by its new pid (the controller's poll
loop starts that recovery when a router dies). ``_wait``'s ``check_async_error`` and the
abort never touch one handle at once: the handle is taken out under ``_handle_lock`` before
it is aborted, and the check runs under the same lock on the handle it found there.

``NcclCommunicator.loopback`` moves a buffer to this rank itself through NCCL (one group of
``ncclSend`` to self and ``ncclRecv`` from self): ``transfer`` turns self-messages into a local
copy, so only ``loopback`` exercises the NCCL path on a single GPU (tests, benchmarks/gpu_check.py).

cupy 14 changed ``get_unique_id`` to return bytes and ``NcclCommunicator`` to take bytes
(cupy 13 and older: a tuple of signed chars); ids travel as 128 ints in 0..255 and are
converted for the cupy found here (:func:`unique_id_for_cupy`). torch and cupy must use the
same CUDA major version: :func:`cuda_pairing_problem` is checked before the first
communicator is made.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from typing import Callable, Sequence

import torch

from raymoe.kernels.comm.base import Deadline, validate_group, validate_timeout
from raymoe.kernels.comm.errors import RECOVERY_HINT, CollectiveTimeout, CommError
from raymoe.kernels.comm.layout import NcclDataType
from raymoe.kernels.comm.p2p import Message, PointToPointCommunicator, as_bytes

LOG = logging.getLogger("raymoe.kernels.comm")
POLL_INTERVAL_S = 0.00002  # host sleep between completion checks while a group runs
MINIMUM_WATCHDOG_S = 0.01
UINT8 = int(NcclDataType.UINT8)  # every message moves as bytes
NCCL_UNIQUE_ID_BYTES = 128
# How long one ncclCommAbort may take before the process is given up on. An abort of a
# healthy or a timed-out group returns in milliseconds to a second or two (it tears down the
# proxy thread and the connections); one that takes longer is stuck in the driver or behind
# a kernel that never ends, and nothing this process can do on that GPU will be trusted.
# Under the controller's 60 s call timeout (CALL_TIMEOUT_S, actors/recovery.py): a router's
# abort_comm or a worker's reset_comms whose abort hangs ends its process before the
# controller gives up on the call, so recovery finds a dead actor, not a frozen one.
ABORT_BOUND_S = 20.0
ABORT_HUNG_EXIT_CODE = 75  # EX_TEMPFAIL: "try again": the actor is restarted, not given up
CUPY_BYTES_UNIQUE_ID_MAJOR = 14  # cupy >= 14: get_unique_id() -> bytes, NcclCommunicator(commId: bytes)


class AbortHung(CommError):
    """``ncclCommAbort`` did not return within its bound: this process's GPU state is unknown
    and the process must be replaced (see :data:`on_abort_hung`)."""

    def __init__(self, what: str, bound_s: float) -> None:
        self.what = what
        self.bound_s = bound_s
        super().__init__(f"{what}: ncclCommAbort did not return within {bound_s:.1f} s; this process's GPU "
                         f"state is unknown, so the process ends and is replaced (its actor is restarted and "
                         f"the controller's recovery rebuilds the group)")

    def __reduce__(self):
        return (type(self), (self.what, self.bound_s))


def replace_this_process(failure: AbortHung) -> None:
    """The default :data:`on_abort_hung`: say why on stderr and in the log, then end the
    process at once (``os._exit``: no atexit handler or finalizer may touch the stuck GPU).
    Ray restarts the actor (``max_restarts=-1``) and the controller's recovery treats it as a
    lost rank: a worker is reloaded, a router rejoins with the placement in service."""
    message = f"raymoe: {failure}; exiting with status {ABORT_HUNG_EXIT_CODE}"
    try:
        LOG.critical(message)
        sys.stderr.write(message + "\n")
        sys.stderr.flush()
    finally:
        os._exit(ABORT_HUNG_EXIT_CODE)


# Called (on the thread that waited) when an abort outlives its bound. Tests and
# benchmarks/gpu_check.py replace it to observe the bound without ending their process.
on_abort_hung: Callable[[AbortHung], None] = replace_this_process


def bounded_abort(nccl_comm, bound_s: float, what: str) -> bool:
    """``nccl_comm.abort()`` on a thread of its own, waited for at most ``bound_s``.

    True when the abort returned (or raised: best effort, the handle is dropped either way);
    False when it is still running at the bound, after :data:`on_abort_hung` was called with
    an :class:`AbortHung` (which, by default, does not return)."""
    finished = threading.Event()

    def run() -> None:
        try:
            nccl_comm.abort()
        except Exception:  # best effort: the handle is dropped either way
            pass
        finally:
            finished.set()

    threading.Thread(target=run, name="raymoe-nccl-abort", daemon=True).start()
    if finished.wait(bound_s):
        return True
    on_abort_hung(AbortHung(what, bound_s))
    return False


def nccl_unique_id() -> tuple[int, ...]:
    """A fresh NCCL unique id, as a tuple of 128 ints that can travel through Ray.

    Call it on rank 0's process: NCCL's bootstrap root listens in the calling process,
    which must stay alive until every rank has created its communicator.
    """
    _, nccl = import_cupy_nccl()
    return normalize_unique_id(nccl.get_unique_id())


def normalize_unique_id(raw) -> tuple[int, ...]:
    """cupy's id (bytes from cupy 14 on, a tuple of signed chars before) as 128 ints in 0..255."""
    return tuple(int(value) & 0xFF for value in raw)


def unique_id_for_cupy(values: Sequence[int], cupy_major: int):
    """The id as this cupy's ``NcclCommunicator`` takes it: ``bytes`` from cupy 14 on, a tuple
    of signed chars (-128..127) before (cupy 13 assigns each to a C ``char``)."""
    values = normalize_unique_id(values)
    if cupy_major >= CUPY_BYTES_UNIQUE_ID_MAJOR:
        return bytes(values)
    return tuple(value - 256 if value > 127 else value for value in values)


def cupy_major_version(cupy) -> int:
    try:
        return int(str(cupy.__version__).split(".")[0])
    except ValueError:
        return CUPY_BYTES_UNIQUE_ID_MAJOR  # a development build: the current API


def cuda_pairing_problem(torch_cuda: str | None, cupy_runtime_version: int | None,
                         cupy_version: str = "?") -> str | None:
    """Why this torch and this cupy cannot share a process's GPU, or None when they can.

    ``torch_cuda`` is ``torch.version.cuda`` ("12.8", "13.0"; None for a CPU build),
    ``cupy_runtime_version`` cupy's ``runtime.runtimeGetVersion()`` (12080 = 12.8). torch
    built for CUDA 13 beside ``cupy-cuda12x`` (or the reverse) loads two CUDA runtimes of
    different major versions and two libnccl builds into one process: install the cupy wheel
    of torch's major (``pip install 'raymoe[gpu-cu13]'`` for a cu13x torch, ``'raymoe[gpu]'``
    for cu12x; docs/DEPLOY.md, "GPU packages")."""
    if torch_cuda is None or cupy_runtime_version is None:
        return None
    try:
        torch_major = int(str(torch_cuda).split(".")[0])
    except ValueError:
        return None
    cupy_major, cupy_minor = cupy_runtime_version // 1000, cupy_runtime_version % 1000 // 10
    if torch_major == cupy_major:
        return None
    extra = "gpu" if torch_major == 12 else f"gpu-cu{torch_major}"
    return (f"torch is built for CUDA {torch_cuda} but cupy {cupy_version} runs CUDA {cupy_major}.{cupy_minor}: "
            f"the NCCL communicator needs both on one CUDA major version; install cupy-cuda{torch_major}x "
            f"(pip install 'raymoe[{extra}]') or a torch built for CUDA {cupy_major}")


def _cupy_runtime_version(cupy) -> int | None:
    for read in (lambda: cupy.cuda.runtime.runtimeGetVersion(), lambda: cupy.cuda.get_local_runtime_version()):
        try:
            return int(read())
        except Exception:
            continue
    return None


_pairing_checked = False


def import_cupy_nccl():
    """(cupy, cupy.cuda.nccl), imported on first use, with a clear error when missing or when
    cupy's CUDA major version is not torch's (checked once per process)."""
    global _pairing_checked
    hint = ("the NCCL communicator needs cupy with NCCL: pip install 'raymoe[gpu]' (cupy-cuda12x, for a torch "
            "built for CUDA 12) or 'raymoe[gpu-cu13]' (cupy-cuda13x, for CUDA 13)")
    try:
        import cupy
        from cupy.cuda import nccl
    except ImportError as error:
        raise ImportError(f"{hint}; import failed: {error}") from error
    if not getattr(nccl, "available", False):  # cupy imports, but found no libnccl
        raise ImportError(f"{hint}; cupy is installed but cannot load the NCCL library")
    if not _pairing_checked:
        problem = cuda_pairing_problem(torch.version.cuda, _cupy_runtime_version(cupy),
                                       getattr(cupy, "__version__", "?"))
        if problem is not None:
            raise ImportError(problem)
        _pairing_checked = True
    return cupy, nccl


def validate_unique_id(unique_id: Sequence[int]) -> tuple[int, ...]:
    values = tuple(unique_id)
    if len(values) != NCCL_UNIQUE_ID_BYTES or not all(isinstance(value, int) and -128 <= value <= 255
                                                      for value in values):
        raise ValueError(f"an NCCL unique id is {NCCL_UNIQUE_ID_BYTES} ints, got {len(values)} values")
    return values


def _cupy_event():
    cupy, _ = import_cupy_nccl()
    return cupy.cuda.Event(disable_timing=True)


class EventPool:
    """Completion events reused across collectives instead of two new ones per collective.
    ``take`` gives a free one (made by ``make`` when none is free); ``give`` returns one whose
    last record nothing waits for on the host any more (a stream's ``wait_event`` is captured
    when it is enqueued, so an event may be recorded again right after). An event of a group
    that failed is never given back."""

    def __init__(self, make: Callable[[], object]):
        self._make = make
        self._free: list = []
        self.created = 0

    def take(self):
        try:
            return self._free.pop()  # (list.pop and append are atomic: threads may share a pool)
        except IndexError:
            self.created += 1
            return self._make()

    def give(self, event) -> None:
        self._free.append(event)


class IssueWatchdog:
    """One long-lived thread per communicator that calls ``callback(*args)`` when an armed
    deadline passes before :meth:`disarm` (a group stuck in ``groupEnd``), replacing a
    ``threading.Timer`` (a new thread) per collective. Arming and disarming take a lock and, at
    most, wake the thread when it sleeps with nothing armed or until a later time; in steady
    state the thread wakes once per deadline period, not per collective. The callback runs
    without the lock (it aborts, bounded)."""

    def __init__(self, name: str):
        self._name = name
        self._condition = threading.Condition()
        self._armed: tuple[float, Callable, tuple] | None = None  # (due, callback, args)
        self._waiting_until: float | None = None  # what the thread sleeps until (None: until armed)
        self._thread: threading.Thread | None = None
        self._stopped = False
        self.threads_started = 0
        self.fired = 0

    def arm(self, after_s: float, callback: Callable, *args) -> None:
        due = time.monotonic() + after_s
        with self._condition:
            if self._stopped:
                return
            self._armed = (due, callback, args)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self.threads_started += 1
                self._thread.start()
            elif self._waiting_until is None or due < self._waiting_until:
                self._condition.notify()

    def disarm(self) -> None:
        with self._condition:
            self._armed = None  # the thread finds nothing due when it next wakes

    def stop(self) -> None:
        with self._condition:
            self._stopped, self._armed = True, None
            self._condition.notify()

    def _run(self) -> None:
        while True:
            with self._condition:
                if self._stopped:
                    return
                if self._armed is None:
                    self._waiting_until = None
                    self._condition.wait()
                    continue
                due, callback, args = self._armed
                remaining = due - time.monotonic()
                if remaining > 0:
                    self._waiting_until = due
                    self._condition.wait(remaining)
                    continue  # re-check: disarmed, re-armed or due now
                self._armed = None
                self.fired += 1
            callback(*args)


class NcclCommunicator(PointToPointCommunicator):
    """One GPU rank of an NCCL group: the transport under `PointToPointCommunicator`."""

    backend_name = "nccl"
    device_ordered = True  # transfer(wait=False): torch's stream waits for the group, not the host

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
        # Guards taking the handle out (before an abort) against _wait's check_async_error on
        # it: held for a pointer swap or one non-blocking check, never across an abort.
        self._handle_lock = threading.Lock()
        self.abort_bound_s = ABORT_BOUND_S
        self.aborts_hung = 0  # aborts that outlived their bound (the process normally ends at the first)
        # Reused by every collective: completion events from a pool, one watchdog thread.
        self._events = EventPool(lambda: _cupy_event())
        self._watchdog_thread = IssueWatchdog(f"raymoe-nccl-watchdog-r{rank}")

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
                nccl_comm = nccl.NcclCommunicator(world_size, unique_id_for_cupy(unique_id, cupy_major_version(cupy)),
                                                  rank)
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

    def _take_handle(self):
        """The handle, taken out: nothing else will use it (or see it) after this returns."""
        with self._handle_lock:
            nccl_comm, self._nccl_comm = self._nccl_comm, None
            self._closed = True
        return nccl_comm

    def _abort_handle(self, nccl_comm, what: str) -> None:
        """Abort a taken-out handle within ``abort_bound_s`` (see the module docstring)."""
        if nccl_comm is not None and not bounded_abort(nccl_comm, self.abort_bound_s, what):
            self.aborts_hung += 1

    def _teardown(self, abort: bool) -> None:
        # Runs under the issue lock (p2p.close/abort): bounded, so that lock is held at most
        # abort_bound_s even when ncclCommAbort blocks.
        self._watchdog_thread.stop()
        nccl_comm = self._take_handle()
        if nccl_comm is None:
            return
        if abort:
            self._abort_handle(nccl_comm, f"rank {self.rank} of {self.world_size}: abort()")
            return
        try:
            nccl_comm.destroy()
        except Exception:  # best effort: the handle is dropped either way
            pass

    def _post(self, sends: list[Message], recvs: list[Message], tag: str):
        """Steps: 1. order after torch's stream, 2. one group of sends/receives, watched.
        Returns the group's completion event (from this communicator's pool, given back once
        waited for, on the host or by torch's stream)."""
        cupy, nccl = import_cupy_nccl()
        deadline = Deadline(self.timeout_s)
        nccl_comm = self._nccl_comm  # one read: the watchdog may take it out while this issues
        if nccl_comm is None:
            raise self._broken(CommError(f"collective {tag!r}: the communicator was aborted. {RECOVERY_HINT}"))
        with cupy.cuda.Device(self.device.index):
            # 1. The dedicated stream waits for work already queued on torch's current stream
            #    (the wait is enqueued now, so the event can go back to the pool at once).
            torch_stream = cupy.cuda.ExternalStream(torch.cuda.current_stream(self.device).cuda_stream)
            inputs_ready = self._events.take()
            inputs_ready.record(torch_stream)
            self._stream.wait_event(inputs_ready)
            self._events.give(inputs_ready)
            # 2. Messages between a pair are matched in issue order; bytes move as uint8.
            # The first contact of a pair connects inside groupEnd and can hang: the
            # communicator's one watchdog thread aborts it if the group is not issued before
            # the deadline (armed here, disarmed below: no thread per collective).
            self._watchdog_thread.arm(max(deadline.remaining_s(), MINIMUM_WATCHDOG_S), self._watchdog, tag)
            try:
                nccl.groupStart()
                try:
                    for message in sends:
                        nccl_comm.send(message.buffer.data_ptr(), message.buffer.numel(), UINT8,
                                       message.peer, self._stream.ptr)
                    for message in recvs:
                        nccl_comm.recv(message.buffer.data_ptr(), message.buffer.numel(), UINT8,
                                       message.peer, self._stream.ptr)
                finally:
                    nccl.groupEnd()
            except Exception as error:  # NcclError, or KeyError from older cupy for new codes
                raise self._broken(CommError(
                    f"collective {tag!r}: NCCL failed to issue the group ({type(error).__name__}: {error}). "
                    f"{RECOVERY_HINT}")) from error
            finally:
                self._watchdog_thread.disarm()
            finished = self._events.take()
            finished.record(self._stream)
            # Even if the wait gives up, torch must not reuse these buffers before the
            # dedicated stream is done with them.
            comm_stream = torch.cuda.ExternalStream(self._stream.ptr, device=self.device)
            for message in [*sends, *recvs]:
                message.buffer.record_stream(comm_stream)
        return finished

    def _order_after(self, finished, deadline: Deadline, tag: str) -> None:
        """``transfer(..., wait=False)``: torch's current stream waits for the group (a device-side
        wait, enqueued now; the host goes on), and the event goes back to the pool."""
        cupy, _ = import_cupy_nccl()
        with cupy.cuda.Device(self.device.index):
            cupy.cuda.ExternalStream(torch.cuda.current_stream(self.device).cuda_stream).wait_event(finished)
        self._events.give(finished)

    def _watchdog(self, tag: str) -> None:
        """Runs on a timer thread while the issuing thread may be stuck in groupEnd: abort
        the handle directly (the issue lock is held by that thread) so that groupEnd returns;
        bounded like every abort."""
        self._broken(CollectiveTimeout(tag=tag, timeout_s=self.timeout_s, peer=None, world_size=self.world_size))
        self._watchdog_thread.stop()  # (this thread ends after this call: nothing more to watch)
        self._abort_handle(self._take_handle(), f"rank {self.rank} of {self.world_size}: collective {tag!r} "
                                                f"not issued before its deadline")

    def _check_async_error(self) -> bool:
        """``ncclCommGetAsyncError`` on the handle in place, never beside an abort of it (the
        abort takes the handle out under the same lock first). False when it is gone."""
        with self._handle_lock:
            nccl_comm = self._nccl_comm
            if nccl_comm is None:
                return False
            nccl_comm.check_async_error()  # non-blocking
            return True

    def loopback(self, send: torch.Tensor, recv: torch.Tensor, *, tag: str, timeout_s: float | None = None) -> None:
        """``recv`` gets ``send``'s bytes through NCCL: one group of ``ncclSend`` to this rank and
        ``ncclRecv`` from this rank (groupStart / send / recv / groupEnd on the dedicated stream,
        waited under the deadline), the path every message to a peer takes. ``transfer``
        copies a message to self locally instead, so on one GPU only this reaches NCCL."""
        self._check_usable(tag)
        for tensor in (send, recv):
            self._check_device(tensor, tag)
            if not tensor.is_contiguous():
                raise CommError(f"collective {tag!r}: loopback buffers must be contiguous")
        if send.numel() * send.element_size() != recv.numel() * recv.element_size():
            raise CommError(f"collective {tag!r}: loopback sends {send.numel() * send.element_size()} bytes into "
                            f"{recv.numel() * recv.element_size()}")
        deadline = Deadline(self.timeout_s if timeout_s is None else timeout_s)
        with self._issue_lock:
            self._check_usable(tag)
            pending = self._post([Message(self.rank, as_bytes(send))], [Message(self.rank, as_bytes(recv))], tag)
        self._wait(pending, deadline, tag)

    def _wait(self, finished, deadline: Deadline, tag: str) -> None:
        """Wait on the host, polling, so the deadline holds; the result is complete on return."""
        while not finished.done:
            if self._closed or self._nccl_comm is None:
                raise self._broken(CommError(f"collective {tag!r}: the communicator was aborted while waiting. "
                                             f"{RECOVERY_HINT}"))
            if deadline.has_expired():
                failure = self._broken(CollectiveTimeout(
                    tag=tag, timeout_s=deadline.timeout_s, peer=None, world_size=self.world_size))
                self.abort()  # unblocks the kernels of this group so the GPU is usable again (bounded)
                raise failure
            try:
                if not self._check_async_error():
                    continue  # aborted meanwhile: the check at the top of the loop says so
            except Exception as error:  # NcclError (a peer's connection broke), KeyError (old cupy)
                failure = self._broken(CommError(
                    f"collective {tag!r}: NCCL reported an asynchronous error ({type(error).__name__}: {error}); "
                    f"a peer may have died. {RECOVERY_HINT}"))
                self.abort()
                raise failure from error
            time.sleep(POLL_INTERVAL_S)
        self._events.give(finished)  # done: the next group may record it again


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
