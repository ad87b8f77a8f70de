"""The controller actor: reads load telemetry, replicates and migrates hot experts, live.

Every ``poll_interval_s`` it pulls each router's per-step logical-expert loads into a sliding
window; every ``interval_steps`` router steps it asks :func:`raymoe.moe.rebalance_policy.decide`
whether a new placement pays. A rebalance runs layer by layer:

1. copy the layer's new experts worker to worker (from a live copy) with one all-to-all-v on
   the workers' migration group (NCCL on GPUs, gloo on CPUs; separate from dispatch/combine),
   into free rows of the destination's weight pool; each worker runs it in its serving loop
   between the same two EP collectives, at a mark the routers deliver in an idle tick
   (``_copy_layer``), so every rank issues the two communicators' collectives in one order;
2. every worker starts serving the next epoch (old and new epochs side by side);
3. every router switches to the new table at a step boundary (weights and routing change
   together: a dispatch never sees a half-updated layer);
4. workers forget the old epoch: no step can use it any more.

Serving goes on throughout. One controller per deployment; it owns no weights, so it can
be restarted and rebuild its state from the routers and workers.

A migration that fails (a worker's copy or activate raises, or a fault point fires) is
undone before any router sees its epoch: every worker discards what it staged or activated
for that epoch, the migration group is rebuilt (no full recovery while every worker is
alive), and the placement in service stays as it was. Every epoch is new (never one staged,
discarded or served before), so a retry cannot meet a failed try's rows.

Failure recovery (rebuilding the groups after a failed step, serving on replicas,
re-including restarted workers) is :class:`raymoe.actors.recovery.Recovery`, which this
actor inherits: ``recover`` is one of its calls, and a rebalance waits while workers are
being restarted.
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from typing import Any

import numpy as np
import ray

from raymoe.actors.recovery import (CALL_TIMEOUT_S, LOST, PING_TIMEOUT_S, RECOVERY_FAULT_POINTS, Recovery, _describe,
                                    _gather)
from raymoe.actors.resize import RESIZE_FAULT_POINTS, Resize
from raymoe.actors.router_resize import RouterResize
from raymoe.actors.autoscaler import Autoscaler
from raymoe.actors.expert_worker import join_mark, migration_mark
from raymoe.actors.self_heal import HEAL_FAULT_POINTS, SelfHeal
from raymoe.moe.autoscale_policy import AutoscalePolicy
from raymoe.moe.placement import PlacementTable
from raymoe.moe.rebalance_policy import RebalanceDecision, RebalancePolicy, decide, placement_balancedness

MIGRATION_TIMEOUT_S = 60.0  # deadline of one layer's copy collective (weights are large)
# Where a test may make the controller fail on purpose (inject_fault): in recovery
# (RECOVERY_FAULT_POINTS: loading the placement into a restarted worker, and joining the
# groups that re-include it); and in a rebalance's layer: before the copies, inside them
# (one worker fails after staging its first copy, or never enters the copy collective,
# leaving its peers waiting there), after them before any worker activates, and inside
# activate (one worker fails, the others have activated).
REBALANCE_FAULT_POINTS = ("rebalance_before_migrate", "rebalance_during_migrate", "rebalance_migrate_peer_missing",
                          "rebalance_before_activate", "rebalance_during_activate")
FAULT_POINTS = (*RECOVERY_FAULT_POINTS, *REBALANCE_FAULT_POINTS, *RESIZE_FAULT_POINTS, *HEAL_FAULT_POINTS)
# How long a failed migration's cleanup waits for the calls still running in it (the aborted
# copy collective makes them fail at once) and for each worker's answer.
MIGRATION_CLEANUP_WAIT_S = 10.0
# The decisions and outcomes status()["counters"] counts, so that a test can tell "it decided
# and skipped" from "it never decided", and "it retried" from "it worked the first time".
COUNTERS = ("rebalance_decisions_taken", "rebalance_decisions_skipped", "rebalances_deferred", "recoveries",
            "recoveries_on_replicas", "reinclude_attempts", "reinclude_failures", "reincludes",
            "reinclude_rollbacks", "repeated_step_failures", "rebalance_failures", "migration_group_rebuilds",
            "reload_timeouts", "resizes", "resizes_refused", "resize_rollbacks", "routers_left_out",
            "router_reincludes", "router_reinclude_failures", "live_switch_failures")


class InjectedFault(RuntimeError):
    """Raised at a fault point armed by :meth:`Controller.inject_fault` (tests only)."""


class MigrationFailed(RuntimeError):
    """A rebalance's migration failed and a worker was lost in it: its cleanup is left to recovery."""


