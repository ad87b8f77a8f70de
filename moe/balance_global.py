"""Global and hierarchical balancers: replicate hot experts, then pack slots onto workers.

Legend: L MoE layers, E logical experts, W workers, S slots per worker, P = W * S physical
slots per layer, M nodes, G expert groups (group-limited routing, DeepSeek-V3's n_group),
Ni items being packed.

This is DeepSeek's EPLB policy with a better packing step. EPLB places items greedily,
heaviest first, on the lightest worker with room (LPT). We start from the same greedy
packing and then swap slots between the busiest worker and the others while the swap
lowers the busier side, so the result is never worse than the greedy one. As in EPLB,
the global policy is the hierarchical one with one group and one node: one code path.
"""

from __future__ import annotations

import numpy as np

from raymoe.moe.balance_search import SearchLimits, improve_layer
from raymoe.moe.placement import PlacementTable

_EPSILON = 1e-12
_POLISH = SearchLimits(stop_imbalance=1.0, max_moves=256)
_COUNT_ROUNDS = 8
_COUNT_CANDIDATES = 6


def worker_to_node(num_workers: int, num_nodes: int) -> np.ndarray:
    """[W] node of each worker: contiguous blocks of W / M workers."""
    if num_nodes <= 0 or num_workers % num_nodes:
        raise ValueError(f"{num_workers} workers do not split evenly onto {num_nodes} nodes")
    return np.arange(num_workers, dtype=np.int64) // (num_workers // num_nodes)


def replicate_by_load(load: np.ndarray, num_slots: int) -> np.ndarray:
    """Replica count per expert: each redundant slot goes to the largest load per replica.

    load: [E] for one layer (or one node's experts). Returns counts [E] summing to num_slots.
    """
    num_experts = load.shape[0]
    if num_slots < num_experts:
        raise ValueError(f"{num_slots} slots cannot hold {num_experts} experts")
    counts = np.ones(num_experts, dtype=np.int64)
    for _ in range(num_slots - num_experts):
        counts[np.argmax(load / counts)] += 1
    return counts


def greedy_packing(weight: np.ndarray, num_packs: int) -> np.ndarray:
    """LPT with equal counts: heaviest item first onto the lightest pack with room.

    weight: [Ni] item weights, Ni divisible by num_packs. Returns pack of each item [Ni].
    """
    num_items = weight.shape[0]
    if num_items % num_packs:
        raise ValueError(f"{num_items} items do not split evenly into {num_packs} packs")
    capacity = num_items // num_packs
    pack_of_item = np.zeros(num_items, dtype=np.int64)
    pack_weight = np.zeros(num_packs)
    pack_items = np.zeros(num_packs, dtype=np.int64)
    for item in np.argsort(-weight, kind="stable"):
        pack = int(np.argmin(np.where(pack_items < capacity, pack_weight, np.inf)))
        pack_of_item[item] = pack
        pack_weight[pack] += weight[item]
        pack_items[pack] += 1
    return pack_of_item


