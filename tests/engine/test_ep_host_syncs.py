"""The exchange's host syncs, counted as a GPU would see them, over a real gloo group of real
Router and ExpertWorker objects in this process (2 routers x 2 workers, threads instead of actors);
and one layer of each side through the GPU path's code, counted here and, on a GPU, by the device.

What counts as a host sync (``SyncCounter``), and why: each call below, made on a CUDA tensor or
towards a CUDA device, stops the host until the GPU has caught up (or, for the last two, puts
the host's scheduler on the layer's path). On this CPU-only machine the same calls run on CPU
tensors, so the counter counts the *calls* on the path the GPU takes too:
1. tensor -> host conversions: ``.item() .tolist() .cpu() .numpy()``, ``int() float() bool()`` of
   a tensor (a device-to-host copy and a stream wait);
2. ``torch.bincount`` (function or method): on CUDA it reads the input's max on the host to size
   its output, with or without ``minlength``;
3. host data to a device through ``torch.tensor(..., device=)`` / ``torch.as_tensor(..., device=)``
   (a blocking copy from pageable memory);
4. ``Tensor.to(<a device>)`` and ``.cuda()`` without ``non_blocking=True`` (blocking when the
   tensor is on the host; a tensor already on the device is not copied, so this is an upper
   bound), and ``copy_`` across devices without ``non_blocking`` (never seen here: both sides
   are the host);
5. ``torch.cuda.synchronize``, ``Event.synchronize``, ``Stream.synchronize``;
6. every ``PointToPointCommunicator.transfer`` the host waits for (``wait=True``, the default):
   on NCCL the host polls the group's completion event, a wait for the device;
   ``wait=False`` (the device waits: torch's stream on the event) does not count;
7. ``threading.Thread.start`` (a thread per collective, NCCL's old watchdog ``Timer``).
Not seen here: syncs inside torch ops that a CPU build does not make (``nonzero``, boolean
masks, ``repeat_interleave`` without an output size...): the gpu-marked test counts with
``torch.cuda.set_sync_debug_mode("warn")``, which sees those but not 6 (cupy's event poll), so
it adds the waited transfers itself.

The budget, measured in docs/BENCHMARKS.md ("Host syncs per MoE layer"): at most 2 per MoE layer
on each side (the router: its plan's counts and the layer's transfer; the worker: the headers'
transfer and their one read, which sizes the grouped GEMM; its rows and sums: none), and 2 per
step outside the layers on the router (step begin: the flags' transfer and read; step end: the
empty layers' transfer and one read of every trailer). The counter can fail: a self-test adds a
bincount to the router's layer and a blocking copy to the worker's. The same runs check the
outputs against the in-process engine.
"""

from __future__ import annotations

import threading
from collections import Counter, defaultdict

import pytest
import torch

from raymoe.actors.expert_worker import ExpertWorker
from raymoe.actors.router import Router
from raymoe.engine.exchange.python_sides import PythonWorkerExchange
from raymoe.engine.engine import EngineConfig, LLMEngine
from raymoe.engine.exchange.remote_experts import RemoteExperts
from raymoe.engine.exchange.sides import RouterExchange
from raymoe.engine.sampling_params import SamplingParams
from raymoe.kernels.comm import CommBackend, new_rendezvous
from raymoe.kernels.comm.p2p import PointToPointCommunicator
from raymoe.moe.initial_placement import initial_placement
from raymoe.engine.hf_config import load_model_config

SYNC_CONVERSIONS = ("item", "tolist", "cpu", "numpy", "__int__", "__float__", "__bool__")


def _names_a_device(args, kwargs) -> bool:
    """Whether a ``Tensor.to`` call names a device (a dtype-only ``.to`` moves nothing)."""
    if kwargs.get("device") is not None:
        return True
    return any(isinstance(a, (torch.device, str, torch.Tensor)) for a in args[:1])


