"""Resizing the expert pool at runtime (issue 31 item 1): the controller's ``resize(workers=N)``.

:class:`Resize` is mixed into :class:`raymoe.actors.controller.Controller`, as recovery is; it
reuses what recovery and rebalancing have: new placement tables in epochs never used before,
copies worker to worker on the workers' migration group (``ExpertWorker.queue_migration``, at
a step boundary the routers mark), epochs activated beside the one in service, routers switched at a step boundary, and the deployment's
one expert-parallel group rebuilt over a new set of workers (``join_ep_group``).

Growing from W to Wn workers (moe/resize_plan.py decides where experts go):

1. reserve one placement-group bundle per new worker (the resources deploy gives workers,
   actors/worker_spec.py), within ``ready_timeout_s``, else refuse: the cluster has no room;
2. start the workers ``{name}-worker-{W..Wn-1}`` with every slot empty: they read no weights;
3. rebuild the migration group over all Wn workers and copy the hottest experts from live
   workers into the new workers' pools (staged under the new epoch, one all-to-all-v a layer);
   every worker activates that epoch beside the one in service;
4. rebuild the expert-parallel group with the new workers, routers switched to the new
   placement while their group is down (the one pause of a grow), then retire old epochs.

Shrinking to Wn workers:

1. every expert held only by a leaving worker is copied onto a staying one (into an empty slot
   or over a copy the expert can spare), in a placement whose leaving workers hold nothing;
   every worker activates it and the routers switch at a step boundary (no pause): nothing is
   routed to the leaving workers from then on;
2. rebuild the group without them (the one pause of a shrink), then end their actors and
   remove the bundles a grow reserved for them.

Serving goes on throughout: routers whose step fails while the group is rebuilt wait in
``recover`` (this holds the recovery lock) and retry the step on the new group. A resize that
fails before the routers switch changes nothing the routers see: staged rows are discarded,
new workers ended, the migration group rebuilt over the old workers. One that fails while the
group is rebuilt (a new worker dies while joining) rolls back: the old placement in a newer
epoch, the group rebuilt over the old workers. Either way no request is lost.

Refused, with nothing changed (``ResizeRefused``; the report's ``status`` is the HTTP status an
admin route answers with): a size below what the experts need (each worker holds
``slots_per_worker`` experts a layer, fixed at deploy), copies beyond a destination's free pool
rows, bundles Ray cannot place within the deadline, and a resize while another resize or a
recovery runs (409).
"""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np
import ray
from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from raymoe.actors.recovery import CALL_TIMEOUT_S, PING_TIMEOUT_S, _describe, join_ep_group
from raymoe.actors.expert_worker import migration_mark
from raymoe.actors.worker_spec import start_worker
from raymoe.moe.placement import PlacementTable
from raymoe.moe.resize_plan import ResizeRefused, check_size, plan_grow, plan_shrink, truncate

# How long a grow waits for Ray to place the new workers' bundles (the autoscaler may have to
# add a node) before it refuses, and for the new workers to construct (they read no weights).
RESIZE_READY_TIMEOUT_S = 60.0
RESIZE_LOAD_TIMEOUT_S = 300.0
RESIZE_COPY_TIMEOUT_S = 120.0
# How long a resize waits for a rebalance in progress to end before it refuses.
RESIZE_REBALANCE_WAIT_S = 30.0
# Where a test may make a resize fail on purpose (Controller.inject_fault): a new worker is
# killed just before the group is rebuilt with it (it dies while joining), or one destination
# of the copies fails inside its copy call.
RESIZE_FAULT_POINTS = ("resize_join", "resize_copy")


