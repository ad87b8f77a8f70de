"""The expert worker actor: one expert-parallel rank (one GPU, or one CPU slot).

It holds the weights of its physical slots for every MoE layer, read straight from the
checkpoint (only its own experts), joins the deployment's one expert-parallel group, and from
then on runs a persistent loop driven by that group, with no Ray call per step: for every MoE
layer, receive every router's rows, run its experts over all of them at once, send the sums
back (engine/exchange/ep_exchange.py). Operators find each as ``{deployment}-worker-{w}`` (Ray namespace
``raymoe``): ``raymoe status --address HOST:PORT`` lists every worker's pid, node, liveness and
last failure (docs/DEPLOY.md, section 4, also for Ray's own tools).

Weights live in a per-layer pool a little larger than the worker's slots. Each placement
epoch maps slots to pool rows, so a migration stages new experts into free rows while every
router keeps serving with the epoch it uses; rows are freed when no epoch uses them. The pool
is only ever read into in place: a restarted worker's reload (:meth:`ExpertWorker.load_placement`)
keeps the rows that hold their expert, moves others within a layer and reads the rest from the
checkpoint into their rows, so it never holds its experts twice (docs/RELIABILITY.md).

Copies and the EP exchange are ordered the same way on every rank, by construction: a worker
that serves the EP group never runs a copy collective on a call thread. The controller queues
each layer's copy on every worker under a *mark* (:meth:`ExpertWorker.queue_migration`), then
gives the routers that mark (``Router.mark_migration``); the routers send it in an idle tick
they all send in the same round (wire.HEADER_MARK), and every worker's serving loop runs the
copy right after the first tick in which a router carries that mark, before it reads the next
step's headers. No router has the mark before every worker queued the copy, and every worker
reads the same sequence of messages from the routers, so on every rank the migration
all-to-all-v comes between the same two EP collectives (NCCL's rule for two communicators on
one GPU: every rank issues them in the same order). A worker outside
the EP group (a grow's new worker, before it joins) has nothing to order against and copies at
once. ``collectives()`` returns the order this worker saw (a bounded log), so tests compare it.
The same marks switch a serving worker to a new EP group formed beside the one it serves (a
re-include's make-before-break, :meth:`ExpertWorker.prepare_switch`): its loop serves the new
group from the step after the tick that carries the switch's mark, when the routers switch too.

A migration that fails is undone with :meth:`ExpertWorker.discard_staged`: its epoch's staged
rows (and the epoch itself, if this worker already activated it) are dropped and the epoch
can never be staged or activated again here, so a retry must take a new one. ``activate``
swaps in only rows staged under its own epoch, and refuses one staged for an expert its
table does not put in that slot.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import ray
import torch

from raymoe.engine.checkpoint import Checkpoint
from raymoe.engine.engine import resolve_dtype
from raymoe.actors.cpu_affinity import pin_current_thread
from raymoe.actors.devices import actor_cuda_device
from raymoe.actors.heap_freeze import freeze_loaded_heap
from raymoe.actors.progress_slot import ProgressSlot
from raymoe.engine.exchange.ep_exchange import GroupLayout, WorkerExchange, worker_exchange
from raymoe.engine.exchange.worker_warm_up import warm_up_experts
from raymoe.engine.host_memory import allocator_in_use, keep_freed_memory
from raymoe.engine.weights import load_expert_stack, read_expert_into
from raymoe.kernels import huge_pages, native_cpu, packed_linear
from raymoe.kernels.expert_mlp import kernel_name
from raymoe.kernels.comm import CommBackend, make_communicator, new_rendezvous
from raymoe.kernels.comm.base import Communicator
from raymoe.kernels.comm.wire import HEADER_KIND, KIND_SPLIT
from raymoe.engine.hf_config import load_model_config
from raymoe.moe.placement import PlacementTable
from raymoe.moe.worker_threads import default_worker_threads


LOG = logging.getLogger("raymoe.worker")
# Where a test may make this worker fail on purpose (inject_fault): entering a migration's copy
# collective (its peers are left waiting in it), right after staging the first incoming expert
# of a migration (the others stay staged), and in activate before anything is committed.
WORKER_FAULT_POINTS = ("migrate_enter", "migrate_staged", "activate")


# Entries of a worker's collective log (ExpertWorker.collectives): its copies and joins, each
# placed among the EP collectives by their count; bounded, the oldest dropped first.
COLLECTIVE_LOG_ENTRIES = 512
MARK_LAYERS = 1 << 16  # marks of one epoch: its join, its layers' copies, its switch


def migration_mark(epoch: int, layer: int) -> int:
    """The mark of the copy collective that stages MoE layer ``layer`` for ``epoch``: unique for
    ever, since an epoch is never reused (and never 0, which a tick carries for "none"). An
    epoch's marks, in the order they are used: :func:`join_mark`, each layer's copy, then
    :func:`switch_mark`; every one above every mark of an older epoch."""
    if not 0 <= layer < MARK_LAYERS - 2:
        raise ValueError(f"layer {layer} outside 0..{MARK_LAYERS - 3}")
    return epoch * MARK_LAYERS + layer + 2


def join_mark(epoch: int) -> int:
    """The mark of a migration-group join before ``epoch``'s copies (or in an epoch of its own)."""
    return epoch * MARK_LAYERS + 1


def switch_mark(epoch: int) -> int:
    """The mark of a switch to a new EP group serving ``epoch`` (after its copies)."""
    return epoch * MARK_LAYERS + MARK_LAYERS


@dataclass
class QueuedCopy:
    """One layer's copy, queued under ``mark`` until the serving loop of ``exchange`` meets that
    mark in a router's idle tick (``exchange`` None: this worker serves no EP group; it runs at once)."""
    mark: int
    args: tuple
    exchange: Any
    done: threading.Event = field(default_factory=threading.Event)
    started: bool = False
    result: int | None = None
    error: BaseException | None = None
    switch: Any = None  # instead of a copy: (exchange, generation) of a group to serve from this mark on
    join: bool = False  # instead of a copy: join a migration group (args: join_migration's)


class InjectedWorkerFault(RuntimeError):
    """Raised at a fault point armed by :meth:`ExpertWorker.inject_fault` (tests only)."""


class StaleStagedRows(RuntimeError):
    """``activate`` found staged rows it must not serve (another epoch's, or another expert's)."""


