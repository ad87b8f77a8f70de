"""The expert-parallel exchange of one MoE layer: which implementation of each side a rank runs,
chosen once when it joins the group (:func:`router_exchange`, :func:`worker_exchange`).

Legend: T tokens, k experts per token, D hidden, R routers, W workers in the group, N rows.

One group per deployment: ranks ``0 .. R-1`` are the routers, rank ``R + i`` is worker
``participants[i]``. Routers step together (a router with nothing to run sends zero rows), so
every rank issues the same messages in the same order and each worker runs one grouped GEMM
over every router's rows. Per MoE layer, two exchanges:

1. dispatch, router -> worker: a header (rows, tag checksum, placement epoch, kind, then the
   assignments for each of the worker's S local slots), then, if rows > 0, the rows, each
   packed as ``D`` activations + k int32 local slots + k float32 gate weights (slot -1: that
   position runs nowhere on this worker);
2. combine, worker -> router: the rows' weighted sums, then a trailer (expert seconds, tag
   checksum). The router knows the row count, so it posts these receives together with its
   dispatch sends: one round trip per layer on the router.

The worker reads the header first (its 2 host syncs per layer on a GPU: the wait for the headers
and their one read; the slot counts in them size the grouped GEMM), then the rows and sends the
sums without a host wait (``transfer(..., wait=False)``: on NCCL torch's stream waits). The
router's per layer are its plan's counts and the layer's transfer (plus, on a GPU, the planner's
``torch.bincount``); it reads the trailers once per step. tests/engine/test_ep_host_syncs.py
counts them.
A header of kind IDLE in the first layer's place says "no step": routers send it now and
then while nobody has work, so a worker waiting for a step never waits past its deadline
for a live group. Every wait has a deadline that names the layer and, where the backend can
tell, the rank. Nothing here imports Ray. The messages' formats, kinds and statuses are defined
once, in kernels/comm/wire.py.

Rooms: engine/exchange/sides.py (the interface of each side, and what both implementations
share), engine/exchange/python_sides.py (every message through ``comm.transfer``: any transport,
dtype, device), engine/exchange/native_sides.py (each layer in one native call: float32 CPUs over
a transport with ``native_routines``, the sockets one). The two send the same messages in the
same order, so a group may mix them.

A worker runs its experts in exactly three ways, each for a reason:
1. the native layer (a float32 or bfloat16 CPU over sockets, one serving thread): headers, rows,
   experts (``raymoe_run_rows``; in bfloat16 ``raymoe_bf16_run_assignments``, each assignment's
   output back) and sums in one C call, no Python per message;
2. the Python layer with ``raymoe_run_rows`` (float32 CPU with the native kernels and one
   serving thread, over a transport without native routines: gloo): the same experts call on
   rows that Python received;
3. the Python layer with engine/experts.py::run_rows (expert threads, ``cpu.worker_threads``
   > 1, which split a layer's experts over cores; GPUs; bf16 over gloo; shapes the native kernel
   does not take): a grouped SwiGLU whose kernel kernels/expert_mlp.py picks.
1 and 2 run the same C function and 2 and 3 give the same bits where both apply.
"""

from __future__ import annotations

from concurrent.futures import Executor

import torch

from raymoe.engine.exchange.native_sides import NativeRouterExchange, NativeWorkerExchange
from raymoe.engine.exchange.python_sides import PythonRouterExchange, PythonWorkerExchange
from raymoe.engine.exchange.sides import RouterExchange, WorkerExchange, WorkerLayerResult
from raymoe.kernels import native_bf16, native_cpu, native_exchange
from raymoe.kernels.comm.base import Communicator
from raymoe.kernels.comm.wire import GroupLayout

__all__ = ["GroupLayout", "RouterExchange", "WorkerExchange", "WorkerLayerResult", "router_exchange",
           "worker_exchange"]


def router_exchange(comm: Communicator, layout: GroupLayout, router_index: int, num_workers: int,
                    slots_per_worker: int, top_k: int, hidden_size: int, dtype: torch.dtype,
                    device: torch.device) -> RouterExchange:
    """A router's side over ``comm``: the native one where the transport lends native code its
    connections and the native library takes these rows (float32 or bfloat16 on the CPU), else Python's."""
    native = comm.native_routines and native_exchange.router_applies(dtype, device)
    side = NativeRouterExchange if native else PythonRouterExchange
    return side(comm, layout, router_index, num_workers, slots_per_worker, top_k, hidden_size, dtype, device)


def worker_exchange(comm: Communicator, layout: GroupLayout, slots_per_worker: int, hidden_size: int, top_k: int,
                    dtype: torch.dtype, device: torch.device, executor: Executor | None = None, *,
                    intermediate_size: int) -> WorkerExchange:
    """A worker's side over ``comm``: the native one where the transport lends native code its
    connections, the native library takes these rows and the experts' sizes, and no threads run
    experts beside the serving one (``executor``: the native layer runs them on its own); else
    Python's."""
    native = (comm.native_routines and executor is None and native_exchange.worker_applies(dtype, device)
              and _experts_fit(dtype, device, hidden_size, intermediate_size))
    if native:
        return NativeWorkerExchange(comm, layout, slots_per_worker, hidden_size, top_k, dtype, device)
    return PythonWorkerExchange(comm, layout, slots_per_worker, hidden_size, top_k, dtype, device, executor,
                                intermediate_size=intermediate_size)


def _experts_fit(dtype: torch.dtype, device: torch.device, hidden_size: int, intermediate_size: int) -> bool:
    """Whether the native layer's experts take these sizes in ``dtype`` (the bfloat16 kernels take the
    stacks as they lie: contiguous pools; float32's are asked of stand-ins: no memory)."""
    if dtype == torch.bfloat16:
        return native_bf16.experts_fit(hidden_size, intermediate_size)
    return native_cpu.experts_fit(dtype, device, hidden_size, intermediate_size)
