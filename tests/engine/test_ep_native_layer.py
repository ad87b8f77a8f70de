"""Each side's layer of the exchange in one native call (kernels/csrc/cpu_exchange.c) against the
Python path it replaces, over real sockets groups (routers and workers as threads of this process).

The native calls must be the Python path's twins: the same sums bit for bit (one and two routers,
two workers, a staged placement epoch, an idle tick, steps with no rows; every mix of native and
Python routers and workers), the same message numbering (a worker may switch between the two
paths between layers and keep going), and the same errors for what goes wrong. A worker: another
layer's header, a message of the wrong size, an epoch it does not serve, headers that disagree
with their rows, a silent router (a deadline naming it), a router that dies, and an abort from
another thread (which must wake the wait at once). A router: a silent worker, a worker that dies,
a reply of the wrong size.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest
import torch

from raymoe.engine.exchange.ep_exchange import router_exchange, worker_exchange
from raymoe.engine.exchange.native_sides import NativeRouterExchange, NativeWorkerExchange
from raymoe.engine.exchange.python_sides import PythonRouterExchange, PythonWorkerExchange
from raymoe.kernels import native_exchange, native_library
from raymoe.kernels.comm import (
    CollectiveMismatch,
    CollectiveTimeout,
    CommClosedError,
    CommError,
    PeerLostError,
    SocketCommunicator,
)
from raymoe.kernels.comm.wire import KIND_IDLE, KIND_STEP, GroupLayout, layer_tag, layer_tags
from raymoe.kernels.comm.wire import header as _header
from raymoe.kernels.comm.ports import free_port
from raymoe.moe.exchange_plan import plan_exchange_on_host
from raymoe.moe.initial_placement import initial_placement

pytestmark = pytest.mark.skipif(native_library.unavailable_reason() is not None,
                                reason=f"native kernels unavailable: {native_library.unavailable_reason()}")

HIDDEN, INTER, EXPERTS, TOP_K, LAYERS = 64, 32, 8, 2, 3
CPU = torch.device("cpu")


FORM_TIMEOUT_S = 30.0  # forming the group (its rendezvous store) on a loaded machine


def sockets_group(world_size: int, timeout_s: float = 10.0) -> list[SocketCommunicator]:
    """A sockets group on loopback whose collectives have the deadline ``timeout_s``. It forms
    under a longer one: a 0.5 s deadline also bounded the rendezvous store's connect, which a
    loaded CI machine missed ("the sockets group did not form")."""
    port = free_port("127.0.0.1")
    comms: list = [None] * world_size

    def join(rank: int) -> None:
        comm = SocketCommunicator.create(rank, world_size, "127.0.0.1", port, max(timeout_s, FORM_TIMEOUT_S),
                                         group_name=f"native-worker-{port}")
        comm.timeout_s = timeout_s
        comms[rank] = comm

    threads = [threading.Thread(target=join, args=(rank,)) for rank in range(world_size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=FORM_TIMEOUT_S + 5)
    assert all(comms), "the sockets group did not form"
    return comms


def router_side(comm: SocketCommunicator, layout: GroupLayout, index: int, num_workers: int, slots: int,
                native: bool = True, dtype: torch.dtype = torch.float32):
    """A router's side as the factory picks it (native: sockets, float32 or bfloat16 on a CPU with the
    native library), or the Python one over the same communicator."""
    chosen = router_exchange(comm, layout, index, num_workers, slots, TOP_K, HIDDEN, dtype, CPU)
    assert isinstance(chosen, NativeRouterExchange)
    return chosen if native else PythonRouterExchange(comm, layout, index, num_workers, slots, TOP_K, HIDDEN,
                                                      dtype, CPU)


def worker_side(comm: SocketCommunicator, layout: GroupLayout, slots: int, native: bool = True,
                dtype: torch.dtype = torch.float32):
    """A worker's side as the factory picks it (native, in float32 and bfloat16), or the Python one
    over the same communicator."""
    chosen = worker_exchange(comm, layout, slots, HIDDEN, TOP_K, dtype, CPU, intermediate_size=INTER)
    assert isinstance(chosen, NativeWorkerExchange)
    return chosen if native else PythonWorkerExchange(comm, layout, slots, HIDDEN, TOP_K, dtype, CPU,
                                                      intermediate_size=INTER)


def run_threads(targets: list) -> list:
    """Runs each callable in its own thread; returns their results (or raises the first error)."""
    results: list = [None] * len(targets)
    errors: list = []

    def body(index: int, target) -> None:
        try:
            results[index] = target()
        except BaseException as error:  # reported below
            errors.append(error)

    threads = [threading.Thread(target=body, args=(i, t), daemon=True) for i, t in enumerate(targets)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not any(thread.is_alive() for thread in threads), "a rank hung"
    if errors:
        raise errors[0]
    return results


def worker_weights(workers: int, slots: int, spare: int = 2, dtype: torch.dtype = torch.float32):
    generator = torch.Generator().manual_seed(7)
    return [[((torch.randn(slots + spare, 2 * INTER, HIDDEN, generator=generator) / 8).to(dtype),
              (torch.randn(slots + spare, HIDDEN, INTER, generator=generator) / 8).to(dtype)) for _ in range(LAYERS)]
            for _ in range(workers)]


def run_deployment(num_routers: int, num_workers: int, native: bool, steps: list[dict],
                   native_routers: bool | None = None, empty_at_once: bool = False, one_call: bool = False,
                   dtype: torch.dtype = torch.float32) -> list:
    """Every router's outputs of every step and layer (plus the workers' row counts), with the
    workers on the native path or the Python one (the routers too, unless ``native_routers``
    says otherwise). ``steps``: per step the epoch the routers use, each router's token count
    (0: nothing this step) and optionally ``"empty_from"`` (router -> the first layer it sends
    no rows, as a step that stopped part-way), or ``{"idle": True}`` for an idle tick. Layers
    without rows go layer by layer through ``exchange`` with no plan, or, with
    ``empty_at_once``, all of a step's in one ``exchange_empty`` (the router's step end). With
    ``one_call`` a native router's layers with rows go through ``moe_layer`` (plan, exchange and
    combine in one native call) instead of a Python plan and ``exchange``. In bfloat16 (``dtype``) a
    native router's layer is two calls (the send, then the receive sized by the assignments)."""
    placement = initial_placement(num_layers=LAYERS, num_experts=EXPERTS, num_workers=num_workers,
                                  strategy="round_robin", redundant_slots_per_worker=1)
    slots = placement.slots_per_worker
    layout = GroupLayout(num_routers, tuple(range(num_workers)))
    comms = sockets_group(layout.world_size)
    weights = worker_weights(num_workers, slots, dtype=dtype)
    # epoch 0: slot s in pool row s; epoch 1: the slots staged into pool rows in another order
    staged = [slots + 1] + list(range(1, slots - 1)) + [slots, 0]
    pool = {0: list(range(slots)), 1: staged[:slots]}
    pool_rows = {epoch: (rows, torch.tensor(rows)) for epoch, rows in pool.items()}
    native_routers = native if native_routers is None else native_routers
    calls = {"worker": 0, "router": 0, "empty": 0, "moe": 0}
    originals = (native_exchange.worker_layer, native_exchange.router_layer, native_exchange.router_empty_layers,
                 native_exchange.router_moe_layer)

    def counting(side, function):
        def counted(*args, **kwargs):
            calls[side] += 1
            return function(*args, **kwargs)
        return counted

    def router(index: int):
        exchange = router_side(comms[index], layout, index, num_workers, slots, native_routers, dtype)
        generator = torch.Generator().manual_seed(100 + index)
        outputs = []
        for step in steps:
            if step.get("idle"):
                exchange.idle_tick()
                continue
            tokens = step["tokens"][index]
            empty_from = empty_layer(step, index) if empty_at_once else LAYERS
            for layer in range(LAYERS):
                hidden = torch.randn(max(tokens, 1), HIDDEN, generator=generator)[:tokens].to(dtype)
                ids = torch.stack([torch.randperm(EXPERTS, generator=generator)[:TOP_K] for _ in range(tokens)]) \
                    if tokens else torch.zeros(0, TOP_K, dtype=torch.int64)
                gates = torch.rand(tokens, TOP_K, generator=generator)
                if layer >= empty_from:
                    continue  # sent below, with the step's other layers without rows
                rows = layer < empty_layer(step, index)  # (0 tokens: never)
                if rows and one_call:
                    out, send_counts, slot_counts, traffic = exchange.moe_layer(
                        layer, ids, gates, torch.tensor(placement.log2phy[layer]),
                        torch.tensor(placement.logcnt[layer]), hidden, step["epoch"], KIND_STEP)
                    expected = plan_exchange_on_host(ids, gates, None, placement.log2phy[layer],
                                                     placement.logcnt[layer], slots, num_workers)
                    assert (send_counts, slot_counts) == (expected.send_counts, expected.slot_counts)
                    assert traffic.rows_per_worker == expected.send_counts
                    outputs.append(out)
                    continue
                plan = plan_exchange_on_host(ids, gates, None, placement.log2phy[layer], placement.logcnt[layer],
                                             slots, num_workers) if rows else None
                out, _ = exchange.exchange(layer, plan, hidden, step["epoch"])
                outputs.append(out)
            if empty_from < LAYERS:
                exchange.exchange_empty(range(empty_from, LAYERS), step["epoch"])
                outputs.extend([None] * (LAYERS - empty_from))
            exchange.read_trailers()
        return outputs

    def worker(position: int):
        exchange = worker_side(comms[num_routers + position], layout, slots, native, dtype)
        served = []
        for step in steps:
            headers = exchange.receive_headers(0)
            if headers is None:
                assert step.get("idle")
                continue
            for layer in range(LAYERS):
                w13, w2 = weights[position][layer]
                result = exchange.serve_layer(layer, None if layer else headers, w13, w2,
                                              {epoch: rows for epoch, rows in pool_rows.items()})
                served.append((result.rows, result.assignments))
        return served

    (native_exchange.worker_layer, native_exchange.router_layer, native_exchange.router_empty_layers,
     native_exchange.router_moe_layer) = (counting("worker", originals[0]), counting("router", originals[1]),
                                          counting("empty", originals[2]), counting("moe", originals[3]))
    try:
        results = run_threads([lambda i=i: router(i) for i in range(num_routers)]
                              + [lambda p=p: worker(p) for p in range(num_workers)])
    finally:
        (native_exchange.worker_layer, native_exchange.router_layer, native_exchange.router_empty_layers,
         native_exchange.router_moe_layer) = originals
        for comm in comms:
            comm.close()
    layers = sum(1 for step in steps if not step.get("idle")) * LAYERS
    assert calls["worker"] == ((layers + len(steps)) * num_workers if native else 0)
    routed = sum(empty_layer(step, r) if empty_at_once else LAYERS
                 for step in steps if not step.get("idle") for r in range(num_routers))
    with_rows = sum(empty_layer(step, r) for step in steps if not step.get("idle") for r in range(num_routers))
    one_calls = with_rows if native_routers and one_call else 0
    assert calls["moe"] == one_calls
    per_layer = 2 if dtype == torch.bfloat16 else 1  # (each assignment's output back: its own receive)
    assert calls["router"] == ((routed - one_calls) * per_layer if native_routers else 0)
    at_once = sum(empty_at_once and empty_layer(step, r) < LAYERS
                  for step in steps if not step.get("idle") for r in range(num_routers))
    assert calls["empty"] == (at_once if native_routers else 0)  # one native call per step end
    return results


