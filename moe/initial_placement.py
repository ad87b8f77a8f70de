"""The placement a cluster starts with, from the config's placement section.

Legend: L MoE layers, E logical experts per layer, W workers, S0 base slots per worker,
S = S0 + redundant slots per worker, P = W * S physical slots per layer.

Pure: no Ray, no config types. The strategy is a plain string value (or any enum whose
``.value`` is one), so that ``moe/`` never imports ``cluster/``.
"""

from __future__ import annotations

import enum
from typing import Mapping, Sequence

import numpy as np

from raymoe.moe.placement import PlacementTable

STRATEGIES = ("contiguous", "round_robin", "explicit")
WorkerMap = Mapping[int, Sequence[int]]  # worker id -> logical experts it holds


def initial_placement(
    num_layers: int,
    num_experts: int,
    num_workers: int,
    strategy: str | enum.Enum,
    redundant_slots_per_worker: int = 0,
    explicit: WorkerMap | None = None,
    explicit_layers: Mapping[int, WorkerMap] | None = None,
    worker2node: Sequence[int] | np.ndarray | None = None,
    load: np.ndarray | None = None,
) -> PlacementTable:
    """One :class:`PlacementTable` (epoch 0) for a strategy, with spare slots replicated.

    explicit: worker -> logical experts, for every layer without an entry in
        ``explicit_layers`` (layer -> such a map). Workers left out hold only replicas.
    load: ``[L, E]`` expected tokens per logical expert; spare slots go to the hottest
        experts (per replica) first. Without it every expert weighs the same, so spare
        slots go round robin over experts 0, 1, 2, ...

    Steps:
      1. Base layout per layer, ``[W]`` lists of experts: contiguous puts expert e on
         worker e // S0 with S0 = ceil(E / W); round_robin puts it on worker e % W;
         explicit takes the maps, S0 = the longest list over all layers.
      2. S = S0 + redundant_slots_per_worker slots per worker; a worker's base experts fill
         its first slots, the rest are empty.
      3. Fill each empty slot with a replica (``_fill_replicas``); a worker gets a second
         copy of an expert only when every expert it lacks has no free slot elsewhere.
    """
    strategy = getattr(strategy, "value", strategy)
    _check_arguments(num_layers, num_experts, num_workers, strategy, redundant_slots_per_worker)
    if load is None:
        load = np.ones((num_layers, num_experts))
    load = np.asarray(load, dtype=np.float64)
    if load.shape != (num_layers, num_experts) or not np.isfinite(load).all() or (load < 0).any():
        raise ValueError(
            f"load must be finite, >= 0 and of shape [layers, experts] = "
            f"[{num_layers}, {num_experts}]; got shape {load.shape}"
        )
    # Step 1: base layout per layer.
    if strategy == "explicit":
        layouts = _explicit_layouts(num_layers, num_experts, num_workers, explicit, explicit_layers)
    else:
        if explicit is not None or explicit_layers is not None:
            raise ValueError(f"explicit maps are only used by strategy 'explicit', not {strategy!r}")
        layouts = [_strategy_layout(strategy, num_experts, num_workers)] * num_layers
    base_slots = max(len(experts) for layout in layouts for experts in layout)
    # Step 2: equal slot counts, -1 = empty.
    slots_per_worker = base_slots + redundant_slots_per_worker
    phy2log = np.full((num_layers, num_workers, slots_per_worker), -1, dtype=np.int64)  # [L, W, S]
    for layer, layout in enumerate(layouts):
        for worker, experts in enumerate(layout):
            phy2log[layer, worker, : len(experts)] = experts
    # Step 3: replicas in every empty slot.
    for layer in range(num_layers):
        _fill_replicas(phy2log[layer], load[layer])
    return PlacementTable.from_phy2log(
        phy2log.reshape(num_layers, -1), slots_per_worker, num_experts, worker2node
    )


