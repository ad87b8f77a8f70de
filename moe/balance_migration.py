"""Migration-aware balancing: near the global optimum while copying few expert weights.

Legend: L MoE layers, E logical experts, W workers, S slots per worker, P = W * S slots.

Plain EPLB ignores the current placement, so re-planning on a fresh sample of the same
load moves most slots to a different GPU. Here each layer is handled on its own:

1. Plan the global optimum for the new load; its max/mean is the target.
2. If the current placement is already within ``tolerance`` of the target, keep it: load
   noise copies nothing.
3. Otherwise take the cheaper of two candidates that reach the target within tolerance:
   a local search from the current placement that pays for every copy (experts stay where
   they already serve), and the fresh optimum relabelled so that each of its worker bins
   lands on the current worker it overlaps most (an assignment problem) and each kept
   expert keeps its slot.
4. With a copy budget, a candidate over budget is out; if none reaches the target, the
   best-balanced candidate within budget wins.
"""

from __future__ import annotations

import numpy as np

from raymoe.moe.balance_global import balance_global, validate_shape
from raymoe.moe.balance_metrics import holdings, layer_imbalance, worker_load
from raymoe.moe.balance_search import SearchLimits, improve_layer
from raymoe.moe.placement import PlacementTable


def assign_max_overlap(overlap: np.ndarray) -> np.ndarray:
    """Hungarian method: the permutation maximising total overlap.

    overlap: [n, n] (row = new bin, column = current worker). Returns column per row [n].
    """
    cost = overlap.max() - np.asarray(overlap, dtype=np.float64)
    size = cost.shape[0]
    # Potentials u (rows), v (columns); match[j] is the row matched to column j (1-based).
    u = np.zeros(size + 1)
    v = np.zeros(size + 1)
    match = np.zeros(size + 1, dtype=np.int64)
    for row in range(1, size + 1):
        match[0] = row
        column = 0
        best = np.full(size + 1, np.inf)
        previous = np.zeros(size + 1, dtype=np.int64)
        used = np.zeros(size + 1, dtype=bool)
        # Step 1: grow a shortest augmenting path from the new row.
        while match[column] != 0:
            used[column] = True
            current_row = match[column]
            reduced = cost[current_row - 1] - u[current_row] - v[1:]
            improve = ~used[1:] & (reduced < best[1:])
            best[1:][improve] = reduced[improve]
            previous[1:][improve] = column
            free = np.flatnonzero(~used[1:]) + 1
            next_column = int(free[np.argmin(best[free])])
            delta = best[next_column]
            u[match[used]] += delta
            v[used] -= delta
            best[~used] -= delta
            column = next_column
        # Step 2: flip the path.
        while column:
            match[column] = match[previous[column]]
            column = previous[column]
    result = np.zeros(size, dtype=np.int64)
    result[match[1:] - 1] = np.arange(size)
    return result


def align_to_current(new_row: np.ndarray, current_row: np.ndarray, slots_per_worker: int) -> np.ndarray:
    """Relabel the workers of ``new_row`` [P] to overlap ``current_row`` [P] the most.

    Worker loads are unchanged (whole bins move); within a worker, experts it already had
    keep their old slots. Returns the relabelled row [P].
    """
    num_experts = int(max(new_row.max(), current_row.max())) + 1
    new_held = holdings(new_row[None], slots_per_worker, num_experts)[0]  # [W, E]
    old_held = holdings(current_row[None], slots_per_worker, num_experts)[0]
    overlap = np.minimum(new_held[:, None, :], old_held[None, :, :]).sum(axis=2)  # [W_new, W_old]
    target_of_bin = assign_max_overlap(overlap)
    aligned = np.empty_like(new_row)
    for bin_index, worker in enumerate(target_of_bin):
        incoming = list(new_row[bin_index * slots_per_worker : (bin_index + 1) * slots_per_worker])
        old_slots = current_row[worker * slots_per_worker : (worker + 1) * slots_per_worker]
        slots = [-2] * slots_per_worker
        for position, expert in enumerate(old_slots):
            if expert in incoming:
                slots[position] = expert
                incoming.remove(expert)
        for position in range(slots_per_worker):
            if slots[position] == -2:
                slots[position] = incoming.pop(0)
        aligned[worker * slots_per_worker : (worker + 1) * slots_per_worker] = slots
    return aligned