def empty_layer(step: dict, router: int) -> int:
    """The first layer of ``step`` at which ``router`` sends no rows (LAYERS: none)."""
    if not step["tokens"][router]:
        return 0
    return step.get("empty_from", {}).get(router, LAYERS)


STEPS = [
    {"idle": True},
    {"epoch": 0, "tokens": [3, 1]},
    {"epoch": 0, "tokens": [0, 5]},  # one router with nothing this step
    {"epoch": 1, "tokens": [7, 2]},  # the staged epoch
    {"idle": True},
    {"epoch": 1, "tokens": [1, 0]},
]


@pytest.mark.parametrize("routers, workers, native_workers, native_routers",
                         [(1, 1, True, True), (2, 2, True, True), (2, 2, True, False), (2, 2, False, True)])
def test_native_layer_equals_the_python_path_bit_for_bit(routers, workers, native_workers, native_routers):
    steps = [{**s, "tokens": s["tokens"][:routers]} if "tokens" in s else s for s in STEPS]
    if routers == 1:
        steps = [s for s in steps if s.get("idle") or s["tokens"][0]]
    native = run_deployment(routers, workers, native_workers, steps, native_routers)
    python = run_deployment(routers, workers, False, steps)
    assert_same_outputs(native, python, routers, workers)


@pytest.mark.skipif(native_library.bf16_unavailable_reason() is not None,
                    reason=f"bfloat16 kernels unavailable: {native_library.bf16_unavailable_reason()}")
