"""The NCCL transport's per-collective parts that need no GPU (issue 34, item 7): one event pool
and one long-lived watchdog thread per communicator instead of two new events and a
``threading.Timer`` per collective, and ``transfer(..., wait=False)``, which a device-ordered
transport (NCCL) hands to ``_order_after`` (torch's stream waits, not the host) while host
transports (gloo, sockets) still wait. Runs on any machine."""

from __future__ import annotations

import threading
import time

import torch

from raymoe.kernels.comm.base import Deadline
from raymoe.kernels.comm.nccl import EventPool, IssueWatchdog
from raymoe.kernels.comm.p2p import PointToPointCommunicator


def test_the_event_pool_reuses_events_given_back():
    made = []
    pool = EventPool(lambda: made.append(object()) or made[-1])
    first = pool.take()
    second = pool.take()  # the first is still out: a new one
    pool.give(first)
    pool.give(second)
    for _ in range(100):  # a collective: take an inputs event, give it back, take a completion event...
        inputs = pool.take()
        pool.give(inputs)
        finished = pool.take()
        pool.give(finished)
    assert pool.created == 2 and len(made) == 2


def test_one_watchdog_thread_for_many_collectives_and_nothing_fires_when_disarmed():
    fired = []
    watchdog = IssueWatchdog("test-watchdog")
    threads_before = threading.active_count()
    for _ in range(200):
        watchdog.arm(5.0, fired.append, "collective")
        watchdog.disarm()
    assert watchdog.threads_started == 1
    assert threading.active_count() <= threads_before + 1
    time.sleep(0.05)
    assert fired == [] and watchdog.fired == 0
    watchdog.stop()


def test_the_watchdog_fires_once_when_the_group_is_not_issued_before_its_deadline():
    fired = threading.Event()
    tags = []
    watchdog = IssueWatchdog("test-watchdog")
    watchdog.arm(5.0, tags.append, "an earlier one")
    watchdog.disarm()
    started = time.monotonic()
    watchdog.arm(0.1, lambda tag: (tags.append(tag), fired.set()), "layer 3 dispatch")  # earlier than the sleep
    assert fired.wait(2.0)
    assert 0.09 <= time.monotonic() - started < 1.0
    assert tags == ["layer 3 dispatch"] and watchdog.fired == 1
    watchdog.arm(0.05, tags.append, "after stop")
    watchdog.stop()
    time.sleep(0.15)
    assert tags == ["layer 3 dispatch"]


class Recording(PointToPointCommunicator):
    """A transport that records whether the host waited for each batch."""

    def __init__(self, device_ordered: bool):
        super().__init__(rank=0, world_size=2, timeout_s=1.0)
        self.device_ordered = device_ordered
        self.calls = []

    def _check_device(self, tensor, tag):
        pass

    def _post(self, sends, recvs, tag):
        return tag

    def _wait(self, pending, deadline: Deadline, tag: str) -> None:
        self.calls.append(("host wait", tag))

    def _order_after(self, pending, deadline: Deadline, tag: str) -> None:
        self.calls.append(("device wait", tag))


def test_wait_false_leaves_the_wait_to_the_device_only_where_the_transport_is_device_ordered():
    buffer = torch.zeros(4)
    nccl_like, host = Recording(device_ordered=True), Recording(device_ordered=False)
    for comm in (nccl_like, host):
        comm.transfer([(1, buffer)], [], tag="layer 0 dispatch")
        comm.transfer([], [(1, buffer)], tag="layer 0 rows", wait=False)
    assert nccl_like.calls == [("host wait", "layer 0 dispatch"), ("device wait", "layer 0 rows")]
    assert host.calls == [("host wait", "layer 0 dispatch"), ("host wait", "layer 0 rows")]