SAVED_ROW = -1  # plan_row_moves: "copy from the row saved aside" (a cycle's one spare copy)


def plan_row_moves(held: list[int | None], target: list[int]) -> list[tuple]:
    """The steps that turn a pool layer whose rows hold ``held`` (an expert, or None: unknown)
    into one whose rows hold ``target`` (-1: a spare row), in place, in order:

    - ``("copy", row, source)``: copy row ``source`` (or ``SAVED_ROW``) into ``row``;
    - ``("save", row)``: keep a copy of ``row`` aside (at most one at a time: a cycle of moves);
    - ``("load", row, expert)``: read ``expert`` from the checkpoint into ``row``.

    Rows already holding their target are not touched, nor are spare rows (-1: nothing reads
    them before a migration stages into them); an expert held elsewhere in the layer
    is copied, never read again, and a row is overwritten only after every row that copies
    from it was written. Pure: tests check it against a simulation."""
    rows = len(target)
    kept = {row for row in range(rows) if target[row] >= 0 and held[row] == target[row]}
    done = kept | {row for row in range(rows) if target[row] < 0}  # never written

    where: dict[int, int] = {}  # expert -> a row holding it now (a kept one where there is one)
    for row in range(rows):
        expert = held[row]
        if expert is not None and expert >= 0 and (expert not in where or row in kept):
            where[expert] = row
    source: dict[int, int] = {}  # row -> the row whose current contents it takes
    taker: dict[int, int] = {}  # row -> the row that takes its current contents
    action: dict[int, tuple] = {}
    first: dict[int, int] = {}  # expert -> the row that receives it first (duplicates copy from there)
    duplicates: list[tuple] = []
    for row in range(rows):
        if row in done:
            continue
        expert = target[row]
        if expert in where and where[expert] in kept:
            action[row] = ("copy", row, where[expert])
        elif expert in first:
            duplicates.append(("copy", row, first[expert]))
            done.add(row)  # written last, from a row written by then
            continue
        elif expert in where:
            source[row] = taker_of = where[expert]
            taker[taker_of] = row
            action[row] = ("copy", row, taker_of)
        else:
            action[row] = ("load", row, expert)
        first[expert] = row
    ops: list[tuple] = []

    def drain(row: int | None) -> None:
        """Write ``row``, then the row it copied from (nobody needs its contents any more), ..."""
        while row is not None and row not in done:
            ops.append(action[row])
            done.add(row)
            row = source.get(row)
            if row == SAVED_ROW:
                row = None

    for row in range(rows):  # chains: start where nobody needs a row's contents
        if row not in done and row not in taker:
            drain(row)
    for row in range(rows):  # what is left are cycles of copies: one row goes aside, then the rest
        if row not in done:
            ops.append(("save", row))
            needs = taker[row]
            source[needs] = SAVED_ROW
            action[needs] = ("copy", needs, SAVED_ROW)
            drain(row)
    return ops + duplicates