@pytest.mark.parametrize("routers, workers, native_workers, native_routers",
                         [(1, 1, True, True), (1, 2, True, False), (2, 2, True, True), (2, 2, False, True)])
def test_native_bf16_sides_give_the_python_sides_outputs_bit_for_bit(routers, workers, native_workers,
                                                                     native_routers):
    """bfloat16 rows: the native worker layer (raymoe_bf16_run_assignments) sends each router each
    of its assignments' outputs, the bits the Python worker's run_assignments sends, and the native
    router's messages (its receive sized by the assignments) carry them to the same combine; a
    staged epoch, idle ticks and a router without rows included, every mix of the sides."""
    steps = [{**s, "tokens": s["tokens"][:routers]} if "tokens" in s else s for s in STEPS]
    if routers == 1:
        steps = [s for s in steps if s.get("idle") or s["tokens"][0]]
    native = run_deployment(routers, workers, native_workers, steps, native_routers, dtype=torch.bfloat16)
    python = run_deployment(routers, workers, False, steps, False, dtype=torch.bfloat16)
    assert_same_outputs(native, python, routers, workers)
    assert all(out.dtype == torch.bfloat16 for out in native[0] if out is not None)


def assert_same_outputs(got_all: list, expected_all: list, routers: int, workers: int) -> None:
    """Every router's sums bit for bit, and every worker's rows and assignments per layer."""
    assert len(got_all) == len(expected_all) == routers + workers
    for got, expected in zip(got_all[:routers], expected_all[:routers]):
        assert len(got) == len(expected) > 0
        for a, b in zip(got, expected):
            assert (a is None) == (b is None)
            if a is not None:
                assert a.shape == b.shape and torch.equal(a, b)
    assert got_all[routers:] == expected_all[routers:]  # rows and assignments per layer
    assert any(rows for served in got_all[routers:] for rows, _ in served)


