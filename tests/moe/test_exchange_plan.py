"""plan_exchange (the router's device-side plan) against the plain per-assignment reference.

The reference loop in test_plan.py implements the documented rules; here every row of the
exchange plan is checked against it: which worker gets which token, in which order, and at
which of the token's k positions each row carries which local slot and weight. Then the
rows are executed worker by worker (run_rows) and combined (combine_partials), and the
result is compared with ``sum_k w[t, k] * expert_{id[t, k]}(x[t])``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_plan import CASES, INTERMEDIATE, KEEP_MODES, make_placement, make_routing, reference_plan

from raymoe.engine.experts import combine_partials, run_rows
from raymoe.moe.exchange_plan import plan_exchange, plan_exchange_on_host

PLANNERS = ("device", "host")  # tensor ops on the activations' device; numpy where that is the CPU


def exchange_plan_for(placement, ids, weights, kept, planner="device"):
    if planner == "host":
        return plan_exchange_on_host(ids, weights, kept, placement.log2phy[0], placement.logcnt[0],
                                     placement.slots_per_worker, placement.num_workers)
    return plan_exchange(ids, weights, kept, torch.tensor(placement.log2phy[0]), torch.tensor(placement.logcnt[0]),
                         placement.slots_per_worker, placement.num_workers)


@pytest.mark.parametrize("planner", PLANNERS)
@pytest.mark.parametrize("keep", KEEP_MODES)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_rows_match_the_reference(case, keep, planner):
    placement = make_placement(case, seed=11)
    ids, weights, kept = make_routing(case, keep, seed=12)
    plan = exchange_plan_for(placement, ids, weights, kept, planner)
    ref = reference_plan(placement, ids, weights, kept)
    S = placement.slots_per_worker
    assert plan.slot.tolist() == ref["slot"]
    assert (plan.row_token.dtype, plan.row_slots.dtype, plan.row_weights.dtype) == (torch.int64, torch.int32,
                                                                                    torch.float32)
    assert plan.send_counts == ref["send_counts"]
    assert plan.slot_counts == ref["slot_counts"]
    # Rows: one per (worker, token) with a kept assignment there, worker-major, tokens ascending.
    expected_rows = sorted({(s // S, t) for t, row in enumerate(ref["slot"]) for s in row if s >= 0})
    assert plan.row_token.tolist() == [t for _, t in expected_rows]
    for index, (worker, token) in enumerate(expected_rows):
        for j in range(case.top_k):
            s = ref["slot"][token][j]
            if s >= 0 and s // S == worker:
                assert int(plan.row_slots[index, j]) == s % S
                assert float(plan.row_weights[index, j]) == pytest.approx(float(weights[token, j]))
            else:
                assert int(plan.row_slots[index, j]) == -1
                assert float(plan.row_weights[index, j]) == 0.0


@pytest.mark.parametrize("keep", KEEP_MODES)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_host_and_device_planners_agree_bit_for_bit(case, keep):
    placement = make_placement(case, seed=3)
    ids, weights, kept = make_routing(case, keep, seed=4)
    device, host = (exchange_plan_for(placement, ids, weights, kept, planner) for planner in PLANNERS)
    assert (host.send_counts, host.slot_counts, host.num_tokens) == (device.send_counts, device.slot_counts,
                                                                     device.num_tokens)
    for field in ("slot", "row_token", "row_slots", "row_weights"):
        assert torch.equal(getattr(host, field), getattr(device, field)), field


@pytest.mark.parametrize("planner", PLANNERS)
@pytest.mark.parametrize("case", [c for c in CASES if c.num_tokens], ids=lambda c: c.name)
def test_executed_rows_equal_the_dense_sum(case, planner):
    placement = make_placement(case, seed=5)
    ids, weights, kept = make_routing(case, "some_dropped", seed=6)
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(case.num_tokens, case.hidden, generator=gen, dtype=torch.float64)
    w13 = torch.randn(case.num_experts, 2 * INTERMEDIATE, case.hidden, generator=gen, dtype=torch.float64)
    w2 = torch.randn(case.num_experts, case.hidden, INTERMEDIATE, generator=gen, dtype=torch.float64)
    plan = exchange_plan_for(placement, ids, weights, kept, planner)
    S = placement.slots_per_worker
    partials, start = [], 0
    for worker, count in enumerate(plan.send_counts):
        rows = x.index_select(0, plan.row_token[start:start + count])
        slots = plan.row_slots[start:start + count].long()
        # The worker's pool: row i holds the expert of local slot i (empty slots: any weights).
        experts = [max(int(e), 0) for e in placement.phy2log[0, worker * S:(worker + 1) * S]]
        pool_counts = torch.bincount(slots[slots >= 0], minlength=S).tolist()
        partial, assignments = run_rows(rows, slots, plan.row_weights[start:start + count],
                                        w13[experts], w2[experts], pool_counts)
        assert assignments == sum(pool_counts)
        partials.append(partial)
        start += count
    out = combine_partials(case.num_tokens, plan.row_token, torch.cat(partials),
                           min(case.top_k, placement.num_workers))
    expected = torch.zeros_like(x)
    for t in range(case.num_tokens):
        for j in range(case.top_k):
            if kept[t, j]:
                e = int(ids[t, j])
                gate, up = (w13[e] @ x[t]).split(INTERMEDIATE)
                expected[t] += float(weights[t, j]) * (w2[e] @ (F.silu(gate) * up))
    torch.testing.assert_close(out, expected, rtol=1e-9, atol=1e-9)


def test_combine_adds_a_tokens_rows_in_a_fixed_order_in_float32():
    gen = torch.Generator().manual_seed(0)
    row_token = torch.tensor([0, 2, 3, 0, 1, 3, 0])  # three workers' rows, worker-major
    partial = torch.randn(7, 16, generator=gen).to(torch.bfloat16)
    out = combine_partials(4, row_token, partial, 3)
    expected = torch.zeros(4, 16)
    for row, token in enumerate(row_token.tolist()):  # arrival order per token, float32
        expected[token] += partial[row].float()
    assert torch.equal(out, expected.to(torch.bfloat16))
    assert all(torch.equal(out, combine_partials(4, row_token, partial, 3)) for _ in range(5))
