"""Router-side telemetry: what the expert-parallel layers routed, moved and spent.

Legend: L MoE layers, E logical experts, P physical slots, W workers, Lr the layers recorded in
a step, Ns steps read from the ring.

Cumulative counters (since start) and a ring buffer of the last ``capacity`` steps, all
plain numbers so they travel through Ray as JSON-friendly dicts:

- per layer and physical slot: tokens routed (kept assignments);
- per worker: rows received, payload bytes sent and received, assignments dropped;
- per step: seconds in the dense part, dispatch, expert compute (slowest worker) and combine.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch



@dataclass(frozen=True)
class LayerTraffic:
    """What one layer's exchange moved and cost, as the router saw it."""

    rows_per_worker: list[int]  # [W] over every worker of the placement
    bytes_sent: int  # dispatch headers + rows, as sent
    bytes_received: int  # combine rows + trailers, as received
    dispatch_s: float  # planning the rows and packing them
    exchange_s: float  # sends, receives and the workers' compute, until the last sum arrived


@dataclass
class StepRecord:
    epoch: int = 0
    dense_s: float = 0.0  # everything but the MoE layers' exchange: attention, gates, sampling
    dispatch_s: float = 0.0  # planning and packing rows
    expert_s: float = 0.0  # the slowest worker's expert compute, summed over layers
    combine_s: float = 0.0  # moving rows and sums (the exchange minus the expert compute)
    tokens: int = 0
    rows_sent: int = 0
    started: float = 0.0  # time.perf_counter() at the step's start (intervals between steps show
    # what the step loop spends outside the step: inbox, delivery, waiting for work)


