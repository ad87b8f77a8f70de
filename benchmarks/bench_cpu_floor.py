"""What this CPU allows a 1 router x 1 worker step: the floors behind docs/BENCHMARKS.md's gap.

A benchmark, not a timed test: it prints numbers measured in one run, as ratios against a
baseline measured in the same run, and asserts nothing. Five questions, each with the bench
model's shapes (the random Mixtral of bench_vs_vllm: hidden 256, expert intermediate 512,
8 experts, 4 MoE layers, float32, so 50 MB of expert weights):

(1) **Threads for the experts.** One decode step at 32 sequences (top-2: ~8 rows per expert,
    every expert hit) runs 32 expert FFNs. Baseline: torch on 1 thread; then 2 intra-op
    threads. If 2 threads do not help, the step is bound by memory, not by a core.
(2) **Micro-batches (ping-pong).** MegaScale-Infer overlaps the router's dense part with the
    experts by splitting the batch in two and interleaving them layer by layer. On a GPU the
    second micro-batch re-reads weights from HBM at a few TB/s; here the question is what the
    second pass over a layer's 12.6 MB costs when it comes right after the first (from L3).
    Baseline: one pass of 8 rows per expert; then two passes of 4 rows, layer-interleaved.
    Overlap can only pay if the second pass costs well under the dense part it would hide.
(4) **The GEMM itself.** The same 32 expert FFNs with torch's default sgemm (baseline) vs
    oneDNN over prepacked weights (kernels/packed_linear.py, raymoe's default on CPU), and a
    plain read of the same bytes (``sum``): how far either GEMM is from the memory's speed.
(3) **Transport round trip.** A small message there and back between two processes: gloo
    send/recv over loopback TCP (what the exchange uses) vs a bare Unix socket pair (what a
    same-node transport could use). Four MoE layers pay it four times a step.

(5) **Waking a peer on this core or another.** A router and its worker take turns, so they can
    share a core (cluster config ``cpu.pin_threads``). Baseline: the same Unix socket round
    trip with the two processes pinned to two different cores; then both on one core.

(6) **The native expert kernel.** A step's experts through ``grouped_swiglu`` (one call per
    layer, as a worker makes it) at 1 and 8 rows an expert: oneDNN over prepacked weights, a
    Python loop of GEMM calls (baseline), vs raymoe's native kernel (kernels/native_cpu.py:
    the layer's experts in one call, fused SwiGLU, software prefetch), against the plain read.

    python benchmarks/bench_cpu_floor.py
"""

from __future__ import annotations

import os
import socket
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import machine_description  # noqa: E402

from raymoe.kernels import native_cpu, packed_linear  # noqa: E402
from raymoe.kernels.expert_mlp import grouped_swiglu  # noqa: E402

HIDDEN, INTER, EXPERTS, LAYERS = 256, 512, 8, 4
REPEATS = 40
RTT_MESSAGES = 400
MESSAGE_BYTES = (4096, 65536)


def expert_weights() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    w13 = [torch.randn(EXPERTS, 2 * INTER, HIDDEN) for _ in range(LAYERS)]
    w2 = [torch.randn(EXPERTS, HIDDEN, INTER) for _ in range(LAYERS)]
    return w13, w2


def run_layer(w13: torch.Tensor, w2: torch.Tensor, rows: torch.Tensor) -> None:
    for expert in range(EXPERTS):
        gate, up = F.linear(rows, w13[expert]).chunk(2, dim=-1)
        F.linear(F.silu(gate) * up, w2[expert])


def per_step_ms(step) -> float:
    for _ in range(3):
        step()
    started = time.perf_counter()
    for _ in range(REPEATS):
        step()
    return 1e3 * (time.perf_counter() - started) / REPEATS


def threads_and_micro_batches() -> None:
    w13, w2 = expert_weights()
    eight, four = torch.randn(8, HIDDEN), torch.randn(4, HIDDEN)

    def one_pass():
        for layer in range(LAYERS):
            run_layer(w13[layer], w2[layer], eight)

    def two_interleaved():
        for layer in range(LAYERS):
            run_layer(w13[layer], w2[layer], four)
            run_layer(w13[layer], w2[layer], four)

    torch.set_num_threads(1)
    packed_linear.set_enabled(False)  # (1) and (2): torch's default GEMM, as before packing
    base = per_step_ms(one_pass)
    torch.set_num_threads(2)
    threaded = per_step_ms(one_pass)
    torch.set_num_threads(1)
    interleaved = per_step_ms(two_interleaved)
    megabytes = LAYERS * EXPERTS * 3 * HIDDEN * INTER * 4 / 1e6
    print(f"(1) 32 expert FFNs of 8 rows ({megabytes:.0f} MB of weights): 1 thread {base:.2f} ms "
          f"({megabytes / base:.1f} GB/s), 2 threads {threaded:.2f} ms: ratio {threaded / base:.2f}")
    print(f"(2) the same rows as 2 micro-batches of 4, layer-interleaved: {interleaved:.2f} ms: ratio "
          f"{interleaved / base:.2f} (the second pass over each layer costs {interleaved - base:.2f} ms)")
    packed_linear.set_enabled(True)

    def one_pass_packed():
        with torch.inference_mode():
            for layer in range(LAYERS):
                for expert in range(EXPERTS):
                    gate, up = packed_linear.linear_row(eight, w13[layer], expert).chunk(2, dim=-1)
                    packed_linear.linear_row(F.silu(gate) * up, w2[layer], expert)

    packed = per_step_ms(one_pass_packed)
    flat = torch.cat([w.reshape(-1) for w in w13 + w2])
    read = per_step_ms(flat.sum)
    print(f"(4) the same 32 FFNs with oneDNN over prepacked weights: {packed:.2f} ms: ratio {packed / base:.2f}; "
          f"a plain read of the {megabytes:.0f} MB takes {read:.2f} ms ({megabytes / read:.0f} GB/s)")