def _strategy_layout(strategy: str, num_experts: int, num_workers: int) -> list[list[int]]:
    experts = range(num_experts)
    if strategy == "contiguous":
        per_worker = -(-num_experts // num_workers)
        return [[e for e in experts if e // per_worker == w] for w in range(num_workers)]
    return [[e for e in experts if e % num_workers == w] for w in range(num_workers)]


def _explicit_layouts(
    num_layers: int,
    num_experts: int,
    num_workers: int,
    explicit: WorkerMap | None,
    explicit_layers: Mapping[int, WorkerMap] | None,
) -> list[list[list[int]]]:
    if explicit is None:
        raise ValueError("strategy 'explicit' needs an explicit worker -> experts map")
    explicit_layers = explicit_layers or {}
    bad_layers = sorted(layer for layer in explicit_layers if not 0 <= layer < num_layers)
    if bad_layers:
        raise ValueError(f"explicit per-layer maps for layers {bad_layers}: the model has MoE layers 0..{num_layers - 1}")
    default = _explicit_layout(explicit, num_experts, num_workers, "explicit map")
    overrides = {
        layer: _explicit_layout(worker_map, num_experts, num_workers, f"layer {layer} override")
        for layer, worker_map in explicit_layers.items()
    }
    return [overrides.get(layer, default) for layer in range(num_layers)]


def _explicit_layout(worker_map: WorkerMap, num_experts: int, num_workers: int, what: str) -> list[list[int]]:
    layout: list[list[int]] = [[] for _ in range(num_workers)]
    for worker, experts in worker_map.items():
        if not 0 <= worker < num_workers:
            raise ValueError(f"{what}: worker {worker} does not exist (workers 0..{num_workers - 1})")
        experts = [int(e) for e in experts]
        outside = sorted({e for e in experts if not 0 <= e < num_experts})
        if outside:
            raise ValueError(f"{what}: worker {worker} lists experts {outside} outside 0..{num_experts - 1}")
        repeated = sorted({e for e in experts if experts.count(e) > 1})
        if repeated:
            raise ValueError(f"{what}: worker {worker} lists experts {repeated} more than once")
        layout[worker] = experts
    placed = {e for experts in layout for e in experts}
    missing = [e for e in range(num_experts) if e not in placed]
    if missing:
        raise ValueError(f"{what}: experts {missing} are not placed on any worker")
    return layout


def _fill_replicas(slots: np.ndarray, load: np.ndarray) -> None:
    """Fills the -1 entries of ``slots: [W, S]`` in place, one replica at a time.

    Each round takes the experts by priority: largest load per replica, then fewest
    replicas, then lowest id (EPLB's replica-count rule). The first one that fits goes
    on the least loaded worker with a free slot that lacks it (lowest id on ties); a
    worker's load is the sum of load per replica of the experts it holds. If only workers
    that hold it have free slots, a replica placed earlier moves into such a slot to
    make room (``_swap_in``). When nothing fits anywhere without a duplicate, the top
    expert goes to the least loaded worker with a free slot.
    """
    num_workers, _ = slots.shape
    num_experts = load.shape[0]
    count = np.bincount(slots[slots >= 0], minlength=num_experts)  # [E]
    is_spare = slots < 0  # [W, S] slots this function fills; base experts never move
    while (slots < 0).any():
        share = load / count  # [E] load per replica
        # Priority: largest share, then fewest replicas, then lowest id (lexsort: last key first).
        order = np.lexsort((np.arange(num_experts), count, -share))
        worker_load = np.where(slots >= 0, share[slots], 0.0).sum(axis=1)  # [W]
        has_free = (slots < 0).any(axis=1)  # [W]
        holds = np.zeros((num_workers, num_experts), dtype=bool)  # [W, E]
        rows, cols = np.nonzero(slots >= 0)
        holds[rows, slots[rows, cols]] = True
        for expert in order:
            candidates = np.flatnonzero(has_free & ~holds[:, expert])
            if len(candidates):
                worker = candidates[np.argmin(worker_load[candidates])]
                break
            worker = _swap_in(slots, is_spare, holds, expert)
            if worker is not None:
                break
        else:  # every worker with a free slot already holds every expert: duplicate.
            expert, candidates = order[0], np.flatnonzero(has_free)
            worker = candidates[np.argmin(worker_load[candidates])]
        slots[worker, np.flatnonzero(slots[worker] < 0)[0]] = expert
        count[expert] += 1


def _swap_in(slots: np.ndarray, is_spare: np.ndarray, holds: np.ndarray, expert: int) -> int | None:
    """Frees a slot for ``expert`` on a worker that lacks it; returns that worker or None.

    A worker ``full`` with a free slot holds ``expert`` already; another worker ``other``
    lacks it and holds, in a spare slot, a replica of ``r`` that ``full`` lacks: ``r``
    moves to ``full``'s free slot, and ``other``'s slot becomes free for ``expert``.
    """
    for full in np.flatnonzero((slots < 0).any(axis=1) & holds[:, expert]):
        for other in np.flatnonzero(~holds[:, expert]):
            for slot in np.flatnonzero(is_spare[other] & (slots[other] >= 0)):
                moved = slots[other, slot]
                if not holds[full, moved]:
                    slots[full, np.flatnonzero(slots[full] < 0)[0]] = moved
                    slots[other, slot] = -1
                    return int(other)
    return None


def _check_arguments(
    num_layers: int, num_experts: int, num_workers: int, strategy: object, redundant: int
) -> None:
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy: expected one of {', '.join(STRATEGIES)}; got {strategy!r}")
    for name, value, least in (
        ("num_layers", num_layers, 1),
        ("num_experts", num_experts, 1),
        ("num_workers", num_workers, 1),
        ("redundant_slots_per_worker", redundant, 0),
    ):
        if not isinstance(value, (int, np.integer)) or value < least:
            raise ValueError(f"{name}: expected an integer >= {least}; got {value!r}")