class SyncCounter:
    """Counts, per scope entry and on the thread that entered the scope, the calls that stop
    the host until a GPU has caught up (see the module docstring for the list and why); a
    scope entered inside another counts its own (a worker's layer reads its headers inside).
    ``kinds[scope]`` says which calls were counted (for the failure messages)."""

    def __init__(self):
        self.local = threading.local()
        self.counts: dict[str, list[int]] = defaultdict(list)  # scope -> syncs per scope entry
        self.kinds: dict[str, Counter] = defaultdict(Counter)
        self.lock = threading.Lock()

    def count(self, kind: str) -> None:
        entries = getattr(self.local, "entries", None)
        if entries:
            scope, index = entries[-1]
            self.counts[scope][index] += 1
            self.kinds[scope][kind] += 1

    def _wrap(self, monkeypatch, owner, name: str, counts_when=lambda *a, **k: True, kind: str | None = None):
        original = getattr(owner, name)
        kind = kind or name

        def counted(*args, _original=original, **kwargs):
            if counts_when(*args, **kwargs):
                self.count(kind)
            return _original(*args, **kwargs)

        monkeypatch.setattr(owner, name, counted)

    def install(self, monkeypatch):
        # 1. Tensor -> host conversions: a device-to-host copy and a wait for the stream.
        for name in SYNC_CONVERSIONS:
            self._wrap(monkeypatch, torch.Tensor, name)
        # 2. bincount: on CUDA it reads the input's max on the host to size its output
        #    (even with minlength).
        self._wrap(monkeypatch, torch, "bincount")
        self._wrap(monkeypatch, torch.Tensor, "bincount")
        # 3. host data to a device through the constructors: a blocking copy from pageable memory.
        for name in ("tensor", "as_tensor"):
            self._wrap(monkeypatch, torch, name, lambda data, *a, **k: k.get("device") is not None
                       and not isinstance(data, torch.Tensor), kind=f"torch.{name}(device=)")
        # 4. Tensor.to / .cuda naming a device without non_blocking=True: a blocking copy when the
        #    tensor is on the host (the device's own tensors are not copied: an upper bound).
        self._wrap(monkeypatch, torch.Tensor, "to", lambda self_, *a, **k: _names_a_device(a, k)
                   and not k.get("non_blocking", False), kind="to(device)")
        self._wrap(monkeypatch, torch.Tensor, "cuda", lambda self_, *a, **k: not k.get("non_blocking", False))
        #    copy_ across devices without non_blocking (never on a CPU-only machine: both sides are the host).
        self._wrap(monkeypatch, torch.Tensor, "copy_", lambda self_, src, non_blocking=False: (
            isinstance(src, torch.Tensor) and src.device != self_.device and not non_blocking), kind="copy_(device)")
        # 5. explicit waits for the device.
        self._wrap(monkeypatch, torch.cuda, "synchronize", kind="cuda.synchronize")
        self._wrap(monkeypatch, torch.cuda.Event, "synchronize", kind="Event.synchronize")
        self._wrap(monkeypatch, torch.cuda.Stream, "synchronize", kind="Stream.synchronize")
        # 6. a collective the host waits for: on NCCL the host polls the group's completion
        #    event, which is a wait for the device. ``transfer(..., wait=False)`` orders the
        #    device after the group instead (no host wait) and does not count.
        self._wrap(monkeypatch, PointToPointCommunicator, "transfer",
                   lambda *a, **k: k.get("wait", True), kind="transfer(wait)")
        # 7. a thread started per collective (a watchdog timer): not a device sync, but a host
        #    round trip through the scheduler on the layer's path; counted with the syncs.
        self._wrap(monkeypatch, threading.Thread, "start", kind="Thread.start")

    def scoped(self, scope: str, function):
        def wrapper(*args, **kwargs):
            entries = getattr(self.local, "entries", None)
            if entries is None:
                entries = self.local.entries = []
            if entries and entries[-1][0] == scope:  # a scope calling itself counts once
                return function(*args, **kwargs)
            with self.lock:
                self.counts[scope].append(0)
                entries.append((scope, len(self.counts[scope]) - 1))
            try:
                return function(*args, **kwargs)
            finally:
                entries.pop()
        return wrapper


