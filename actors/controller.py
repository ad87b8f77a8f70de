"""The controller actor: reads load telemetry, replicates and migrates hot experts, live.

Every ``poll_interval_s`` it pulls each router's per-step logical-expert loads into a sliding
window; every ``interval_steps`` router steps it asks :func:`raymoe.moe.rebalance_policy.decide`
whether a new placement pays. A rebalance runs layer by layer:

1. copy the layer's new experts worker to worker (from a live copy, through Ray's object
   store), into free rows of the destination's weight pool;
2. every worker starts serving the next epoch (old and new epochs side by side);
3. every router switches to the new table at a step boundary (weights and routing change
   together: a dispatch never sees a half-updated layer);
4. workers forget the old epoch: no step can use it any more.

Serving goes on throughout. One controller per deployment; it owns no weights, so it can
be restarted and rebuild its state from the routers and workers.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Any

import numpy as np
import ray

from raymoe.moe.placement import PlacementTable
from raymoe.moe.rebalance_policy import RebalanceDecision, RebalancePolicy, decide, placement_balancedness

CALL_TIMEOUT_S = 60.0


class Controller:
    def __init__(self, routers: list[Any], workers: list[Any], placement: dict[str, Any], policy: RebalancePolicy,
                 window_steps: int, interval_steps: int, poll_interval_s: float, expert_bytes: int, enabled: bool):
        self.routers = routers
        self.workers = workers
        self.placement = PlacementTable.from_dict(placement)
        self.policy = policy
        self.window: deque = deque(maxlen=window_steps)  # [L, E] per router step
        self.interval_steps = interval_steps
        self.poll_interval_s = poll_interval_s
        self.expert_bytes = expert_bytes
        self.cursors = [0] * len(routers)
        self.steps_since_decision = 0
        self.rebalances = 0
        self.migration_seconds = 0.0
        self.bytes_moved = 0
        self.last: dict[str, Any] | None = None
        self.last_decision: RebalanceDecision | None = None
        self._rebalance_lock = threading.Lock()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="raymoe-controller", daemon=True)
        if enabled:
            self._thread.start()

    # ---- telemetry ----------------------------------------------------------------------
    def poll(self) -> int:
        """Pull new steps' loads from every router; returns how many steps arrived."""
        answers = ray.get([r.expert_loads_since.remote(c) for r, c in zip(self.routers, self.cursors)],
                          timeout=CALL_TIMEOUT_S)
        arrived = 0
        for index, (cursor, loads) in enumerate(answers):
            self.cursors[index] = cursor
            self.window.extend(loads)
            arrived += len(loads)
        self.steps_since_decision += arrived
        return arrived

    def window_load(self) -> np.ndarray:
        """``[L, E]`` tokens per logical expert over the window."""
        if not self.window:
            return np.zeros((self.placement.num_layers, self.placement.num_experts))
        return np.sum(np.stack(self.window), axis=0)

    def _loop(self) -> None:
        while not self._stopped.wait(self.poll_interval_s):
            try:
                self.poll()
                if self.steps_since_decision >= self.interval_steps:
                    self.rebalance(force=False)
            except Exception as error:  # keep controlling; the last error is in status()
                self.last = {"error": f"{type(error).__name__}: {error}", "time": time.time()}

    # ---- rebalancing --------------------------------------------------------------------
    def rebalance(self, force: bool = True) -> dict[str, Any]:
        """Decide on the current window and, if it pays (or ``force``), migrate. Returns a report."""
        with self._rebalance_lock:
            self.poll()
            self.steps_since_decision = 0
            decision = decide(self.window_load(), self.placement, self.policy, force=force)
            self.last_decision = decision
            report: dict[str, Any] = {
                "time": time.time(), "rebalanced": decision.rebalance, "reason": decision.reason,
                "balancedness_before": decision.current_balancedness,
                "balancedness_predicted": decision.predicted_balancedness,
            }
            if decision.rebalance:
                report.update(self._execute(decision))
                self.window.clear()  # the old window describes the old placement's history only
            if decision.rebalance or force:
                self.last = report
            return report

    def _execute(self, decision: RebalanceDecision) -> dict[str, Any]:
        started = time.perf_counter()
        target = decision.result.placement
        copies = decision.result.migration.copies
        slots = self.placement.slots_per_worker
        for layer in sorted({copy.layer for copy in copies}):
            current = self.placement
            layer_table = current.with_layer(layer, target.phy2log[layer])
            # Step 1: copy the layer's new experts from live peers into free pool rows.
            staged = []
            for copy in (c for c in copies if c.layer == layer):
                weights = self.workers[copy.source_worker].export_expert.remote(current.epoch, layer, copy.expert)
                staged.append(self.workers[copy.destination_worker].stage_expert.remote(
                    layer_table.epoch, layer, copy.destination_slot % slots, weights))
            ray.get(staged, timeout=CALL_TIMEOUT_S)
            # Step 2: workers serve the new epoch beside the old one.
            ray.get([w.activate.remote(layer_table.epoch, current.epoch, layer_table.to_dict()) for w in self.workers],
                    timeout=CALL_TIMEOUT_S)
            # Step 3: routers switch at their next step boundary.
            ray.get([r.set_placement.remote(layer_table.to_dict()) for r in self.routers], timeout=CALL_TIMEOUT_S)
            # Step 4: no step can use the old epoch any more: free its rows.
            ray.get([w.retire.remote(layer_table.epoch) for w in self.workers], timeout=CALL_TIMEOUT_S)
            self.placement = layer_table
        seconds = time.perf_counter() - started
        moved = len(copies) * self.expert_bytes
        self.rebalances += 1
        self.migration_seconds += seconds
        self.bytes_moved += moved
        return {
            "epoch": self.placement.epoch, "seconds": seconds, "bytes_moved": moved, "copies": len(copies),
            "cross_node_copies": sum(not c.same_node for c in copies),
            "moved": [c.to_dict() for c in copies],
        }

    # ---- status ---------------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        load = self.window_load()
        overall, worker_loads = placement_balancedness(load, self.placement)
        per_layer = [
            float(np.mean(row) / np.max(row)) if np.max(row) > 0 else 1.0 for row in worker_loads
        ]
        return {
            "epoch": self.placement.epoch,
            "balancedness": overall,
            "balancedness_min": min(per_layer) if per_layer else 1.0,
            "balancedness_per_layer": per_layer,
            "window_steps": len(self.window),
            "worker_load": worker_loads.sum(axis=0).tolist(),
            "placement": self.placement.phy2log.tolist(),
            "slots_per_worker": self.placement.slots_per_worker,
            "worker2node": self.placement.worker2node.tolist(),
            "rebalances": self.rebalances,
            "migration_seconds": self.migration_seconds,
            "bytes_moved": self.bytes_moved,
            "last_rebalance": self.last,
            "last_decision": None if self.last_decision is None else {
                "rebalance": self.last_decision.rebalance, "reason": self.last_decision.reason,
                "balancedness": self.last_decision.current_balancedness,
                "predicted": self.last_decision.predicted_balancedness},
        }

    def stop(self) -> None:
        self._stopped.set()