def native_kernel() -> None:
    """(6): 4 layers x 8 experts through grouped_swiglu, oneDNN's loop vs the native kernel."""
    w13, w2 = expert_weights()
    w13, w2 = [w / HIDDEN ** 0.5 for w in w13], [w / INTER ** 0.5 for w in w2]
    megabytes = LAYERS * EXPERTS * 3 * HIDDEN * INTER * 4 / 1e6
    read = per_step_ms(torch.cat([w.reshape(-1) for w in w13 + w2]).sum)
    reason = native_cpu.unavailable_reason()
    if reason is not None:
        print(f"(6) the native expert kernel does not run here: {reason}")
        return
    torch.set_num_threads(1)
    for rows in (1, 8):
        x = torch.randn(EXPERTS * rows, HIDDEN)
        counts = [rows] * EXPERTS

        def step():
            with torch.inference_mode():
                for layer in range(LAYERS):
                    grouped_swiglu(x, counts, w13[layer], w2[layer])

        native_cpu.set_enabled(False)
        onednn = per_step_ms(step)
        native_cpu.set_enabled(True)
        native = per_step_ms(step)
        print(f"(6) 32 expert FFNs of {rows} row{'s' if rows > 1 else ''} through grouped_swiglu: oneDNN "
              f"{onednn:.2f} ms ({megabytes / onednn:.0f} GB/s), native kernel {native:.2f} ms "
              f"({megabytes / native:.0f} GB/s): ratio {native / onednn:.2f}; the plain read {read:.2f} ms")


def _gloo_peer(rank: int, port: int, size: int, results) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    buffer = torch.zeros(size // 4)
    for rounds in (50, RTT_MESSAGES):
        started = time.perf_counter()
        for _ in range(rounds):
            if rank == 0:
                dist.send(buffer, 1)
                dist.recv(buffer, 1)
            else:
                dist.recv(buffer, 0)
                dist.send(buffer, 0)
    if rank == 0:
        results.put((time.perf_counter() - started) / RTT_MESSAGES)
    dist.destroy_process_group()


def gloo_rtt_us(size: int) -> float:
    with socket.socket() as probe:  # a free loopback port for the rendezvous
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    context = mp.get_context("spawn")
    results = context.Queue()
    peers = [context.Process(target=_gloo_peer, args=(rank, port, size, results)) for rank in range(2)]
    for peer in peers:
        peer.start()
    value = results.get(timeout=120)
    for peer in peers:
        peer.join(60)
    return 1e6 * value


def _receive_exactly(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        got += sock.recv_into(view[got:])


def unix_socket_rtt_us(size: int, cores: tuple[int, int] | None = None) -> float:
    """Round trip of ``size`` bytes to a forked echoing peer; ``cores``: pin this process and the
    peer to these cores (the same one twice: the two hand off on one core)."""
    here, there = socket.socketpair()
    pid = os.fork()
    if pid == 0:  # the echoing peer
        if cores is not None:
            os.sched_setaffinity(0, {cores[1]})
        buffer = bytearray(size)
        for _ in range(50 + RTT_MESSAGES):
            _receive_exactly(there, memoryview(buffer))
            there.sendall(buffer)
        os._exit(0)
    allowed = os.sched_getaffinity(0)
    if cores is not None:
        os.sched_setaffinity(0, {cores[0]})
    buffer = bytearray(size)
    for index in range(50 + RTT_MESSAGES):
        if index == 50:
            started = time.perf_counter()
        here.sendall(buffer)
        _receive_exactly(here, memoryview(buffer))
    elapsed = time.perf_counter() - started
    os.waitpid(pid, 0)
    os.sched_setaffinity(0, allowed)
    here.close()
    there.close()
    return 1e6 * elapsed / RTT_MESSAGES


def main() -> None:
    print(f"machine: {machine_description()}; load average {os.getloadavg()[0]:.1f}")
    threads_and_micro_batches()
    native_kernel()
    for size in MESSAGE_BYTES:
        gloo, unix = gloo_rtt_us(size), unix_socket_rtt_us(size)
        print(f"(3) {size // 1024} KiB there and back: gloo over loopback TCP {gloo:.0f} us, Unix socket pair "
              f"{unix:.0f} us: ratio {unix / gloo:.2f}")
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) > 1:
        apart = unix_socket_rtt_us(4096, (cores[0], cores[1]))
        together = unix_socket_rtt_us(4096, (cores[0], cores[0]))
        print(f"(5) 4 KiB there and back over a Unix socket pair, the two processes pinned to two cores "
              f"{apart:.0f} us, to one core {together:.0f} us: ratio {together / apart:.2f}")
    print(f"load average after: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
