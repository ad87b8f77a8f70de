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


def test_halves_of_a_micro_batched_step_and_a_new_placement_add_up_as_the_layers_say():
    """A micro-batched step records each layer twice (once a half), a step may reach only some
    layers, and the placement (phy2log) may change between steps: the loads and slot counters
    are each layer's counts mapped through that step's placement, added up."""
    first = np.array([[0, 1, 2, 3], [3, 2, 1, 0]])
    second = np.array([[1, 1, 0, -1], [0, 1, 2, 3]])  # expert 1 replicated in layer 0, slot 3 empty
    telemetry = Telemetry(num_layers=2, num_slots=4, num_workers=2, num_experts=4)
    steps = [  # (phy2log, [(layer, slot counts)])
        (first, [(0, [1, 2, 0, 0]), (0, [0, 1, 1, 0]), (1, [2, 0, 0, 1]), (1, [0, 0, 3, 0])]),  # two halves
        (first, [(0, [0, 0, 0, 5])]),  # reached layer 0 only
        (second, [(0, [1, 2, 3, 0]), (1, [4, 0, 0, 1])]),
    ]
    expected_loads, slot_tokens = [], np.zeros((2, 4), dtype=np.int64)
    for phy2log, layers in steps:
        telemetry.begin_step()
        load = np.zeros((2, 4), dtype=np.int64)
        for layer, counts in layers:
            telemetry.record_layer(layer, counts, None, traffic([1, 1], 10, 5), 64, 16, 2)
            slot_tokens[layer] += counts
            for slot, count in enumerate(counts):
                if phy2log[layer, slot] >= 0:
                    load[layer, phy2log[layer, slot]] += count
        telemetry.end_step(dense_s=0.01, expert_s=0.0, epoch=0, phy2log=phy2log)
        expected_loads.append(load)
    _, loads = telemetry.expert_loads_since(0)
    assert (loads == np.stack(expected_loads)).all(), loads
    assert telemetry.snapshot()["slot_tokens"] == slot_tokens.tolist()
