"""How good a placement is, and what it costs to move to it.

Legend: L MoE layers, E logical experts, W workers, S slots per worker, P = W * S physical
slots per layer.

Definitions used by every balancer, the simulator and ``raymoe plan``:

- worker load: the sum over a worker's slots of ``load[expert] / replicas[expert]``. A
  replicated expert's tokens are split evenly across its replicas.
- imbalance: mean over layers of ``max worker load / mean worker load`` (1.0 is perfect).
- balancedness: mean over layers of ``mean worker load / max worker load`` (vLLM's
  definition; 1.0 is perfect).
- copy: a ``(layer, worker, logical expert)`` that the new placement has on a worker that
  the old placement did not have there: expert weights that must be copied.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from raymoe.moe.placement import PlacementTable


def worker_load(load: np.ndarray, phy2log: np.ndarray, slots_per_worker: int) -> np.ndarray:
    """Token load of each worker.

    load: [L, E] tokens per logical expert; phy2log: [L, P]. Returns [L, W] floats.
    """
    load = np.asarray(load, dtype=np.float64)
    phy2log = np.asarray(phy2log, dtype=np.int64)
    if load.ndim != 2 or phy2log.ndim != 2 or load.shape[0] != phy2log.shape[0]:
        raise ValueError(f"load {load.shape} and phy2log {phy2log.shape} must be [L, E] and [L, P]")
    num_layers, num_experts = load.shape
    if phy2log.shape[1] % slots_per_worker:
        raise ValueError(f"{phy2log.shape[1]} slots do not split into workers of {slots_per_worker}")
    # Step 1: replicas per expert, so each slot carries its share of the expert's tokens.
    occupied = phy2log >= 0
    expert = np.where(occupied, phy2log, 0)
    replicas = np.zeros((num_layers, num_experts), dtype=np.float64)
    np.add.at(replicas, (np.nonzero(occupied)[0], phy2log[occupied]), 1.0)
    per_replica = load / np.maximum(replicas, 1.0)  # [L, E]
    slot_load = np.take_along_axis(per_replica, expert, axis=1) * occupied  # [L, P]
    # Step 2: sum the slots of each worker.
    return slot_load.reshape(num_layers, -1, slots_per_worker).sum(axis=2)


def _layer_ratios(worker_loads: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    worker_loads = np.asarray(worker_loads, dtype=np.float64)
    if worker_loads.ndim != 2:
        raise ValueError(f"worker loads must be [L, W], got {worker_loads.shape}")
    return worker_loads.max(axis=1), worker_loads.mean(axis=1)


def imbalance(worker_loads: np.ndarray) -> float:
    """Mean over layers of max/mean worker load; a layer without tokens counts as 1.0."""
    peak, mean = _layer_ratios(worker_loads)
    ratio = np.where(mean > 0, peak / np.where(mean > 0, mean, 1.0), 1.0)
    return float(ratio.mean())


def layer_imbalance(worker_loads: np.ndarray) -> np.ndarray:
    """[L] max/mean worker load of each layer."""
    peak, mean = _layer_ratios(worker_loads)
    return np.where(mean > 0, peak / np.where(mean > 0, mean, 1.0), 1.0)


def balancedness(worker_loads: np.ndarray) -> float:
    """Mean over layers of mean/max worker load (vLLM's definition)."""
    peak, mean = _layer_ratios(worker_loads)
    ratio = np.where(peak > 0, mean / np.where(peak > 0, peak, 1.0), 1.0)
    return float(ratio.mean())


def holdings(phy2log: np.ndarray, slots_per_worker: int, num_experts: int) -> np.ndarray:
    """[L, W, E] number of slots each worker gives each logical expert."""
    phy2log = np.asarray(phy2log, dtype=np.int64)
    num_layers, num_slots = phy2log.shape
    num_workers = num_slots // slots_per_worker
    held = np.zeros((num_layers, num_workers, num_experts), dtype=np.int64)
    layer, slot = np.nonzero(phy2log >= 0)
    np.add.at(held, (layer, slot // slots_per_worker, phy2log[layer, slot]), 1)
    return held


def copy_mask(
    old_phy2log: np.ndarray, new_phy2log: np.ndarray, slots_per_worker: int, num_experts: int
) -> np.ndarray:
    """[L, W, E] True where the new placement needs expert weights the worker lacks."""
    old = np.asarray(old_phy2log)
    new = np.asarray(new_phy2log)
    if old.shape != new.shape:
        raise ValueError(f"old placement {old.shape} and new placement {new.shape} differ in shape")
    return (holdings(new, slots_per_worker, num_experts) > 0) & (
        holdings(old, slots_per_worker, num_experts) == 0
    )


def count_copies(old: PlacementTable, new: PlacementTable) -> int:
    """Expert weights that must be copied to go from ``old`` to ``new``."""
    _check_compatible(old, new)
    return int(copy_mask(old.phy2log, new.phy2log, new.slots_per_worker, new.num_experts).sum())


def _check_compatible(old: PlacementTable, new: PlacementTable) -> None:
    if (old.phy2log.shape, old.slots_per_worker, old.num_experts) != (
        new.phy2log.shape,
        new.slots_per_worker,
        new.num_experts,
    ):
        raise ValueError(f"placements are not over the same slots: {old!r} vs {new!r}")


@dataclass(frozen=True)
class ExpertCopy:
    """Copy one expert's weights of one layer from a worker that has them to one that does not."""

    layer: int
    expert: int
    source_worker: int
    destination_worker: int
    destination_slot: int
    same_node: bool

    def to_dict(self) -> dict[str, Any]:
        return {
            "layer": self.layer,
            "expert": self.expert,
            "source_worker": self.source_worker,
            "destination_worker": self.destination_worker,
            "destination_slot": self.destination_slot,
            "same_node": self.same_node,
        }


@dataclass(frozen=True)
class MigrationPlan:
    """Every expert copy needed to switch placements; sources are read before the switch."""

    copies: tuple[ExpertCopy, ...] = ()

    @property
    def num_copies(self) -> int:
        return len(self.copies)

    @property
    def num_cross_node(self) -> int:
        return sum(1 for copy in self.copies if not copy.same_node)

    def to_list(self) -> list[dict[str, Any]]:
        return [copy.to_dict() for copy in self.copies]


def plan_migration(current: PlacementTable, new: PlacementTable) -> MigrationPlan:
    """The copies that take ``current`` to ``new``, each with a source worker.

    A source is a worker holding the expert in ``current``; one on the destination's node
    is preferred (NVLink instead of the network), then the one sending the fewest copies
    so far, so that no single worker serialises the whole migration.
    """
    _check_compatible(current, new)
    mask = copy_mask(current.phy2log, new.phy2log, new.slots_per_worker, new.num_experts)
    old_held = holdings(current.phy2log, current.slots_per_worker, current.num_experts)
    sent = np.zeros(current.num_workers, dtype=np.int64)
    copies = []
    for layer, worker, expert in zip(*np.nonzero(mask)):
        sources = np.flatnonzero(old_held[layer, :, expert])
        same_node = current.worker2node[sources] == new.worker2node[worker]
        # Step 1: same node first, then the least busy sender, then the lowest index.
        order = np.lexsort((sources, sent[sources], ~same_node))
        source = int(sources[order[0]])
        sent[source] += 1
        slots = new.worker_slots(int(worker))
        slot = next(s for s in slots if new.phy2log[layer, s] == expert)
        copies.append(
            ExpertCopy(int(layer), int(expert), source, int(worker), int(slot), bool(same_node[order[0]]))
        )
    return MigrationPlan(tuple(copies))
