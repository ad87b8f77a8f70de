"""A worker's reload never holds its experts twice (issue 34 item 2), without Ray: the row
planner against a simulation, and ExpertWorker.load_placement rewriting its pool in place."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from raymoe.actors.expert_worker import SAVED_ROW, ExpertWorker, plan_row_moves
from raymoe.engine.checkpoint import Checkpoint
from raymoe.engine.weights import load_expert_stack
from raymoe.kernels import native_cpu
from raymoe.moe.initial_placement import initial_placement
from raymoe.engine.hf_config import load_model_config
from raymoe.moe.placement import PlacementTable


def simulate(held: list, target: list[int], ops: list[tuple]) -> tuple[list, int]:
    """Run the planner's steps on row labels; returns the rows and how many rows were read."""
    rows, saved, loads = [("held", e) for e in held], None, 0
    for op in ops:
        if op[0] == "save":
            assert saved is None, "two rows aside at once"
            saved = rows[op[1]]
        elif op[0] == "copy":
            rows[op[1]] = saved if op[2] == SAVED_ROW else rows[op[2]]
            if op[2] == SAVED_ROW:
                saved = None
        elif op[0] == "load":
            rows[op[1]] = ("held", op[2])
            loads += 1
        else:
            raise AssertionError(op)
    assert saved is None
    return rows, loads


@pytest.mark.parametrize("seed", range(300))
def test_row_plan_reaches_the_target_reading_only_missing_experts(seed):
    rng = random.Random(seed)
    rows, experts = rng.randint(1, 9), rng.randint(2, 12)
    held = [rng.choice([None, -1, *range(experts)]) for _ in range(rows)]
    target = [rng.choice([-1, *range(experts)]) for _ in range(rows)]
    if seed % 3 == 0:  # a pure permutation of distinct experts: cycles
        held = rng.sample(range(experts), min(rows, experts)) + [-1] * max(0, rows - experts)
        target = held[:]
        rng.shuffle(target)
    ops = plan_row_moves(held, target)
    result, loads = simulate(held, target, ops)
    assert [label for (_, label), want in zip(result, target) if want >= 0] == [e for e in target if e >= 0]
    known = {e for e in held if e is not None and e >= 0}
    assert loads == len({e for e in target if e >= 0} - known)  # each missing expert read once, no held one
    untouched = {r for r in range(rows) if target[r] < 0 or held[r] == target[r]}  # spare rows: left as they are
    assert not untouched & {op[1] for op in ops if op[0] != "save"}


def test_a_cycle_takes_one_row_aside():
    ops = plan_row_moves([0, 1, 2, 3], [1, 2, 3, 0])
    assert sum(op[0] == "save" for op in ops) == 1 and not any(op[0] == "load" for op in ops)
    assert simulate([0, 1, 2, 3], [1, 2, 3, 0], ops)[0] == [("held", e) for e in (1, 2, 3, 0)]


def test_reload_rewrites_the_pool_in_place(tiny_mixtral_dir):
    """A placement that moves, drops and adds experts: same tensors (no second pool), each row
    the checkpoint's expert, only the experts the worker did not hold read, packed copies remade."""
    config = load_model_config(tiny_mixtral_dir)
    layers = len(config.moe_layers)
    table = initial_placement(layers, config.num_experts, 2, "round_robin", redundant_slots_per_worker=1)
    worker = ExpertWorker(0, tiny_mixtral_dir, "float32", "cpu", table.to_dict(), spare_rows=2)
    pointers = [(w13.data_ptr(), w2.data_ptr()) for w13, w2 in zip(worker.w13, worker.w2)]
    rng = np.random.default_rng(5)
    phy2log = table.phy2log.copy()
    for layer in range(layers):
        phy2log[layer] = rng.permutation(phy2log[layer])  # worker 0 gets other experts, in other slots
    moved = table.with_phy2log(phy2log)
    report = worker.load_placement(moved.to_dict())
    assert [(w13.data_ptr(), w2.data_ptr()) for w13, w2 in zip(worker.w13, worker.w2)] == pointers
    held_before = [set(table.worker_experts(layer, 0)) for layer in range(layers)]
    missing = sum(len(set(moved.worker_experts(layer, 0)) - held_before[layer]) for layer in range(layers))
    assert report["rows_read"] == missing
    checkpoint = Checkpoint(tiny_mixtral_dir)
    for moe_layer, layer in enumerate(config.moe_layers):
        experts = moved.worker_experts(moe_layer, 0) + [-1, -1]
        w13, w2 = load_expert_stack(checkpoint, config, layer, experts, torch.float32, torch.device("cpu"))
        serving = slice(0, table.slots_per_worker)  # the spare rows are free: whatever they held stays
        assert torch.equal(worker.w13[moe_layer][serving], w13[serving])
        assert torch.equal(worker.w2[moe_layer][serving], w2[serving])
        w13[table.slots_per_worker:], w2[table.slots_per_worker:] = worker.w13[moe_layer][serving.stop:], \
            worker.w2[moe_layer][serving.stop:]
        if native_cpu.prepare_experts(w13, w2):  # the kernel's layouts are the new rows', not the old ones'
            for cached, fresh in zip(native_cpu._packed_experts(worker.w13[moe_layer], worker.w2[moe_layer]),
                                     native_cpu._packed_experts(w13, w2)):
                # bit for bit: a spare row holds whatever its memory held (engine/weights.py), NaN patterns included
                assert torch.equal(cached.view(torch.int32), fresh.view(torch.int32))
    assert worker.experts == {moved.epoch: [moved.worker_experts(layer, 0) for layer in range(layers)]}
    again = worker.load_placement(moved.to_dict())  # a retried reload: nothing read, nothing moved
    assert (again["rows_read"], again["rows_moved"]) == (0, 0)