@pytest.mark.parametrize("routers, workers, native_workers", [(1, 1, True), (2, 2, True), (2, 2, False), (1, 3, True)])
def test_a_layer_in_one_native_call_equals_the_python_plan_and_exchange_bit_for_bit(routers, workers, native_workers):
    """RemoteExperts' one call per layer (NativeRouterExchange.moe_layer: plan, pack, send,
    receive, combine) against the Python plan around the exchange: the same sums, bit for bit,
    the same counts (checked in run_deployment), the same messages (native or Python workers
    cannot tell)."""
    steps = [{**s, "tokens": s["tokens"][:routers]} if "tokens" in s else s for s in STEPS]
    if routers == 1:
        steps = [s for s in steps if s.get("idle") or s["tokens"][0]]
    one_call = run_deployment(routers, workers, native_workers, steps, True, one_call=True)
    python = run_deployment(routers, workers, False, steps)
    assert_same_outputs(one_call, python, routers, workers)


def test_a_layer_in_one_native_call_refuses_an_expert_out_of_range_and_sends_nothing():
    comms = sockets_group(2)
    exchange = router_side(comms[0], GroupLayout(1, (0,)), 0, 1, SLOTS)
    placement = initial_placement(num_layers=1, num_experts=EXPERTS, num_workers=1, strategy="round_robin")
    ids = torch.tensor([[0, EXPERTS]])
    with pytest.raises(ValueError, match="out of range"):
        exchange.moe_layer(0, ids, torch.rand(1, TOP_K), torch.tensor(placement.log2phy[0]),
                           torch.tensor(placement.logcnt[0]), torch.randn(1, HIDDEN), 0, KIND_STEP)
    assert comms[0]._sent[1] == 0 and comms[0]._failure is None  # nothing went out; the group is usable
    for comm in comms:
        comm.close()


@pytest.mark.parametrize("native_workers, native_routers", [(True, True), (False, False), (True, False)])
def test_layers_without_rows_at_once_equal_layer_by_layer(native_workers, native_routers):
    """A router's layers without rows (nothing this step, or the rest of a step that stopped
    part-way) sent all at once by ``exchange_empty`` (one native call, or the Python transport):
    the workers read the same messages, so every router's sums are bit for bit those of the
    layer-by-layer exchange, over native and Python workers, with an idle tick and a staged
    epoch between."""
    steps = [{"epoch": 0, "tokens": [3, 0]},  # router 1 idle: all its layers at once
             {"epoch": 0, "tokens": [2, 4], "empty_from": {0: 1}},  # router 0 stops after layer 0
             {"idle": True},
             {"epoch": 1, "tokens": [0, 6], "empty_from": {1: 2}},  # both: one idle, one part-way
             {"epoch": 1, "tokens": [5, 1]}]
    at_once = run_deployment(2, 2, native_workers, steps, native_routers, empty_at_once=True)
    by_layer = run_deployment(2, 2, native_workers, steps, native_routers)
    for got, expected in zip(at_once[:2], by_layer[:2]):
        assert len(got) == len(expected) == len(steps[:-1]) * LAYERS
        for a, b in zip(got, expected):
            assert (a is None) == (b is None)
            if a is not None:
                assert a.shape == b.shape and torch.equal(a, b)
    assert sum(a is None for a in at_once[0]) == LAYERS + LAYERS - 1  # the layers without rows
    assert at_once[2:] == by_layer[2:] and any(rows for served in at_once[2:] for rows, _ in served)


