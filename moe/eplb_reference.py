"""A plain re-implementation of DeepSeek's EPLB policy, the baseline our balancers must beat.

Legend: L MoE layers, E logical experts, P physical slots per layer, M nodes, W workers
(GPUs), S slots per worker, G expert groups. ``Xb`` is any leading batch of rows, ``Ni`` the
items in a row.

It follows the published algorithm step by step and nothing more: replicate the expert
with the largest load per replica into each redundant slot, then greedily place the
heaviest remaining item on the lightest pack that still has room. With groups dividing
evenly onto nodes it is hierarchical (groups -> nodes, replicate within nodes, pack onto
the node's GPUs); otherwise it is the same procedure with one group and one node.
It ignores the current placement: that is the churn the migration-aware balancer avoids.
"""

from __future__ import annotations

import numpy as np


def balanced_packing(weight: np.ndarray, num_packs: int) -> tuple[np.ndarray, np.ndarray]:
    """Greedy equal-count packing.

    weight: [Xb, Ni] item weights, Ni divisible by num_packs.
    Returns pack_index [Xb, Ni] and rank_in_pack [Xb, Ni].
    """
    num_rows, num_items = weight.shape
    if num_items % num_packs:
        raise ValueError(f"{num_items} items do not split evenly into {num_packs} packs")
    items_per_pack = num_items // num_packs
    pack_index = np.zeros((num_rows, num_items), dtype=np.int64)
    rank_in_pack = np.zeros((num_rows, num_items), dtype=np.int64)
    for row in range(num_rows):
        pack_weight = np.zeros(num_packs)
        pack_items = np.zeros(num_packs, dtype=np.int64)
        for item in np.argsort(-weight[row], kind="stable"):
            open_weight = np.where(pack_items < items_per_pack, pack_weight, np.inf)
            pack = int(np.argmin(open_weight))
            pack_index[row, item] = pack
            rank_in_pack[row, item] = pack_items[pack]
            pack_weight[pack] += weight[row, item]
            pack_items[pack] += 1
    return pack_index, rank_in_pack


def replicate_experts(weight: np.ndarray, num_physical: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Fill redundant slots with the expert of largest load per replica.

    weight: [Xb, num_logical]. Returns phy2log [Xb, num_physical], replica rank
    [Xb, num_physical] and logcnt [Xb, num_logical].
    """
    num_rows, num_logical = weight.shape
    if num_physical < num_logical:
        raise ValueError(f"{num_physical} physical slots cannot hold {num_logical} experts")
    rows = np.arange(num_rows)
    phy2log = np.zeros((num_rows, num_physical), dtype=np.int64)
    rank = np.zeros((num_rows, num_physical), dtype=np.int64)
    logcnt = np.ones((num_rows, num_logical), dtype=np.int64)
    phy2log[:, :num_logical] = np.arange(num_logical)
    for slot in range(num_logical, num_physical):
        redundant = np.argmax(weight / logcnt, axis=-1)
        phy2log[:, slot] = redundant
        rank[:, slot] = logcnt[rows, redundant]
        logcnt[rows, redundant] += 1
    return phy2log, rank, logcnt


def _inverse(permutation: np.ndarray) -> np.ndarray:
    inverse = np.empty_like(permutation)
    np.put_along_axis(
        inverse, permutation, np.broadcast_to(np.arange(permutation.shape[1]), permutation.shape), axis=1
    )
    return inverse


def rebalance_hierarchical(
    weight: np.ndarray, num_physical: int, num_groups: int, num_nodes: int, num_gpus: int
) -> np.ndarray:
    """EPLB's hierarchical policy. weight: [L, E]. Returns phy2log [L, P]."""
    num_layers, num_logical = weight.shape
    group_size = num_logical // num_groups
    groups_per_node = num_groups // num_nodes
    logical_per_node = num_logical // num_nodes
    physical_per_node = num_physical // num_nodes
    physical_per_gpu = num_physical // num_gpus
    # Step 1: pack groups onto nodes; mlog is the node-major ("middle") expert order.
    tokens_per_group = weight.reshape(num_layers, num_groups, group_size).sum(-1)
    group_pack, group_rank = balanced_packing(tokens_per_group, num_nodes)
    log2mlog = ((group_pack * groups_per_node + group_rank) * group_size)[:, :, None] + np.arange(group_size)
    mlog2log = _inverse(log2mlog.reshape(num_layers, num_logical))
    # Step 2: replicate within each node.
    tokens_per_mlog = np.take_along_axis(weight, mlog2log, axis=1).reshape(-1, logical_per_node)
    phy2mlog, _, mlogcnt = replicate_experts(tokens_per_mlog, physical_per_node)
    # Step 3: pack the node's physical experts onto its GPUs.
    tokens_per_phy = np.take_along_axis(tokens_per_mlog / mlogcnt, phy2mlog, axis=1)
    pack_index, rank_in_pack = balanced_packing(tokens_per_phy, num_gpus // num_nodes)
    pphy2phy = _inverse(pack_index * physical_per_gpu + rank_in_pack)
    pphy2mlog = np.take_along_axis(phy2mlog, pphy2phy, axis=1)
    node_offset = np.arange(0, num_logical, logical_per_node)[None, :, None]
    pphy2mlog = (pphy2mlog.reshape(num_layers, num_nodes, -1) + node_offset).reshape(num_layers, -1)
    return np.take_along_axis(mlog2log, pphy2mlog, axis=1)


def eplb_reference(
    load: np.ndarray, num_workers: int, slots_per_worker: int, num_groups: int = 1, num_nodes: int = 1
) -> np.ndarray:
    """DeepSeek EPLB from scratch. load: [L, E]. Returns phy2log [L, W * S].

    Slot ``s`` sits on worker ``s // slots_per_worker``.
    """
    weight = np.asarray(load, dtype=np.float64)
    num_physical = num_workers * slots_per_worker
    if num_groups % num_nodes == 0 and weight.shape[1] % num_groups == 0 and num_workers % num_nodes == 0:
        return rebalance_hierarchical(weight, num_physical, num_groups, num_nodes, num_workers)
    return rebalance_hierarchical(weight, num_physical, 1, 1, num_workers)
