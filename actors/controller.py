"""The controller actor: reads load telemetry, replicates and migrates hot experts, live.

Every ``poll_interval_s`` it pulls each router's per-step logical-expert loads into a sliding
window; every ``interval_steps`` router steps it asks :func:`raymoe.moe.rebalance_policy.decide`
whether a new placement pays. A rebalance runs layer by layer:

1. copy the layer's new experts worker to worker (from a live copy) with one all-to-all-v on
   the workers' migration group (NCCL on GPUs, gloo on CPUs; separate from dispatch/combine),
   into free rows of the destination's weight pool;
2. every worker starts serving the next epoch (old and new epochs side by side);
3. every router switches to the new table at a step boundary (weights and routing change
   together: a dispatch never sees a half-updated layer);
4. workers forget the old epoch: no step can use it any more.

Serving goes on throughout. One controller per deployment; it owns no weights, so it can
be restarted and rebuild its state from the routers and workers.

A migration that fails (a worker's migrate or activate raises, or a fault point fires) is
undone before any router sees its epoch: every worker discards what it staged or activated
for that epoch, the migration group is rebuilt (no full recovery while every worker is
alive), and the placement in service stays as it was. Every epoch is new (never one staged,
discarded or served before), so a retry cannot meet a failed try's rows.
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from typing import Any

import numpy as np
import ray

from raymoe.kernels.comm import errors as comm_errors
from raymoe.moe.placement import PlacementTable
from raymoe.moe.rebalance_policy import RebalanceDecision, RebalancePolicy, decide, placement_balancedness

CALL_TIMEOUT_S = 60.0
# Loading the placement into a restarted worker (ExpertWorker.load_placement) reads up to its
# whole expert pool from the checkpoint and packs it: its deadline grows with the pool's bytes,
# RELOAD_FLOOR_S plus the bytes at RELOAD_MIN_BYTES_PER_S, a rate below what a cold local disk
# or a network filesystem gives (a CPU worker here loads and packs ~0.6 GB/s from the page
# cache); 16 GiB of experts get 60 + 328 s. A reload that still times out is tried again
# (the worker serializes reloads: a retry waits for the one still running, then finds every
# row in place), RELOAD_ATTEMPTS tries in all, RELOAD_FIRST_BACKOFF_S doubling between them.
RELOAD_FLOOR_S = 60.0
RELOAD_MIN_BYTES_PER_S = 50 * 2**20
RELOAD_ATTEMPTS = 3
RELOAD_FIRST_BACKOFF_S = 2.0
PING_TIMEOUT_S = 5.0  # a worker that cannot answer `info` in this long is treated as lost
MIGRATION_TIMEOUT_S = 60.0  # deadline of one layer's copy collective (weights are large)
RESTART_TIMEOUT_S = 300.0
LOST = (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError, ray.exceptions.ActorUnavailableError)
# Re-including restarted workers: attempt k waits REINCLUDE_FIRST_BACKOFF_S * 2**(k-1) (at most
# REINCLUDE_MAX_BACKOFF_S) after a failure; after REINCLUDE_MAX_ATTEMPTS the deployment stays on
# the replicas and says so in status(); the next recovery starts a new round of attempts.
REINCLUDE_MAX_ATTEMPTS = 6
REINCLUDE_FIRST_BACKOFF_S = 1.0
REINCLUDE_MAX_BACKOFF_S = 30.0
# A step that fails this many recoveries in a row with the same workers' errors (and no step
# served in between) fails deterministically: its requests are failed, not retried for ever.
MAX_IDENTICAL_STEP_FAILURES = 3
# Where a test may make the controller fail on purpose (inject_fault): loading the placement
# into a restarted worker, and joining the groups that re-include it; and in a rebalance's
# layer: before the copies, inside them (one worker fails after staging its first copy, or
# never enters the copy collective, leaving its peers waiting there), after them before any
# worker activates, and inside activate (one worker fails, the others have activated).
REBALANCE_FAULT_POINTS = ("rebalance_before_migrate", "rebalance_during_migrate", "rebalance_migrate_peer_missing",
                          "rebalance_before_activate", "rebalance_during_activate")
FAULT_POINTS = ("reinclude_load", "reinclude_join", *REBALANCE_FAULT_POINTS)
# How long a failed migration's cleanup waits for the calls still running in it (the aborted
# copy collective makes them fail at once) and for each worker's answer.
MIGRATION_CLEANUP_WAIT_S = 10.0
# The decisions and outcomes status()["counters"] counts, so that a test can tell "it decided
# and skipped" from "it never decided", and "it retried" from "it worked the first time".
COUNTERS = ("rebalance_decisions_taken", "rebalance_decisions_skipped", "rebalances_deferred", "recoveries",
            "recoveries_on_replicas", "reinclude_attempts", "reinclude_failures", "reincludes",
            "reinclude_rollbacks", "repeated_step_failures", "rebalance_failures", "migration_group_rebuilds",
            "reload_timeouts")


class InjectedFault(RuntimeError):
    """Raised at a fault point armed by :meth:`Controller.inject_fault` (tests only)."""


class RepeatedStepFailure(RuntimeError):
    """The same step failed the same way after every rebuild: retrying cannot help."""


class MigrationFailed(RuntimeError):
    """A rebalance's migration failed and a worker was lost in it: its cleanup is left to recovery."""