def test_layers_larger_than_the_socket_buffers_go_through_in_parts():
    """A prefill-sized layer (each router's rows ~400 KB to each worker, their sums ~380 KB back:
    more than a socket buffer holds) is written and read in parts on both sides, without a
    deadlock, and gives the Python path's sums."""
    steps = [{"epoch": 0, "tokens": [1500, 1300]}, {"epoch": 1, "tokens": [2, 1400]}]
    native = run_deployment(2, 2, True, steps)
    python = run_deployment(2, 2, False, steps)
    for got, expected in zip(native[:2], python[:2]):
        assert all(torch.equal(a, b) for a, b in zip(got, expected)) and len(got) == len(expected)
    assert native[2:] == python[2:] and max(rows for served in native[2:] for rows, _ in served) > 1000


# ---- failures: one router (rank 0) sends by hand, the worker (rank 1) serves natively ------------
SLOTS = EXPERTS


def native_worker(comm: SocketCommunicator) -> NativeWorkerExchange:
    return worker_side(comm, GroupLayout(1, (0,)), SLOTS)


def serve_one_layer(exchange: NativeWorkerExchange, layer: int = 0, epochs=(0,)):
    w13, w2 = worker_weights(1, SLOTS, spare=0)[0][0]
    pool_rows = {epoch: (list(range(SLOTS)), torch.arange(SLOTS)) for epoch in epochs}
    return exchange.serve_layer(layer, None, w13, w2, pool_rows)


def one_row(slots=(0, 3), weights=(0.5, 0.25)) -> torch.Tensor:
    activations = torch.randn(1, HIDDEN).view(torch.uint8)
    return torch.cat([activations, torch.tensor([list(slots)], dtype=torch.int32).view(torch.uint8),
                      torch.tensor([list(weights)], dtype=torch.float32).view(torch.uint8)], dim=1).reshape(-1)


def slot_counts(slots=(0, 3)) -> list[int]:
    return [int(s in slots) for s in range(SLOTS)]


def failure_of(call, other_does, comms: list[SocketCommunicator], rank: int):
    """The error ``call()`` raises on ``rank`` (of two) while the other rank runs
    ``other_does(its communicator)``, and the time it took; the failure must break ``rank``'s
    communicator."""
    outcome = {}

    def body():
        started = time.monotonic()
        try:
            call()
        except Exception as error:
            outcome["error"], outcome["elapsed"] = error, time.monotonic() - started

    thread = threading.Thread(target=body, daemon=True)
    thread.start()
    other_does(comms[1 - rank])
    thread.join(timeout=60)
    assert not thread.is_alive()
    assert not comms[rank].usable
    for comm in comms:
        comm.abort()
    return outcome["error"], outcome["elapsed"]


def failing_layer(router_sends, timeout_s: float = 10.0, layer: int = 0):
    """The worker's error when rank 0 runs ``router_sends(comm)`` instead of a router; the time it took."""
    comms = sockets_group(2, timeout_s)
    exchange = native_worker(comms[1])
    return failure_of(lambda: serve_one_layer(exchange, layer), router_sends, comms, 1)


def test_a_header_of_another_layer_is_a_mismatch_naming_the_router():
    error, _ = failing_layer(lambda comm: comm.transfer(
        [(1, _header(1, layer_tag(1, "dispatch"), 0, KIND_STEP, slot_counts(), CPU)), (1, one_row())], [],
        tag="wrong layer"))
    assert isinstance(error, CollectiveMismatch) and "'layer 0 dispatch'" in str(error) and "rank 0" in str(error)


def test_a_message_of_the_wrong_size_says_the_ranks_called_collectives_in_different_orders():
    error, _ = failing_layer(lambda comm: comm.transfer([(1, torch.zeros(3, dtype=torch.int64))], [], tag="short"))
    assert isinstance(error, CommError) and "different orders" in str(error) and "rank 0" in str(error)