@pytest.fixture(scope="module")
def in_process_deployment(tiny_mixtral_dir):
    """2 routers and 2 workers over one gloo group on loopback; every object is the real one."""
    config = load_model_config(tiny_mixtral_dir)
    placement = initial_placement(num_layers=len(config.moe_layers), num_experts=config.num_experts, num_workers=2,
                                  strategy="round_robin", redundant_slots_per_worker=1)
    engine_config = EngineConfig(dtype="float32")
    workers = [ExpertWorker(w, tiny_mixtral_dir, "float32", "cpu", placement.to_dict()) for w in range(2)]
    routers = [Router(f"router-{r}", tiny_mixtral_dir, engine_config, placement.to_dict(), workers, "gloo", 20.0,
                      r, 2) for r in range(2)]
    rendezvous = new_rendezvous(CommBackend.GLOO, host="127.0.0.1", group_name="host-sync-test")
    joins = [threading.Thread(target=r.join, args=(rendezvous, 0, [0, 1])) for r in routers]
    joins += [threading.Thread(target=w.join, args=("gloo", rendezvous, 2 + w.worker, 2, [0, 1], 20.0))
              for w in workers]
    for thread in joins:
        thread.start()
    for thread in joins:
        thread.join(timeout=60)
    assert all(w.exchange is not None for w in workers) and all(r.experts.exchange is not None for r in routers)
    yield routers, workers
    for router in routers:
        router.shutdown()
    for worker in workers:
        worker.shutdown()


