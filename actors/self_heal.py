"""Self-healing to the target size (issue 31 item 4): a worker Ray will not bring back gets a
new actor in its place.

Recovery (actors/recovery.py) serves on the survivors' replicas when a worker is lost and
re-includes the worker once Ray has restarted it. A worker Ray has given up on (its actor is
DEAD: killed for good, out of restarts, or its node gone with nowhere to restart it) never
comes back, and the deployment would stay on the replicas, one worker short, for good.

:class:`SelfHeal` (mixed into the controller) replaces such a worker before the re-include
waits for it: a new actor under the same name and index, in a placement-group bundle of its
own (the resources deploy gives workers, actors/worker_spec.py; Ray places it where there is
room, or its autoscaler adds a node), started with the placement in service, whose slots of
that worker are empty: it reads no weights at start. The re-include then seeds it with the
experts the lost worker held (the full placement's rows of that worker), copied worker to
worker from the survivors that serve them on replicas (moe/refill_plan.py; the grow's copies
on the migration group, ``Resize._copy``), activates that placement on every worker and
rebuilds the groups with it, so the deployment is back at its size, serving the placement it
had before the loss. Where a copy cannot be made (more workers lost than replaced, a copy that
fails: that attempt fails and the next one), the new worker loads those experts from the
checkpoint instead, as a worker Ray restarted does.
"""

from __future__ import annotations

import time
from typing import Any

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from raymoe.actors.rank_watch import actor_table_entry
from raymoe.actors.recovery import PING_TIMEOUT_S, _describe
from raymoe.actors.worker_spec import start_worker
from raymoe.moe.placement import PlacementTable
from raymoe.moe.refill_plan import plan_refill

# How long a replacement waits for Ray to place its bundle (the autoscaler may add a node).
REPLACE_READY_TIMEOUT_S = 60.0
# Where a test may make self-healing fail on purpose (Controller.inject_fault): the replacement
# fails inside its first copy from the survivors.
HEAL_FAULT_POINTS = ("heal_copy",)


class SelfHeal:
    """The controller's replacement of dead workers (module docstring): mixed into ``Controller``."""

    def _init_self_heal(self) -> None:
        self._unseeded: set[int] = set()  # replacements not yet seeded by copies
        self.heals: list[dict[str, Any]] = []  # each seeding by copies: workers, copies, bytes, seconds

    def _replace_dead_workers(self, lost: list[int]) -> list[int]:
        """Start a new actor for each of ``lost`` whose actor Ray reports DEAD; returns those
        replaced. Raises (the re-include counts it and tries again later) when Ray cannot place
        one within ``REPLACE_READY_TIMEOUT_S``."""
        replaced = []
        for index in lost:
            if actor_table_entry(self.workers[index]._actor_id.hex()).get("State") != "DEAD":
                continue  # alive or restarting: Ray brings it back
            if self.worker_spec is None:
                raise RuntimeError(f"worker {index} is dead for good and this controller has no worker recipe "
                                   "(it was not started by deploy) to start another")
            self.workers[index] = self._start_replacement(index)
            self._count("workers_replaced")
            self._unseeded.add(index)
            replaced.append(index)
        return replaced

    def _seed_replacements(self, lost: list[int], current: PlacementTable, restored: PlacementTable) -> list[int]:
        """Copy ``restored``'s experts into the replaced workers among ``lost`` from the
        survivors serving ``current`` (recovery lock held); returns those seeded (they activate
        ``restored`` like the survivors). Only when every lost worker is a new, empty one (the
        copy collective needs every worker) and each replacement is seeded once: after a failed
        copy (raised: the re-include tries again) they load from the checkpoint."""
        fresh = [index for index in lost if index in self._unseeded]
        if not fresh or len(fresh) != len(lost):
            return []
        self._unseeded -= set(fresh)
        copies = plan_refill(current, restored, fresh)
        started = time.perf_counter()
        try:
            self._join_migration_group(epoch=restored.epoch)
            if self._take_fault("heal_copy"):  # (tests) the replacement fails inside its copy
                ray.get(self.workers[fresh[-1]].inject_fault.remote("migrate_staged"), timeout=PING_TIMEOUT_S)
            moved = self._copy(list(self.workers), current.epoch, restored, copies)
        except Exception as error:
            self._discard(list(self.workers), restored.epoch)
            raise RuntimeError(f"copying the lost workers' experts into their replacements {fresh} failed "
                               f"({_describe(error)}); the next attempt loads them from the checkpoint") from None
        self.heals.append({"time": time.time(), "workers": fresh, "copies": len(copies), "bytes_copied": moved,
                           "copy_s": time.perf_counter() - started})
        return fresh

    def _start_replacement(self, index: int) -> Any:
        spec = self.worker_spec
        bundles = placement_group([spec.bundle()], strategy="PACK", lifetime="detached",
                                  name=f"{spec.name}-resize-replace-{index}-{time.time_ns()}")
        ready, _ = ray.wait([bundles.ready()], timeout=REPLACE_READY_TIMEOUT_S)
        if not ready:
            remove_placement_group(bundles)
            raise RuntimeError(
                f"worker {index} is dead for good and Ray could not place a new one ({spec.bundle()}) within "
                f"{REPLACE_READY_TIMEOUT_S:g} s; available now: {ray.available_resources()} (add a node, or let "
                "Ray's autoscaler add one)")
        # The placement in service has that worker's slots empty (the survivors serve on replicas):
        # the new actor reads no weights at start; the re-include loads the lost worker's experts.
        actor = start_worker(spec, index, self.placement.to_dict(), PlacementGroupSchedulingStrategy(bundles, 0),
                             detached=True)
        self.resize_groups.append((bundles, {index}))  # removed once a shrink takes this index away
        return actor