def test_reload_of_another_pool_shape_replaces_it(tiny_mixtral_dir):
    config = load_model_config(tiny_mixtral_dir)
    table = initial_placement(len(config.moe_layers), config.num_experts, 2, "round_robin")
    worker = ExpertWorker(1, tiny_mixtral_dir, "float32", "cpu", table.to_dict())
    wider = initial_placement(len(config.moe_layers), config.num_experts, 2, "round_robin",
                              redundant_slots_per_worker=1)
    worker.load_placement(PlacementTable.from_dict({**wider.to_dict(), "epoch": 3}).to_dict())
    assert worker.w13[0].shape[0] == wider.slots_per_worker
    assert worker.experts == {3: [wider.worker_experts(layer, 1) for layer in range(len(config.moe_layers))]}


# ---- the controller's reload call: a deadline from the bytes, retried on a timeout -------------
def test_reload_deadline_grows_with_the_bytes_to_load():
    from raymoe.actors import recovery

    assert recovery.reload_deadline_s(0) == recovery.RELOAD_FLOOR_S
    small, large = recovery.reload_deadline_s(2**30), recovery.reload_deadline_s(16 * 2**30)
    assert recovery.RELOAD_FLOOR_S < small < large
    assert large - recovery.RELOAD_FLOOR_S == pytest.approx(16 * 2**30 / recovery.RELOAD_MIN_BYTES_PER_S)
    assert large > 300  # the fixed 60 s the reload had before could not load 16 GiB at any disk's speed


def test_a_timed_out_reload_is_retried_with_backoff_then_given_up():
    import ray

    from raymoe.actors.recovery import retry_on_timeout

    calls, sleeps, timeouts = [], [], []

    def attempt(fail: int):
        def run():
            calls.append(1)
            if len(calls) <= fail:
                raise ray.exceptions.GetTimeoutError("slow disk")
            return "loaded"
        return run

    assert retry_on_timeout(attempt(2), "reload", attempts=3, first_backoff_s=1.5, on_timeout=timeouts.append,
                            sleep=sleeps.append) == "loaded"
    assert (len(calls), sleeps, len(timeouts)) == (3, [1.5, 3.0], 2)
    calls.clear(), sleeps.clear()
    with pytest.raises(ray.exceptions.GetTimeoutError, match="reload timed out 3 times"):
        retry_on_timeout(attempt(5), "reload", attempts=3, first_backoff_s=1.0, sleep=sleeps.append)
    assert (len(calls), sleeps) == (3, [1.0, 2.0])
    calls.clear()
    with pytest.raises(ValueError):  # anything but a timeout is not retried here
        retry_on_timeout(lambda: calls.append(1) or (_ for _ in ()).throw(ValueError("bad")), "reload",
                         sleep=sleeps.append)
    assert len(calls) == 1


def test_the_controller_reloads_with_the_deadline_and_retries(monkeypatch):
    """Controller._reload passes the bytes' deadline to each try and retries a timed-out one."""
    import ray

    from raymoe.actors import controller, recovery

    gets = []

    def fake_get(ref, timeout=None):
        gets.append(timeout)
        if len(gets) == 1:
            raise ray.exceptions.GetTimeoutError("first try too slow")
        return {"bytes_read": 0}

    class Worker:
        class load_placement:
            @staticmethod
            def remote(placement):
                return placement

    monkeypatch.setattr(recovery.ray, "get", fake_get)
    monkeypatch.setattr(recovery.time, "sleep", lambda s: None)
    host = controller.Controller.__new__(controller.Controller)
    host.workers, host.pool_bytes = [Worker()], 8 * 2**30
    host.counters, host._counters_lock = dict.fromkeys(controller.COUNTERS, 0), __import__("threading").Lock()
    table = initial_placement(2, 8, 1, "round_robin")
    assert host._reload(0, table) == {"bytes_read": 0}
    assert gets == [recovery.reload_deadline_s(8 * 2**30)] * 2
    assert host.counters["reload_timeouts"] == 1


def test_reload_after_a_migration_moves_staged_rows_instead_of_reading_them(tiny_mixtral_dir):
    """A worker serving an epoch whose slot 0 is a spare row (a migration staged its expert
    there) reloads that epoch's table: the expert moves to row 0, nothing is read."""
    config = load_model_config(tiny_mixtral_dir)
    layers = len(config.moe_layers)
    table = initial_placement(layers, config.num_experts, 2, "round_robin")
    worker = ExpertWorker(0, tiny_mixtral_dir, "float32", "cpu", table.to_dict(), spare_rows=1)
    incoming = next(e for e in range(config.num_experts) if e not in table.worker_experts(0, 0))
    phy2log = table.phy2log.copy()
    phy2log[0, 0] = incoming
    phy2log[0, table.slots_per_worker] = table.phy2log[0, 0]  # (worker 1 takes the expert worker 0 gives up)
    later = table.with_phy2log(phy2log)
    checkpoint = Checkpoint(tiny_mixtral_dir)
    w13, w2 = load_expert_stack(checkpoint, config, config.moe_layers[0], [incoming], torch.float32,
                                torch.device("cpu"))
    worker._stage(later.epoch, 0, 0, incoming, w13[0], w2[0])
    worker.activate(later.epoch, table.epoch, later.to_dict())
    worker.retire(later.epoch)
    assert worker.slot_rows[later.epoch][0][0] == table.slots_per_worker  # served from the spare row
    report = worker.load_placement(later.to_dict())
    assert (report["rows_read"], report["rows_moved"]) == (0, 1)
    assert worker.slot_rows == {later.epoch: [list(range(table.slots_per_worker))] * layers}
    assert torch.equal(worker.w13[0][0], w13[0]) and torch.equal(worker.w2[0][0], w2[0])