class Resize:
    """The controller's resize (module docstring): mixed into ``Controller``."""

    def _init_resize(self, worker_spec: Any) -> None:
        self.worker_spec = worker_spec
        self._resize_lock = threading.Lock()
        self.resizing: dict[str, Any] | None = None  # the resize in progress
        self.last_resize: dict[str, Any] | None = None
        self.resizes: list[dict[str, Any]] = []
        self.resize_groups: list[tuple[Any, set[int]]] = []  # a grow's placement group, its workers

    # ---- the call ----------------------------------------------------------------------
    def resize(self, workers: int, ready_timeout_s: float = RESIZE_READY_TIMEOUT_S) -> dict[str, Any]:
        """Grow or shrink the expert pool to ``workers`` while serving. Returns a report:
        ``resized`` (bool), ``workers_before``/``workers``, ``seconds`` (from the call to
        serving at the new size), ``pause_s`` (the group rebuild, when routers wait),
        ``copies``, ``bytes_copied`` and ``bytes_all_experts`` (copying every expert once), and
        the phases' seconds (``reserve_s``, ``start_s`` of a grow; ``copy_s``: copies and activation);
        refused: ``refused`` True, ``error`` naming the limit and ``status`` (400, 409, 503)."""
        try:
            workers = int(workers)
        except (TypeError, ValueError):
            return self._refused(f"workers must be an integer, got {workers!r}", 400)
        if not self._resize_lock.acquire(blocking=False):
            running = self.resizing or {}
            return self._refused(f"another resize is running (to {running.get('workers')} workers, started "
                                 f"{time.time() - running.get('since', time.time()):.1f} s ago); try again when it "
                                 "has finished", 409)
        try:
            before = len(self.workers)
            if self.routers_out:
                return self._refused(f"routers {sorted(self.routers_out)} were lost and are being restarted; "
                                     "resizing waits until the deployment is whole again", 409)
            if self.degraded is not None or self._recover_lock.locked():
                lost = self.degraded["lost"] if self.degraded is not None else "?"
                return self._refused(f"a recovery is running (workers {lost} are being restarted or re-included); "
                                     "resizing waits until the deployment is whole again", 409)
            if self.worker_spec is None:
                return self._refused("this controller has no worker recipe (it was not started by deploy); "
                                     "it cannot start workers", 400)
            if workers == before:
                return {"resized": False, "workers_before": before, "workers": before,
                        "reason": f"already {before} workers", "time": time.time()}
            try:
                check_size(self.placement, workers)
            except ResizeRefused as error:
                return self._refused(str(error), 400)
            if not self._rebalance_lock.acquire(timeout=RESIZE_REBALANCE_WAIT_S):
                return self._refused(f"a rebalance has been running for over {RESIZE_REBALANCE_WAIT_S:.0f} s; "
                                     "try again when it has finished", 409)
            self.resizing = {"workers": workers, "since": time.time()}
            try:
                if workers > before:
                    report = self._grow(workers, ready_timeout_s)
                else:
                    report = self._shrink(workers)
            except ResizeRefused as error:
                report = self._refused(str(error), getattr(error, "status", 400))
            finally:
                self.resizing = None
                self._rebalance_lock.release()
            report.setdefault("workers_before", before)
            report["time"] = time.time()
            self.last_resize = report
            self.resizes.append({key: value for key, value in report.items() if key != "moved"})
            if report.get("resized"):
                self.window.clear()  # the old window describes the old placement's history only
                self._count("resizes")
            elif not report.get("refused"):
                self._count("resize_rollbacks")
            return report
        finally:
            self._resize_lock.release()

    def _refused(self, message: str, status: int, pool: str = "workers") -> dict[str, Any]:
        """A resize of ``pool`` (``workers`` or ``routers``, the controller's list of them)
        refused, nothing changed: counted, with the pool's size."""
        self._count("resizes_refused")
        return {"resized": False, "refused": True, "error": message, "status": status,
                pool: len(getattr(self, pool)), "time": time.time()}

    # ---- growing -----------------------------------------------------------------------
    def _grow(self, target: int, ready_timeout_s: float) -> dict[str, Any]:
        started = time.perf_counter()
        spec, current = self.worker_spec, self.placement
        old = list(self.workers)
        added = list(range(len(old), target))
        # Step 1: room for them, within a bounded wait (else: refused, nothing changed). One
        # placement group per grow, a bundle per new worker; removed once its workers all left.
        bundles = placement_group([spec.bundle() for _ in added], strategy="PACK",
                                  name=f"{spec.name}-resize-{added[0]}-{target}", lifetime="detached")
        ready, _ = ray.wait([bundles.ready()], timeout=ready_timeout_s)
        if not ready:
            remove_placement_group(bundles)
            error = ResizeRefused(
                f"workers={target}: Ray could not place {len(added)} more expert workers ({spec.bundle()} each) within "
                f"{ready_timeout_s:g} s; available now: {ray.available_resources()} on {len(ray.nodes())} nodes "
                "(add nodes, or let Ray's autoscaler add them, and try again)")
            error.status = 503
            raise error
        phases = {"reserve_s": time.perf_counter() - started}
        bundle_nodes = placement_group_table(bundles)["bundles_to_node_id"]
        new_nodes = self._node_indices([bundle_nodes[i] for i in range(len(added))], old)
        # Step 2: the new workers, every slot empty (they read no weights), in a new epoch.
        phy2log = np.full((current.num_layers, target * current.slots_per_worker), -1, dtype=np.int64)
        phy2log[:, : current.num_slots] = current.phy2log
        empty = self._table(phy2log, list(current.worker2node.tolist()) + new_nodes)
        new = [start_worker(spec, w, empty.to_dict(), PlacementGroupSchedulingStrategy(bundles, i), detached=True)
               for i, w in enumerate(added)]

        def end_new_workers() -> None:
            for actor in new:
                ray.kill(actor, no_restart=True)
            remove_placement_group(bundles)

        try:
            pids = [info["pid"] for info in ray.get([a.info.remote() for a in new], timeout=RESIZE_LOAD_TIMEOUT_S)]
        except Exception as error:
            end_new_workers()
            return self._failed(f"starting workers {added} failed: {type(error).__name__}: {error}", started)
        phases["start_s"] = time.perf_counter() - started - phases["reserve_s"]
        everyone = old + new
        load = self.window_load() if self.window else None
        phy2log, copies = plan_grow(current, target, load, new_nodes)
        table = self._table(phy2log, empty.worker2node.tolist())
        with self._recover_lock:
            if self._changed_since(current):  # a recovery ran while the new workers started
                end_new_workers()
                return self._refused(self._changed_since(current), 409)
            # Step 3: copies from live workers into the new ones; everyone activates the epoch.
            try:
                self._join_migration_group(everyone, table.epoch)
                self._fault_into(new, "resize_copy")
                moved = self._copy(everyone, current.epoch, table, copies)
                ray.get([w.activate.remote(table.epoch, current.epoch, table.to_dict()) for w in old]
                        + [w.activate.remote(table.epoch, empty.epoch, table.to_dict()) for w in new],
                        timeout=CALL_TIMEOUT_S)
            except Exception as error:  # the routers never saw the new epoch: nothing to undo for them
                self._discard(old, table.epoch)
                end_new_workers()
                self._join_migration_group(old)
                return self._failed(f"copying experts onto workers {added} failed: {_describe(error)}", started,
                                    rolled_back="before the switch: the placement in service never changed")
            phases["copy_s"] = time.perf_counter() - started - phases["reserve_s"] - phases["start_s"]
            # Step 4: the group with the new workers; routers switch while it is down.
            if self._take_fault("resize_join"):  # (tests) a new worker dies while joining
                ray.kill(new[-1], no_restart=True)
            try:
                pause = self._switch(everyone, table)
            except Exception as error:
                rolled = self._roll_back_to(old, current)
                end_new_workers()
                return self._failed(f"joining workers {added} to the group failed: {_describe(error)}", started,
                                    rolled_back=f"back to {len(old)} workers (epoch {self.placement.epoch}), {rolled}")
            ray.get([w.retire.remote(table.epoch) for w in everyone], timeout=CALL_TIMEOUT_S)
            self.workers = everyone
            self.worker_pids = list(self.worker_pids) + pids
            self.placement = table
            self.resize_groups.append((bundles, set(added)))
        return dict(self._report(len(old), target, started, pause, copies, moved, table), **phases)

    # ---- shrinking ---------------------------------------------------------------------
    def _shrink(self, target: int) -> dict[str, Any]:
        started = time.perf_counter()
        current = self.placement
        old = list(self.workers)
        kept, leaving = old[:target], old[target:]
        load = self.window_load() if self.window else None
        phy2log, copies = plan_shrink(current, target, load, self.worker_spec.spare_rows)  # may refuse
        drained = self._table(phy2log, current.worker2node.tolist())
        phases: dict[str, float] = {}
        with self._recover_lock:
            if self._changed_since(current):
                return self._refused(self._changed_since(current), 409)
            # Step 1: the leaving workers' experts onto staying ones; routing moves off them.
            try:
                self._fault_into(kept, "resize_copy")
                moved = self._copy(old, current.epoch, drained, copies)
                ray.get([w.activate.remote(drained.epoch, current.epoch, drained.to_dict()) for w in old],
                        timeout=CALL_TIMEOUT_S)
            except Exception as error:
                self._discard(old, drained.epoch)
                self._join_migration_group(old)
                return self._failed(f"copying the leaving workers' experts failed: {_describe(error)}", started,
                                    rolled_back="before the switch: the placement in service never changed")
            phases["copy_s"] = time.perf_counter() - started
            ray.get([r.set_placement.remote(drained.to_dict()) for r in self.group_routers()], timeout=CALL_TIMEOUT_S)
            ray.get([w.retire.remote(drained.epoch) for w in old], timeout=CALL_TIMEOUT_S)
            self.placement = drained
            # Step 2: the group without them.
            table = truncate(drained, target, self._next_epoch())
            ray.get([w.activate.remote(table.epoch, drained.epoch, table.to_dict()) for w in kept],
                    timeout=CALL_TIMEOUT_S)
            try:
                pause = self._switch(kept, table)
            except Exception as error:
                rolled = self._roll_back_to(old, drained)
                return self._failed(f"rebuilding the group without workers {list(range(target, len(old)))} "
                                    f"failed: {_describe(error)}", started,
                                    rolled_back=f"back to {len(old)} workers (epoch {self.placement.epoch}; nothing "
                                                f"is routed to the leaving workers), {rolled}")
            ray.get([w.retire.remote(table.epoch) for w in kept], timeout=CALL_TIMEOUT_S)
            self.workers = kept
            self.worker_pids = list(self.worker_pids)[:target]
            self.placement = table
        for actor in leaving:
            try:
                ray.get(actor.shutdown.remote(), timeout=PING_TIMEOUT_S)
            except Exception:
                pass  # ended below all the same
            ray.kill(actor, no_restart=True)
        for bundles, indices in list(self.resize_groups):
            if min(indices) >= target:  # every worker it placed has left
                remove_placement_group(bundles)
                self.resize_groups.remove((bundles, indices))
        return dict(self._report(len(old), target, started, pause, copies, moved, table), **phases)

    # ---- parts ---------------------------------------------------------------------------
    def _changed_since(self, current: PlacementTable) -> str | None:
        """Why the resize planned on ``current`` must not go on (a recovery changed the placement
        or the workers meanwhile), or None."""
        if self.placement.epoch != current.epoch or self.degraded is not None:
            return (f"a recovery changed the deployment while the resize was being prepared (placement epoch "
                    f"{current.epoch} -> {self.placement.epoch}); nothing was changed by the resize: try again")
        return None

    def _next_epoch(self) -> int:
        with self._counters_lock:
            self.max_epoch += 1
            return self.max_epoch

    def _table(self, phy2log: np.ndarray, worker2node: list[int]) -> PlacementTable:
        return PlacementTable.from_phy2log(phy2log, self.placement.slots_per_worker, self.placement.num_experts,
                                           worker2node, self._next_epoch())

    def _node_indices(self, node_ids: list[str], old: list[Any]) -> list[int]:
        """The placement's node index of each new worker's node (a node new to the pool gets the next)."""
        infos = ray.get([w.info.remote() for w in old], timeout=CALL_TIMEOUT_S)
        known = {info["node_id"]: int(self.placement.worker2node[i]) for i, info in enumerate(infos)}
        indices = []
        for node in node_ids:
            if node not in known:
                known[node] = max(known.values(), default=-1) + 1
            indices.append(known[node])
        return indices

    def _copy(self, workers: list[Any], epoch: int, table: PlacementTable, copies: list[Any]) -> int:
        """Every layer's copies, one all-to-all-v a layer on the migration group (every worker
        runs its part; a serving one at the step boundary the routers mark: ``_copy_layer``),
        staged under ``table``'s epoch. Returns bytes sent."""
        slots, moved = table.slots_per_worker, 0
        for layer in sorted({c.layer for c in copies}):
            mine = [c for c in copies if c.layer == layer]
            sends = [[(c.destination_worker, c.expert) for c in mine if c.source_worker == w] for w in range(len(workers))]
            receives = [[(c.source_worker, c.destination_slot % slots, c.expert) for c in mine
                         if c.destination_worker == w] for w in range(len(workers))]
            moved += sum(self._copy_layer(workers, [(epoch, layer, table.epoch, sends[i], receives[i])
                                                    for i in range(len(workers))],
                                          migration_mark(table.epoch, layer), RESIZE_COPY_TIMEOUT_S))
        return moved

    def _fault_into(self, workers: list[Any], point: str) -> None:
        if self._take_fault(point):  # (tests) the last destination fails inside its copy
            ray.get(workers[-1].inject_fault.remote("migrate_staged"), timeout=CALL_TIMEOUT_S)

    def _discard(self, workers: list[Any], epoch: int) -> None:
        for worker in workers:
            try:
                worker.abort_migration.remote()
                ray.get(worker.discard_staged.remote(epoch), timeout=CALL_TIMEOUT_S)
            except Exception:
                pass  # a worker that does not answer is recovery's business

    def _switch(self, workers: list[Any], table: PlacementTable) -> float:
        """Rebuild the deployment's group over ``workers`` (every one a member), the routers
        switched to ``table`` while it is down, and the migration group over them. Returns the
        seconds the routers had no group (from their abort to the group's join)."""
        started = time.perf_counter()
        ray.get([r.abort_comm.remote() for r in self.group_routers()], timeout=CALL_TIMEOUT_S)
        ray.get([r.set_placement.remote(table.to_dict()) for r in self.group_routers()], timeout=CALL_TIMEOUT_S)
        ray.get([w.reset_comms.remote() for w in workers], timeout=CALL_TIMEOUT_S)
        # Before the EP group, while no worker serves one (the routers wait in recover and carry
        # no mark): no communicator is created beside live collectives.
        self._join_migration_group(workers)
        generation = self.generation + 1
        self.generation = generation  # a router's recover() of the failed group returns once this is done
        join_ep_group(self.routers, workers, list(range(len(workers))), self.groups["backend"],
                      self.groups["timeout_s"], generation, self.router_members())
        return time.perf_counter() - started

    def _roll_back_to(self, workers: list[Any], table: PlacementTable) -> str:
        """After a failed group rebuild: ``table``'s placement again over ``workers``, in a newer
        epoch (routers never go back to an older one), the group rebuilt over them. Says how it
        went. If that fails too (one of ``workers`` is lost as well), the routers still get the
        rolled-back placement and recovery takes over in the background once this resize has
        released the recovery lock (it waits for restarts and rebuilds the groups)."""
        rolled = self._table(table.phy2log, table.worker2node.tolist())
        self.placement = rolled
        try:
            ray.get([w.activate.remote(rolled.epoch, table.epoch, rolled.to_dict()) for w in workers],
                    timeout=CALL_TIMEOUT_S)
            self._switch(workers, rolled)
            ray.get([w.retire.remote(rolled.epoch) for w in workers], timeout=CALL_TIMEOUT_S)
            return "the group rebuilt over them"
        except Exception as error:
            for router in self.group_routers():  # never route to a worker that is not coming back
                try:
                    ray.get(router.set_placement.remote(rolled.to_dict()), timeout=CALL_TIMEOUT_S)
                except Exception:
                    pass  # a lost router is recovery's business too
            generation = self.generation
            threading.Thread(target=self._recover_quietly, args=(generation,), name="raymoe-resize-recover",
                             daemon=True).start()
            return f"but rebuilding the group failed too ({_describe(error)}): recovery rebuilds it"

    def _recover_quietly(self, generation: int) -> None:
        try:
            self.recover(generation)
        except Exception as error:  # shown in status()
            self.last = {"error": f"recovery after a failed resize rollback: {_describe(error)}", "time": time.time()}

    def _failed(self, message: str, started: float, rolled_back: str = "nothing had changed") -> dict[str, Any]:
        self.last = {"error": f"resize failed: {message}", "time": time.time()}
        return {"resized": False, "error": message, "rolled_back": rolled_back, "workers": len(self.workers),
                "epoch": self.placement.epoch, "seconds": time.perf_counter() - started, "status": 500}

    def _report(self, before: int, after: int, started: float, pause: float, copies: list[Any], moved: int,
                table: PlacementTable) -> dict[str, Any]:
        row_bytes = self.expert_row_bytes()
        return {"resized": True, "workers_before": before, "workers": after, "epoch": table.epoch,
                "seconds": time.perf_counter() - started, "pause_s": pause, "copies": len(copies),
                "bytes_copied": moved,
                "bytes_all_experts": row_bytes * table.num_layers * table.num_experts if row_bytes else None,
                "moved": [c.to_dict() for c in copies]}

    def expert_row_bytes(self) -> int | None:
        """Bytes of one expert's weights (a pool row), from a worker's pool."""
        if not self.workers or not self.pool_bytes:
            return None
        rows = self.placement.num_layers * (self.placement.slots_per_worker + (self.worker_spec.spare_rows
                                                                               if self.worker_spec else 0))
        return self.pool_bytes // rows if rows else None