def _layer_copies(row: np.ndarray, current_row: np.ndarray, slots_per_worker: int, num_experts: int) -> int:
    new = holdings(row[None], slots_per_worker, num_experts)[0] > 0
    old = holdings(current_row[None], slots_per_worker, num_experts)[0] > 0
    return int((new & ~old).sum())


def balance_migration(
    load: np.ndarray,
    current: PlacementTable,
    tolerance: float = 0.02,
    max_copies_per_layer: int | None = None,
) -> PlacementTable:
    """Rebalance ``current`` for ``load`` [L, E], copying as few expert weights as possible.

    tolerance: how far above the fresh optimum's max/mean a layer may stay.
    max_copies_per_layer: the migration budget, in expert copies per layer (None: no cap).
    Returns a table over the same workers and nodes with the next epoch.
    """
    slots_per_worker = current.slots_per_worker
    load = validate_shape(load, current.num_workers, slots_per_worker)
    if load.shape != (current.num_layers, current.num_experts):
        raise ValueError(
            f"load {load.shape} does not match the current placement's [layers, experts] "
            f"({current.num_layers}, {current.num_experts})"
        )
    if tolerance < 0:
        raise ValueError(f"tolerance must be >= 0, got {tolerance}")
    if max_copies_per_layer is not None and max_copies_per_layer < 0:
        raise ValueError(f"max_copies_per_layer must be >= 0, got {max_copies_per_layer}")
    # Step 1: the fresh optimum and its max/mean per layer.
    fresh = balance_global(load, current.num_workers, slots_per_worker)
    target = layer_imbalance(worker_load(load, fresh.phy2log, slots_per_worker))
    now = layer_imbalance(worker_load(load, current.phy2log, slots_per_worker))
    old_held = holdings(current.phy2log, slots_per_worker, current.num_experts)
    rows = []
    for layer in range(current.num_layers):
        current_row = current.phy2log[layer]
        goal = target[layer] + tolerance
        # Step 2: noise: keep the layer as it is.
        if now[layer] <= goal:
            rows.append(current_row.copy())
            continue
        # Step 3: local search from the current placement, and the aligned fresh optimum.
        limits = SearchLimits(stop_imbalance=goal, max_copies=max_copies_per_layer)
        candidates = [
            improve_layer(current_row, load[layer], slots_per_worker, old_held[layer], limits),
            align_to_current(fresh.phy2log[layer], current_row, slots_per_worker),
        ]
        rows.append(_choose(candidates, current_row, load[layer], slots_per_worker, goal, max_copies_per_layer))
    return current.with_phy2log(np.stack(rows))


def _choose(
    candidates: list[np.ndarray],
    current_row: np.ndarray,
    load: np.ndarray,
    slots_per_worker: int,
    goal: float,
    max_copies: int | None,
) -> np.ndarray:
    """Step 4: fewest copies among those reaching the goal, else the best balanced."""
    num_experts = load.shape[0]
    scored = []
    for row in candidates:
        copies = _layer_copies(row, current_row, slots_per_worker, num_experts)
        ratio = float(layer_imbalance(worker_load(load[None], row[None], slots_per_worker))[0])
        if max_copies is None or copies <= max_copies:
            scored.append((ratio > goal + 1e-12, copies if ratio <= goal + 1e-12 else ratio, ratio, row))
    if not scored:
        return current_row.copy()
    return min(scored, key=lambda item: item[:3])[3]
