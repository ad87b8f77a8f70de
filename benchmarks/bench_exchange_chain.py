"""The expert-parallel exchange between two processes on one core, against its floor.

A router process and a worker process, both pinned to core 0 with torch on one thread (the
CPU defaults of a 1x1 deployment), run decode steps of the bench model's MoE part: 4 layers,
8 experts, top-2, hidden 256, intermediate 512, float32. Each layer the router plans the
rows (``plan_exchange_on_host``) and exchanges them; the worker runs its experts
(``run_rows``) and sends the sums back. No dense part and no Ray: only what the exchange
costs beside the experts.

- ``sockets-unix`` and ``sockets-tcp``: raymoe's own router and worker sides of the exchange
  (``router_exchange``, ``worker_exchange``: the native ones, where the kernels run) over the
  sockets transport, connected as ranks on one machine are (a Unix socket) and as
  ranks on two machines are (TCP over loopback);
- ``floor``: the same plan, rows, experts and combine over a bare socket pair with no
  framework at all (a size header, blocking reads, no tags, trailers, deadlines or checks):
  what the step would cost if the exchange's own code were free.

Prints the median step per mode and its ratio to the floor; the modes alternate within each
round so that a busy minute hits all of them.

    python benchmarks/bench_exchange_chain.py [--tokens 1,32] [--rounds 3] [--steps 200]
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time
import traceback

import numpy as np
import torch

from raymoe.engine.exchange.ep_exchange import GroupLayout, router_exchange, worker_exchange
from raymoe.engine.experts import combine_partials, run_rows
from raymoe.kernels.comm.ports import free_port
from raymoe.kernels.comm.sockets import SocketCommunicator
from raymoe.moe.exchange_plan import plan_exchange_on_host
from raymoe.moe.placement import single_worker_placement

LAYERS, EXPERTS, HIDDEN, TOP_K, INTERMEDIATE = 4, 8, 256, 2, 512
WARMUP = 20
MODES = ("floor", "sockets-unix", "sockets-tcp")


def expert_weights() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    w13 = [torch.randn(EXPERTS, 2 * INTERMEDIATE, HIDDEN, generator=generator) * 0.05 for _ in range(LAYERS)]
    w2 = [torch.randn(EXPERTS, HIDDEN, INTERMEDIATE, generator=generator) * 0.05 for _ in range(LAYERS)]
    return w13, w2


def routing(tokens: int) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(tokens, HIDDEN, generator=generator)
    ids = [torch.stack([torch.randperm(EXPERTS, generator=generator)[:TOP_K] for _ in range(tokens)])
           for _ in range(LAYERS)]
    return hidden, ids, torch.rand(tokens, TOP_K, generator=generator)


def plan_layer(placement, ids: list[torch.Tensor], weights: torch.Tensor, layer: int, step: int):
    """The router's plan of one layer (the routing cycles through the layers' choices step by step)."""
    return plan_exchange_on_host(ids[(layer + step) % LAYERS], weights, None, placement.log2phy[layer],
                                 placement.logcnt[layer], EXPERTS, 1)


def recv_exactly(connection: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        received = connection.recv_into(view[got:])
        if not received:
            raise ConnectionError("the other process closed the connection")
        got += received


def floor_worker(connection: socket.socket, steps: int, w13: list[torch.Tensor], w2: list[torch.Tensor]) -> None:
    row_bytes = 4 * HIDDEN + 8 * TOP_K
    header = np.empty(1 + EXPERTS, dtype=np.int64)
    payload = torch.empty(1024 * row_bytes, dtype=torch.uint8)
    for _ in range(steps):
        for layer in range(LAYERS):
            recv_exactly(connection, memoryview(header).cast("B"))
            rows = int(header[0])
            body = payload[:rows * row_bytes]
            recv_exactly(connection, memoryview(body.numpy()))
            packed = body.view(rows, row_bytes)
            slots = packed[:, 4 * HIDDEN:4 * HIDDEN + 4 * TOP_K].view(torch.int32).long()
            weights = packed[:, 4 * HIDDEN + 4 * TOP_K:].view(torch.float32)
            out, _ = run_rows(packed[:, :4 * HIDDEN].view(torch.float32), slots, weights, w13[layer], w2[layer],
                              header[1:].tolist())
            connection.sendmsg([memoryview(out.numpy()).cast("B")])


def floor_router(connection: socket.socket, tokens: int, steps: int) -> list[float]:
    placement = single_worker_placement(LAYERS, EXPERTS)
    hidden, ids, weights = routing(tokens)
    header = np.zeros(1 + EXPERTS, dtype=np.int64)
    times = []
    for step in range(steps):
        started = time.perf_counter()
        for layer in range(LAYERS):
            plan = plan_layer(placement, ids, weights, layer, step)
            rows = hidden.index_select(0, plan.row_token)
            packed = torch.cat([rows.view(torch.uint8), plan.row_slots.view(torch.uint8),
                                plan.row_weights.view(torch.uint8)], dim=1)
            header[0], header[1:] = plan.num_rows, plan.slot_counts
            connection.sendmsg([memoryview(header).cast("B"), memoryview(packed.numpy()).cast("B")])
            sums = torch.empty(plan.num_rows, HIDDEN)
            recv_exactly(connection, memoryview(sums.numpy()).cast("B"))
            combine_partials(tokens, plan.row_token, sums, 1)
        times.append(time.perf_counter() - started)
    return times


def exchange_worker(comm: SocketCommunicator, steps: int, w13: list[torch.Tensor], w2: list[torch.Tensor]) -> None:
    exchange = worker_exchange(comm, GroupLayout(1, (0,)), EXPERTS, HIDDEN, TOP_K, torch.float32, torch.device("cpu"),
                               intermediate_size=w2[0].shape[2])
    pool_rows = {0: (list(range(EXPERTS)), torch.arange(EXPERTS))}
    for _ in range(steps):
        for layer in range(LAYERS):
            exchange.serve_layer(layer, None, w13[layer], w2[layer], pool_rows)  # (it reads the headers)


def exchange_router(comm: SocketCommunicator, tokens: int, steps: int) -> list[float]:
    placement = single_worker_placement(LAYERS, EXPERTS)
    hidden, ids, weights = routing(tokens)
    exchange = router_exchange(comm, GroupLayout(1, (0,)), 0, 1, EXPERTS, TOP_K, HIDDEN, torch.float32,
                               torch.device("cpu"))
    times = []
    for step in range(steps):
        started = time.perf_counter()
        for layer in range(LAYERS):
            plan = plan_layer(placement, ids, weights, layer, step)
            exchange.exchange(layer, plan, hidden, placement.epoch)
        exchange.read_trailers()
        times.append(time.perf_counter() - started)
    return times


def run(mode: str, tokens: int, steps: int) -> float:
    """Median step (ms) of one mode: the router here, the worker in a forked child; both on core 0."""
    total = steps + WARMUP
    pair = socket.socketpair() if mode == "floor" else None
    port = free_port("127.0.0.1")
    child = os.fork()
    if child == 0:  # the worker
        code = 0
        if pair is not None:
            pair[0].close()
        try:
            os.sched_setaffinity(0, {0})
            torch.set_num_threads(1)
            weights = expert_weights()  # outside inference mode, as a worker loads them (packed once, by version)
            with torch.inference_mode():
                if pair is not None:
                    floor_worker(pair[1], total, *weights)
                else:
                    exchange_worker(connect(mode, 1, port), total, *weights)
        except BaseException:  # noqa: BLE001 - printed here, reported by the parent as a failed run
            traceback.print_exc()
            code = 1
        os._exit(code)
    if pair is not None:
        pair[1].close()  # the worker's end: if it dies, the router reads an end of stream
    affinity, threads = os.sched_getaffinity(0), torch.get_num_threads()
    os.sched_setaffinity(0, {0})
    torch.set_num_threads(1)
    try:
        with torch.inference_mode():
            if pair is not None:
                times = floor_router(pair[0], tokens, total)
            else:
                comm = connect(mode, 0, port)
                times = exchange_router(comm, tokens, total)
                comm.close()
    finally:
        os.sched_setaffinity(0, affinity)
        torch.set_num_threads(threads)
        if pair is not None:
            pair[0].close()
        _, status = os.waitpid(child, 0)
    if status != 0:
        raise RuntimeError(f"the {mode} worker failed (wait status {status})")
    return 1e3 * statistics.median(times[WARMUP:])


def connect(mode: str, rank: int, port: int) -> SocketCommunicator:
    return SocketCommunicator.create(rank, 2, "127.0.0.1", port, 60.0, group_name=f"chain-{port}",
                                     local_connections=mode != "sockets-tcp")  # TCP: as between two machines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", default="1,32", help="tokens per step, comma-separated")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    counts = [int(n) for n in args.tokens.split(",")]
    results: dict[tuple[int, str], list[float]] = {}
    for round_ in range(args.rounds):
        for tokens in counts:
            for mode in MODES:
                results.setdefault((tokens, mode), []).append(run(mode, tokens, args.steps))
        print(f"round {round_ + 1}/{args.rounds} done", flush=True)
    print(f"median decode step of {LAYERS} MoE layers (ms), router and worker processes on one core, "
          f"{args.rounds} rounds x {args.steps} steps")
    print(f"{'tokens':>6} | " + " | ".join(f"{mode:>12} {'/floor':>6}" for mode in MODES))
    for tokens in counts:
        floor = statistics.median(results[(tokens, "floor")])
        cells = []
        for mode in MODES:
            value = statistics.median(results[(tokens, mode)])
            cells.append(f"{value:12.3f} {value / floor:6.2f}")
        print(f"{tokens:>6} | " + " | ".join(cells))


if __name__ == "__main__":
    main()
