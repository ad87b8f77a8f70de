"""Router-side telemetry: what the expert-parallel layers routed, moved and spent.

Legend: L MoE layers, P physical slots, W workers.

Cumulative counters (since start) and a ring buffer of the last ``capacity`` steps, all
plain numbers so they travel through Ray as JSON-friendly dicts:

- per layer and physical slot: tokens routed (kept assignments);
- per worker: rows received, payload bytes sent and received, assignments dropped;
- per step: seconds in the dense part, dispatch, expert compute (slowest worker) and combine.
"""

from __future__ import annotations

from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from raymoe.engine.ep_exchange import LayerTraffic
from raymoe.moe.plan import DispatchPlan


@dataclass
class StepRecord:
    epoch: int = 0
    dense_s: float = 0.0
    dispatch_s: float = 0.0
    expert_s: float = 0.0
    combine_s: float = 0.0
    tokens: int = 0
    rows_sent: int = 0


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
    dropped: int = 0
    num_steps: int = 0
    steps: deque = field(init=False)
    expert_loads: deque = field(init=False)  # (step index, [L, E] kept assignments per logical expert)

    def __post_init__(self) -> None:
        self.slot_tokens = np.zeros((self.num_layers, self.num_slots), dtype=np.int64)
        self.worker_rows = np.zeros(self.num_workers, dtype=np.int64)
        self.worker_bytes_sent = np.zeros(self.num_workers, dtype=np.int64)
        self.worker_bytes_received = np.zeros(self.num_workers, dtype=np.int64)
        self.worker_dropped = np.zeros(self.num_workers, dtype=np.int64)
        self.steps = deque(maxlen=self.capacity)
        self.expert_loads = deque(maxlen=self.capacity)
        self._current = StepRecord()
        self._current_load = np.zeros((self.num_layers, self.num_experts), dtype=np.int64)

    def record_layer(
        self, layer: int, plan: DispatchPlan, traffic: LayerTraffic, row_bytes: int, dropped_per_worker: np.ndarray,
        expert_tokens: np.ndarray,
    ) -> None:
        """One MoE layer of the current step; drops are charged to the expert's first replica's worker."""
        self.slot_tokens[layer] += plan.slot_counts.numpy()
        rows = np.asarray(traffic.rows_per_worker, dtype=np.int64)
        self.worker_rows += rows
        self.worker_bytes_sent += rows * row_bytes
        self.worker_bytes_received += rows * row_bytes
        self.meta_bytes += traffic.meta_bytes
        self.dropped += plan.num_dropped
        self.worker_dropped += dropped_per_worker
        self._current_load[layer] += expert_tokens
        self._current.dispatch_s += traffic.dispatch_s
        self._current.combine_s += traffic.combine_s
        self._current.tokens = plan.num_tokens
        self._current.rows_sent += int(rows.sum())

    def begin_step(self) -> None:
        self._current = StepRecord()
        self._current_load = np.zeros((self.num_layers, self.num_experts), dtype=np.int64)

    def end_step(self, dense_s: float, worker_results: list[Any], epoch: int) -> None:
        self._current.dense_s = dense_s
        self._current.expert_s = max((sum(r["compute_s"]) for r in worker_results), default=0.0)
        self._current.epoch = epoch
        self.steps.append(self._current)
        self.expert_loads.append((self.num_steps, self._current_load))
        self.num_steps += 1
        self._current = StepRecord()
        self._current_load = np.zeros((self.num_layers, self.num_experts), dtype=np.int64)

    def expert_loads_since(self, cursor: int) -> tuple[int, np.ndarray]:
        """Per-step logical-expert loads of the steps numbered ``>= cursor`` still in the ring.

        Returns the next cursor and ``[n, L, E]``.
        """
        loads = [load for index, load in self.expert_loads if index >= cursor]
        stacked = np.stack(loads) if loads else np.zeros((0, self.num_layers, self.num_experts), dtype=np.int64)
        return self.num_steps, stacked

    def snapshot(self) -> dict[str, Any]:
        return {
            "slot_tokens": self.slot_tokens.tolist(),
            "worker_rows": self.worker_rows.tolist(),
            "worker_bytes_sent": self.worker_bytes_sent.tolist(),
            "worker_bytes_received": self.worker_bytes_received.tolist(),
            "meta_bytes": self.meta_bytes,
            "dropped": self.dropped,
            "worker_dropped": self.worker_dropped.tolist(),
            "steps": [asdict(s) for s in self.steps],
        }