def test_an_epoch_the_worker_does_not_serve_is_named():
    error, _ = failing_layer(lambda comm: comm.transfer(
        [(1, _header(1, layer_tag(0, "dispatch"), 7, KIND_STEP, slot_counts(), CPU)), (1, one_row())], [],
        tag="epoch 7"))
    assert isinstance(error, RuntimeError) and "epoch 7" in str(error) and "serves [0]" in str(error)


def test_headers_that_disagree_with_their_rows_are_refused():
    error, _ = failing_layer(lambda comm: comm.transfer(
        [(1, _header(1, layer_tag(0, "dispatch"), 0, KIND_STEP, slot_counts((0, 1, 2)), CPU)), (1, one_row())], [],
        tag="three announced, two sent"))
    assert isinstance(error, ValueError) and "assignments" in str(error)


def test_an_idle_tick_inside_a_step_is_refused():
    error, _ = failing_layer(lambda comm: comm.transfer(
        [(1, _header(0, layer_tag(1, "dispatch"), 0, KIND_IDLE, [0] * SLOTS, CPU))], [], tag="idle at layer 1"),
        layer=1)
    assert isinstance(error, CommError) and "disagree" in str(error)


def test_a_silent_router_times_out_naming_it():
    error, elapsed = failing_layer(lambda comm: None, timeout_s=0.5)
    assert isinstance(error, CollectiveTimeout) and "rank 0" in str(error) and "'layer 0 dispatch'" in str(error)
    assert 0.45 <= elapsed < 5.0


def test_a_router_that_dies_is_a_lost_peer():
    def die(comm):
        time.sleep(0.2)
        comm.abort()  # its sockets close, as a killed process's do

    error, elapsed = failing_layer(die)
    assert isinstance(error, PeerLostError) and "rank 0" in str(error)
    assert elapsed < 5.0


def test_abort_from_another_thread_wakes_the_native_wait():
    comms = sockets_group(2, timeout_s=30.0)
    exchange = native_worker(comms[1])
    outcome = {}

    def worker():
        started = time.monotonic()
        try:
            exchange.receive_headers(0)
        except Exception as error:
            outcome["error"], outcome["elapsed"] = error, time.monotonic() - started

    thread = threading.Thread(target=worker, daemon=True)
    thread.start()
    time.sleep(0.3)
    comms[1].abort()
    thread.join(timeout=10)
    assert not thread.is_alive(), "abort() did not wake the native wait"
    assert isinstance(outcome["error"], CommClosedError) and 0.25 <= outcome["elapsed"] < 5.0
    comms[0].abort()


def test_the_paths_share_message_numbers_layer_by_layer():
    """A worker that switches between the native and the Python path between layers keeps the
    group going: both advance the same per-peer message numbers."""
    steps = [{"epoch": 0, "tokens": [4]}, {"epoch": 0, "tokens": [2]}]
    placement = initial_placement(num_layers=LAYERS, num_experts=EXPERTS, num_workers=1, strategy="round_robin")
    comms = sockets_group(2)
    w = worker_weights(1, SLOTS, spare=0)[0]
    pool_rows = {0: (list(range(SLOTS)), torch.arange(SLOTS))}

    def router():
        exchange = router_side(comms[0], GroupLayout(1, (0,)), 0, 1, SLOTS)
        outs = []
        for step in steps:
            for layer in range(LAYERS):
                tokens = step["tokens"][0]
                ids = torch.stack([torch.randperm(EXPERTS)[:TOP_K] for _ in range(tokens)])
                plan = plan_exchange_on_host(ids, torch.rand(tokens, TOP_K), None, placement.log2phy[layer],
                                             placement.logcnt[layer], SLOTS, 1)
                outs.append(exchange.exchange(layer, plan, torch.randn(tokens, HIDDEN), 0)[0])
            exchange.read_trailers()
        return outs

    def worker():
        # both sides over the one communicator, taking turns layer by layer
        sides = [worker_side(comms[1], GroupLayout(1, (0,)), SLOTS, native) for native in (True, False)]
        flips = 0
        for _ in steps:
            headers = sides[flips % 2].receive_headers(0)
            for layer in range(LAYERS):
                flips += 1
                sides[flips % 2].serve_layer(layer, None if layer else headers, *w[layer], pool_rows)
        return flips

    outs, flips = run_threads([router, worker])
    assert flips == len(steps) * LAYERS and len(outs) == flips and all(o.shape[1] == HIDDEN for o in outs)
    for comm in comms:
        comm.close()


