"""Telemetry is written by the router's step thread and read by actor calls on other threads."""

import threading
import time

import numpy as np

from raymoe.engine.telemetry import Telemetry


def test_snapshot_while_steps_end_on_another_thread():
    # A CI run failed in get_telemetry with "deque mutated during iteration": the ring was
    # walked while the step thread appended. Readers and the writer now share a lock.
    telemetry = Telemetry(num_layers=2, num_slots=4, num_workers=2, capacity=50)
    phy2log = np.full((2, 4), -1)  # no layer is recorded: the placement is not read
    stop = threading.Event()
    errors: list[BaseException] = []

    def steps():
        try:
            while not stop.is_set():
                telemetry.end_step(dense_s=0.001, expert_s=0.0005, epoch=0, phy2log=phy2log)
        except BaseException as exc:  # noqa: BLE001 - reported by the assertion below
            errors.append(exc)

    writer = threading.Thread(target=steps)
    writer.start()
    snapshots = 0
    deadline = time.monotonic() + 2.0
    try:
        while time.monotonic() < deadline and snapshots < 3000:
            snapshot = telemetry.snapshot()
            assert len(snapshot["steps"]) <= 50
            cursor, loads = telemetry.expert_loads_since(0)
            assert loads.shape[1:] == (2, 0) and loads.shape[0] <= 50 and cursor >= loads.shape[0]
            snapshots += 1
    finally:
        stop.set()
        writer.join(timeout=10)
    assert not errors, errors
    assert telemetry.num_steps > 0 and snapshots > 0
