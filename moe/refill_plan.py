"""Where a replaced worker's experts come from (issue 31 item 4), as pure math.

Legend: L MoE layers, E logical experts, S slots per worker.

After a worker is lost for good, the survivors serve ``current`` (the lost workers' slots
empty, every expert still held by a survivor) and the controller restores ``restored`` (the
placement before the loss) with a new worker in each lost one's place. :func:`plan_refill`
lists the copies that fill the new workers' slots of ``restored`` from survivors that hold
each expert in ``current``: one copy per slot, from a survivor on the destination's node
first, then the one that sends least, then the lowest index (the grow's rule, moe/resize_plan.py).
"""

from __future__ import annotations

import numpy as np

from raymoe.moe.placement import PlacementTable
from raymoe.moe.resize_plan import ResizeCopy


def plan_refill(current: PlacementTable, restored: PlacementTable, workers: list[int]) -> list[ResizeCopy]:
    """Copies filling ``workers``' slots of ``restored`` from the other workers' slots in
    ``current`` (module docstring). Raises ``ValueError`` naming an expert no other worker holds."""
    S = current.slots_per_worker
    if restored.slots_per_worker != S or restored.num_slots != current.num_slots:
        raise ValueError("plan_refill: current and restored must have the same workers and slots")
    refilled = set(workers)
    copies: list[ResizeCopy] = []
    for layer in range(current.num_layers):
        sent = np.zeros(current.num_workers, dtype=np.int64)
        holders: dict[int, list[int]] = {}
        for slot, expert in enumerate(current.phy2log[layer].tolist()):
            if expert >= 0 and slot // S not in refilled:
                holders.setdefault(expert, []).append(slot // S)
        for worker in workers:
            for slot in range(worker * S, (worker + 1) * S):
                expert = int(restored.phy2log[layer, slot])
                if expert < 0:
                    continue
                if expert not in holders:
                    raise ValueError(f"plan_refill: layer {layer} expert {expert} is held by no worker outside "
                                     f"{sorted(refilled)}: it cannot be copied (load it from the checkpoint)")
                node = current.worker2node[worker]
                source = min(holders[expert], key=lambda w: (current.worker2node[w] != node, sent[w], w))
                sent[source] += 1
                copies.append(ResizeCopy(layer, expert, source, worker, slot,
                                         bool(current.worker2node[source] == node)))
    return copies