# ---- failures: the router (rank 0) exchanges natively, rank 1 stands in for its worker ------------
def failing_router(worker_does, timeout_s: float = 10.0):
    """The router's error when rank 1 runs ``worker_does(comm)`` instead of a worker; the time it took."""
    comms = sockets_group(2, timeout_s)
    exchange = router_side(comms[0], GroupLayout(1, (0,)), 0, 1, SLOTS)
    placement = initial_placement(num_layers=1, num_experts=EXPERTS, num_workers=1, strategy="round_robin")
    plan = plan_exchange_on_host(torch.tensor([[0, 3], [1, 2]]), torch.rand(2, TOP_K), None, placement.log2phy[0],
                                 placement.logcnt[0], SLOTS, 1)
    return failure_of(lambda: exchange.exchange(0, plan, torch.randn(2, HIDDEN), 0), worker_does, comms, 0)


def failing_one_call_router(worker_does, timeout_s: float = 10.0):
    """As :func:`failing_router`, the layer through ``moe_layer`` (plan to combine in one call)."""
    comms = sockets_group(2, timeout_s)
    exchange = router_side(comms[0], GroupLayout(1, (0,)), 0, 1, SLOTS)
    placement = initial_placement(num_layers=1, num_experts=EXPERTS, num_workers=1, strategy="round_robin")
    return failure_of(lambda: exchange.moe_layer(0, torch.tensor([[0, 3], [1, 2]]), torch.rand(2, TOP_K),
                                                 torch.tensor(placement.log2phy[0]),
                                                 torch.tensor(placement.logcnt[0]), torch.randn(2, HIDDEN), 0,
                                                 KIND_STEP), worker_does, comms, 0)


def test_a_sum_with_another_layers_trailer_is_a_mismatch_naming_the_worker():
    """One call checks each worker's trailer itself (the Python path at the step's end)."""
    def wrong_trailer(comm):
        read_rows(comm)
        sums = torch.zeros(2 * 4 * HIDDEN + 16, dtype=torch.uint8)
        sums[-16:] = torch.tensor([0, layer_tags(1)[3]], dtype=torch.int64).view(torch.uint8)  # layer 1's combine
        comm.transfer([(0, sums)], [], tag="sums")

    error, _ = failing_one_call_router(wrong_trailer)
    assert isinstance(error, CollectiveMismatch) and "rank 1" in str(error) and "layer 0 combine" in str(error)


def read_rows(comm):
    """What a worker reads of the router's layer 0: its header and its two rows."""
    header = torch.empty(4 + SLOTS, dtype=torch.int64)
    comm.transfer([], [(0, header)], tag="header")
    rows = torch.empty(int(header[0]), 4 * HIDDEN + 8 * TOP_K, dtype=torch.uint8)
    comm.transfer([], [(0, rows)], tag="rows")


def test_a_reply_of_the_wrong_size_says_the_ranks_called_collectives_in_different_orders():
    def short_reply(comm):
        read_rows(comm)
        comm.transfer([(0, torch.zeros(5, dtype=torch.uint8))], [], tag="short")

    error, _ = failing_router(short_reply)
    assert isinstance(error, CommError) and "different orders" in str(error) and "rank 1" in str(error)


# ---- failures of a router's layers without rows at once (raymoe_router_empty_layers) -------------
def failing_empty_router(worker_does, timeout_s: float = 10.0):
    """The error of ``exchange_empty(range(3))`` when rank 1 runs ``worker_does(comm)``; the time it took."""
    comms = sockets_group(2, timeout_s)
    exchange = router_side(comms[0], GroupLayout(1, (0,)), 0, 1, SLOTS)
    return failure_of(lambda: exchange.exchange_empty(range(3), 0), worker_does, comms, 0)


def read_empty_headers(comm, layers: int = 3) -> list[list[int]]:
    """What a worker reads of the router's layers without rows: one header each."""
    headers = []
    for _ in range(layers):
        header = torch.empty(4 + SLOTS, dtype=torch.int64)
        comm.transfer([], [(0, header)], tag="header")
        headers.append(header.tolist())
    return headers


