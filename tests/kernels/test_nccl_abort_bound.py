"""Every abort of an NCCL communicator is bounded in time (issue 34, item 4); runs on any machine.

``ncclCommAbort`` can block (a kernel or proxy thread that never ends), and it runs while the
issue lock ``_post`` needs is held. The communicator runs each abort on a thread of its own and
waits at most ``abort_bound_s``; past it ``on_abort_hung`` is called, whose default ends the
process with ``ABORT_HUNG_EXIT_CODE`` so that Ray restarts the actor and the controller's
recovery replaces the rank. Stand-in handles whose ``abort`` never returns play the stuck
NCCL here: no GPU, cupy or NCCL is needed. Also here: cupy 13/14's two forms of the unique id,
and the torch/cupy CUDA pairing check.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time
import types

import pytest
import torch

from raymoe.kernels.comm import CommClosedError, CollectiveTimeout
from raymoe.kernels.comm import nccl as nccl_module
from raymoe.kernels.comm.nccl import (
    ABORT_HUNG_EXIT_CODE,
    AbortHung,
    NcclCommunicator,
    bounded_abort,
    cuda_pairing_problem,
    normalize_unique_id,
    unique_id_for_cupy,
)

BOUND_S = 0.3
SLACK_S = 1.5  # thread start and scheduling on a busy 2-core machine


class StuckHandle:
    """An NCCL handle whose abort never returns (until released at the end of the test)."""

    def __init__(self):
        self.release = threading.Event()
        self.abort_entered = threading.Event()
        self.aborting = False
        self.overlaps = 0
        self.checks = 0

    def abort(self):
        self.aborting = True
        self.abort_entered.set()
        self.release.wait()

    def destroy(self):
        pass

    def check_async_error(self):
        if self.aborting:
            self.overlaps += 1
        self.checks += 1


class QuickHandle(StuckHandle):
    def abort(self):
        self.aborting = True
        time.sleep(0.05)
        self.aborting = False


@pytest.fixture
def hung(monkeypatch):
    """Replaces the default hook (which ends the process) with a recorder."""
    calls: list[AbortHung] = []
    monkeypatch.setattr(nccl_module, "on_abort_hung", calls.append)
    return calls


def communicator(handle, bound_s: float = BOUND_S) -> NcclCommunicator:
    comm = NcclCommunicator(rank=0, world_size=2, timeout_s=5.0, device=torch.device("cuda", 0),
                            nccl_comm=handle, stream=None)
    comm.abort_bound_s = bound_s
    return comm


def test_an_abort_that_never_returns_is_given_up_at_its_bound(hung):
    handle = StuckHandle()
    started = time.monotonic()
    assert bounded_abort(handle, BOUND_S, "test abort") is False
    elapsed = time.monotonic() - started
    assert handle.abort_entered.is_set()
    assert BOUND_S <= elapsed < BOUND_S + SLACK_S
    assert len(hung) == 1 and isinstance(hung[0], AbortHung) and hung[0].bound_s == BOUND_S
    assert "test abort: ncclCommAbort did not return within 0.3 s" in str(hung[0])
    handle.release.set()


def test_an_abort_that_returns_is_waited_for_and_reports_nothing(hung):
    assert bounded_abort(QuickHandle(), BOUND_S, "quick") is True
    assert hung == []


def test_communicator_abort_returns_within_its_bound_and_frees_the_issue_lock(hung):
    handle = StuckHandle()
    comm = communicator(handle)
    started = time.monotonic()
    comm.abort()
    elapsed = time.monotonic() - started
    assert elapsed < BOUND_S + SLACK_S
    assert comm.aborts_hung == 1 and len(hung) == 1
    # _post needs this lock: it is free again although ncclCommAbort is still stuck.
    assert handle.abort_entered.is_set() and not handle.release.is_set()
    assert comm._issue_lock.acquire(timeout=1.0)
    comm._issue_lock.release()
    assert not comm.usable
    with pytest.raises(CommClosedError):
        comm.exchange_counts(torch.tensor([1, 2]), tag="after a hung abort")
    comm.abort()  # idempotent: the handle is gone, nothing waits again
    assert comm.aborts_hung == 1 and len(hung) == 1
    handle.release.set()


def test_the_watchdog_abort_is_bounded_too(hung):
    handle = StuckHandle()
    comm = communicator(handle)
    started = time.monotonic()
    comm._watchdog("layer 3 dispatch")  # the timer thread's path while groupEnd hangs
    assert time.monotonic() - started < BOUND_S + SLACK_S
    assert len(hung) == 1 and "collective 'layer 3 dispatch' not issued before its deadline" in str(hung[0])
    assert isinstance(comm._failure, CollectiveTimeout) and not comm.usable
    handle.release.set()


def test_the_async_error_check_never_runs_beside_an_abort_of_its_handle(hung):
    handle = QuickHandle()
    comm = communicator(handle, bound_s=5.0)
    stop = threading.Event()
    results = []

    def poll():  # _wait's loop: check_async_error as often as it can
        while not stop.is_set():
            results.append(comm._check_async_error())

    poller = threading.Thread(target=poll)
    poller.start()
    time.sleep(0.05)
    comm.abort()
    time.sleep(0.05)
    stop.set()
    poller.join(timeout=5)
    assert handle.checks > 0 and handle.overlaps == 0
    assert results[-1] is False  # the handle was taken out before it was aborted
    assert hung == []


def test_by_default_a_hung_abort_ends_the_process_with_the_restart_status():
    program = textwrap.dedent(
        """
        import threading
        from raymoe.kernels.comm.nccl import bounded_abort

        class Stuck:
            def abort(self):
                threading.Event().wait()

        bounded_abort(Stuck(), 0.2, "rank 1 of 3: abort()")
        print("STILL RUNNING")
        """
    )
    started = time.monotonic()
    finished = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=120)
    assert finished.returncode == ABORT_HUNG_EXIT_CODE, finished.stderr
    assert "STILL RUNNING" not in finished.stdout
    assert "rank 1 of 3: abort(): ncclCommAbort did not return within 0.2 s" in finished.stderr
    assert f"exiting with status {ABORT_HUNG_EXIT_CODE}" in finished.stderr
    assert time.monotonic() - started < 60


def test_a_hung_abort_in_a_restartable_actor_ends_it_and_ray_restarts_it(ray_session_local):
    """The link to recovery: the process ends, Ray restarts the actor (a new pid), which is how
    ``Controller.recover`` tells a lost rank from a live one."""
    import ray

    @ray.remote(max_restarts=-1)
    class Rank:
        def pid(self):
            import os

            return os.getpid()

        def abort_stuck(self):
            import threading

            from raymoe.kernels.comm.nccl import bounded_abort

            class Stuck:
                def abort(self):
                    threading.Event().wait()

            return bounded_abort(Stuck(), 0.2, "stand-in")

    actor = Rank.remote()
    first = ray.get(actor.pid.remote(), timeout=60)
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(actor.abort_stuck.remote(), timeout=60)
    deadline = time.monotonic() + 60
    while True:
        try:
            second = ray.get(actor.pid.remote(), timeout=10)
            break
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            assert time.monotonic() < deadline, "the actor was not restarted"
            time.sleep(0.5)
    assert second != first
    ray.kill(actor, no_restart=True)


@pytest.fixture(scope="module")
def ray_session_local():
    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=False)
    yield
    ray.shutdown()


# ---- the unique id: cupy 13 (tuple of signed chars) and cupy 14 (bytes) ----------------------
def test_unique_ids_travel_as_unsigned_ints_and_reach_each_cupy_in_its_form():
    signed = tuple(range(-64, 64))  # what cupy 13's get_unique_id returns
    as_bytes = bytes(value & 0xFF for value in signed)  # what cupy 14's returns
    assert normalize_unique_id(signed) == normalize_unique_id(as_bytes) == tuple(as_bytes)
    values = normalize_unique_id(as_bytes)
    assert unique_id_for_cupy(values, 14) == as_bytes
    assert unique_id_for_cupy(values, 15) == as_bytes
    assert unique_id_for_cupy(values, 13) == signed
    assert all(-128 <= v <= 127 for v in unique_id_for_cupy(tuple(range(128, 256)), 13))
    assert nccl_module.validate_unique_id(values) == values


# ---- torch's and cupy's CUDA must share a major version --------------------------------------
@pytest.mark.parametrize("torch_cuda, runtime, expected", [
    ("12.8", 12080, None),
    ("12.4", 12090, None),  # minor versions may differ
    ("13.0", 13000, None),
    (None, 12080, None),  # a CPU torch: nothing to pair (no NCCL rank either)
    ("12.8", None, None),  # cupy could not say: the import decides
    ("13.0", 12080, "torch is built for CUDA 13.0 but cupy 13.4.0 runs CUDA 12.8"),
    ("12.6", 13000, "torch is built for CUDA 12.6 but cupy 13.4.0 runs CUDA 13.0"),
])
def test_cuda_pairing(torch_cuda, runtime, expected):
    problem = cuda_pairing_problem(torch_cuda, runtime, "13.4.0")
    if expected is None:
        assert problem is None
    else:
        assert problem.startswith(expected)
        major = torch_cuda.split(".")[0]
        assert f"cupy-cuda{major}x" in problem
        assert ("raymoe[gpu]" if major == "12" else "raymoe[gpu-cu13]") in problem


def test_a_mismatched_cupy_fails_the_import_with_the_pairing_message(monkeypatch):
    cupy = types.ModuleType("cupy")
    cupy.__version__ = "13.4.0"
    cuda = types.ModuleType("cupy.cuda")
    nccl = types.ModuleType("cupy.cuda.nccl")
    nccl.available = True
    cuda.runtime = types.SimpleNamespace(runtimeGetVersion=lambda: 12080)
    cupy.cuda, cuda.nccl = cuda, nccl
    for name, module in [("cupy", cupy), ("cupy.cuda", cuda), ("cupy.cuda.nccl", nccl)]:
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(nccl_module, "_pairing_checked", False)
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    with pytest.raises(ImportError, match=r"torch is built for CUDA 13.0 but cupy 13.4.0 runs CUDA 12.8.*"
                                          r"cupy-cuda13x"):
        nccl_module.import_cupy_nccl()
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    assert nccl_module.import_cupy_nccl() == (cupy, nccl)
    assert nccl_module._pairing_checked