def _gather(refs: list[Any], timeout_s: float = CALL_TIMEOUT_S) -> list[Any]:
    """``ray.get(refs)``, but a failed call raises as soon as it fails, not once every other
    call has ended (a copy collective's peers wait in it until the failure is cleaned up)."""
    deadline = time.monotonic() + timeout_s
    pending = list(refs)
    while pending:
        ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
        if not ready:
            raise ray.exceptions.GetTimeoutError(f"{len(pending)} of {len(refs)} calls did not finish in {timeout_s} s")
        ray.get(ready)
    return ray.get(list(refs))


def _describe(error: BaseException) -> str:
    """``Type: text`` of the error a remote call raised (not Ray's wrapper and traceback)."""
    cause = getattr(error, "cause", None) if isinstance(error, ray.exceptions.RayTaskError) else None
    if isinstance(cause, BaseException):
        return f"{type(cause).__name__}: {' '.join(str(cause).split())}"
    lines = str(error).strip().splitlines()  # Ray's text ends with the remote error's own line
    return f"{type(error).__name__}: {lines[-1] if lines else ''}"


def join_ep_group(routers: list[Any], workers: list[Any], members: list[int], backend: str, timeout_s: float,
                  generation: int) -> None:
    """The deployment's one expert-parallel group: router ``r`` is rank ``r``, worker
    ``members[i]`` is rank ``len(routers) + i``. Every rank must join or none completes; deploy
    and recovery both build the group here."""
    rendezvous = ray.get(routers[0].rendezvous.remote(), timeout=CALL_TIMEOUT_S)
    num_routers = len(routers)
    ray.get([router.join.remote(rendezvous, generation, members) for router in routers] + [
        workers[w].join.remote(backend, rendezvous, num_routers + rank, num_routers, members, timeout_s, generation)
        for rank, w in enumerate(members)
    ], timeout=CALL_TIMEOUT_S)


def _is_comm_error(message: str) -> bool:
    """Whether a worker's ``last_error`` ("Type: text") is a communicator's error."""
    name = message.split(":", 1)[0]
    return isinstance(getattr(comm_errors, name, None), type) and issubclass(getattr(comm_errors, name),
                                                                             comm_errors.CommError)


def reload_deadline_s(pool_bytes: int) -> float:
    """How long one ``load_placement`` of a worker whose pool holds ``pool_bytes`` may take."""
    return RELOAD_FLOOR_S + max(0, pool_bytes) / RELOAD_MIN_BYTES_PER_S


def retry_on_timeout(attempt, what: str, attempts: int = RELOAD_ATTEMPTS, first_backoff_s: float = RELOAD_FIRST_BACKOFF_S,
                     on_timeout=None, sleep=None) -> Any:
    """``attempt()``, tried again after a ``GetTimeoutError`` (``first_backoff_s``, doubling),
    ``attempts`` tries in all; the last timeout is raised, saying how many tries there were.
    ``on_timeout(error)`` is called for each timeout (a counter)."""
    backoff = first_backoff_s
    for number in range(1, attempts + 1):
        try:
            return attempt()
        except ray.exceptions.GetTimeoutError as error:
            if on_timeout is not None:
                on_timeout(error)
            if number == attempts:
                raise ray.exceptions.GetTimeoutError(f"{what} timed out {attempts} times: {error}") from error
            (sleep or time.sleep)(backoff)
            backoff *= 2