def test_layers_without_rows_send_every_header_before_the_first_reply():
    """Every layer's header is there before the worker answers any (the point of the call), each
    with its layer's tag and no rows; the trailers then complete the call."""
    seen = {}

    def worker(comm):
        seen["headers"] = read_empty_headers(comm)
        for layer in range(3):
            trailer = torch.tensor([0, layer_tags(layer)[3]], dtype=torch.int64)
            comm.transfer([(0, trailer)], [], tag="trailer")

    comms = sockets_group(2)
    exchange = router_side(comms[0], GroupLayout(1, (0,)), 0, 1, SLOTS)
    run_threads([lambda: exchange.exchange_empty(range(3), 5), lambda: worker(comms[1])])
    assert [h[:4] for h in seen["headers"]] == [[0, layer_tags(layer)[1], 5, KIND_STEP] for layer in range(3)]
    assert all(not any(h[4:]) for h in seen["headers"])
    assert exchange.read_trailers() == 0.0  # every combine tag checked
    for comm in comms:
        comm.close()


# a router's two native calls: (the failing call, what rank 1 reads of it, the tag an error names,
# the layers its deadline covers: each layer has the communicator's timeout, as layer by layer)
ROUTER_CALLS = {"one layer": (failing_router, read_rows, "'layer 0 dispatch'", 1),
                "one call": (failing_one_call_router, read_rows, "'layer 0 dispatch'", 1),
                "layers without rows": (failing_empty_router, read_empty_headers, "'layers 0-2 dispatch (no rows)'", 3)}


@pytest.mark.parametrize("call", ROUTER_CALLS)
def test_a_silent_worker_times_out_naming_it(call):
    failing, read, tag, layers = ROUTER_CALLS[call]
    error, elapsed = failing(read, timeout_s=0.5)
    assert isinstance(error, CollectiveTimeout) and "rank 1" in str(error) and tag in str(error)
    assert 0.5 * layers - 0.05 <= elapsed < 0.5 * layers + 4.0


@pytest.mark.parametrize("call", ROUTER_CALLS)
def test_a_worker_that_dies_is_a_lost_peer(call):
    failing, read, _, _ = ROUTER_CALLS[call]

    def die(comm):
        read(comm)
        comm.abort()

    error, _ = failing(die)
    assert isinstance(error, PeerLostError) and "rank 1" in str(error)


def test_the_factory_picks_the_python_sides_where_the_native_layer_does_not_apply():
    """Chosen once at join: the native sides only over a transport that lends native code its
    connections, float32 on a CPU with the native kernels (bfloat16 too: a router's messages, and a
    worker's layer where the bfloat16 kernels run), and (a worker) one serving thread and expert
    sizes the kernel takes; the Python sides everywhere else."""
    layout = GroupLayout(1, (0,))
    sockets, gloo = SimpleNamespace(native_routines=True, timeout_s=1.0), SimpleNamespace(native_routines=False,
                                                                                           timeout_s=1.0)

    def router(comm, dtype=torch.float32):
        return type(router_exchange(comm, layout, 0, 1, SLOTS, TOP_K, HIDDEN, dtype, CPU))

    def worker(comm, dtype=torch.float32, executor=None, intermediate=INTER):
        return type(worker_exchange(comm, layout, SLOTS, HIDDEN, TOP_K, dtype, CPU, executor,
                                    intermediate_size=intermediate))

    assert router(sockets) is NativeRouterExchange and worker(sockets) is NativeWorkerExchange
    assert router(gloo) is PythonRouterExchange and worker(gloo) is PythonWorkerExchange
    assert router(sockets, torch.bfloat16) is NativeRouterExchange and router(gloo, torch.bfloat16) is PythonRouterExchange
    assert router(sockets, torch.float16) is PythonRouterExchange
    bf16_native = native_library.bf16_unavailable_reason() is None
    assert worker(sockets, torch.bfloat16) is (NativeWorkerExchange if bf16_native else PythonWorkerExchange)
    assert worker(gloo, torch.bfloat16) is PythonWorkerExchange
    assert worker(sockets, torch.bfloat16, intermediate=48) is PythonWorkerExchange  # I not a multiple of 32
    assert worker(sockets, torch.float16) is PythonWorkerExchange
    with ThreadPoolExecutor(1) as threads:
        assert worker(sockets, executor=threads) is PythonWorkerExchange  # expert threads
    assert worker(sockets, intermediate=40) is PythonWorkerExchange  # I not a multiple of 16
    native_library.set_enabled(False)
    try:
        assert router(sockets) is PythonRouterExchange and worker(sockets) is PythonWorkerExchange
    finally:
        native_library.set_enabled(True)
