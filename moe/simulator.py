"""Routing simulator: what a placement does with a batch of routed tokens.

Legend: L MoE layers, E logical experts, T tokens, k top-k, W workers, S slots per worker,
P = W * S physical slots, D hidden size, M nodes.

Tokens start on a source worker (contiguous blocks of the batch, as with data-parallel
attention). The i-th assignment to an expert goes to its replica ``i mod replicas``, so a
replicated expert's tokens split evenly, the same rule the balancers assume. Per layer it
counts assignments per worker and dispatch bytes four ways: naive (every assignment is a
payload, local or not; the seeds' T x k x D x s), remote (assignments leaving their source
worker), deduplicated per worker (a token goes once to each remote worker however many of
its experts live there) and deduplicated per node (once to each remote node: the
cross-node traffic). Combine returns the same widths, so its bytes equal dispatch's.
Replay of recorded telemetry works from counts alone (no token identities), so it gives
loads and drops but no bytes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from raymoe.moe.balance_metrics import balancedness, imbalance, worker_load
from raymoe.moe.placement import PlacementTable


@dataclass(frozen=True)
class SimulationResult:
    assignments_per_worker: np.ndarray  # [L, W]
    activated_per_worker: np.ndarray  # [L, W] distinct slots that received a token
    dispatch_bytes_naive: int
    dispatch_bytes_remote: int
    dispatch_bytes_dedup_worker: int
    dispatch_bytes_dedup_node: int
    cross_worker_fraction: float
    dropped: int
    num_assignments: int
    imbalance: float = field(init=False)
    balancedness: float = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "imbalance", imbalance(self.assignments_per_worker))
        object.__setattr__(self, "balancedness", balancedness(self.assignments_per_worker))

    @property
    def combine_bytes_naive(self) -> int:
        return self.dispatch_bytes_naive

    def to_dict(self) -> dict[str, Any]:
        return {
            "assignments_per_worker": self.assignments_per_worker.tolist(),
            "max_over_mean": self.imbalance,
            "balancedness": self.balancedness,
            "dispatch_bytes_naive": self.dispatch_bytes_naive,
            "combine_bytes_naive": self.combine_bytes_naive,
            "dispatch_bytes_remote": self.dispatch_bytes_remote,
            "dispatch_bytes_dedup_worker": self.dispatch_bytes_dedup_worker,
            "dispatch_bytes_dedup_node": self.dispatch_bytes_dedup_node,
            "cross_worker_fraction": self.cross_worker_fraction,
            "dropped": self.dropped,
            "num_assignments": self.num_assignments,
            "max_activated_per_worker": float(self.activated_per_worker.max(axis=1).mean()),
        }


def slot_capacity(capacity_factor: float, num_assignments: int, num_slots: int) -> int:
    """Assignments one physical slot may take: ceil(factor x assignments / slots)."""
    if capacity_factor <= 0:
        raise ValueError(f"capacity_factor must be > 0, got {capacity_factor}")
    return math.ceil(capacity_factor * num_assignments / num_slots)


def contiguous_sources(num_tokens: int, num_workers: int) -> np.ndarray:
    """[T] source worker of each token: the batch split into W contiguous blocks."""
    return np.arange(num_tokens, dtype=np.int64) * num_workers // max(num_tokens, 1)


def assign_slots(topk_ids: np.ndarray, placement: PlacementTable, layer: int) -> np.ndarray:
    """[T, k] expert ids of one layer -> [T, k] physical slots, replicas round-robin."""
    flat = topk_ids.reshape(-1)
    order = np.argsort(flat, kind="stable")
    sorted_experts = flat[order]
    # Step 1: the rank of each assignment among those to the same expert, in token order.
    starts = np.r_[0, np.flatnonzero(np.diff(sorted_experts)) + 1]
    lengths = np.diff(np.r_[starts, flat.size])
    rank = np.empty_like(flat)
    rank[order] = np.arange(flat.size) - np.repeat(starts, lengths)
    # Step 2: round-robin over the expert's replicas.
    replica = rank % placement.logcnt[layer, flat]
    return placement.log2phy[layer, flat, replica].reshape(topk_ids.shape)


def simulate_routing(
    topk_ids: np.ndarray,
    placement: PlacementTable,
    hidden_size: int,
    bytes_per_value: int,
    capacity_factor: float | None = None,
    source_worker: np.ndarray | None = None,
) -> SimulationResult:
    """Simulate one batch. topk_ids: [L, T, k] expert ids; source_worker: [T] (default:
    contiguous blocks). Bytes are summed over layers."""
    topk_ids = np.asarray(topk_ids, dtype=np.int64)
    if topk_ids.ndim != 3 or topk_ids.shape[0] != placement.num_layers:
        raise ValueError(f"topk_ids must be [{placement.num_layers}, tokens, k], got {topk_ids.shape}")
    num_layers, num_tokens, top_k = topk_ids.shape
    num_workers, slots_per_worker = placement.num_workers, placement.slots_per_worker
    if source_worker is None:
        source_worker = contiguous_sources(num_tokens, num_workers)
    source_worker = np.asarray(source_worker, dtype=np.int64)
    if source_worker.shape != (num_tokens,) or (source_worker < 0).any() or (source_worker >= num_workers).any():
        raise ValueError(f"source_worker must be [{num_tokens}] worker ids below {num_workers}")
    worker2node = placement.worker2node
    value_bytes = hidden_size * bytes_per_value
    per_worker = np.zeros((num_layers, num_workers), dtype=np.int64)
    activated = np.zeros((num_layers, num_workers), dtype=np.int64)
    remote = dedup_worker = dedup_node = dropped = 0
    capacity = None if capacity_factor is None else slot_capacity(capacity_factor, num_tokens * top_k, placement.num_slots)
    for layer in range(num_layers):
        slots = assign_slots(topk_ids[layer], placement, layer)  # [T, k]
        destination = slots // slots_per_worker  # [T, k]
        slot_count = np.bincount(slots.reshape(-1), minlength=placement.num_slots)
        per_worker[layer] = slot_count.reshape(num_workers, slots_per_worker).sum(axis=1)
        activated[layer] = (slot_count > 0).reshape(num_workers, slots_per_worker).sum(axis=1)
        if capacity is not None:
            dropped += int(np.maximum(slot_count - capacity, 0).sum())
        # Step 1: remote assignments, then each token once per remote worker and node.
        is_remote = destination != source_worker[:, None]
        remote += int(is_remote.sum())
        token = np.repeat(np.arange(num_tokens), top_k).reshape(num_tokens, top_k)
        dedup_worker += np.unique((token * num_workers + destination)[is_remote]).size
        node = worker2node[destination]
        cross_node = node != worker2node[source_worker][:, None]
        dedup_node += np.unique((token * placement.num_nodes + node)[cross_node]).size
    num_assignments = num_layers * num_tokens * top_k
    return SimulationResult(
        assignments_per_worker=per_worker,
        activated_per_worker=activated,
        dispatch_bytes_naive=num_assignments * value_bytes,
        dispatch_bytes_remote=remote * value_bytes,
        dispatch_bytes_dedup_worker=dedup_worker * value_bytes,
        dispatch_bytes_dedup_node=dedup_node * value_bytes,
        cross_worker_fraction=remote / num_assignments if num_assignments else 0.0,
        dropped=dropped,
        num_assignments=num_assignments,
    )


def load_from_telemetry(data: Any, placement: PlacementTable | None = None) -> np.ndarray:
    """Recorded counts -> [L, E] load per logical expert.

    data: ``{"load": [L, E]}`` per expert, ``{"slot_load": [L, P]}`` per physical slot
    (folded onto experts through ``placement``), or a bare [L, E] array.
    """
    if isinstance(data, dict):
        if "slot_load" in data:
            if placement is None:
                raise ValueError("per-slot telemetry needs the placement it was recorded under")
            slot_load = np.asarray(data["slot_load"], dtype=np.float64)
            if slot_load.shape != placement.phy2log.shape:
                raise ValueError(f"slot_load {slot_load.shape} does not match placement {placement.phy2log.shape}")
            load = np.zeros((placement.num_layers, placement.num_experts))
            layer, slot = np.nonzero(placement.phy2log >= 0)
            np.add.at(load, (layer, placement.phy2log[layer, slot]), slot_load[layer, slot])
            return load
        if "load" not in data:
            raise ValueError("telemetry must have a 'load' or a 'slot_load' key")
        data = data["load"]
    load = np.asarray(data, dtype=np.float64)
    if load.ndim != 2 or (load < 0).any():
        raise ValueError(f"load must be a non-negative [layers, experts] array, got shape {load.shape}")
    return load


def replay_load(load: np.ndarray, placement: PlacementTable, capacity_factor: float | None = None) -> dict[str, Any]:
    """Worker loads, balance and drops of recorded counts [L, E] under ``placement``."""
    per_worker = worker_load(load, placement.phy2log, placement.slots_per_worker)  # [L, W]
    result: dict[str, Any] = {
        "assignments_per_worker": per_worker.tolist(),
        "max_over_mean": imbalance(per_worker),
        "balancedness": balancedness(per_worker),
    }
    if capacity_factor is not None:
        load = np.asarray(load, dtype=np.float64)
        occupied = placement.phy2log >= 0
        expert = np.maximum(placement.phy2log, 0)
        slot_load = np.take_along_axis(load / placement.logcnt, expert, axis=1) * occupied  # [L, P]
        capacity = np.array(
            [slot_capacity(capacity_factor, int(round(total)), placement.num_slots) for total in load.sum(axis=1)]
        )
        result["dropped"] = float(np.maximum(slot_load - capacity[:, None], 0).sum())
    return result