@dataclass
class Telemetry:
    num_layers: int
    num_slots: int
    num_workers: int
    capacity: int = 1000
    slot_tokens: np.ndarray = field(init=False)  # [L, P] cumulative
    worker_rows: np.ndarray = field(init=False)  # [W]
    worker_bytes_sent: np.ndarray = field(init=False)  # [W] router -> worker payload bytes
    worker_bytes_received: np.ndarray = field(init=False)  # [W] worker -> router payload bytes
    worker_dropped: np.ndarray = field(init=False)  # [W] assignments dropped for experts homed there
    num_experts: int = 0
    meta_bytes: int = 0
    bytes_sent: int = 0  # every dispatch message as sent (headers, rows, slots, weights)
    bytes_received: int = 0  # every combine message as received (sums, trailers)
    dropped: int = 0
    num_steps: int = 0
    steps: deque = field(init=False)
    expert_loads: deque = field(init=False)  # (step index, [L, E] kept assignments per logical expert)
    # The step thread writes; actor calls (get_telemetry, expert_loads) read from other threads.
    # The lock covers what a reader walks or copies, so a read never sees a ring mid-append
    # (a CI run failed with "deque mutated during iteration").
    _lock: threading.Lock = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.slot_tokens = np.zeros((self.num_layers, self.num_slots), dtype=np.int64)
        self.worker_rows = np.zeros(self.num_workers, dtype=np.int64)
        self.worker_bytes_sent = np.zeros(self.num_workers, dtype=np.int64)
        self.worker_bytes_received = np.zeros(self.num_workers, dtype=np.int64)
        self.worker_dropped = np.zeros(self.num_workers, dtype=np.int64)
        self.steps = deque(maxlen=self.capacity)
        self.expert_loads = deque(maxlen=self.capacity)
        self._lock = threading.Lock()
        self._every_layer = list(range(self.num_layers))  # a step's layers when each ran once, in order
        self._load_index_of: tuple[np.ndarray, np.ndarray] | None = None  # (phy2log, _load_index of it)
        self.begin_step()

    def resize(self, num_slots: int, num_workers: int) -> None:
        """A resized expert pool (workers appended or removed at the end): the per-slot and
        per-worker counters keep the workers that stay, new ones start at zero. Call it between
        steps (the router holds its engine lock)."""
        def fit(array: np.ndarray, size: int) -> np.ndarray:
            out = np.zeros(array.shape[:-1] + (size,), dtype=array.dtype)
            keep = min(size, array.shape[-1])
            out[..., :keep] = array[..., :keep]
            return out

        with self._lock:
            self.slot_tokens = fit(self.slot_tokens, num_slots)
            self.worker_rows = fit(self.worker_rows, num_workers)
            self.worker_bytes_sent = fit(self.worker_bytes_sent, num_workers)
            self.worker_bytes_received = fit(self.worker_bytes_received, num_workers)
            self.worker_dropped = fit(self.worker_dropped, num_workers)
            self.num_slots, self.num_workers = num_slots, num_workers

    def record_layer(self, layer: int, slot_counts: list[int], dropped_per_worker, traffic: LayerTraffic,
                     row_bytes: int, meta_row_bytes: int, num_tokens: int) -> None:
        """One MoE layer of the current step, kept as given and added up once, in :meth:`end_step`
        (a few list appends per layer instead of a dozen small numpy calls). ``slot_counts [P]``
        are host ints; ``dropped_per_worker [W]`` (or None) is a device tensor, read at the end of
        the step with the others, not once per layer."""
        self._layer_counts.append((layer, slot_counts, traffic.rows_per_worker, dropped_per_worker))
        self._row_bytes, self._meta_row_bytes = row_bytes, meta_row_bytes
        self._bytes_sent += traffic.bytes_sent
        self._bytes_received += traffic.bytes_received
        self._current.dispatch_s += traffic.dispatch_s
        self._current.combine_s += traffic.exchange_s  # the expert part comes out in end_step
        tokens = self._layer_tokens
        tokens[layer] = tokens.get(layer, 0) + num_tokens  # (a micro-batched step: each half adds its own)

    def begin_step(self, started: float = 0.0) -> None:
        self._current = StepRecord(started=started)
        self._layer_counts: list = []
        self._layer_tokens: dict[int, int] = {}
        self._bytes_sent = self._bytes_received = 0

    def end_step(self, dense_s: float, expert_s: float, epoch: int, phy2log: np.ndarray) -> None:
        """Close the step. ``phy2log [L, P]``: the step's placement (the logical expert in each
        physical slot, -1 for none), which turns the layers' slot counts into expert loads."""
        self._current.dense_s = dense_s
        self._current.expert_s = expert_s
        self._current.combine_s = max(0.0, self._current.combine_s - expert_s)
        self._current.epoch = epoch
        if self._layer_tokens:  # the step's tokens: a layer's, both halves of a micro-batched step together
            self._current.tokens = max(self._layer_tokens.values())
        load = np.zeros((self.num_layers, self.num_experts), dtype=np.int64)
        records = self._layer_counts
        if records:
            # (a layer appears twice in a micro-batched step, once a half: added up)
            layer_list = [layer for layer, _, _, _ in records]
            every_layer_once = layer_list == self._every_layer
            layers = None if every_layer_once else np.array(layer_list, dtype=np.intp)
            counts = np.array([slots for _, slots, _, _ in records], dtype=np.int64)  # [Lr, P]
            rows = np.array([per_worker for _, _, per_worker, _ in records], dtype=np.int64).sum(axis=0)  # [W]
            index = self._load_index(phy2log)  # a logical expert's tokens: the counts of the slots holding it
            flat = index.reshape(-1) if every_layer_once else index[layers].reshape(-1)
            cells = self.num_layers * self.num_experts
            load = np.bincount(flat, weights=counts.reshape(-1), minlength=cells + 1)[:cells].reshape(
                self.num_layers, self.num_experts).astype(np.int64)
            self._current.rows_sent = int(rows.sum())
        dropped_tensors = [dropped.to(torch.int64) for _, _, _, dropped in records if dropped is not None]
        if dropped_tensors:  # the step's one host read of its drop counts
            flat_dropped = np.asarray(torch.cat(dropped_tensors).tolist(), dtype=np.int64).reshape(-1, self.num_workers)
        with self._lock:
            if records:
                if every_layer_once:
                    self.slot_tokens += counts
                else:
                    np.add.at(self.slot_tokens, layers, counts)
                self.worker_rows += rows
                self.worker_bytes_sent += rows * self._row_bytes
                self.worker_bytes_received += rows * self._row_bytes
                self.meta_bytes += int(rows.sum()) * self._meta_row_bytes
                self.bytes_sent += self._bytes_sent
                self.bytes_received += self._bytes_received
            if dropped_tensors:
                self.worker_dropped += flat_dropped.sum(axis=0)
                self.dropped += int(flat_dropped.sum())
            self.steps.append(self._current)
            self.expert_loads.append((self.num_steps, load))
            self.num_steps += 1
        self.begin_step()

    def _load_index(self, phy2log: np.ndarray) -> np.ndarray:
        """``[L, P]``: each physical slot's cell ``layer * E + expert`` in a step's flat ``[L, E]``
        loads (``L * E`` for an empty slot: counted nowhere), made once per placement."""
        cached = self._load_index_of
        if cached is not None and cached[0] is phy2log:
            return cached[1]
        layers = np.arange(phy2log.shape[0], dtype=np.intp)[:, None]
        index = np.where(phy2log >= 0, layers * self.num_experts + phy2log, self.num_layers * self.num_experts)
        self._load_index_of = (phy2log, index.astype(np.intp))
        return self._load_index_of[1]

    def expert_loads_since(self, cursor: int) -> tuple[int, np.ndarray]:
        """Per-step logical-expert loads of the steps numbered ``>= cursor`` still in the ring.

        Returns the next cursor and ``[Ns, L, E]``.
        """
        with self._lock:
            loads = [load for index, load in self.expert_loads if index >= cursor]
            num_steps = self.num_steps
        stacked = np.stack(loads) if loads else np.zeros((0, self.num_layers, self.num_experts), dtype=np.int64)
        return num_steps, stacked

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return self._snapshot_locked()

    def _snapshot_locked(self) -> dict[str, Any]:
        return {
            "slot_tokens": self.slot_tokens.tolist(),
            "worker_rows": self.worker_rows.tolist(),
            "worker_bytes_sent": self.worker_bytes_sent.tolist(),
            "worker_bytes_received": self.worker_bytes_received.tolist(),
            "meta_bytes": self.meta_bytes,
            "bytes_sent": self.bytes_sent,
            "bytes_received": self.bytes_received,
            "dropped": self.dropped,
            "worker_dropped": self.worker_dropped.tolist(),
            "steps": [asdict(s) for s in self.steps],
        }
