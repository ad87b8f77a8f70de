"""Telemetry adds a step's layers up once, at the end of the step: the sums it keeps are the
layers' own, in every counter a reader sees (Prometheus, the controller's expert loads)."""

import numpy as np
import torch

from raymoe.engine.telemetry import LayerTraffic
from raymoe.engine.telemetry import Telemetry


def traffic(rows: list[int], sent: int, received: int) -> LayerTraffic:
    return LayerTraffic(rows_per_worker=rows, bytes_sent=sent, bytes_received=received, dispatch_s=0.001,
                        exchange_s=0.004)


def test_a_step_of_layers_adds_up_to_their_counts():
    # 3 layers, 2 workers x 3 slots; layer 1 holds expert 2 twice (slots 1 and 4) and nothing in slot 5.
    phy2log = np.array([[0, 1, 2, 3, 4, 5], [0, 2, 1, 3, 2, -1], [5, 4, 3, 2, 1, 0]])
    telemetry = Telemetry(num_layers=3, num_slots=6, num_workers=2, num_experts=6)
    for step in range(2):
        telemetry.begin_step()
        telemetry.record_layer(0, [1, 0, 2, 0, 3, 0], None, traffic([3, 2], 100, 50), 64, 16, 4)
        telemetry.record_layer(1, [4, 1, 0, 0, 2, 0], torch.tensor([1, 0]), traffic([2, 2], 80, 40), 64, 16, 4)
        telemetry.record_layer(2, [0, 0, 0, 0, 0, 7], torch.tensor([0, 2]), traffic([0, 4], 60, 30), 64, 16, 4)
        telemetry.end_step(dense_s=0.01, expert_s=0.003, epoch=0, phy2log=phy2log)
    cursor, loads = telemetry.expert_loads_since(0)
    assert cursor == 2 and loads.shape == (2, 3, 6)
    expected = np.zeros((3, 6), dtype=np.int64)
    expected[0] = [1, 0, 2, 0, 3, 0]
    expected[1] = [4, 0, 1 + 2, 0, 0, 0]  # expert 2 in slots 1 and 4
    expected[2, 0] = 7  # slot 5 holds expert 0
    assert (loads[0] == expected).all() and (loads[1] == expected).all()
    snapshot = telemetry.snapshot()
    assert snapshot["slot_tokens"] == [[2, 0, 4, 0, 6, 0], [8, 2, 0, 0, 4, 0], [0, 0, 0, 0, 0, 14]]
    assert snapshot["worker_rows"] == [10, 16]  # (3 + 2 + 0, 2 + 2 + 4) rows a step, two steps
    assert snapshot["worker_bytes_sent"] == [640, 1024] and snapshot["worker_bytes_received"] == [640, 1024]
    assert snapshot["meta_bytes"] == 26 * 16
    assert snapshot["bytes_sent"] == 480 and snapshot["bytes_received"] == 240
    assert snapshot["worker_dropped"] == [2, 4] and snapshot["dropped"] == 6
    step = snapshot["steps"][-1]
    assert step["rows_sent"] == 13 and step["tokens"] == 4
    assert abs(step["dispatch_s"] - 0.003) < 1e-12 and abs(step["combine_s"] - (0.012 - 0.003)) < 1e-12