class Controller(Recovery, Resize, RouterResize, Autoscaler, SelfHeal):
    def __init__(self, routers: list[Any], workers: list[Any], placement: dict[str, Any], policy: RebalancePolicy,
                 window_steps: int, interval_steps: int, poll_interval_s: float, enabled: bool,
                 groups: dict[str, Any] | None = None, worker_spec: Any = None,
                 autoscale: AutoscalePolicy | None = None, router_spec: Any = None):
        self._init_recovery()  # generation, recoveries, degraded, ... (actors/recovery.py)
        self._init_resize(worker_spec)  # how to start workers, the resize lock (actors/resize.py)
        self._init_router_resize(router_spec)  # how to start routers (actors/router_resize.py)
        self.routers = routers
        # How to rebuild communicator groups: router ids, backend, deadline (see recover()).
        self.groups = groups or {}
        self.counters = dict.fromkeys(COUNTERS, 0)
        self._counters_lock = threading.Lock()
        self._faults: dict[str, int] = {}  # fault point -> how many more times it fails
        # A worker Ray has already restarted answers pings; its new pid gives it away.
        worker_infos = ray.get([w.info.remote() for w in workers], timeout=CALL_TIMEOUT_S)
        self.worker_pids = [info["pid"] for info in worker_infos]
        # Every worker's pool has the same rows (the reload deadline's bytes); a worker whose
        # reload failed midway may report less.
        self.pool_bytes = max(info.get("pool_bytes", 0) for info in worker_infos)
        self.workers = workers
        self.placement = PlacementTable.from_dict(placement)
        self.policy = policy
        self.window: deque = deque(maxlen=window_steps)  # [L, E] per router step
        self.interval_steps = interval_steps
        self.poll_interval_s = poll_interval_s
        self.cursors = [0] * len(routers)
        self.steps_since_decision = 0
        self.rebalances = 0
        self.migration_seconds = 0.0
        self.bytes_moved = 0
        self.last: dict[str, Any] | None = None
        self.last_decision: RebalanceDecision | None = None
        self._rebalance_lock = threading.Lock()
        self._stopped = threading.Event()
        self.enabled = enabled
        router_infos = ray.get([r.info.remote() for r in routers], timeout=CALL_TIMEOUT_S)
        self.router_pids = [info["pid"] for info in router_infos]
        self.generation = max(info["comm_generation"] for info in router_infos)  # > 0 after a restart
        # Ray's was_current_actor_reconstructed, minus its deprecated `actor_id` read (a RayDeprecationWarning)
        from ray._private.state import actors as actor_table

        if actor_table(actor_id=ray.get_runtime_context().get_actor_id()).get("NumRestarts", 0):
            self.placement = self._placement_from_workers()  # a restarted controller: the workers know
        # The largest epoch ever used (staged, discarded or served): every new table's epoch is
        # larger, so no epoch is reused, also by a restarted controller.
        self.max_epoch = max([self.placement.epoch, *(info.get("max_epoch", 0) for info in worker_infos)])
        if self.groups:
            self._join_migration_group()
        self._thread = threading.Thread(target=self._loop, name="raymoe-controller", daemon=True)
        self._thread.start()
        self.counters["workers_replaced"] = 0  # dead workers given a new actor (actors/self_heal.py)
        self._init_self_heal()
        self._init_autoscale(autoscale)  # the autoscale: policy's thread, if any (actors/autoscaler.py)

    # ---- telemetry ----------------------------------------------------------------------
    def poll(self) -> int:
        """Pull new steps' loads from every router; returns how many steps arrived."""
        indices = self.router_members()  # (a router left out of the group may be restarting)
        answers = ray.get([self.routers[i].expert_loads_since.remote(self.cursors[i]) for i in indices],
                          timeout=CALL_TIMEOUT_S)
        arrived = 0
        for index, (cursor, loads) in zip(indices, answers):
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
                try:
                    self.poll()
                except LOST:  # a router died: once Ray restarts it, rebuild the groups with it
                    self.recover(self.generation)
                    continue
                if self.enabled and self.steps_since_decision >= self.interval_steps:
                    self.rebalance(force=False)
            except Exception as error:  # keep controlling; the last error is in status()
                self.last = {"error": f"{type(error).__name__}: {error}", "time": time.time()}

    def _placement_from_workers(self) -> PlacementTable:
        """Rebuild the placement in service from what every worker serves (its latest epoch)."""
        infos = ray.get([w.info.remote() for w in self.workers], timeout=CALL_TIMEOUT_S)
        phy2log = [sum((info["experts"][layer] for info in infos), []) for layer in range(self.placement.num_layers)]
        epoch = max(max(info["epochs"]) for info in infos)
        worker2node = self.placement.worker2node
        if len(worker2node) != len(infos):  # resized since deploy: number the workers' nodes afresh
            nodes = {info["node_id"]: None for info in infos}
            index = {node: i for i, node in enumerate(nodes)}
            worker2node = [index[info["node_id"]] for info in infos]
        return PlacementTable.from_phy2log(phy2log, self.placement.slots_per_worker, self.placement.num_experts,
                                           worker2node, epoch)

    # ---- rebalancing --------------------------------------------------------------------
    def rebalance(self, force: bool = True) -> dict[str, Any]:
        """Decide on the current window and, if it pays (or ``force``), migrate. Returns a report."""
        with self._rebalance_lock:
            if self.degraded is not None:
                self._count("rebalances_deferred")
                return {"time": time.time(), "rebalanced": False,
                        "reason": f"workers {self.degraded['lost']} are being restarted; rebalancing waits"}
            self.poll()
            self.steps_since_decision = 0
            decision = decide(self.window_load(), self.placement, self.policy, force=force)
            self.last_decision = decision
            self._count("rebalance_decisions_taken" if decision.rebalance else "rebalance_decisions_skipped")
            report: dict[str, Any] = {
                "time": time.time(), "rebalanced": decision.rebalance, "reason": decision.reason,
                "balancedness_before": decision.current_balancedness,
                "balancedness_predicted": decision.predicted_balancedness,
            }
            if decision.rebalance:
                report.update(self._execute(decision, report))
                if report["rebalanced"]:
                    self.window.clear()  # the old window describes the old placement's history only
            if decision.rebalance or force:
                self.last = report
            return report

    def _new_table(self, phy2log: np.ndarray) -> PlacementTable:
        """``phy2log`` over the placement's workers, in an epoch never used before."""
        with self._counters_lock:  # a rebalance and a recovery may both ask
            self.max_epoch += 1
            epoch = self.max_epoch
        current = self.placement
        return PlacementTable.from_phy2log(phy2log, current.slots_per_worker, current.num_experts,
                                           current.worker2node, epoch)

    def _execute(self, decision: RebalanceDecision, report: dict[str, Any]) -> dict[str, Any]:
        """Migrate to ``decision``'s placement layer by layer. A layer that fails is undone
        (``_undo_migration``) and ends the rebalance: the report says so, with the error, and
        the layers done before it stay in service. Raises :class:`MigrationFailed` (after
        recording the report) only when a worker was lost in it: recovery cleans up then."""
        started = time.perf_counter()
        target = decision.result.placement
        copies = decision.result.migration.copies
        changed = [layer for layer in range(target.num_layers)
                   if not np.array_equal(target.phy2log[layer], self.placement.phy2log[layer])]
        moved, epochs = 0, []
        for done, layer in enumerate(changed):  # a layer may change without copies (a replica dropped or re-pointed)
            current = self.placement
            phy2log = current.phy2log.copy()
            phy2log[layer] = target.phy2log[layer]
            layer_table = self._new_table(phy2log)
            progress = {"step": "migrate", "routers_told": False}
            try:
                moved += self._migrate_layer(current, layer_table, layer, [c for c in copies if c.layer == layer],
                                             progress)
            except Exception as error:
                failure = self._migration_failed(error, current, layer_table, layer, progress)
                if progress["routers_told"]:
                    self.placement = layer_table  # some routers may serve it already: it is in service
                    epochs.append(layer_table.epoch)
                seconds = time.perf_counter() - started
                self.migration_seconds += seconds
                self.bytes_moved += moved
                report.update(failure, rebalanced=False, epoch=self.placement.epoch, epochs=epochs, seconds=seconds,
                              bytes_moved=moved, layers_done=done + progress["routers_told"],
                              layers_to_do=len(changed))
                report["reason"] = f"migration failed: {failure['error']}"
                if failure["workers_lost"]:
                    self.last = report
                    raise MigrationFailed(report["reason"]) from None
                return report
            self.placement = layer_table
            epochs.append(layer_table.epoch)
        seconds = time.perf_counter() - started
        self.rebalances += 1
        self.migration_seconds += seconds
        self.bytes_moved += moved
        return {
            "epoch": self.placement.epoch, "epochs": epochs, "seconds": seconds, "bytes_moved": moved,
            "copies": len(copies), "cross_node_copies": sum(not c.same_node for c in copies),
            "moved": [c.to_dict() for c in copies],
        }

    def _migrate_layer(self, current: PlacementTable, table: PlacementTable, layer: int, copies: list[Any],
                       progress: dict[str, Any]) -> int:
        """One layer's four steps; ``progress`` tells a failure how far it got. Returns bytes moved."""
        slots, workers = self.placement.slots_per_worker, self.workers
        # Step 1: every worker joins one all-to-all-v on the migration group that moves the
        # layer's new experts from live peers into free pool rows. Sends and receives keep the
        # copies' order, so the k-th copy a source sends a destination is the k-th it receives.
        sends = [[(c.destination_worker, c.expert) for c in copies if c.source_worker == w]
                 for w in range(len(workers))]
        receives = [[(c.source_worker, c.destination_slot % slots, c.expert) for c in copies
                     if c.destination_worker == w] for w in range(len(workers))]
        self._fault("rebalance_before_migrate")
        # (tests: one worker fails inside the copy; the last that receives, so the others stage theirs)
        receivers = [w for w in range(len(workers)) if receives[w]] or [len(workers) - 1]
        for point, worker_point in (("rebalance_during_migrate", "migrate_staged"),
                                    ("rebalance_migrate_peer_missing", "migrate_enter")):
            if self._take_fault(point):
                ray.get(workers[receivers[-1]].inject_fault.remote(worker_point), timeout=CALL_TIMEOUT_S)
        moved = sum(self._copy_layer(workers, [(current.epoch, layer, table.epoch, sends[i], receives[i])
                                               for i in range(len(workers))],
                                     migration_mark(table.epoch, layer), MIGRATION_TIMEOUT_S, progress))
        # Step 2: workers serve the new epoch beside the old one.
        progress["step"] = "activate"
        self._fault("rebalance_before_activate")
        if self._take_fault("rebalance_during_activate"):
            ray.get(workers[-1].inject_fault.remote("activate"), timeout=CALL_TIMEOUT_S)
        progress["calls"] = [w.activate.remote(table.epoch, current.epoch, table.to_dict()) for w in workers]
        _gather(progress["calls"])
        # Step 3: routers switch at their next step boundary. From here on the new epoch may
        # be in service: a failure no longer undoes it.
        progress.update(step="set_placement", routers_told=True, calls=[])
        _gather([r.set_placement.remote(table.to_dict()) for r in self.group_routers()])
        # Step 4: no step can use the old epoch any more: free its rows.
        progress["step"] = "retire"
        _gather([w.retire.remote(table.epoch) for w in workers])
        return moved

    def _copy_layer(self, workers: list[Any], calls: list[tuple], mark: int, timeout_s: float,
                    progress: dict[str, Any] | None = None) -> list[int]:
        """One layer's copy collective on the migration group, ordered against the EP exchange
        the same way on every rank: every worker queues its part under ``mark`` (``calls[i]``:
        worker i's ``migrate`` arguments), and only then do the routers get the mark, which
        they send in an idle tick they all send in the same round; each serving worker runs
        the copy right after that tick (ExpertWorker.queue_migration). Returns each worker's
        bytes sent; the first failure raises at once (``progress["calls"]``: the waits, for
        the failure's cleanup)."""
        _gather([w.queue_migration.remote(mark, *args) for w, args in zip(workers, calls)])
        waits = [w.wait_migration.remote(mark, timeout_s) for w in workers]
        if progress is not None:
            progress["calls"] = waits
        _gather([r.mark_migration.remote(mark) for r in self.group_routers()])
        return _gather(waits, timeout_s + CALL_TIMEOUT_S)

    def _migration_failed(self, error: BaseException, current: PlacementTable, table: PlacementTable, layer: int,
                          progress: dict[str, Any]) -> dict[str, Any]:
        """Count and describe a failed layer; undo it unless routers may serve its epoch."""
        self._count("rebalance_failures")
        message = (f"{progress['step']} of layer {layer} to epoch {table.epoch} failed: {_describe(error)}")
        failure: dict[str, Any] = {"failed_step": progress["step"], "failed_layer": layer,
                                   "failed_epoch": table.epoch, "workers_lost": [], "rolled_back": False,
                                   "migration_group_rebuilt": False}
        if progress["routers_told"]:
            # Every worker activated the epoch and some routers may use it: it stays, and the
            # old one is retired by the next rebalance (its retire covers every older epoch).
            failure["error"] = f"{message}; epoch {table.epoch} is in service (routers may use it already)"
            return failure
        cleanup = self._undo_migration(table.epoch, progress.get("calls", []))
        failure.update(cleanup, rolled_back=True)
        notes = [f"the placement in service is unchanged (epoch {current.epoch})",
                 f"epoch {table.epoch} was discarded on every live worker and is never reused"]
        if cleanup["workers_lost"]:
            notes.append(f"workers {cleanup['workers_lost']} did not answer: recovery rebuilds the groups")
        elif cleanup["migration_group_rebuilt"]:
            notes.append("the migration group was rebuilt")
        notes += cleanup["cleanup_errors"]
        failure["error"] = f"{message}; " + "; ".join(notes)
        return failure

    def _undo_migration(self, epoch: int, calls: list[Any]) -> dict[str, Any]:
        """Undo a failed layer before any router saw ``epoch``: abort the copy collective
        (peers waiting in it fail at once), wait for the calls still running, make every
        worker discard what it staged or activated for ``epoch``, and join a new migration
        group. A worker that does not answer (or was restarted) is left to recovery: the
        others only discard, and recovery rebuilds every group."""
        errors: list[str] = []
        lost = []
        answers = [w.info.remote() for w in self.workers]
        for index, answer in enumerate(answers):
            try:
                if ray.get(answer, timeout=PING_TIMEOUT_S)["pid"] != self.worker_pids[index]:
                    lost.append(index)
            except Exception:  # dead, restarting or frozen: recovery's business
                lost.append(index)
        live = [w for w in range(len(self.workers)) if w not in lost]

        def each(call: str, *args: Any) -> list[Any]:
            refs = {w: getattr(self.workers[w], call).remote(*args) for w in live}
            answers = []
            for w, ref in refs.items():
                try:
                    answers.append(ray.get(ref, timeout=MIGRATION_CLEANUP_WAIT_S))
                except Exception as error:
                    errors.append(f"worker {w} {call}: {_describe(error)}")
            return answers

        if lost:  # (a staging call that ends later is refused: the epoch is discarded first)
            discarded = each("discard_staged", epoch)
            if calls:
                ray.wait(calls, num_returns=len(calls), timeout=MIGRATION_CLEANUP_WAIT_S)
            return {"workers_lost": lost, "migration_group_rebuilt": False, "discarded": discarded,
                    "cleanup_errors": errors}
        rebuilt = False
        with self._recover_lock:  # never beside a recovery's rebuild of the same group
            each("abort_migration")
            if calls:  # they end at once now
                ray.wait(calls, num_returns=len(calls), timeout=MIGRATION_CLEANUP_WAIT_S)
            discarded = each("discard_staged", epoch)
            if self.groups:
                try:
                    self._join_migration_group()
                    rebuilt = True
                    self._count("migration_group_rebuilds")
                except Exception as error:
                    errors.append(f"rebuilding the migration group: {_describe(error)}")
        return {"workers_lost": lost, "migration_group_rebuilt": rebuilt, "discarded": discarded,
                "cleanup_errors": errors}

    # ---- fault injection (tests only) -----------------------------------------------------------
    def inject_fault(self, point: str, times: int = 1) -> None:
        """Make the next ``times`` passes through fault ``point`` raise :class:`InjectedFault`
        (the ``rebalance_during_*`` and ``rebalance_migrate_peer_missing`` points make one
        worker raise instead, inside its call).

        For tests only: a failed re-include or migration becomes deterministic instead of a
        matter of timing. ``point`` is one of ``FAULT_POINTS``; nothing calls this in serving."""
        if point not in FAULT_POINTS:
            raise ValueError(f"unknown fault point {point!r}; choose one of {', '.join(FAULT_POINTS)}")
        if times < 0:
            raise ValueError(f"times must be >= 0, got {times}")
        self._faults[point] = times

    def _take_fault(self, point: str) -> bool:
        """Whether fault ``point`` fires on this pass (and one fewer time from now on)."""
        if self._faults.get(point, 0) > 0:
            self._faults[point] -= 1
            return True
        return False

    def _fault(self, point: str | None) -> None:
        if point is not None and self._take_fault(point):
            raise InjectedFault(f"fault injected at {point!r} (Controller.inject_fault)")

    def _count(self, name: str) -> None:
        with self._counters_lock:
            self.counters[name] += 1

    def _join_migration_group(self, workers: list[Any] | None = None, epoch: int | None = None) -> None:
        """All workers (or ``workers``: a resize's) in one group of their own for expert copies
        (rank = worker index), joined as a copy runs: a worker serving the EP group joins right
        after the idle tick that carries the join's mark, so no communicator is ever created
        beside its live EP collectives (ExpertWorker.queue_migration_join); one serving none
        joins at once. The mark is ``join_mark(epoch)``: the epoch whose copies follow (below
        their marks), else an epoch number of its own (never a table's), above every mark used
        before and below every later table's. Called where the routers step
        (they carry the mark); where they wait for a rebuild (recovery, a resize's switch) the
        group is joined before the EP group, while no worker serves one."""
        workers = self.workers if workers is None else workers
        backend, world = self.groups["backend"], len(workers)
        timeout_s = max(self.groups["timeout_s"], MIGRATION_TIMEOUT_S)
        rendezvous = ray.get(workers[0].migration_rendezvous.remote(backend), timeout=CALL_TIMEOUT_S)
        if epoch is None:
            with self._counters_lock:  # (a rebalance and a recovery may both take epochs)
                self.max_epoch += 1
                epoch = self.max_epoch
        mark = join_mark(epoch)
        where = _gather([w.queue_migration_join.remote(mark, backend, rendezvous, world, timeout_s) for w in workers])
        waits = [w.wait_migration.remote(mark, timeout_s) for w in workers]
        if "step boundary" in where:
            _gather([r.mark_migration.remote(mark) for r in self.group_routers()])
        _gather(waits, timeout_s + CALL_TIMEOUT_S)

    # ---- status ---------------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        degraded = self.degraded  # one read: the re-include thread may clear it meanwhile
        load = self.window_load()
        overall, worker_loads = placement_balancedness(load, self.placement)
        per_layer = [
            float(np.mean(row) / np.max(row)) if np.max(row) > 0 else 1.0 for row in worker_loads
        ]
        return {
            "pid": os.getpid(),
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
            "recoveries": self.recoveries,
            "counters": dict(self.counters),
            "routers_left_out": sorted(self.routers_out),  # lost, back in once Ray restarted them
            "degraded": None if degraded is None else {key: value for key, value in degraded.items() if key != "rows"},
            "routers": self._router_infos(),
            # the live size (a resize changes it; actors/resize.py)
            "workers": len(self.workers),
            "num_routers": len(self.routers),
            "resizing": None if self.resizing is None else dict(self.resizing),
            "last_resize": None if self.last_resize is None else {
                key: value for key, value in self.last_resize.items() if key != "moved"},
            "last_decision": None if self.last_decision is None else {
                "rebalance": self.last_decision.rebalance, "reason": self.last_decision.reason,
                "balancedness": self.last_decision.current_balancedness,
                "predicted": self.last_decision.predicted_balancedness},
            "autoscale": self.autoscale_status(),  # None: off (actors/autoscaler.py)
            "heals": self.heals[-5:],  # replaced workers seeded by copies (actors/self_heal.py)
        }

    def _router_infos(self) -> list[dict[str, Any]]:
        infos = []
        for index, router in enumerate(self.routers):
            try:
                infos.append(dict(ray.get(router.info.remote(), timeout=PING_TIMEOUT_S), alive=True))
            except LOST:
                infos.append({"router": self.groups.get("router_ids", [None] * len(self.routers))[index], "alive": False})
        return infos

    def stop(self) -> None:
        self._stopped.set()