def refine_by_swaps(weight: np.ndarray, pack_of_item: np.ndarray, num_packs: int) -> np.ndarray:
    """Swap items between the busiest pack and another while that lowers the busier side.

    A swap moving ``d`` from a pack at ``high`` to one at ``low`` with ``0 < d < high - low``
    strictly lowers the sum of squared pack weights, so the loop terminates; the busiest
    pack never gets busier, so the maximum never rises.
    weight: [Ni]; pack_of_item: [Ni]. Returns the refined pack of each item [Ni].
    """
    pack_of_item = pack_of_item.copy()
    if num_packs < 2:
        return pack_of_item
    scale = max(float(weight.sum()), _EPSILON)
    for _ in range(4 * weight.shape[0] + 16):
        pack_weight = np.bincount(pack_of_item, weights=weight, minlength=num_packs)
        busiest = int(np.argmax(pack_weight))
        mine = np.flatnonzero(pack_of_item == busiest)
        others = np.flatnonzero(pack_of_item != busiest)
        # Step 1: every (mine, other) swap; d is the weight moved off the busiest pack.
        moved = weight[mine][:, None] - weight[others][None, :]  # [n_mine, n_others]
        gap = pack_weight[busiest] - pack_weight[pack_of_item[others]][None, :]
        gain = np.minimum(moved, gap - moved)  # how much the busier side of the pair drops
        gain[(moved <= _EPSILON * scale) | (gap - moved <= _EPSILON * scale)] = -np.inf
        # Step 2: take the swap that lowers the busiest pack the most, if any.
        best = np.unravel_index(int(np.argmax(gain)), gain.shape)
        if not np.isfinite(gain[best]) or gain[best] <= _EPSILON * scale:
            break
        a, b = mine[best[0]], others[best[1]]
        pack_of_item[a], pack_of_item[b] = pack_of_item[b], pack_of_item[a]
    return pack_of_item


def pack_evenly(weight: np.ndarray, num_packs: int) -> np.ndarray:
    """Greedy packing followed by swap refinement. weight: [Ni]. Returns pack per item [Ni]."""
    return refine_by_swaps(weight, greedy_packing(weight, num_packs), num_packs)


def _pack_replicas(load: np.ndarray, counts: np.ndarray, num_packs: int) -> tuple[float, np.ndarray]:
    """Pack the replicas given by ``counts`` [E]; returns (peak pack load, pack per item)."""
    item_weight = np.repeat(load / counts, counts)
    pack = pack_evenly(item_weight, num_packs)
    return float(np.bincount(pack, weights=item_weight, minlength=num_packs).max()), pack


def search_replica_counts(load: np.ndarray, counts: np.ndarray, num_packs: int) -> np.ndarray:
    """Move single replicas between experts while re-packing lowers the peak.

    Greedy replication minimises the largest replica, not the busiest worker: giving a
    replica to a lighter expert can pack better. Candidates are the few experts with the
    largest load per replica (to gain) and the replicated ones that lose least (to give).
    load: [E]; counts: [E]. Returns improved counts [E].
    """
    counts = counts.copy()
    best_peak, _ = _pack_replicas(load, counts, num_packs)
    for _ in range(_COUNT_ROUNDS):
        per_replica = load / counts
        gainers = np.argsort(-per_replica, kind="stable")[:_COUNT_CANDIDATES]
        loss = np.where(counts >= 2, load / np.maximum(counts - 1, 1) - per_replica, np.inf)
        givers = np.argsort(loss, kind="stable")[: min(_COUNT_CANDIDATES, int((counts >= 2).sum()))]
        best_move = None
        for giver in givers:
            for gainer in gainers:
                if giver == gainer:
                    continue
                trial = counts.copy()
                trial[giver] -= 1
                trial[gainer] += 1
                peak, _ = _pack_replicas(load, trial, num_packs)
                if peak < best_peak * (1 - 1e-9):
                    best_peak, best_move = peak, trial
        if best_move is None:
            break
        counts = best_move
    return counts


def _items_to_slots(item_expert: np.ndarray, pack_of_item: np.ndarray) -> np.ndarray:
    """Lay items out pack by pack: [Ni] expert and pack per item -> [Ni] expert per slot."""
    return item_expert[np.lexsort((item_expert, pack_of_item))]