def run_counted(routers, workers, tiny_mixtral_dir, monkeypatch, max_tokens: int = 8, extra=None) -> SyncCounter:
    """Generate on both routers at once under a fresh counter; outputs checked against the
    in-process engine. ``extra(counter)``: patches applied after the counter's scopes."""
    counter = SyncCounter()
    counter.install(monkeypatch)
    monkeypatch.setattr(RemoteExperts, "forward", counter.scoped("router layer", RemoteExperts.forward))
    monkeypatch.setattr(RemoteExperts, "complete_step", counter.scoped("router step end", RemoteExperts.complete_step))
    monkeypatch.setattr(RouterExchange, "agree_round", counter.scoped("router step begin",  # (the step loop's agreement)
                                                                      RouterExchange.agree_round))
    assert all(type(w.exchange) is PythonWorkerExchange for w in workers)  # gloo: the Python side
    monkeypatch.setattr(PythonWorkerExchange, "receive_headers", counter.scoped("worker headers",
                                                                               PythonWorkerExchange.receive_headers))
    monkeypatch.setattr(PythonWorkerExchange, "serve_layer", counter.scoped("worker rows",
                                                                           PythonWorkerExchange.serve_layer))
    if extra is not None:
        extra(counter)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    prompts = [[5, 9, 11, 40], [7, 7, 3], [100, 20, 30, 40, 50], [8]]
    results = {}

    def run(index: int, router: Router):  # router 1 gets one request: routers step with uneven work
        share = [(f"r{index}-{i}-{max_tokens}", p, params) for i, p in enumerate(prompts) if i % 4 == 0 or index == 0]
        results[index] = (share, router.generate(share))

    threads = [threading.Thread(target=run, args=(i, r)) for i, r in enumerate(routers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    reference = LLMEngine.from_pretrained(tiny_mixtral_dir, EngineConfig(dtype="float32"))
    assert len(results) == 2
    for share, outputs in results.values():
        expected = reference.generate([p for _, p, _ in share], params)
        assert [o.output_token_ids for o in outputs] == [e.output_token_ids for e in expected]
    return counter


def worst(counter: SyncCounter) -> dict[str, tuple[int, dict]]:
    return {scope: (max(values), dict(counter.kinds[scope])) for scope, values in counter.counts.items()}


def test_at_most_two_syncs_per_layer_per_side_and_outputs_equal_the_engine(in_process_deployment, tiny_mixtral_dir,
                                                                           monkeypatch):
    routers, workers = in_process_deployment
    counter = run_counted(routers, workers, tiny_mixtral_dir, monkeypatch)
    seen = worst(counter)
    print("host syncs (worst per scope entry, kinds over the run):", seen)
    layers = counter.counts["router layer"]
    assert len(layers) >= 8 * 2  # >= 8 steps with tokens, 2 MoE layers each
    # The router's layer: its plan's counts (one host read) and the layer's transfer (the host
    # waits for the sums: the next layer's plan must not run into an unbounded wait).
    assert max(layers) <= ROUTER_LAYER_BUDGET, f"router syncs per MoE layer: {seen['router layer']}"
    # Per step: the step-begin flags (the transfer, one read) and the step end (the empty
    # layers' transfer, one read of every trailer).
    assert max(counter.counts["router step begin"]) <= 2, seen["router step begin"]
    assert max(counter.counts["router step end"]) <= 2, seen["router step end"]
    # A worker's layer: its headers (the transfer's wait and one read: they size the grouped
    # GEMM; read inside serve_layer after the step's first layer), then the rows: no sync at all
    # (the rows' receive and the sums' send leave the wait to the device).
    served = counter.counts["worker rows"]
    assert len(served) >= 2 * 8 * 2  # both workers served every layer of every step
    assert max(served) == 0, f"worker syncs while serving rows: {seen['worker rows']}"
    assert max(counter.counts["worker headers"]) + max(served) <= WORKER_LAYER_BUDGET, seen["worker headers"]


ROUTER_LAYER_BUDGET = 2
WORKER_LAYER_BUDGET = 2


def test_the_counter_sees_a_bincount_or_a_blocking_copy_added_to_a_layer(in_process_deployment, tiny_mixtral_dir,
                                                                         monkeypatch):
    """The counter can fail: a ``torch.bincount`` on the router's layer path and a blocking
    host-to-device copy on the worker's each add one to their side's count, over the budget."""
    routers, workers = in_process_deployment

    def add_syncs(counter: SyncCounter) -> None:
        layer, serve = RemoteExperts.forward, PythonWorkerExchange.serve_layer

        def forward_with_bincount(self, moe_layer, hidden, topk_ids, topk_weights):
            torch.bincount(topk_ids.reshape(-1))
            return layer(self, moe_layer, hidden, topk_ids, topk_weights)

        def serve_with_copy(self, *args, **kwargs):
            torch.zeros(4).to(self.device)  # pageable host memory, blocking
            return serve(self, *args, **kwargs)

        monkeypatch.setattr(RemoteExperts, "forward", counter.scoped("router layer", forward_with_bincount))
        monkeypatch.setattr(PythonWorkerExchange, "serve_layer", counter.scoped("worker rows", serve_with_copy))

    counter = run_counted(routers, workers, tiny_mixtral_dir, monkeypatch, max_tokens=2, extra=add_syncs)
    assert max(counter.counts["router layer"]) == ROUTER_LAYER_BUDGET + 1
    assert counter.kinds["router layer"]["bincount"] == len(counter.counts["router layer"])
    assert max(counter.counts["worker headers"]) + max(counter.counts["worker rows"]) == WORKER_LAYER_BUDGET + 1
    assert counter.kinds["worker rows"]["to(device)"] == len(counter.counts["worker rows"])


# ---- one layer of each side, counted by the device (GPU) or by SyncCounter (here) -------------

class Relay:
    """Stands in for the communicator of a 1 router x 1 worker group: records what is sent and
    fills receives from ``inbox`` (zeros when empty), all on the device; counts the transfers
    the host would wait for (``wait`` True: on NCCL a poll of the group's completion event,
    which ``set_sync_debug_mode`` does not see)."""

    timeout_s = 5.0

    def __init__(self):
        self.sent: list[torch.Tensor] = []
        self.inbox: list[torch.Tensor] = []
        self.waited = 0

    def transfer(self, sends, recvs, *, tag, timeout_s=None, wait=True):
        self.waited += int(wait)
        for _, tensor in sends:
            self.sent.append(tensor.clone())
        for _, tensor in recvs:
            target = tensor.reshape(-1).view(torch.uint8)
            if self.inbox:
                target.copy_(self.inbox.pop(0).reshape(-1).view(torch.uint8))
            else:
                target.zero_()


def count_device_syncs(device: torch.device, function, monkeypatch) -> tuple[int, object]:
    """``function()``'s host syncs: on CUDA the warnings of ``torch.cuda.set_sync_debug_mode("warn")``
    (every synchronising CUDA call torch makes), elsewhere :class:`SyncCounter`'s count."""
    if device.type == "cuda":
        import warnings

        torch.cuda.synchronize(device)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                result = function()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        return sum("synchroniz" in str(w.message) for w in caught), result
    with monkeypatch.context() as patch:
        counter = SyncCounter()
        counter.install(patch)
        result = counter.scoped("call", function)()
    return counter.counts["call"][0] - counter.kinds["call"]["transfer(wait)"], result  # waits: Relay's


def one_layer_each_side(device: torch.device, monkeypatch) -> dict[str, int]:
    """A layer planned on the device (moe/exchange_plan.py::plan_exchange, the GPU path), its
    router side (PythonRouterExchange.exchange), then its worker side (receive_headers,
    serve_layer: bfloat16, the path a GPU worker runs), each counted."""
    from raymoe.engine.exchange.python_sides import PythonRouterExchange
    from raymoe.kernels.comm.wire import GroupLayout
    from raymoe.moe.exchange_plan import plan_exchange

    torch.manual_seed(0)
    T, D, I, E, S, k = 6, 64, 32, 4, 4, 2
    dtype = torch.bfloat16
    layout = GroupLayout(1, (0,))
    hidden = torch.randn(T, D, dtype=dtype, device=device)
    topk_ids = torch.randint(0, E, (T, k), device=device)
    topk_weights = torch.rand(T, k, device=device)
    log2phy = torch.arange(E, device=device).view(E, 1)
    logcnt = torch.ones(E, dtype=torch.int64, device=device)
    counts = {}
    counts["planner"], plan = count_device_syncs(device, lambda: plan_exchange(
        topk_ids, topk_weights, None, log2phy, logcnt, S, 1), monkeypatch)
    router_comm = Relay()
    router = PythonRouterExchange(router_comm, layout, 0, 1, S, k, D, dtype, device)
    counts["router exchange"], _ = count_device_syncs(device, lambda: router.exchange(0, plan, hidden, 0), monkeypatch)
    counts["router exchange"] += router_comm.waited
    worker_comm = Relay()
    worker_comm.inbox = list(router_comm.sent)  # the header, then the rows
    worker = PythonWorkerExchange(worker_comm, layout, S, D, k, dtype, device, None, intermediate_size=I)
    w13 = torch.randn(S, 2 * I, D, dtype=dtype, device=device) * 0.1
    w2 = torch.randn(S, D, I, dtype=dtype, device=device) * 0.1
    pool_rows = {0: (list(range(S)), torch.arange(S, device=device))}
    counts["worker headers"], headers = count_device_syncs(device, lambda: worker.receive_headers(0), monkeypatch)
    counts["worker headers"] += worker_comm.waited
    waited = worker_comm.waited
    counts["worker rows"], result = count_device_syncs(
        device, lambda: worker.serve_layer(0, headers, w13, w2, pool_rows), monkeypatch)
    counts["worker rows"] += worker_comm.waited - waited
    assert result.rows == plan.num_rows and len(worker_comm.sent) == 1  # the sums and trailer went back
    return counts


def check_one_layer_counts(counts: dict[str, int]) -> None:
    print("host syncs of one layer:", counts)
    # The router's exchange: the layer's waited transfer only (headers go pinned, non-blocking).
    # Its planner: the one host read of the counts (counted by scatter-add, never bincount).
    assert counts["router exchange"] <= 1 and counts["planner"] <= 1
    assert counts["planner"] + counts["router exchange"] <= 2
    assert counts["worker headers"] <= 2 and counts["worker rows"] == 0


def test_one_layer_each_side_counted_here(monkeypatch):
    check_one_layer_counts(one_layer_each_side(torch.device("cpu"), monkeypatch))


@pytest.mark.gpu
def test_one_layer_each_side_counted_by_the_device(monkeypatch):
    """The same layer on a GPU, counted by ``torch.cuda.set_sync_debug_mode("warn")``."""
    check_one_layer_counts(one_layer_each_side(torch.device("cuda", torch.cuda.current_device()), monkeypatch))
