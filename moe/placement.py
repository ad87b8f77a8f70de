"""The placement table: which physical slot holds which logical expert, on which worker.

Legend: L MoE layers, E logical experts per layer, W workers, S slots per worker,
P = W * S physical slots per layer, Rc the largest replica count of any expert.

Index maps follow one vocabulary (``src2dst``):

- ``phy2log: [L, P]``  logical expert held by each physical slot (-1: empty slot)
- ``log2phy: [L, E, Rc]`` physical slots holding each logical expert, ascending, -1 padded
- ``logcnt:  [L, E]``  number of replicas of each logical expert
- ``slot2worker: [P]`` worker owning each slot (``slot // S``: equal slots per worker)
- ``worker2node: [W]`` node index of each worker

A :class:`PlacementTable` is the single source of truth for placement. YAML configs and
balancers produce one; everybody else only reads it. It is immutable: a new placement is a
new table with a larger ``epoch``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np


def _frozen(array: np.ndarray) -> np.ndarray:
    array = np.ascontiguousarray(array, dtype=np.int64)
    array.setflags(write=False)
    return array


@dataclass(frozen=True, eq=False)
class PlacementTable:
    """Per-layer placement of logical experts onto physical slots of workers.

    Build one with :meth:`from_phy2log`; the derived maps are computed and validated once.
    """

    phy2log: np.ndarray  # [L, P]
    slots_per_worker: int
    worker2node: np.ndarray  # [W]
    num_experts: int
    epoch: int = 0
    log2phy: np.ndarray = field(init=False)  # [L, E, Rc]
    logcnt: np.ndarray = field(init=False)  # [L, E]

    @classmethod
    def from_phy2log(
        cls,
        phy2log: np.ndarray | Sequence[Sequence[int]],
        slots_per_worker: int,
        num_experts: int,
        worker2node: np.ndarray | Sequence[int] | None = None,
        epoch: int = 0,
    ) -> "PlacementTable":
        phy2log = np.asarray(phy2log, dtype=np.int64)
        if phy2log.ndim != 2:
            raise ValueError(f"phy2log must be [layers, slots], got shape {phy2log.shape}")
        if slots_per_worker <= 0 or phy2log.shape[1] % slots_per_worker:
            raise ValueError(
                f"{phy2log.shape[1]} physical slots cannot be split into equal groups of "
                f"slots_per_worker={slots_per_worker}"
            )
        num_workers = phy2log.shape[1] // slots_per_worker
        if worker2node is None:
            worker2node = np.zeros(num_workers, dtype=np.int64)
        return cls(
            phy2log=phy2log,
            slots_per_worker=int(slots_per_worker),
            worker2node=np.asarray(worker2node, dtype=np.int64),
            num_experts=int(num_experts),
            epoch=int(epoch),
        )

    def __post_init__(self) -> None:
        phy2log = _frozen(self.phy2log)
        worker2node = _frozen(self.worker2node)
        object.__setattr__(self, "phy2log", phy2log)
        object.__setattr__(self, "worker2node", worker2node)
        num_layers, num_slots = phy2log.shape
        if worker2node.shape != (num_slots // self.slots_per_worker,):
            raise ValueError(
                f"worker2node has {worker2node.shape[0]} entries, expected one per worker "
                f"({num_slots // self.slots_per_worker})"
            )
        if self.epoch < 0:
            raise ValueError(f"epoch must be >= 0, got {self.epoch}")
        bad = (phy2log < -1) | (phy2log >= self.num_experts)
        if bad.any():
            layer, slot = np.argwhere(bad)[0]
            raise ValueError(
                f"layer {layer} slot {slot} holds expert {phy2log[layer, slot]}, "
                f"outside [0, {self.num_experts})"
            )
        # Step 1: count replicas per logical expert; every expert must live somewhere.
        logcnt = np.zeros((num_layers, self.num_experts), dtype=np.int64)
        layer_idx, slot_idx = np.nonzero(phy2log >= 0)
        np.add.at(logcnt, (layer_idx, phy2log[layer_idx, slot_idx]), 1)
        missing = np.argwhere(logcnt == 0)
        if len(missing):
            layer, expert = missing[0]
            raise ValueError(f"layer {layer}: logical expert {expert} has no physical slot")
        # Step 2: list each expert's slots in ascending order, padded with -1.
        max_replicas = int(logcnt.max()) if logcnt.size else 1
        log2phy = np.full((num_layers, self.num_experts, max_replicas), -1, dtype=np.int64)
        order = np.lexsort((slot_idx, phy2log[layer_idx, slot_idx], layer_idx))
        layer_s, slot_s = layer_idx[order], slot_idx[order]
        expert_s = phy2log[layer_s, slot_s]
        group_start = np.r_[0, np.flatnonzero(np.diff(layer_s * self.num_experts + expert_s)) + 1]
        rank = np.arange(len(slot_s)) - np.repeat(group_start, np.diff(np.r_[group_start, len(slot_s)]))
        log2phy[layer_s, expert_s, rank] = slot_s
        object.__setattr__(self, "log2phy", _frozen(log2phy))
        object.__setattr__(self, "logcnt", _frozen(logcnt))

    # ---- shape -------------------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return int(self.phy2log.shape[0])

    @property
    def num_slots(self) -> int:
        return int(self.phy2log.shape[1])

    @property
    def num_workers(self) -> int:
        return self.num_slots // self.slots_per_worker

    @property
    def num_nodes(self) -> int:
        return int(self.worker2node.max()) + 1 if self.worker2node.size else 0

    @property
    def slot2worker(self) -> np.ndarray:
        """``[P]`` worker owning each physical slot."""
        return np.arange(self.num_slots, dtype=np.int64) // self.slots_per_worker

    # ---- queries -----------------------------------------------------------------------
    def replicas(self, layer: int, expert: int) -> list[int]:
        """Physical slots holding ``expert`` at ``layer``, ascending."""
        count = int(self.logcnt[layer, expert])
        return [int(s) for s in self.log2phy[layer, expert, :count]]

    def worker_slots(self, worker: int) -> range:
        return range(worker * self.slots_per_worker, (worker + 1) * self.slots_per_worker)

    def worker_experts(self, layer: int, worker: int) -> list[int]:
        """Logical expert of each of ``worker``'s slots at ``layer`` (-1: empty)."""
        s = self.slots_per_worker
        return [int(e) for e in self.phy2log[layer, worker * s : (worker + 1) * s]]

    def with_phy2log(self, phy2log: np.ndarray) -> "PlacementTable":
        """A new table over the same workers with ``phy2log`` and the next epoch."""
        return PlacementTable.from_phy2log(
            phy2log, self.slots_per_worker, self.num_experts, self.worker2node, self.epoch + 1
        )

    def with_layer(self, layer: int, row: np.ndarray | Sequence[int]) -> "PlacementTable":
        """A new table, next epoch, where only ``layer``'s slots change to ``row: [P]``."""
        phy2log = self.phy2log.copy()
        phy2log[layer] = np.asarray(row, dtype=np.int64)
        return self.with_phy2log(phy2log)

    def same_placement(self, other: "PlacementTable") -> bool:
        return (
            self.slots_per_worker == other.slots_per_worker
            and self.num_experts == other.num_experts
            and np.array_equal(self.phy2log, other.phy2log)
            and np.array_equal(self.worker2node, other.worker2node)
        )

    # ---- serialisation (JSON-friendly, never pickle) -----------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "num_experts": self.num_experts,
            "slots_per_worker": self.slots_per_worker,
            "worker2node": self.worker2node.tolist(),
            "phy2log": self.phy2log.tolist(),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "PlacementTable":
        return cls.from_phy2log(
            data["phy2log"],
            data["slots_per_worker"],
            data["num_experts"],
            data["worker2node"],
            data["epoch"],
        )

    def __repr__(self) -> str:
        return (
            f"PlacementTable(epoch={self.epoch}, layers={self.num_layers}, "
            f"experts={self.num_experts}, workers={self.num_workers}, "
            f"slots_per_worker={self.slots_per_worker}, nodes={self.num_nodes})"
        )


def single_worker_placement(num_layers: int, num_experts: int) -> PlacementTable:
    """Every expert in one slot of one worker: the in-process engine's placement."""
    phy2log = np.tile(np.arange(num_experts, dtype=np.int64), (num_layers, 1))
    return PlacementTable.from_phy2log(phy2log, num_experts, num_experts)
