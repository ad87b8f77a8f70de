"""Local search over one layer's placement, with an optional price on copying weights.

Legend: E logical experts, W workers, S slots per worker, P = W * S physical slots,
Kp distinct (worker, expert) pairs present in the layer.

Two kinds of move, each evaluated for every candidate at once with numpy:

- reassign: one slot of worker ``u`` stops holding expert ``a`` (which keeps at least one
  other replica) and holds expert ``b`` instead; replica counts of ``a`` and ``b`` change,
  so every worker holding either sees its share change.
- swap: slots on workers ``u`` and ``v`` exchange experts; replica counts stay, only the
  two workers' loads change.

The objective is the busiest worker's load plus a small multiple of the load-weighted
mean load, so that with several workers tied at the top a move that relieves one of them
still counts as progress. A copy is a (worker, expert) the layer now has that the old
placement did not have on that worker. Moves that add no copies are taken first; after
that, the move with the best improvement per copy.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

_TIE_WEIGHT = 1e-2
_EPSILON = 1e-12


@dataclass(frozen=True)
class SearchLimits:
    """When to stop: imbalance reached, copy budget spent, or no improving move left."""

    stop_imbalance: float = 1.0
    max_copies: int | None = None
    max_moves: int = 10_000


def _objective(worker_loads: np.ndarray) -> np.ndarray:
    """[..., W] -> [...]: the peak load plus a tie-breaking spread term."""
    total = np.maximum(worker_loads.sum(axis=-1), _EPSILON)
    return worker_loads.max(axis=-1) + _TIE_WEIGHT * (worker_loads**2).sum(axis=-1) / total


class _LayerState:
    """Mutable per-layer bookkeeping: slot contents, holdings, loads and copies."""

    def __init__(self, row: np.ndarray, load: np.ndarray, slots_per_worker: int, old_held: np.ndarray | None):
        self.row = row.copy()  # [P], -1 for an empty slot
        self.load = load  # [E]
        self.slots_per_worker = slots_per_worker
        num_workers = row.shape[0] // slots_per_worker
        self.held = np.zeros((num_workers, load.shape[0]), dtype=np.int64)  # [W, E]
        occupied = self.row >= 0
        np.add.at(self.held, (np.flatnonzero(occupied) // slots_per_worker, self.row[occupied]), 1)
        self.old_free = self.held > 0 if old_held is None else old_held > 0  # copy-free weights [W, E]

    @property
    def counts(self) -> np.ndarray:
        return self.held.sum(axis=0)

    def per_replica(self) -> np.ndarray:
        return self.load / np.maximum(self.counts, 1)

    def worker_loads(self) -> np.ndarray:
        return self.held @ self.per_replica()

    def num_copies(self) -> int:
        return int(((self.held > 0) & ~self.old_free).sum())

    def is_copy(self, worker: np.ndarray, expert: np.ndarray) -> np.ndarray:
        """Would (worker, expert) be a new copy if it appeared now?"""
        return (self.held[worker, expert] == 0) & ~self.old_free[worker, expert]

    def drops_copy(self, worker: np.ndarray, expert: np.ndarray) -> np.ndarray:
        """Does removing one slot of (worker, expert) remove a copy?"""
        return (self.held[worker, expert] == 1) & ~self.old_free[worker, expert]

    def slot_of(self, worker: int, expert: int) -> int:
        slots = np.arange(worker * self.slots_per_worker, (worker + 1) * self.slots_per_worker)
        return int(slots[self.row[slots] == expert][0])


def _reassign_moves(state: _LayerState, loads: np.ndarray):
    """Every reassign move: (gain [Kp, E], copy delta [Kp, E], pair workers [Kp], experts [Kp])."""
    num_workers, num_experts = state.held.shape
    counts = state.counts
    per_replica = state.per_replica()
    worker, expert = np.nonzero((state.held > 0) & (counts >= 2)[None, :])  # [Kp]
    if worker.size == 0:
        return None
    # Step 1: loads after removing one replica of a from worker u.
    fewer = state.load[expert] / (counts[expert] - 1)  # [Kp]
    after_remove = loads[None, :] + state.held[:, expert].T * (fewer - per_replica[expert])[:, None]
    after_remove[np.arange(worker.size), worker] -= fewer  # [Kp, W]
    # Step 2: loads after adding one replica of b on worker u.
    more = state.load / (counts + 1)  # [E]
    add_shift = (state.held * (more - per_replica)[None, :]).T  # [E, W]
    after = after_remove[:, None, :] + add_shift[None, :, :]  # [Kp, E, W]
    after[np.arange(worker.size), :, worker] += more[None, :]
    gain = _objective(loads) - _objective(after)  # [Kp, E]
    gain[np.arange(worker.size), expert] = -np.inf
    copy_delta = state.is_copy(worker[:, None], np.arange(num_experts)[None, :]).astype(np.int64) - state.drops_copy(
        worker, expert
    ).astype(np.int64)[:, None]
    return gain, copy_delta, worker, expert


def _swap_moves(state: _LayerState, loads: np.ndarray):
    """Every swap move: (gain [Kp, Kp], copy delta [Kp, Kp], pair workers [Kp], experts [Kp])."""
    worker, expert = np.nonzero(state.held > 0)  # [Kp]
    per_replica = state.per_replica()
    moved = per_replica[expert][:, None] - per_replica[expert][None, :]  # off u, onto v
    after_u = loads[worker][:, None] - moved
    after_v = loads[worker][None, :] + moved
    # Step 1: the peak of the untouched workers, from the three largest loads.
    top = np.argsort(-loads)[:3]
    rest_peak = np.full(moved.shape, 0.0)
    for candidate in top[::-1]:
        untouched = (worker[:, None] != candidate) & (worker[None, :] != candidate)
        rest_peak = np.where(untouched, loads[candidate], rest_peak)
    peak = np.maximum(np.maximum(after_u, after_v), rest_peak)
    total = max(float(loads.sum()), _EPSILON)
    spread = (loads**2).sum() + after_u**2 - loads[worker][:, None] ** 2 + after_v**2 - loads[worker][None, :] ** 2
    gain = _objective(loads) - (peak + _TIE_WEIGHT * spread / total)
    gain[(worker[:, None] == worker[None, :]) | (expert[:, None] == expert[None, :])] = -np.inf
    copy_delta = (
        state.is_copy(worker[None, :], expert[:, None]).astype(np.int64)
        + state.is_copy(worker[:, None], expert[None, :])
        - state.drops_copy(worker, expert)[:, None]
        - state.drops_copy(worker, expert)[None, :]
    )
    return gain, copy_delta, worker, expert


def _pick(gain: np.ndarray, copy_delta: np.ndarray, copy_room: float, scale: float) -> tuple[float, tuple] | None:
    """Best move of one kind as (score, index); free moves outrank paid ones."""
    allowed = (gain > _EPSILON * scale) & (copy_delta <= copy_room)
    if not allowed.any():
        return None
    score = np.where(copy_delta <= 0, gain / scale + 1e6, gain / scale / np.maximum(copy_delta, 1))
    score = np.where(allowed, score, -np.inf)
    index = np.unravel_index(int(np.argmax(score)), score.shape)
    return float(score[index]), index


def improve_layer(
    row: np.ndarray,
    load: np.ndarray,
    slots_per_worker: int,
    old_held: np.ndarray | None = None,
    limits: SearchLimits = SearchLimits(),
) -> np.ndarray:
    """Improve one layer's placement by reassign and swap moves.

    row: [P] logical expert per slot; load: [E]; old_held: [W, E] slots per worker in the
    placement being migrated from (None: copies are free). Returns the new row [P].
    """
    state = _LayerState(np.asarray(row, dtype=np.int64), np.asarray(load, dtype=np.float64), slots_per_worker, old_held)
    scale = max(float(state.load.sum()), _EPSILON)
    for _ in range(limits.max_moves):
        loads = state.worker_loads()
        if loads.max() <= limits.stop_imbalance * loads.mean() + _EPSILON * scale:
            break
        copy_room = np.inf if limits.max_copies is None else limits.max_copies - state.num_copies()
        # Step 1: the best move of each kind.
        reassign = _reassign_moves(state, loads)
        swap = _swap_moves(state, loads)
        best_reassign = None if reassign is None else _pick(reassign[0], reassign[1], copy_room, scale)
        best_swap = _pick(swap[0], swap[1], copy_room, scale)
        if best_reassign is None and best_swap is None:
            break
        # Step 2: apply the better one.
        if best_swap is None or (best_reassign is not None and best_reassign[0] >= best_swap[0]):
            _, (pair, new_expert) = best_reassign
            worker, expert = int(reassign[2][pair]), int(reassign[3][pair])
            state.row[state.slot_of(worker, expert)] = new_expert
            state.held[worker, expert] -= 1
            state.held[worker, new_expert] += 1
        else:
            _, (first, second) = best_swap
            u, a, v, b = (int(swap[2][first]), int(swap[3][first]), int(swap[2][second]), int(swap[3][second]))
            slot_u, slot_v = state.slot_of(u, a), state.slot_of(v, b)
            state.row[slot_u], state.row[slot_v] = b, a
            state.held[u, a] -= 1
            state.held[u, b] += 1
            state.held[v, b] -= 1
            state.held[v, a] += 1
    return state.row