def _balance_layer(
    load: np.ndarray, num_workers: int, slots_per_worker: int, num_nodes: int, num_groups: int
) -> np.ndarray:
    """One layer. load: [E]. Returns phy2log row [P], node-major then worker-major."""
    num_experts = load.shape[0]
    group_size = num_experts // num_groups
    groups_per_node = num_groups // num_nodes
    workers_per_node = num_workers // num_nodes
    slots_per_node = workers_per_node * slots_per_worker
    # Step 1: pack groups onto nodes (equal groups per node) by group load.
    group_load = load.reshape(num_groups, group_size).sum(axis=1)
    node_of_group = pack_evenly(group_load, num_nodes) if num_nodes > 1 else np.zeros(num_groups, np.int64)
    row = []
    for node in range(num_nodes):
        groups = np.flatnonzero(node_of_group == node)
        experts = (groups[:, None] * group_size + np.arange(group_size)).reshape(-1)
        if experts.shape[0] != groups_per_node * group_size:
            raise ValueError("groups did not split evenly onto nodes")
        # Step 2: replicate this node's experts into its slots.
        counts = replicate_by_load(load[experts], slots_per_node)
        counts = search_replica_counts(load[experts], counts, workers_per_node)
        # Step 3: pack the node's replicas evenly onto its workers.
        _, pack = _pack_replicas(load[experts], counts, workers_per_node)
        local_row = _items_to_slots(np.repeat(np.arange(experts.shape[0]), counts), pack)
        # Step 4: polish by moving single replicas (changes replica counts) and swapping slots.
        local_row = improve_layer(local_row, load[experts], slots_per_worker, limits=_POLISH)
        row.append(experts[local_row])
    return np.concatenate(row)


def validate_shape(load: np.ndarray, num_workers: int, slots_per_worker: int) -> np.ndarray:
    """Check a load matrix against the slot layout; returns it as float64 [L, E]."""
    load = np.asarray(load, dtype=np.float64)
    if load.ndim != 2:
        raise ValueError(f"load must be [layers, experts], got shape {load.shape}")
    if not np.isfinite(load).all() or (load < 0).any():
        raise ValueError("load must be finite and non-negative")
    if num_workers <= 0 or slots_per_worker <= 0:
        raise ValueError(f"need workers > 0 and slots per worker > 0, got {num_workers}, {slots_per_worker}")
    if num_workers * slots_per_worker < load.shape[1]:
        raise ValueError(
            f"{num_workers} workers x {slots_per_worker} slots cannot hold {load.shape[1]} experts"
        )
    return load


def balance_hierarchical(
    load: np.ndarray, num_workers: int, slots_per_worker: int, num_nodes: int = 1, num_groups: int = 1
) -> PlacementTable:
    """Groups onto nodes, replicas within nodes, replicas onto workers.

    load: [L, E]. Needs E % G == 0, G % M == 0, W % M == 0 and every node's slots to hold its
    experts. Slot ``s`` sits on worker ``s // S``; worker ``w`` on node ``w // (W / M)``.
    """
    load = validate_shape(load, num_workers, slots_per_worker)
    num_experts = load.shape[1]
    worker2node = worker_to_node(num_workers, num_nodes)
    if num_groups <= 0 or num_experts % num_groups or num_groups % num_nodes:
        raise ValueError(
            f"{num_experts} experts in {num_groups} groups on {num_nodes} nodes: need experts % groups "
            "== 0 and groups % nodes == 0"
        )
    if (num_workers // num_nodes) * slots_per_worker < num_experts // num_nodes:
        raise ValueError("each node needs at least as many slots as the experts of its groups")
    phy2log = np.stack(
        [_balance_layer(layer, num_workers, slots_per_worker, num_nodes, num_groups) for layer in load]
    )
    return PlacementTable.from_phy2log(phy2log, slots_per_worker, num_experts, worker2node)


def balance_global(
    load: np.ndarray, num_workers: int, slots_per_worker: int, num_nodes: int = 1
) -> PlacementTable:
    """EPLB's global policy (one group, one node) with refined packing. load: [L, E].

    ``num_nodes`` only labels workers with nodes (for migration sources); the packing is
    node-blind, as in EPLB's global policy.
    """
    table = balance_hierarchical(load, num_workers, slots_per_worker, num_nodes=1, num_groups=1)
    return PlacementTable.from_phy2log(
        table.phy2log, slots_per_worker, table.num_experts, worker_to_node(num_workers, num_nodes)
    )