class ExpertWorker:
    def __init__(self, worker: int, model_dir: str, dtype: str, device: str, placement: dict[str, Any],
                 spare_rows: int = 0, threads: int | None = None, packed_experts: bool = True,
                 pin_core: int | None = None):
        # CPU workers (cluster config `cpu.worker_threads`): torch keeps one thread, and
        # `threads - 1` more run other experts of the same layer meanwhile (the same GEMM calls,
        # so outputs do not depend on the thread count). Torch's own intra-op threads were
        # slower here: an expert's decode GEMM is too small to split well.
        packed_linear.set_enabled(packed_experts)  # cluster config `cpu.packed_experts` (CPU float32 only)
        self.worker = worker
        self.model_dir = model_dir
        self.spare_rows = spare_rows
        self.config = load_model_config(model_dir)
        self.device = actor_cuda_device() if device == "cuda" else torch.device("cpu")
        if self.device.type == "cpu":
            keep_freed_memory()  # engine/host_memory.py
        self.dtype = resolve_dtype(dtype, self.config, self.device)
        if threads is None and self.device.type == "cpu":  # `cpu.worker_threads` unset: by the experts' size
            threads = default_worker_threads(self.config.hidden_size, self.config.moe_intermediate_size,
                                             self.dtype.itemsize)
        self.threads = threads or 1
        self.executor = ThreadPoolExecutor(self.threads - 1, thread_name_prefix=f"worker-{worker}-experts") \
            if self.threads > 1 else None
        # The core index the serving thread pins itself to (actors/cpu_affinity.py): only a worker
        # that computes on one thread (its other threads would inherit the pinned core).
        self.pin_core = pin_core if self.threads == 1 else None
        self.pinned_core: int | None = None  # the core it took
        self.exchange: WorkerExchange | None = None
        self.migration_comm: Communicator | None = None
        self.generation = -1
        self.last_error: str | None = None
        self.steps_served = 0
        # Every layer served and every idle tick counts here, where the controller's rank watch
        # reads it without this process's GIL (actors/progress_slot.py).
        self.progress = ProgressSlot()
        self.step_stats: deque = deque(maxlen=1000)  # per step: rows, assignments, compute seconds
        self.migration_joins = 0  # how many migration groups this process joined
        self.discarded: set[int] = set()  # epochs of failed migrations: never staged or served here again
        self.max_epoch = 0  # the largest epoch this process ever staged, served or discarded
        self._staging_lock = threading.Lock()  # staging and discarding, from different Ray call threads
        self._faults: dict[str, int] = {}  # worker fault point -> how many more times it fails
        self._copies: dict[int, QueuedCopy] = {}  # mark -> a copy queued or running (queue_migration)
        self._copies_lock = threading.Lock()  # the copies above, and which exchange they wait for
        self._last_mark = 0  # the largest mark queued here
        # Where the serving loop is in this generation's EP collectives (group steps and idle
        # ticks): 2n between the n-th and the next, 2n+1 inside the next (waiting for it included).
        # One counter per generation, so that an old loop on its way out never moves a new one's.
        self._ep_counter = [0]
        self.collective_log: deque = deque(maxlen=COLLECTIVE_LOG_ENTRIES)
        self._log_lock = threading.Lock()
        self._load_lock = threading.Lock()  # one load_placement at a time
        # A group joined beside none (this worker served no group): (exchange, generation), served
        # once the controller says so (serve_pending); prepare_switch.
        self._pending: tuple[WorkerExchange, int] | None = None
        self.w13: list[torch.Tensor] = []  # per MoE layer: [S + spare, 2I, D]
        self.w2: list[torch.Tensor] = []  # per MoE layer: [S + spare, D, I]
        self.slot_rows: dict[int, list[list[int]]] = {}
        self.experts: dict[int, list[list[int]]] = {}
        self.staged: dict[tuple[int, int, int], tuple[int, int]] = {}
        self.load_placement(placement)
        # The kernel its experts run on (kernels/expert_mlp.py), built now rather than in the first step.
        self.expert_kernel = kernel_name(torch.empty(1, self.config.hidden_size, dtype=self.dtype,
                                                                    device=self.device), self.w13[0], self.w2[0])
        # Every layer's experts run once now (issue 34 item 5): first-call costs (packed
        # weights, oneDNN primitives, cuBLAS / grouped GEMM set-up) are paid before join() can
        # be called, not inside the group's first step under the workers' deadline.
        self.warm_up = warm_up_experts(self.w13, self.w2, self.config.top_k,
                                       self.executor if self.device.type == "cpu" else None)
        self.huge_pages = huge_pages.report(f"worker {worker}")  # its experts' stacks (kernels/huge_pages.py)
        self.frozen_objects = freeze_loaded_heap()  # last: what loading built lives as long as this actor

    def load_placement(self, placement: dict[str, Any]) -> dict[str, Any]:
        """(Re)load this worker's experts for ``placement`` from the checkpoint, forgetting older epochs.

        A restarted worker is constructed with the placement it started with; the supervisor
        calls this with the current one before the worker serves again (never while it serves).
        It never holds the experts twice: a pool of the same shape is rewritten in place, one
        MoE layer at a time (rows already holding their new expert stay, others move within the
        layer through at most one spare row's copy, the rest are read from the checkpoint
        straight into their rows); a pool of another shape is dropped before its replacement is
        allocated. A reload that changes no row (a retry; the placement it was built with) only
        swaps the epochs. Calls are serialized (a retried call waits for the one still
        running, then finds every row in place). Returns what it did (bytes read, rows moved).
        """
        with self._load_lock:
            return self._load_placement(PlacementTable.from_dict(placement))

    def _load_placement(self, table: PlacementTable) -> dict[str, Any]:
        checkpoint = Checkpoint(self.model_dir)
        rows_per_layer = table.slots_per_worker + self.spare_rows
        padding = [-1] * self.spare_rows
        targets = [table.worker_experts(moe_layer, self.worker) + padding for moe_layer in range(table.num_layers)]
        reshaped = len(self.w13) != table.num_layers or any(w.shape[0] != rows_per_layer for w in self.w13)
        held = self._held_rows() if not reshaped else None
        plans = [plan_row_moves(held[layer], targets[layer]) for layer in range(table.num_layers)] if held else None
        if reshaped or any(plans):
            # From here on no epoch describes the pool until the new one does (a failure midway
            # leaves a worker that refuses to join; a retried load makes it whole). A reload that
            # changes no row (a retry, or the placement the worker was built with) swaps epochs only.
            self.slot_rows, self.experts, self.staged = {}, {}, {}
            self._publish_pool_rows()
        if reshaped:  # dropped before anything new is allocated
            self.w13, self.w2 = [], []
        self.slots = table.slots_per_worker
        self.num_layers = table.num_layers
        row_bytes = 3 * self.config.moe_intermediate_size * self.config.hidden_size * self.dtype.itemsize
        read = moved = 0
        for moe_layer, layer in enumerate(self.config.moe_layers):
            if plans is not None:  # in place, reusing the rows that hold an expert already
                ops = plans[moe_layer]
                self._apply_row_moves(checkpoint, moe_layer, ops)
                read += sum(op[0] == "load" for op in ops)
                moved += sum(op[0] == "copy" for op in ops)
            else:
                w13, w2 = load_expert_stack(checkpoint, self.config, layer, targets[moe_layer], self.dtype, self.device)
                self.w13.append(w13)
                self.w2.append(w2)
                read += sum(expert >= 0 for expert in targets[moe_layer])
            native_cpu.prepare_experts(self.w13[moe_layer], self.w2[moe_layer])  # packed now, not in a step
        # epoch -> per layer, the pool row serving each of this worker's slots
        self.slot_rows = {table.epoch: [list(range(self.slots)) for _ in range(self.num_layers)]}
        self.experts = {table.epoch: [table.worker_experts(layer, self.worker) for layer in range(self.num_layers)]}
        # (epoch, layer, slot) -> (pool row, the expert staged there; -1 when the sender did not say)
        self.staged = {}
        self.max_epoch = max(self.max_epoch, table.epoch)
        self._publish_pool_rows()
        return {"worker": self.worker, "epoch": table.epoch, "bytes_read": read * row_bytes, "rows_read": read,
                "rows_moved": moved, "pool_bytes": self.pool_bytes()}

    def pool_bytes(self) -> int:
        """Bytes of this worker's expert pool (every row of every MoE layer, packed copies not counted)."""
        return sum(w.numel() * w.element_size() for stack in (self.w13, self.w2) for w in stack)

    def _held_rows(self) -> list[list[int | None]]:
        """Per MoE layer, the expert each pool row holds as far as this worker knows (an epoch
        serves it or a migration staged it), else None."""
        held: list[list[int | None]] = [[None] * stack.shape[0] for stack in self.w13]
        for epoch, layers in self.slot_rows.items():
            for layer, rows in enumerate(layers):
                for slot, row in enumerate(rows):
                    held[layer][row] = self.experts[epoch][layer][slot]
        for (_, layer, _), (row, expert) in self.staged.items():
            if expert >= 0:
                held[layer][row] = expert
        return held

    def _apply_row_moves(self, checkpoint: Checkpoint, layer: int, ops: list[tuple]) -> None:
        """Run :func:`plan_row_moves`' steps on MoE layer ``layer``'s pool, in order."""
        w13, w2 = self.w13[layer], self.w2[layer]
        saved: tuple[torch.Tensor, torch.Tensor] | None = None
        for op in ops:
            kind, row = op[0], op[1]
            if kind == "save":
                saved = (w13[row].clone(), w2[row].clone())
            elif kind == "copy":
                source = op[2]
                w13[row].copy_(saved[0] if source == SAVED_ROW else w13[source])
                w2[row].copy_(saved[1] if source == SAVED_ROW else w2[source])
            else:  # "load"
                read_expert_into(checkpoint, self.config, self.config.moe_layers[layer], op[2], w13[row], w2[row])
        if any(op[0] == "load" for op in ops):
            # Rows read from the file bypass torch: move the version counter so that the packed
            # copies of the old contents (kernels/packed_linear.py's cache) are dropped and remade.
            torch.autograd.graph.increment_version(w13)
            torch.autograd.graph.increment_version(w2)

    def _publish_pool_rows(self) -> None:
        """The serving loop's view of ``slot_rows``: epoch -> per layer the pool row of each slot, as
        host ints and as a device tensor, swapped in as one new dict so the loop never sees a
        half-made one."""
        self.pool_rows = {epoch: [(list(rows), torch.tensor(rows, dtype=torch.int64, device=self.device))
                                  for rows in layers] for epoch, layers in self.slot_rows.items()}

    def info(self) -> dict[str, Any]:
        latest = max(self.experts) if self.experts else None  # None: a load_placement failed midway
        return {
            "worker": self.worker,
            "pid": os.getpid(),
            "node_id": ray.get_runtime_context().get_node_id(),
            "compute_threads": self.threads,
            "pinned_core": self.pinned_core,
            "allocator": allocator_in_use(),  # cpu.allocator (engine/host_memory.py)
            "expert_kernel": self.expert_kernel,  # native-avx512, onednn or torch (kernels/expert_mlp.py)
            "warm_up": self.warm_up,  # per expert shape: run once before joining (engine/experts.py)
            "frozen_objects": self.frozen_objects,  # actors/heap_freeze.py
            "huge_pages": self.huge_pages,  # resident weights and of them on 2 MiB pages, after loading
            "niceness": os.nice(0),
            "epochs": sorted(self.slot_rows),
            "experts": self.experts[latest] if latest is not None else [],
            "pool_bytes": self.pool_bytes(),
            "staged": sorted([epoch, layer, slot] for epoch, layer, slot in self.staged),
            "max_epoch": self.max_epoch,
            "discarded_epochs": sorted(self.discarded),
            "migration_joins": self.migration_joins,
            "generation": self.generation,
            "serving": self.exchange is not None,
            # NativeWorkerExchange (a layer in one C call) or PythonWorkerExchange (engine/exchange/ep_exchange.py)
            "exchange_side": type(self.exchange).__name__ if self.exchange is not None else None,
            "steps_served": self.steps_served,
            "last_error": self.last_error,
        }

    def ready(self) -> bool:
        """True once constructed, i.e. once this worker's experts are loaded."""
        return True

    def join(self, backend: str, rendezvous: Any, rank: int, num_routers: int, participants: list[int],
             timeout_s: float, generation: int = 0) -> None:
        """Join the deployment's group as ``rank`` (blocks until every rank joined), then serve
        it from a persistent loop until the group breaks or is replaced."""
        exchange = self._connect(backend, rendezvous, rank, num_routers, participants, timeout_s)
        self._drop_pending()  # a group built instead of one prepared beside the old
        self._serve(exchange, generation)

    def _connect(self, backend: str, rendezvous: Any, rank: int, num_routers: int, participants: list[int],
                 timeout_s: float) -> WorkerExchange:
        """Join the group as ``rank`` (blocks until every rank joined): this worker's side of it."""
        if not self.slot_rows:
            raise RuntimeError(f"worker {self.worker}: no placement loaded (a load_placement failed midway); "
                               "load one before joining")
        layout = GroupLayout(num_routers, tuple(participants))
        comm = make_communicator(
            CommBackend(backend), rendezvous, rank=rank, world_size=layout.world_size, timeout_s=timeout_s,
            device=self.device if self.device.type == "cuda" else None,
            bind_host=ray.util.get_node_ip_address(),
        )
        return worker_exchange(comm, layout, self.slots, self.config.hidden_size, self.config.top_k, self.dtype,
                               self.device, self.executor if self.device.type == "cpu" else None,
                               intermediate_size=self.config.moe_intermediate_size)

    def _serve(self, exchange: WorkerExchange, generation: int) -> None:
        """Serve ``exchange`` from a persistent loop of its own (the one before leaves its loop)."""
        with self._log_lock:
            self.exchange, self.generation, self.last_error, self._ep_counter = exchange, generation, None, [0]
            self.collective_log.append(("join", generation, 0))
        threading.Thread(target=self._serve_loop, args=(exchange, self._ep_counter),
                         name=f"worker-{self.worker}-g{generation}",
                         daemon=True).start()

    # ---- make-before-break: a new group formed beside the one in service (actors/recovery.py) ----
    def prepare_switch(self, backend: str, rendezvous: Any, rank: int, num_routers: int, participants: list[int],
                       timeout_s: float, generation: int, mark: int) -> str:
        """Join a new group (``join``'s arguments) beside the one this worker serves, which it
        goes on serving: its serving loop switches to the new group right after the first
        idle tick that carries ``mark`` (the routers switch after that same tick: every router
        prepared before any got the mark), as a copy queued under a mark runs there
        (``queue_migration``). A worker serving no group (the one re-included) serves the new
        group once told (``serve_pending``). Returns ``"at mark"`` or ``"when told"``. CPU
        transports only (on NCCL the controller stops every rank instead)."""
        if CommBackend(backend).resolve() is CommBackend.NCCL:
            raise RuntimeError("a new NCCL group is never formed beside a live one; the controller stops every rank")
        exchange = self._connect(backend, rendezvous, rank, num_routers, participants, timeout_s)
        with self._copies_lock:
            serving = self.exchange
            if serving is not None:
                if mark <= self._last_mark:
                    exchange.comm.abort()
                    raise RuntimeError(f"worker {self.worker}: switch mark {mark} is not above the last mark queued "
                                       f"here ({self._last_mark}); a mark is never reused")
                self._last_mark = mark
                self._copies[mark] = QueuedCopy(mark, (), serving, switch=(exchange, generation))
        if serving is not None:
            return "at mark"
        self._drop_pending()
        self._pending = (exchange, generation)
        return "when told"

    def serve_pending(self, generation: int) -> None:
        """Serve the group of ``generation`` prepared beside none (``prepare_switch``)."""
        pending, self._pending = self._pending, None
        if pending is None or pending[1] != generation:
            if pending is not None:
                pending[0].comm.abort()
            raise RuntimeError(f"worker {self.worker}: no group of generation {generation} prepared")
        self._serve(*pending)

    def wait_switched(self, generation: int, timeout_s: float) -> bool:
        """Whether this worker serves the group of ``generation`` (within ``timeout_s``)."""
        deadline = time.monotonic() + timeout_s
        while self.generation != generation or self.exchange is None:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.002)
        return True

    def _switch_now(self, copy: QueuedCopy, old: WorkerExchange) -> None:
        """(Serving loop of ``old``, right after the tick that carries the switch mark.) Serve
        the prepared group from now on; the old loop ends and its communicator is closed."""
        exchange, generation = copy.switch
        if self.exchange is not old:  # the old group ended meanwhile (reset): nothing to switch from
            exchange.comm.abort()
            copy.error = RuntimeError(f"worker {self.worker}: the group to switch from ended first")
        else:
            self._serve(exchange, generation)
            copy.result = 0
            old.comm.close()
        copy.done.set()

    def _drop_pending(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            pending[0].comm.abort()

    def _serve_loop(self, exchange: WorkerExchange, position: list[int]) -> None:
        """Serve group steps until this exchange is replaced or fails. Each step: every MoE
        layer in order; the first layer's header may instead be an idle tick, after which the
        copies queued under the marks the routers' ticks carry run (in mark order)."""
        self.pinned_core = pin_current_thread(self.pin_core)
        viewed, layer_views = None, []
        try:
            with torch.inference_mode():
                while self.exchange is exchange:
                    position[0] += 1  # (odd: inside an EP collective, until the step's last layer)
                    headers = exchange.receive_headers(0)
                    self.progress.tick()
                    if headers is None:
                        position[0] += 1
                        marks = exchange.tick_marks
                        if any(marks):
                            for mark in sorted(set(marks) - {0}):
                                self._run_marked_copy(mark, exchange, position)
                        continue
                    rows, assignments, compute_s = 0, 0, 0.0
                    pool_rows = self.pool_rows  # one placement view for the whole step
                    if pool_rows is not viewed:  # each layer's view of it, made once per placement
                        viewed, layer_views = pool_rows, [{epoch: rows_[layer] for epoch, rows_ in pool_rows.items()}
                                                          for layer in range(self.num_layers)]
                    # A step in two micro-batches has two exchanges a layer (its first header says so).
                    halves = 2 if headers[0][HEADER_KIND] == KIND_SPLIT else 1
                    for index in range(self.num_layers * halves):  # (later headers are read in serve_layer)
                        layer = index // halves
                        result = exchange.serve_layer(index, None if index else headers, self.w13[layer],
                                                      self.w2[layer], layer_views[layer])
                        rows += result.rows
                        assignments += result.assignments
                        compute_s += result.compute_s
                        self.progress.tick()
                    position[0] += 1
                    self.steps_served += 1
                    self.step_stats.append((rows, assignments, compute_s))
        except Exception as error:  # the group is broken: peers fail fast, the controller rebuilds
            if self.exchange is exchange:
                self.last_error = f"{type(error).__name__}: {error}"
                self.exchange = None
            exchange.comm.abort()
        finally:  # copies still waiting for this group's tick will never meet it
            self._cancel_copies("the EP group it waited in for its step boundary ended before the routers' "
                                "mark arrived", exchange)

    # ---- migration ------------------------------------------------------------------
    def migration_rendezvous(self, backend: str) -> Any:
        """The rendezvous of the workers' migration group; made here because rank 0 runs here."""
        host = ray.util.get_node_ip_address()
        return new_rendezvous(CommBackend(backend), host=host, group_name="raymoe-migration")

    def join_migration(self, backend: str, rendezvous: Any, world_size: int, timeout_s: float) -> None:
        """Join the workers' migration group (rank = worker index) now, on the calling thread: a
        communicator of its own, so copies never share a stream with dispatch/combine (their
        order: queue_migration). Only while this worker serves no EP group: creating a
        communicator beside live collectives on the same GPU can deadlock (NCCL's init
        allocates device memory; jax#11637), so a serving worker joins at a step boundary
        instead (:meth:`queue_migration_join`), on every backend alike."""
        if self.exchange is not None:
            raise RuntimeError(f"worker {self.worker} serves the EP group: it joins a migration group only between "
                               "two of its collectives (queue_migration_join under a mark the routers carry)")
        self.abort_migration()
        self._join_migration_now(backend, rendezvous, world_size, timeout_s)

    def queue_migration_join(self, mark: int, backend: str, rendezvous: Any, world_size: int,
                             timeout_s: float) -> str:
        """Join a new migration group (``join_migration``'s arguments) under ``mark``, as a copy
        is queued (``queue_migration``): a worker serving the EP group joins in its serving loop
        right after the first idle tick that carries ``mark`` (every worker at the same tick,
        no EP collective in flight on it meanwhile); one serving none joins at once. Returns
        ``"step boundary"`` or ``"now"``; ``wait_migration(mark)`` waits for the join. The old
        migration group is aborted when the new one is joined (copies already queued then run
        on the new one)."""
        where = self._enqueue(mark, (backend, rendezvous, world_size, timeout_s), self._run_join, "migration-join",
                              join=True)
        self.max_epoch = max(self.max_epoch, (mark - 1) // MARK_LAYERS)  # (its epoch is never a table's)
        return where

    def _enqueue(self, mark: int, args: tuple, run, name: str, join: bool = False) -> str:
        """Queue a copy (or a join) under ``mark`` for the serving loop, to run right after the
        first tick that carries it; where this worker serves no EP group (nothing to order it
        against), ``run`` runs it at once on a thread of its own. Returns where."""
        with self._copies_lock:
            # Marks only grow (epochs are never reused and a copy's layers go in order): a mark
            # the routers may carry already could meet an old tick before every worker queued it.
            if mark <= self._last_mark:
                raise RuntimeError(f"worker {self.worker}: migration mark {mark} is not above the last one queued "
                                   f"here ({self._last_mark}); a mark is never reused")
            self._last_mark = mark
            for old in [old for old, queued in self._copies.items() if queued.done.is_set()]:
                del self._copies[old]  # ended, and nobody waited for it (a failed migration's): forgotten
            copy = QueuedCopy(mark, args, self.exchange, join=join)
            self._copies[mark] = copy
            if copy.exchange is None:  # no EP group on this device: nothing to order the copy against
                copy.started = True
        if copy.exchange is None:
            threading.Thread(target=run, args=(copy,), name=f"worker-{self.worker}-{name}", daemon=True).start()
            return "now"
        return "step boundary"

    def _run_join(self, copy: QueuedCopy, position: list[int] | None = None) -> None:
        """A queued migration-group join (on the serving loop whose EP position is ``position``,
        or where no EP group is served), logged with where it fell."""
        position = self._ep_counter if position is None else position
        generation, before = self.generation, position[0]
        try:
            old, self.migration_comm = self.migration_comm, None
            if old is not None:
                old.abort()
            self._join_migration_now(*copy.args, where=("step boundary" if copy.exchange is not None else "now",
                                                        generation if copy.exchange is not None else None,
                                                        before))
            copy.result = 0
        except Exception as error:  # told to the caller of wait_migration; serving goes on
            copy.error = error
        finally:
            copy.done.set()

    def _join_migration_now(self, backend: str, rendezvous: Any, world_size: int, timeout_s: float,
                            where: tuple = ("not serving", None, None)) -> None:
        self.migration_comm = make_communicator(
            CommBackend(backend), rendezvous, rank=self.worker, world_size=world_size, timeout_s=timeout_s,
            device=self.device if self.device.type == "cuda" else None,
            bind_host=ray.util.get_node_ip_address(),
        )
        self.migration_joins += 1
        self._log("migration join", self.migration_joins, *where)

    def abort_migration(self) -> None:
        """Abort the migration group (a migration failed): a copy collective waiting in it on
        this worker fails at once instead of at its deadline, and copies queued for a mark fail
        now. The controller joins a new one."""
        self._cancel_copies("the migration group was aborted")
        comm, self.migration_comm = self.migration_comm, None
        if comm is not None:
            comm.abort()

    def queue_migration(self, mark: int, epoch: int, layer: int, new_epoch: int, sends: list[tuple[int, int]],
                        receives: list[tuple[int, int]]) -> str:
        """Queue one layer's copy (``migrate``'s arguments) under ``mark`` (``migration_mark``);
        every worker of the migration group queues its part. A worker serving the EP group runs
        it in its serving loop, after the first idle tick in which a router carries ``mark``
        (``Router.mark_migration``, given only once every worker has queued it), so on every
        rank it comes between the same two EP collectives; one serving none runs it at
        once. Returns where: ``"step boundary"`` or ``"now"``. ``wait_migration`` returns its result."""
        self._check_epoch_usable(new_epoch, "stage")
        if self.migration_comm is None:
            raise RuntimeError(f"worker {self.worker}: no migration group (aborted after a failed migration and "
                               "not joined again); the controller rebuilds it")
        return self._enqueue(mark, (epoch, layer, new_epoch, sends, receives), self._run_copy, "copy")

    def wait_migration(self, mark: int, timeout_s: float) -> int:
        """Wait up to ``timeout_s`` for the copy queued under ``mark``; returns its bytes sent or
        raises its error (a copy cancelled by ``abort_migration`` raises that)."""
        copy = self._copies.get(mark)
        if copy is None:
            raise RuntimeError(f"worker {self.worker}: no copy queued under mark {mark} (cancelled, or never queued)")
        if not copy.done.wait(timeout_s):
            raise TimeoutError(f"worker {self.worker}: the copy under mark {mark} did not finish in {timeout_s:g} s "
                               f"({'running' if copy.started else 'its step boundary never came'})")
        with self._copies_lock:
            if self._copies.get(mark) is copy:
                del self._copies[mark]
        if copy.error is not None:
            raise copy.error
        return copy.result

    def _run_marked_copy(self, mark: int, exchange: WorkerExchange, position: list[int]) -> None:
        """The serving loop met ``mark`` in a router's tick: run the copy queued under it (if
        any and not run yet: a router's ticks repeat its mark until it gets another)."""
        with self._copies_lock:
            copy = self._copies.get(mark)
            if copy is None or copy.started or copy.exchange is not exchange:
                return
            copy.started = True
        if copy.switch is not None:  # not a copy: the step boundary at which to serve a new group
            self._switch_now(copy, exchange)
            return
        if copy.join:  # not a copy: the step boundary at which to join a migration group
            self._run_join(copy, position)
            return
        with torch.inference_mode(False):  # staging writes the pool (normal tensors), as outside the loop
            self._run_copy(copy, position)

    def _run_copy(self, copy: QueuedCopy, position: list[int] | None = None) -> None:
        """Run a copy (on the serving loop whose EP position is ``position``, or where no EP group
        is served) and log where it fell."""
        position = self._ep_counter if position is None else position
        generation, before = self.generation, position[0]
        started = time.monotonic()
        try:
            copy.result = self._migrate_now(*copy.args)
        except Exception as error:  # told to the caller of wait_migration; serving goes on
            copy.error = error
        finally:
            epoch, layer, new_epoch = copy.args[:3]
            self._log("copy", copy.mark, layer, new_epoch, "step boundary" if copy.exchange is not None else "now",
                      generation if copy.exchange is not None else None, before, position[0],
                      round(time.monotonic() - started, 6), copy.error is None)
            copy.done.set()

    def _cancel_copies(self, why: str, exchange: Any = None) -> None:
        """Fail every copy not started yet (only those waiting for ``exchange``'s ticks, if given)."""
        with self._copies_lock:
            for mark, copy in list(self._copies.items()):
                if copy.started or (exchange is not None and copy.exchange is not exchange):
                    continue
                copy.started = True
                copy.error = RuntimeError(f"worker {self.worker}: the copy under mark {mark} never ran: {why}")
                if copy.switch is not None:  # a group prepared beside this one: never served
                    copy.switch[0].comm.abort()
                copy.done.set()  # (kept for its wait_migration, which says why)

    def _log(self, kind: str, *details: Any) -> None:
        """One entry of the collective log: its kind, the EP generation and the position among its
        EP collectives then (``collectives()``), and the details."""
        with self._log_lock:
            self.collective_log.append((kind, self.generation, self._ep_counter[0], *details))

    def collectives(self) -> dict[str, Any]:
        """The order in which this worker met the collectives of its two communicators: a
        bounded log (``COLLECTIVE_LOG_ENTRIES``, oldest dropped) of EP group joins
        ``("join", generation, 0)``, migration group joins ``("migration join", generation,
        position, joins, where, served_generation, position_before)`` (where: ``"step boundary"``,
        ``"now"`` or ``"not serving"``) and copies ``("copy", generation, position, mark, layer, epoch, where,
        served_generation, position_before, position_after, seconds, ok)``. A position places an
        entry among the EP collectives (group steps and idle ticks) of its generation: ``2n``
        right after the n-th, ``2n + 1`` inside the next one (its wait included), so a copy
        ordered between two EP collectives starts and ends at the same even position."""
        with self._log_lock:
            return {"worker": self.worker, "generation": self.generation, "ep_position": self._ep_counter[0],
                    "serving": self.exchange is not None, "log": [list(entry) for entry in self.collective_log]}

    def migrate(self, epoch: int, layer: int, new_epoch: int, sends: list[tuple[int, int]],
                receives: list[tuple[int, int]]) -> int:
        """One layer's copy, on this call's thread: only on a worker that serves no EP group (a
        serving worker copies at a marked step boundary only: ``queue_migration``)."""
        if self.exchange is not None:
            raise RuntimeError(f"worker {self.worker} serves the EP group: its copies run between EP steps at a "
                               "mark every rank agrees on (queue_migration, Router.mark_migration, wait_migration)")
        return self._migrate_now(epoch, layer, new_epoch, sends, receives)

    def _migrate_now(self, epoch: int, layer: int, new_epoch: int, sends: list[tuple[int, int]],
                    receives: list[tuple[int, int]]) -> int:
        """Copy experts worker to worker over the migration group; every worker calls it.

        sends: ``(destination worker, expert)`` this worker sends from what it serves in ``epoch``;
        receives: ``(source worker, local slot[, expert])`` it receives, staged to serve from
        ``new_epoch`` (with the expert, ``activate`` checks that its table puts that expert there).
        Both lists are in the order the controller made them, so the k-th expert a source sends
        to a destination is the k-th that destination receives from it. Returns bytes sent.
        Runs on the serving loop (a marked step boundary) or where no EP group is served.
        """
        self._check_epoch_usable(new_epoch, "stage")
        comm = self.migration_comm
        if comm is None:
            raise RuntimeError(f"worker {self.worker}: no migration group (aborted after a failed migration and "
                               "not joined again); the controller rebuilds it")
        self._fault("migrate_enter")
        world = comm.world_size
        inter, hidden = self.w2[layer].shape[2], self.w2[layer].shape[1]
        width = 3 * inter * hidden  # gate/up rows, then down
        # Step 1: this worker's outgoing experts, grouped by destination (stable).
        outgoing = sorted(enumerate(sends), key=lambda item: (item[1][0], item[0]))
        send_counts = [0] * world
        rows = []
        for _, (destination, expert) in outgoing:
            slot = self.experts[epoch][layer].index(expert)
            row = self.slot_rows[epoch][layer][slot]
            rows.append(torch.cat([self.w13[layer][row].reshape(-1), self.w2[layer][row].reshape(-1)]))
            send_counts[destination] += 1
        send = torch.stack(rows) if rows else self.w13[layer].new_empty(0, width)
        # Step 2: one all-to-all-v moves every copy of the layer.
        incoming = sorted(enumerate(receives), key=lambda item: (item[1][0], item[0]))
        recv_counts = [0] * world
        for _, (source, *_) in incoming:
            recv_counts[source] += 1
        received = comm.exchange_payload(send, send_counts, recv_counts,
                                         tag=f"migration layer {layer} epoch {new_epoch}")
        # Step 3: stage what arrived into free pool rows.
        for index, (row, (_, (_, slot, *expert))) in enumerate(zip(received, incoming)):
            self._stage(new_epoch, layer, slot, expert[0] if expert else -1,
                        row[: 2 * inter * hidden].view(2 * inter, hidden), row[2 * inter * hidden:].view(hidden, inter))
            if index == 0:
                self._fault("migrate_staged")
        if not incoming:
            self._fault("migrate_staged")
        return send.numel() * send.element_size()

    def _check_epoch_usable(self, epoch: int, what: str) -> None:
        if epoch in self.discarded:
            raise StaleStagedRows(f"worker {self.worker}: cannot {what} epoch {epoch}: it was discarded after a "
                                  "failed migration, and an epoch is never reused (a retry takes a new one)")

    def _stage(self, epoch: int, layer: int, slot: int, expert: int, w13: torch.Tensor, w2: torch.Tensor) -> None:
        """Write an incoming expert into a free pool row, to serve local ``slot`` from ``epoch`` on."""
        with self._staging_lock:  # a discard_staged of this epoch either precedes (refused) or follows it
            self._check_epoch_usable(epoch, "stage")
            free = self._free_rows(layer)
            if not free:
                raise RuntimeError(
                    f"worker {self.worker} layer {layer}: no free pool row to stage into; lower "
                    "balancer.max_copies_per_rebalance or retire old epochs first"
                )
            self.w13[layer][free[0]].copy_(w13)
            self.w2[layer][free[0]].copy_(w2)
            self.staged[(epoch, layer, slot)] = (free[0], expert)
            self.max_epoch = max(self.max_epoch, epoch)

    def _free_rows(self, layer: int) -> list[int]:
        """Pool rows of MoE layer ``layer`` that no epoch serves an expert from and no
        migration staged into. A row that serves only empty slots (expert -1: no router sends
        rows there) is free too: a worker a resize added starts with every slot empty and
        receives its experts into those rows."""
        used = {row for epoch, rows in self.slot_rows.items()
                for row, expert in zip(rows[layer], self.experts[epoch][layer]) if expert >= 0}
        used |= {row for (_, staged_layer, _), (row, _) in self.staged.items() if staged_layer == layer}
        return [r for r in range(self.w13[layer].shape[0]) if r not in used]

    def activate(self, epoch: int, base_epoch: int, placement: dict[str, Any]) -> None:
        """Serve ``epoch``: ``base_epoch``'s rows, with this epoch's staged experts swapped in.

        Only rows staged under ``epoch`` itself are swapped in. Refuses
        (:class:`StaleStagedRows`, nothing changed) an epoch that was discarded or is served
        already, and a row staged under ``epoch`` for an expert its table does not put in that
        slot (another try's row under a reused epoch). Rows staged under an older epoch can
        never be served any more (routers only move forward): they are discarded, that epoch
        with them. Nothing is committed before every check and checkpoint read has passed."""
        table = PlacementTable.from_dict(placement)
        if table.epoch != epoch:
            raise ValueError(f"worker {self.worker}: activate({epoch}) was given a table of epoch {table.epoch}")
        self._check_epoch_usable(epoch, "activate")
        if epoch in self.slot_rows:
            raise StaleStagedRows(f"worker {self.worker}: epoch {epoch} is served already; an epoch is activated once")
        experts = [table.worker_experts(layer, self.worker) for layer in range(self.num_layers)]
        rows = [list(layer_rows) for layer_rows in self.slot_rows[base_epoch]]
        taken = []
        for (staged_epoch, layer, slot), (row, expert) in self.staged.items():
            if staged_epoch != epoch:
                continue  # never swapped in: an older one is dropped below, a newer one waits for its activate
            if expert >= 0 and expert != experts[layer][slot]:
                raise StaleStagedRows(
                    f"worker {self.worker}: layer {layer} slot {slot} has expert {expert} staged under epoch {epoch}, "
                    f"but that epoch's table puts expert {experts[layer][slot]} there; refusing to serve it")
            rows[layer][slot] = row
            taken.append((staged_epoch, layer, slot))
        swapped = {(layer, slot) for _, layer, slot in taken}  # (a staged row may be its slot's own empty row)
        base_rows, base_experts = self.slot_rows[base_epoch], self.experts[base_epoch]
        for layer in range(self.num_layers):
            for slot, expert in enumerate(experts[layer]):
                if expert == base_experts[layer][slot] or (layer, slot) in swapped:
                    continue  # unchanged, or staged above
                if expert in base_experts[layer]:  # already held in another slot: re-point, no copy
                    rows[layer][slot] = base_rows[layer][base_experts[layer].index(expert)]
                elif expert >= 0:  # the plan sent no copy: read it from the checkpoint (same weights)
                    LOG.warning("worker %d: epoch %d puts expert %d in layer %d slot %d, but no copy was staged "
                                "(the slot held expert %d); loading it from the checkpoint", self.worker, epoch,
                                expert, layer, slot, base_experts[layer][slot])
                    rows[layer][slot] = self._load_into_free_row(layer, expert, rows)
        self._fault("activate")
        with self._staging_lock:
            self._check_epoch_usable(epoch, "activate")  # discarded meanwhile: commit nothing
            for key in taken:
                del self.staged[key]
            stale = sorted({key[0] for key in self.staged if key[0] < epoch})
            if stale:  # a failed migration's rows (the controller's discard_staged may still be on its way)
                LOG.warning("worker %d: activating epoch %d discards rows staged under older epoch(s) %s",
                            self.worker, epoch, stale)
                self.discarded.update(stale)
                for key in [key for key in self.staged if key[0] < epoch]:
                    del self.staged[key]
            self.slot_rows[epoch] = rows
            self.experts[epoch] = experts
            self.max_epoch = max(self.max_epoch, epoch)
            self._publish_pool_rows()

    def discard_staged(self, epoch: int) -> dict[str, Any]:
        """Undo a failed migration to ``epoch``: drop the rows staged for it (and any older
        epoch's: an earlier failure's leftovers) and, if this worker activated it already (no
        router uses it yet), the epoch itself; their pool rows become free. ``epoch`` can never
        be staged or activated here again. Returns what was dropped."""
        with self._staging_lock:
            self.discarded.add(epoch)
            self.max_epoch = max(self.max_epoch, epoch)
            dropped = [key for key in self.staged if key[0] <= epoch]
            for key in dropped:
                del self.staged[key]
            activated = epoch in self.slot_rows
            if activated:
                if len(self.slot_rows) == 1:
                    raise RuntimeError(f"worker {self.worker}: epoch {epoch} is the only one it serves; "
                                       "a placement in service is never discarded")
                del self.slot_rows[epoch]
                del self.experts[epoch]
                self._publish_pool_rows()
        return {"worker": self.worker, "epoch": epoch, "staged_rows": len(dropped), "activated": activated}

    # ---- fault injection (tests only) -----------------------------------------------------------
    def inject_fault(self, point: str, times: int = 1) -> None:
        """Make the next ``times`` passes through worker fault ``point`` raise
        :class:`InjectedWorkerFault` (``WORKER_FAULT_POINTS``). For tests only."""
        if point not in WORKER_FAULT_POINTS:
            raise ValueError(f"unknown worker fault point {point!r}; choose one of {', '.join(WORKER_FAULT_POINTS)}")
        self._faults[point] = times

    def _fault(self, point: str) -> None:
        if self._faults.get(point, 0) > 0:
            self._faults[point] -= 1
            raise InjectedWorkerFault(f"worker {self.worker}: fault injected at {point!r} (ExpertWorker.inject_fault)")

    def _load_into_free_row(self, layer: int, expert: int, pending: list[list[int]]) -> int:
        """Read one expert of MoE layer ``layer`` from the checkpoint into a free pool row."""
        free = [row for row in self._free_rows(layer) if row not in set(pending[layer])]
        if not free:
            raise RuntimeError(f"worker {self.worker} layer {layer}: no free pool row for expert {expert}; "
                               "lower balancer.max_copies_per_rebalance")
        read_expert_into(Checkpoint(self.model_dir), self.config, self.config.moe_layers[layer], expert,
                         self.w13[layer][free[0]], self.w2[layer][free[0]])
        torch.autograd.graph.increment_version(self.w13[layer])  # (read_expert_into bypasses torch)
        torch.autograd.graph.increment_version(self.w2[layer])
        return free[0]

    def retire(self, epochs_below: int) -> None:
        """Forget every epoch older than ``epochs_below``; their pool rows become free."""
        for epoch in [e for e in self.slot_rows if e < epochs_below]:
            del self.slot_rows[epoch]
            del self.experts[epoch]
        self._publish_pool_rows()

    def reset_comms(self) -> None:
        """Abort every communicator (a peer failed); the supervisor builds new groups next."""
        self._cancel_copies("the groups were reset")
        self._drop_pending()
        exchange, self.exchange = self.exchange, None
        for comm in [*([exchange.comm] if exchange else []), *([self.migration_comm] if self.migration_comm else [])]:
            comm.abort()
        self.migration_comm = None

    def shutdown(self) -> None:
        exchange, self.exchange = self.exchange, None
        if exchange is not None:
            exchange.comm.close()