def _until_available(call, timeout_s: float = RESTART_TIMEOUT_S, call_timeout_s: float = CALL_TIMEOUT_S) -> Any:
    """``ray.get(call(), timeout=call_timeout_s)``, retried while the actor is between restarts."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return ray.get(call(), timeout=call_timeout_s)
        except (ray.exceptions.ActorUnavailableError, ray.exceptions.ActorDiedError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


class Controller:
    def __init__(self, routers: list[Any], workers: list[Any], placement: dict[str, Any], policy: RebalancePolicy,
                 window_steps: int, interval_steps: int, poll_interval_s: float, enabled: bool,
                 groups: dict[str, Any] | None = None):
        self.routers = routers
        # How to rebuild communicator groups: router ids, backend, deadline (see recover()).
        self.groups = groups or {}
        self.generation = 0
        self.recoveries: list[dict[str, Any]] = []
        self.degraded: dict[str, Any] | None = None  # lost workers while replicas serve for them
        self._recover_lock = threading.Lock()
        self._reinclude_thread: threading.Thread | None = None
        self.counters = dict.fromkeys(COUNTERS, 0)
        self._counters_lock = threading.Lock()
        self._faults: dict[str, int] = {}  # fault point -> how many more times it fails
        # The last recovery's workers' errors, how many recoveries in a row saw them, and the
        # steps the workers had served then (a served step ends a streak).
        self._failure_streak: tuple[tuple, int, int] = ((), 0, -1)
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
        return PlacementTable.from_phy2log(phy2log, self.placement.slots_per_worker, self.placement.num_experts,
                                           self.placement.worker2node, epoch)

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
        progress["calls"] = [w.migrate.remote(current.epoch, layer, table.epoch, sends[i], receives[i])
                             for i, w in enumerate(workers)]
        moved = sum(_gather(progress["calls"], MIGRATION_TIMEOUT_S + CALL_TIMEOUT_S))
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
        _gather([r.set_placement.remote(table.to_dict()) for r in self.routers])
        # Step 4: no step can use the old epoch any more: free its rows.
        progress["step"] = "retire"
        _gather([w.retire.remote(table.epoch) for w in workers])
        return moved

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

    # ---- failure recovery -------------------------------------------------------------------
    def recover(self, generation: int) -> int:
        """Rebuild every communicator group after a failed step; returns the new generation.

        Called by each router whose step failed with the generation of its group; the first
        caller does the work, later callers of the same generation return at once.

        1. Ping every worker; one that is dead or does not answer is lost.
        2. Kill lost workers that are merely frozen, so Ray restarts them (a worker is
           restartable: it reloads its experts from the checkpoint). If every lost expert has
           a replica on a survivor, serve on the survivors at once (``_serve_on_replicas``).
        3. Otherwise wait for the restarted workers and load the current placement into them.
        4. Abort every old communicator and join every router with every worker anew.

        Raises :class:`RepeatedStepFailure` (after rebuilding the groups, so serving goes on)
        when the step failed ``MAX_IDENTICAL_STEP_FAILURES`` times in a row with the same
        workers' errors and nobody lost: a deterministic compute error, which a retry only
        repeats. The calling router fails its requests in flight with that message.
        """
        with self._recover_lock:
            if generation < self.generation:
                return self.generation
            started = time.perf_counter()
            self._count("recoveries")
            # Step 1: who answers, and who was restarted already (a new pid)? Workers left out
            # while the replicas serve for them are the re-include thread's business.
            excluded = set(self.degraded["lost"]) if self.degraded is not None else set()
            members = [w for w in range(len(self.workers)) if w not in excluded]
            answers = {index: self.workers[index].info.remote() for index in members}
            lost, restarted, frozen, infos = [], [], [], {}
            for index, answer in answers.items():
                try:
                    infos[index] = ray.get(answer, timeout=PING_TIMEOUT_S)
                    if infos[index]["pid"] != self.worker_pids[index]:
                        restarted.append(index)
                except ray.exceptions.GetTimeoutError:
                    frozen.append(index)  # alive but not answering
                except LOST:
                    lost.append(index)  # dead: Ray is restarting it already
            repeated = self._repeated_failure(infos, any_lost=bool(lost or frozen or restarted))
            if self.degraded is not None and not self._reinclude_running():
                self._start_reinclude()  # an earlier round of attempts gave up: try again
            # Step 2: a frozen worker cannot serve: kill it so that Ray restarts it too.
            for index in frozen:
                ray.kill(self.workers[index], no_restart=False)
            lost = sorted(lost + frozen)
            for index in restarted:  # back already: it serves the placement in service
                self.worker_pids[index] = self._wait_restarted(self.workers[index], self._restart_timeout_s())
                self._reload(index, self.placement)
            if lost and self.degraded is None and self._covered_without(lost):
                return self._serve_on_replicas(lost, restarted, started)
            # Step 3: wait for them, then give them the placement in service.
            for index in lost:
                self.worker_pids[index] = self._wait_restarted(self.workers[index], self._restart_timeout_s())
                self._reload(index, self.placement)
            lost = sorted(lost + restarted)
            # Step 3b: a restarted router (its requests were retried elsewhere by the ingress)
            # gets the supervisor and the placement in service back.
            restarted_routers = []
            for index, router in enumerate(self.routers):
                pid = self._wait_restarted(router)
                if pid != self.router_pids[index]:
                    self.router_pids[index] = pid
                    self.cursors[index] = 0
                    ray.get([router.set_supervisor.remote(ray.get_runtime_context().current_actor),
                             router.set_placement.remote(self.placement.to_dict())], timeout=CALL_TIMEOUT_S)
                    restarted_routers.append(index)
            # Step 4: new groups, one per router, every member joins.
            self._rebuild_groups(members)
            next_generation = self.generation
            self.recoveries.append({"time": time.time(), "lost_workers": lost, "restarted_routers": restarted_routers,
                                    "mode": "restart", "generation": next_generation,
                                    "seconds": time.perf_counter() - started})
            if repeated is not None:
                self._count("repeated_step_failures")
                self._failure_streak = ((), 0, -1)  # the next requests get their own retries
                self.last = {"error": repeated, "time": time.time()}
                raise RepeatedStepFailure(repeated)
            return self.generation

    def _repeated_failure(self, infos: dict[int, dict[str, Any]], any_lost: bool) -> str | None:
        """The message to fail the step's requests with, if this recovery is the
        ``MAX_IDENTICAL_STEP_FAILURES``-th in a row to find the same workers' compute errors
        (not communication errors: those are what a rebuild fixes), with no worker lost and no
        step served since the last one; else None."""
        errors = tuple(sorted((index, info["last_error"]) for index, info in infos.items()
                              if info["last_error"] and not _is_comm_error(info["last_error"])))
        served = sum(info["steps_served"] for info in infos.values())
        previous, streak, previous_served = self._failure_streak
        if any_lost or not errors:
            self._failure_streak = ((), 0, served)
            return None
        streak = streak + 1 if errors == previous and served == previous_served else 1
        self._failure_streak = (errors, streak, served)
        if streak < MAX_IDENTICAL_STEP_FAILURES:
            return None
        named = "; ".join(f"worker {index}: {error}" for index, error in errors)
        return (f"the step failed {streak} times in a row with the same error after every rebuild ({named}); "
                "this is not a lost peer but a deterministic failure, so the requests in flight are failed "
                "instead of retried (see the workers' logs)")

    def _rebuild_groups(self, members: list[int], fault_point: str | None = None) -> None:
        """Abort every communicator and join every router with ``members`` (worker indices) anew."""
        for index in members:
            _until_available(self.workers[index].reset_comms.remote)
        for router in self.routers:
            _until_available(router.abort_comm.remote)
        self._fault(fault_point)
        next_generation = self.generation + 1
        join_ep_group(self.routers, self.workers, members, self.groups["backend"], self.groups["timeout_s"],
                      next_generation)
        if len(members) == len(self.workers):
            self._join_migration_group()
        self.generation = next_generation

    def _switch_groups(self, table: PlacementTable, base_epoch: int, activate_on: list[int],
                       members: list[int], fault_point: str | None = None) -> None:
        """Serve ``table`` with groups over ``members``: workers in ``activate_on`` add its epoch,
        routers stop (comms aborted), switch placement, and join the new groups."""
        ray.get([self.workers[w].activate.remote(table.epoch, base_epoch, table.to_dict()) for w in activate_on],
                timeout=CALL_TIMEOUT_S)
        for router in self.routers:
            _until_available(router.abort_comm.remote)
        ray.get([r.set_placement.remote(table.to_dict()) for r in self.routers], timeout=CALL_TIMEOUT_S)
        self._rebuild_groups(members, fault_point)

    def _covered_without(self, lost: list[int]) -> bool:
        """Every logical expert of every layer still has a slot on a worker not in ``lost``."""
        table = self.placement
        alive = [s for s in range(table.num_slots) if s // table.slots_per_worker not in lost]
        return all(set(table.phy2log[layer, alive].tolist()) >= set(range(table.num_experts))
                   for layer in range(table.num_layers))

    def _serve_on_replicas(self, lost: list[int], restarted: list[int], started: float) -> int:
        """Keep serving at once: the survivors' replicas take the lost workers' tokens.

        The lost workers' slots become empty in a new epoch, the groups are rebuilt over the
        survivors only, and a background thread re-includes the workers once Ray has
        restarted them (their experts come back from the checkpoint).
        """
        current = self.placement
        phy2log = current.phy2log.copy()
        for index in lost:
            phy2log[:, current.worker_slots(index)] = -1
        degraded = self._new_table(phy2log)
        survivors = [w for w in range(len(self.workers)) if w not in lost]
        self._switch_groups(degraded, current.epoch, survivors, survivors)
        self.placement = degraded
        self.degraded = {"lost": lost, "rows": current.phy2log.copy(), "since": time.time(), "attempts": 0,
                         "last_error": None, "next_attempt_at": None, "gave_up": False}
        self._count("recoveries_on_replicas")
        self.recoveries.append({"time": time.time(), "lost_workers": lost, "restarted_routers": [],
                                "mode": "replicas", "generation": self.generation,
                                "seconds": time.perf_counter() - started})
        self._start_reinclude()
        return self.generation

    # ---- re-including restarted workers -------------------------------------------------------
    def _reinclude_running(self) -> bool:
        return self._reinclude_thread is not None and self._reinclude_thread.is_alive()

    def _start_reinclude(self) -> None:
        self.degraded.update(gave_up=False, next_attempt_at=time.time())
        self._reinclude_thread = threading.Thread(target=self._reinclude, name="raymoe-reinclude", daemon=True)
        self._reinclude_thread.start()

    def _reinclude(self) -> None:
        """Re-include the lost workers once they are back, retrying a failed attempt with
        exponential backoff, at most ``REINCLUDE_MAX_ATTEMPTS`` times. The replicas serve
        throughout; every attempt and failure is counted and the last error is in status()."""
        backoff = REINCLUDE_FIRST_BACKOFF_S
        for attempt in range(1, REINCLUDE_MAX_ATTEMPTS + 1):
            degraded = self.degraded
            if degraded is None or self._stopped.is_set():
                return
            self._count("reinclude_attempts")
            degraded["attempts"] += 1
            degraded["next_attempt_at"] = None
            try:
                self._reinclude_once()
                return
            except Exception as error:  # counted, shown in status(), and tried again after a pause
                self._count("reinclude_failures")
                message = f"re-including workers {degraded['lost']} failed (attempt {attempt} of " \
                          f"{REINCLUDE_MAX_ATTEMPTS}): {type(error).__name__}: {error}"
                degraded["last_error"] = message
                self.last = {"error": message, "time": time.time()}
            if attempt == REINCLUDE_MAX_ATTEMPTS:
                degraded.update(gave_up=True, next_attempt_at=None)
                return
            degraded["next_attempt_at"] = time.time() + backoff
            if self._stopped.wait(backoff):
                return
            backoff = min(2 * backoff, REINCLUDE_MAX_BACKOFF_S)

    def _reinclude_once(self) -> None:
        """One attempt: wait for the lost workers' restart, load the full placement into them,
        then switch everybody to it. A failure after the routers stopped rolls them back onto
        the replicas (the degraded placement, groups over the survivors) before it is raised,
        so requests wait a moment but are never lost."""
        lost = self.degraded["lost"]
        pids = {index: self._wait_restarted(self.workers[index], self._restart_timeout_s()) for index in lost}
        with self._recover_lock:
            if self.degraded is None:
                return
            started = time.perf_counter()
            current = self.placement
            restored = self._new_table(self.degraded["rows"])
            for index in lost:
                self.worker_pids[index] = pids[index]
                self._fault("reinclude_load")
                self._reload(index, restored)
            survivors = [w for w in range(len(self.workers)) if w not in lost]
            try:
                self._switch_groups(restored, current.epoch, survivors, list(range(len(self.workers))),
                                    fault_point="reinclude_join")
            except Exception:
                self._roll_back(restored, survivors)
                raise
            ray.get([self.workers[w].retire.remote(restored.epoch) for w in survivors], timeout=CALL_TIMEOUT_S)
            self.placement = restored
            self.degraded = None
            self._count("reincludes")
            self.recoveries.append({"time": time.time(), "reincluded_workers": lost, "mode": "reinclude",
                                    "generation": self.generation, "seconds": time.perf_counter() - started})

    def _roll_back(self, attempted: PlacementTable, survivors: list[int]) -> None:
        """Back onto the replicas after a failed switch to ``attempted``: the degraded placement
        again, in a newer epoch (routers never go back to an older one), served by the
        survivors, with the groups rebuilt over them; older epochs are forgotten."""
        self._count("reinclude_rollbacks")
        rolled = self._new_table(self.placement.phy2log)
        self._switch_groups(rolled, self.placement.epoch, survivors, survivors)
        ray.get([self.workers[w].retire.remote(rolled.epoch) for w in survivors], timeout=CALL_TIMEOUT_S)
        self.placement = rolled

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

    def _join_migration_group(self) -> None:
        """All workers in one group of their own for expert copies (rank = worker index)."""
        backend, world = self.groups["backend"], len(self.workers)
        rendezvous = ray.get(self.workers[0].migration_rendezvous.remote(backend), timeout=CALL_TIMEOUT_S)
        ray.get([w.join_migration.remote(backend, rendezvous, world, max(self.groups["timeout_s"], MIGRATION_TIMEOUT_S))
                 for w in self.workers], timeout=CALL_TIMEOUT_S)

    def _wait_restarted(self, actor: Any, timeout_s: float = RESTART_TIMEOUT_S) -> int:
        """Wait until ``worker`` answers again; returns its pid."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                return ray.get(actor.info.remote(), timeout=PING_TIMEOUT_S)["pid"]
            except LOST:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"a lost actor did not restart within {timeout_s:.0f} s") from None
                time.sleep(0.5)

    def _restart_timeout_s(self) -> float:
        """A restarted worker answers once its constructor loaded its experts: the restart
        deadline plus one reload's."""
        return RESTART_TIMEOUT_S + reload_deadline_s(self.pool_bytes)

    def _reload(self, index: int, table: PlacementTable) -> dict[str, Any]:
        """Load ``table`` into restarted worker ``index``: a deadline from its pool's bytes,
        retried on a timeout (``retry_on_timeout``), waiting out further restarts meanwhile."""
        deadline_s = reload_deadline_s(self.pool_bytes)
        placement = table.to_dict()
        return retry_on_timeout(
            lambda: _until_available(lambda: self.workers[index].load_placement.remote(placement),
                                     call_timeout_s=deadline_s),
            what=f"loading the placement into worker {index} ({self.pool_bytes / 2**30:.2f} GiB pool, "
                 f"{deadline_s:.0f} s a try)",
            on_timeout=lambda error: self._count("reload_timeouts"))

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
            "degraded": None if degraded is None else {key: value for key, value in degraded.items() if key != "rows"},
            "routers": self._router_infos(),
            "last_decision": None if self.last_decision is None else {
                "rebalance": self.last_decision.rebalance, "reason": self.last_decision.reason,
                "balancedness": self.last_decision.current_balancedness,
                "predicted": self.last_decision.predicted_balancedness},
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
