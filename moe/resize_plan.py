"""Where experts go when the expert pool grows or shrinks (issue 31 item 1), as pure math.

Legend: L MoE layers, E logical experts, W workers now, Wn workers after, S slots per worker.

A worker's slots (S) are fixed at deploy (its pool is allocated once), so a resize changes
the number of workers only: a placement of ``Wn * S`` physical slots, where slot ``s`` lives
on worker ``s // S`` as always. Workers keep their indices; growing appends workers
``W .. Wn-1``, shrinking removes the last ones.

- :func:`plan_grow`: the new workers' slots are filled with replicas, hottest first (the
  expert whose load per copy is highest gets the next copy; with no load known, the expert
  with the fewest copies, lowest index first), never twice on one worker while another expert
  could go there. Each copy comes from a live worker that holds the expert (same node first,
  then the source that sends least). Old workers keep exactly what they hold.
- :func:`plan_shrink`: every expert held only by a leaving worker gets a slot on a staying
  worker (an empty slot first, else one holding a copy the expert can spare: the copy with
  the least load per copy), copied from a leaving worker that holds it. The result is a
  placement of all ``W`` workers whose leaving workers' slots are empty (routing moves away
  from them at a step boundary); :func:`truncate` then drops those workers.

Each copy lands in a free row of its destination's pool: the rows :func:`free_rows` counts
(its spare rows and the rows of its empty slots, per layer). A plan that needs more is
refused by :class:`ResizeRefused`, naming the limit, as is a size the experts do not fit.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from raymoe.moe.placement import PlacementTable


class ResizeRefused(ValueError):
    """A resize that cannot be done as asked; the message names the limit. Nothing changed."""


@dataclass(frozen=True)
class ResizeCopy:
    """One expert copied worker to worker for a resize (the migration's copy, as rebalances make)."""

    layer: int
    expert: int
    source_worker: int
    destination_worker: int
    destination_slot: int  # physical slot in the target placement
    same_node: bool

    def to_dict(self) -> dict[str, int | bool]:
        return {"layer": self.layer, "expert": self.expert, "source_worker": self.source_worker,
                "destination_worker": self.destination_worker, "destination_slot": self.destination_slot,
                "same_node": self.same_node}


def min_workers(num_experts: int, slots_per_worker: int) -> int:
    """The fewest workers whose slots hold every expert of a layer once."""
    return -(-num_experts // slots_per_worker)


def check_size(current: PlacementTable, workers: int) -> None:
    """Refuse a size below what one copy of every expert needs (each worker's pool holds
    ``slots_per_worker`` experts a layer, fixed at deploy) or below 1."""
    if workers < 1:
        raise ResizeRefused(f"workers must be >= 1, got {workers}")
    needed = min_workers(current.num_experts, current.slots_per_worker)
    if workers < needed:
        raise ResizeRefused(
            f"workers={workers} cannot hold the experts: each layer has {current.num_experts} experts and each worker "
            f"{current.slots_per_worker} slots (its expert memory, fixed at deploy), so at least {needed} workers "
            f"are needed")


def free_rows(table: PlacementTable, spare_rows: int) -> np.ndarray:
    """``[L, W]`` pool rows a copy may land in: the spare rows plus the rows of empty slots."""
    empty = (table.phy2log < 0).reshape(table.num_layers, table.num_workers, table.slots_per_worker).sum(axis=2)
    return empty + spare_rows


def _per_copy(load: np.ndarray, counts: np.ndarray) -> np.ndarray:
    return load / np.maximum(counts, 1)


def plan_grow(current: PlacementTable, workers: int, load: np.ndarray | None,
              new_worker2node: list[int] | None = None) -> tuple[np.ndarray, list[ResizeCopy]]:
    """``(phy2log [L, workers*S], copies)`` filling workers ``W .. workers-1`` (module docstring)."""
    S, W, E = current.slots_per_worker, current.num_workers, current.num_experts
    if workers <= W:
        raise ValueError(f"plan_grow: {workers} workers is not more than {W}")
    load = np.zeros((current.num_layers, E)) if load is None else np.asarray(load, dtype=np.float64)
    worker2node = list(current.worker2node.tolist()) + list(new_worker2node or [0] * (workers - W))
    phy2log = np.full((current.num_layers, workers * S), -1, dtype=np.int64)
    phy2log[:, : W * S] = current.phy2log
    copies: list[ResizeCopy] = []
    for layer in range(current.num_layers):
        counts = current.logcnt[layer].astype(np.int64).copy()
        holders = {e: sorted({int(s) // S for s in current.log2phy[layer, e] if s >= 0}) for e in range(E)}
        sent = np.zeros(W, dtype=np.int64)
        for worker in range(W, workers):
            on_worker: set[int] = set()
            for local in range(S):
                candidates = [e for e in range(E) if e not in on_worker] or list(range(E))
                # hottest per copy first; then fewest copies; then lowest index
                expert = min(candidates, key=lambda e: (-_per_copy(load[layer, e], counts[e]), counts[e], e))
                sources = holders[expert]
                source = min(sources, key=lambda w: (worker2node[w] != worker2node[worker], sent[w], w))
                sent[source] += 1
                slot = worker * S + local
                phy2log[layer, slot] = expert
                counts[expert] += 1
                on_worker.add(expert)
                copies.append(ResizeCopy(layer, expert, source, worker, slot,
                                         worker2node[source] == worker2node[worker]))
    return phy2log, copies


def plan_shrink(current: PlacementTable, workers: int, load: np.ndarray | None,
                spare_rows: int) -> tuple[np.ndarray, list[ResizeCopy]]:
    """``(phy2log [L, W*S], copies)``: workers ``workers .. W-1`` hold nothing, every expert
    has a slot on workers ``0 .. workers-1`` (module docstring). Refuses (:class:`ResizeRefused`)
    a size the experts do not fit, or copies beyond a destination's free pool rows."""
    S, W, E = current.slots_per_worker, current.num_workers, current.num_experts
    if workers >= W:
        raise ValueError(f"plan_shrink: {workers} workers is not fewer than {W}")
    check_size(current, workers)
    load = np.zeros((current.num_layers, E)) if load is None else np.asarray(load, dtype=np.float64)
    phy2log = current.phy2log.copy()
    phy2log[:, workers * S:] = -1
    rows = free_rows(current, spare_rows)
    copies: list[ResizeCopy] = []
    for layer in range(current.num_layers):
        kept = phy2log[layer, : workers * S]
        counts = np.bincount(kept[kept >= 0], minlength=E)
        missing = [e for e in range(E) if counts[e] == 0]
        # the hottest missing expert first: it gets the best slot
        missing.sort(key=lambda e: (-load[layer, e], e))
        received = np.zeros(workers, dtype=np.int64)
        for expert in missing:
            empty = [s for s in range(workers * S) if phy2log[layer, s] < 0]
            if empty:
                slot = min(empty, key=lambda s: (received[s // S], s))
            else:
                spare = [s for s in range(workers * S) if counts[phy2log[layer, s]] > 1]
                if not spare:  # cannot happen when check_size passed; kept for a clear message
                    raise ResizeRefused(f"layer {layer}: no slot left on workers 0..{workers - 1} for expert {expert}")
                slot = min(spare, key=lambda s: (_per_copy(load[layer, phy2log[layer, s]], counts[phy2log[layer, s]]),
                                                 -counts[phy2log[layer, s]], received[s // S], s))
                counts[phy2log[layer, slot]] -= 1
            destination = slot // S
            received[destination] += 1
            if received[destination] > rows[layer, destination]:
                raise ResizeRefused(
                    f"workers={workers}: layer {layer} needs more expert copies onto worker {destination} than its pool "
                    f"has free rows ({rows[layer, destination]}: spare rows and empty slots); a worker's spare rows "
                    f"come from balancer.enabled and balancer.max_copies_per_rebalance (docs/CONFIG.md)")
            sources = sorted({int(s) // S for s in current.log2phy[layer, expert] if s >= 0})
            source = min(sources, key=lambda w: (current.worker2node[w] != current.worker2node[destination], w))
            phy2log[layer, slot] = expert
            counts[expert] += 1
            copies.append(ResizeCopy(layer, expert, source, destination, slot,
                                     bool(current.worker2node[source] == current.worker2node[destination])))
    return phy2log, copies


def truncate(table: PlacementTable, workers: int, epoch: int) -> PlacementTable:
    """``table`` over its first ``workers`` workers (the others must hold nothing), in ``epoch``."""
    S = table.slots_per_worker
    if (table.phy2log[:, workers * S:] >= 0).any():
        raise ValueError(f"truncate: workers {workers}.. still hold experts")
    return PlacementTable.from_phy2log(table.phy2log[:, : workers * S], S, table.num_experts,
                                       table.worker2node[:workers], epoch)
