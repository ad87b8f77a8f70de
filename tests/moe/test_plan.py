"""plan_dispatch against a plain per-assignment reference, over a table of shapes.

Legend: T tokens, E logical experts, k experts per token, W workers, S slots per worker,
P = W * S physical slots, D hidden, I expert intermediate, A kept assignments.

Each case builds a PlacementTable, random distinct top-k ids and weights and a kept mask,
then checks the plan field by field against a Python loop over (token, choice), and
finally executes the plan worker by worker and compares with
``sum_k w[t, k] * expert_{id[t, k]}(x[t])`` for several placements of the same experts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from raymoe.engine.experts import LocalExperts, plan_layer, run_worker_slots
from raymoe.moe.capacity import CapacityConfig, OverflowPolicy, keep_mask
from raymoe.moe.placement import PlacementTable
from raymoe.moe.plan import DispatchPlan, plan_dispatch

INTERMEDIATE = 6


@dataclass(frozen=True)
class Case:
    name: str
    num_tokens: int
    num_experts: int
    top_k: int
    num_workers: int
    slots_per_worker: int
    redundant: bool  # spare slots hold replicas (True) or stay empty (False)
    hidden: int
    features: tuple[str, ...] = ()  # what the case must exercise; asserted, not assumed


CASES = [
    Case("empty_batch", 0, 4, 2, 2, 2, False, 8),
    Case("one_token", 1, 4, 2, 2, 2, False, 8),
    Case("one_token_k1_replicated", 1, 3, 1, 2, 2, True, 4, ("replicas",)),
    Case("empty_experts", 3, 8, 1, 4, 2, False, 8, ("empty_expert",)),
    Case("k2_one_worker", 6, 4, 2, 1, 4, False, 8, ("same_worker",)),
    Case("k2_two_workers", 12, 4, 2, 2, 2, False, 8, ("same_worker",)),
    Case("empty_slots", 10, 5, 2, 2, 3, False, 8, ("empty_slot", "same_worker")),
    Case("replicated", 16, 4, 2, 3, 2, True, 8, ("replicas", "same_worker")),
    Case("replicated_heavy", 24, 2, 2, 2, 3, True, 4, ("replicas", "same_worker")),
    Case("k_equals_experts", 5, 4, 4, 2, 2, False, 8, ("same_worker",)),
    Case("k4_many", 40, 16, 4, 4, 5, True, 16, ("replicas", "same_worker")),
    Case("k8_large", 64, 32, 8, 8, 5, True, 16, ("replicas", "same_worker")),
]

KEEP_MODES = ["all", "some_dropped", "none"]


# ---- inputs ---------------------------------------------------------------------------


def make_placement(case: Case, seed: int) -> PlacementTable:
    """A random placement: every expert once, spare slots replicas or empty, shuffled."""
    rng = np.random.default_rng(seed)
    num_slots = case.num_workers * case.slots_per_worker
    assert num_slots >= case.num_experts
    spare = num_slots - case.num_experts
    if case.redundant:
        extra = rng.integers(0, case.num_experts, size=spare)
    else:
        extra = np.full(spare, -1)
    phy2log = rng.permutation(np.concatenate([np.arange(case.num_experts), extra]))
    return PlacementTable.from_phy2log(phy2log[None, :], case.slots_per_worker, case.num_experts)


def make_routing(case: Case, keep: str, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    rows = [torch.randperm(case.num_experts, generator=gen)[: case.top_k] for _ in range(case.num_tokens)]
    ids = torch.stack(rows) if rows else torch.zeros(0, case.top_k, dtype=torch.int64)
    weights = torch.rand(case.num_tokens, case.top_k, generator=gen)
    if keep == "all":
        kept = torch.ones(case.num_tokens, case.top_k, dtype=torch.bool)
    elif keep == "none":
        kept = torch.zeros(case.num_tokens, case.top_k, dtype=torch.bool)
    else:
        kept = torch.rand(case.num_tokens, case.top_k, generator=gen) < 0.6
        if case.num_tokens * case.top_k >= 2:  # make sure both a drop and a keep occur
            kept.view(-1)[0] = False
            kept.view(-1)[-1] = True
    return ids, weights, kept


def plan_for(placement: PlacementTable, ids, weights, kept) -> DispatchPlan:
    return plan_dispatch(
        ids,
        weights,
        kept,
        torch.tensor(placement.log2phy[0]),
        torch.tensor(placement.logcnt[0]),
        placement.slots_per_worker,
        placement.num_slots,
    )


# ---- the plain reference --------------------------------------------------------------


def reference_plan(placement: PlacementTable, ids, weights, kept) -> dict:
    """Per-assignment loop implementing the documented plan, in plain Python."""
    num_tokens, top_k = ids.shape
    slots_per_worker = placement.slots_per_worker
    seen = [0] * placement.num_experts  # kept assignments of each expert so far, token order
    slot = [[-1] * top_k for _ in range(num_tokens)]
    assignments = []  # (slot, token, weight)
    for t in range(num_tokens):
        for j in range(top_k):
            if not kept[t, j]:
                continue
            expert = int(ids[t, j])
            replicas = placement.replicas(0, expert)
            chosen = replicas[seen[expert] % len(replicas)]
            seen[expert] += 1
            slot[t][j] = chosen
            assignments.append((chosen, t, float(weights[t, j])))
    assignments.sort(key=lambda a: (a[0], a[1]))
    rows = sorted({(s // slots_per_worker, t) for s, t, _ in assignments})
    row_of = {pair: i for i, pair in enumerate(rows)}
    slot_counts = [0] * placement.num_slots
    for s, _, _ in assignments:
        slot_counts[s] += 1
    send_counts = [0] * placement.num_workers
    for w, _ in rows:
        send_counts[w] += 1
    return {
        "slot": slot,
        "assign_slot": [a[0] for a in assignments],
        "assign_token": [a[1] for a in assignments],
        "assign_weight": [a[2] for a in assignments],
        "assign_row": [row_of[(s // slots_per_worker, t)] for s, t, _ in assignments],
        "send_token": [t for _, t in rows],
        "send_worker": [w for w, _ in rows],
        "send_counts": send_counts,
        "slot_counts": slot_counts,
        "num_dropped": sum(1 for t in range(num_tokens) for j in range(top_k) if not kept[t, j]),
    }


def make_experts(num_experts: int, hidden: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    w13 = torch.randn(num_experts, 2 * INTERMEDIATE, hidden, generator=gen) * 0.3
    w2 = torch.randn(num_experts, hidden, INTERMEDIATE, generator=gen) * 0.3
    return w13, w2


def reference_expert(w13: torch.Tensor, w2: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """One token through one SwiGLU expert, in float64 for a trustworthy reference."""
    w13, w2, x = w13.double(), w2.double(), x.double()
    gate, up = w13[:INTERMEDIATE] @ x, w13[INTERMEDIATE:] @ x
    return w2 @ (F.silu(gate) * up)


def reference_moe(x, ids, weights, kept, w13, w2) -> torch.Tensor:
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            if kept[t, j]:
                out[t] += float(weights[t, j]) * reference_expert(w13[ids[t, j]], w2[ids[t, j]], x[t])
    return out.float()


def execute_plan(plan: DispatchPlan, placement: PlacementTable, x, w13, w2) -> torch.Tensor:
    """Run the plan as the distributed engine would: each worker only sees its rows."""
    num_slots_w = placement.slots_per_worker
    gen = torch.Generator().manual_seed(99)
    out = torch.zeros_like(x)
    send_offsets = plan.send_offsets()
    assign_offsets = plan.assign_offsets()
    for worker in range(placement.num_workers):
        experts = placement.worker_experts(0, worker)
        # Empty slots get garbage weights: with zero rows they must never be read.
        w13_w = torch.stack(
            [w13[e] if e >= 0 else torch.randn(w13.shape[1:], generator=gen) * 1e3 for e in experts]
        )
        w2_w = torch.stack(
            [w2[e] if e >= 0 else torch.randn(w2.shape[1:], generator=gen) * 1e3 for e in experts]
        )
        r0, r1 = int(send_offsets[worker]), int(send_offsets[worker + 1])
        a0, a1 = int(assign_offsets[worker]), int(assign_offsets[worker + 1])
        rows = x.index_select(0, plan.send_token[r0:r1])
        partial = run_worker_slots(
            rows,
            plan.assign_row[a0:a1] - r0,
            plan.assign_weight[a0:a1],
            plan.slot_counts[worker * num_slots_w : (worker + 1) * num_slots_w],
            w13_w,
            w2_w,
        )
        out.index_add_(0, plan.send_token[r0:r1], partial)
    return out


# ---- the table must exercise what it claims ------------------------------------------


def check_features(case: Case, placement: PlacementTable, ids: torch.Tensor, plan: DispatchPlan) -> None:
    if "replicas" in case.features:
        assert placement.logcnt.max() > 1, "case should replicate an expert"
    if "empty_slot" in case.features:
        assert (placement.phy2log == -1).any()
    if "empty_expert" in case.features:
        assert len(set(ids.reshape(-1).tolist())) < case.num_experts, "some expert should get no token"
    if "same_worker" in case.features:
        workers = torch.div(plan.slot, placement.slots_per_worker, rounding_mode="floor")
        assert any(
            len(set(row)) < len(row) for row in workers.tolist()
        ), "some token should send two assignments to one worker"


# ---- tests ----------------------------------------------------------------------------


@pytest.mark.parametrize("keep", KEEP_MODES)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_plan_matches_reference(case: Case, keep: str) -> None:
    placement = make_placement(case, seed=1)
    ids, weights, kept = make_routing(case, keep, seed=2)
    plan = plan_for(placement, ids, weights, kept)
    if keep == "all":
        check_features(case, placement, ids, plan)
    ref = reference_plan(placement, ids, weights, kept)

    assert plan.num_tokens == case.num_tokens
    assert plan.num_workers == case.num_workers
    assert plan.slot.shape == (case.num_tokens, case.top_k)
    assert plan.slot.tolist() == ref["slot"]
    assert plan.assign_slot.tolist() == ref["assign_slot"]
    assert plan.assign_token.tolist() == ref["assign_token"]
    assert plan.assign_weight.dtype == torch.float32
    assert torch.equal(plan.assign_weight, torch.tensor(ref["assign_weight"], dtype=torch.float32))
    assert plan.assign_row.tolist() == ref["assign_row"]
    assert plan.send_token.tolist() == ref["send_token"]
    assert plan.send_counts.tolist() == ref["send_counts"]
    assert plan.slot_counts.tolist() == ref["slot_counts"]
    assert plan.num_dropped == ref["num_dropped"]
    assert plan.worker_assign_counts.sum().item() == len(ref["assign_slot"])


@pytest.mark.parametrize("keep", KEEP_MODES)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_plan_invariants(case: Case, keep: str) -> None:
    """The same facts stated as invariants, independent of the reference's ordering."""
    placement = make_placement(case, seed=3)
    ids, weights, kept = make_routing(case, keep, seed=4)
    plan = plan_for(placement, ids, weights, kept)
    slots_per_worker = placement.slots_per_worker

    # Every kept assignment appears exactly once, in a slot holding its logical expert.
    kept_pairs = sorted((t, int(ids[t, j])) for t in range(case.num_tokens) for j in range(case.top_k) if kept[t, j])
    planned = sorted(
        (int(t), int(placement.phy2log[0, s])) for t, s in zip(plan.assign_token, plan.assign_slot)
    )
    assert planned == kept_pairs
    for t in range(case.num_tokens):
        for j in range(case.top_k):
            s = int(plan.slot[t, j])
            if kept[t, j]:
                assert placement.phy2log[0, s] == ids[t, j]
            else:
                assert s == -1
    # assign_slot is ascending: each worker's assignments are contiguous and by local slot.
    assert torch.all(plan.assign_slot[1:] >= plan.assign_slot[:-1])

    # send rows: unique (worker, token) pairs, grouped by worker ascending then token ascending.
    offsets = plan.send_offsets().tolist()
    send_worker = [w for w in range(case.num_workers) for _ in range(offsets[w], offsets[w + 1])]
    assert len(send_worker) == plan.send_token.numel()
    pairs = list(zip(send_worker, plan.send_token.tolist()))
    assert pairs == sorted(set(pairs))
    expected_pairs = {(int(s) // slots_per_worker, int(t)) for s, t in zip(plan.assign_slot, plan.assign_token)}
    assert set(pairs) == expected_pairs

    # assign_row points at a row of the assignment's token on the assignment's worker.
    for a in range(plan.assign_slot.numel()):
        row = int(plan.assign_row[a])
        assert pairs[row] == (int(plan.assign_slot[a]) // slots_per_worker, int(plan.assign_token[a]))

    # Counts.
    assert plan.slot_counts.tolist() == np.bincount(plan.assign_slot.numpy(), minlength=placement.num_slots).tolist()
    assert plan.send_counts.tolist() == [offsets[w + 1] - offsets[w] for w in range(case.num_workers)]
    assert plan.num_dropped == int((~kept).sum())
    assert plan.slot_counts.sum().item() + plan.num_dropped == case.num_tokens * case.top_k
    # Empty slots never receive work.
    assert all(plan.slot_counts[s] == 0 for s in np.flatnonzero(placement.phy2log[0] == -1))

    # Replica choice spreads: n assignments over r replicas -> floor(n/r) or ceil(n/r) each.
    for expert in range(case.num_experts):
        replicas = placement.replicas(0, expert)
        loads = [int(plan.slot_counts[s]) for s in replicas]
        n, r = sum(loads), len(replicas)
        assert all(n // r <= load <= math.ceil(n / r) for load in loads), (expert, loads)

    # Deterministic.
    again = plan_for(placement, ids, weights, kept)
    fields = ("slot", "assign_slot", "assign_token", "assign_weight", "assign_row", "slot_counts", "send_token")
    for field in fields + ("send_counts",):
        assert torch.equal(getattr(plan, field), getattr(again, field)), field


@pytest.mark.parametrize("keep", ["all", "some_dropped"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_executed_plan_equals_reference_for_every_placement(case: Case, keep: str) -> None:
    ids, weights, kept = make_routing(case, keep, seed=5)
    w13, w2 = make_experts(case.num_experts, case.hidden, seed=6)
    x = torch.randn(case.num_tokens, case.hidden, generator=torch.Generator().manual_seed(7))
    expected = reference_moe(x, ids, weights, kept, w13, w2)
    outputs = []
    for seed in (10, 11, 12):
        placement = make_placement(case, seed)
        out = execute_plan(plan_for(placement, ids, weights, kept), placement, x, w13, w2)
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
        outputs.append(out)
    for out in outputs[1:]:
        torch.testing.assert_close(out, outputs[0], rtol=1e-5, atol=1e-5)


def test_dropped_assignments_contribute_zero() -> None:
    """A token whose every assignment is dropped gets exactly zero from the experts."""
    case = Case("drop", 4, 4, 2, 2, 2, True, 8)
    ids = torch.tensor([[0, 1], [2, 3], [1, 0], [3, 2]])
    weights = torch.rand(4, 2, generator=torch.Generator().manual_seed(0))
    kept = torch.tensor([[True, True], [False, False], [True, False], [False, True]])
    w13, w2 = make_experts(4, 8, seed=1)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(2))
    placement = make_placement(case, seed=3)
    plan = plan_for(placement, ids, weights, kept)
    out = execute_plan(plan, placement, x, w13, w2)
    assert plan.num_dropped == 4
    assert torch.equal(out[1], torch.zeros(8))
    assert 1 not in plan.send_token.tolist()
    torch.testing.assert_close(out, reference_moe(x, ids, weights, kept, w13, w2), rtol=1e-5, atol=1e-5)


def test_replicas_take_turns_in_token_order() -> None:
    """Expert 0 on slots 1 and 2: its i-th kept assignment goes to replica i % 2."""
    placement = PlacementTable.from_phy2log([[1, 0, 0, 2]], 2, 3)
    ids = torch.tensor([[0, 1], [2, 0], [0, 2], [1, 0], [0, 1]])
    kept = torch.tensor([[True, True], [True, False], [True, True], [True, True], [True, True]])
    plan = plan_for(placement, ids, torch.ones(5, 2), kept)
    # Kept assignments of expert 0 in token order: t0, t2, t3, t4 (t1's was dropped).
    assert plan.slot[:, 0].tolist() == [1, 3, 2, 0, 2]
    assert plan.slot[:, 1].tolist() == [0, -1, 3, 1, 0]
    assert plan.slot_counts.tolist() == [3, 2, 2, 2]
    # Worker 0 holds slots 0,1 (experts 1, 0), worker 1 slots 2,3 (experts 0, 2).
    assert plan.send_token.tolist() == [0, 3, 4, 1, 2, 4]
    assert plan.send_counts.tolist() == [3, 3]


@pytest.mark.parametrize("capacity_factor", [0.5, 1.0, 4.0])
def test_plan_layer_and_local_experts_match_reference(capacity_factor: float) -> None:
    """Capacity + plan + execution: placements agree with each other and with LocalExperts."""
    case = Case("layer", 32, 8, 2, 4, 3, True, 8)
    ids, weights, _ = make_routing(case, "all", seed=20)
    capacity = CapacityConfig(capacity_factor, OverflowPolicy.DROP)
    kept = keep_mask(ids, case.num_experts, capacity)
    if capacity_factor < 1:
        assert not kept.all(), "cf < 1 must drop something"
    w13, w2 = make_experts(case.num_experts, case.hidden, seed=21)
    x = torch.randn(case.num_tokens, case.hidden, generator=torch.Generator().manual_seed(22))
    expected = reference_moe(x, ids, weights, kept, w13, w2)
    for seed in (30, 31):
        placement = make_placement(case, seed)
        plan = plan_layer(placement, 0, ids, weights, capacity)
        assert plan.num_dropped == int((~kept).sum())
        torch.testing.assert_close(execute_plan(plan, placement, x, w13, w2), expected, rtol=1e-5, atol=1e-5)
    local = LocalExperts([w13], [w2], capacity)
    torch.testing.assert_close(local.forward(0, x, ids, weights), expected, rtol=1e-5, atol=1e-5)
    assert local.num_dropped == int((~kept).sum())
    assert local.tokens_per_expert[0].tolist() == np.bincount(ids[kept].numpy(), minlength=8).tolist()
