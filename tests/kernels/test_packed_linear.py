"""oneDNN-prepacked linears: the same function as F.linear, row-invariant, refreshed when
the weights change in place, and off when asked. This is the path where raymoe's native kernels
do not run (tests/kernels/test_native_cpu.py tests those), so they are off here."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from raymoe.kernels import native_cpu, packed_linear, weight_cache
from raymoe.kernels.expert_mlp import grouped_swiglu

pytestmark = pytest.mark.skipif(not packed_linear.available(), reason="this torch build has no oneDNN linear")


@pytest.fixture(autouse=True)
def enabled():
    packed_linear.set_enabled(True)
    native_cpu.set_enabled(False)
    yield
    packed_linear.set_enabled(True)
    native_cpu.set_enabled(True)


def test_equals_linear_within_float32_rounding_and_is_row_invariant():
    generator = torch.Generator().manual_seed(0)
    stack = torch.randn(3, 96, 64, generator=generator) / 8
    x = torch.randn(70, 64, generator=generator)
    assert packed_linear.applies(x, stack)
    for row in range(3):
        full = packed_linear.linear_row(x, stack, row)
        torch.testing.assert_close(full, F.linear(x, stack[row]), rtol=1e-5, atol=1e-5)
        for rows in (1, 2, 5, 8, 16, 17, 33, 69):  # a row's result never depends on its call's size
            assert torch.equal(packed_linear.linear_row(x[:rows].contiguous(), stack, row), full[:rows]), rows
        assert torch.equal(packed_linear.linear_row(x[10:30], stack, row), full[10:30])


def test_a_stack_written_in_place_is_packed_again():
    stack = torch.randn(2, 32, 16)
    x = torch.randn(4, 16)
    before = packed_linear.linear_row(x, stack, 1)
    stack[1].copy_(torch.randn(32, 16))  # a migration staging another expert in this row
    after = packed_linear.linear_row(x, stack, 1)
    torch.testing.assert_close(after, F.linear(x, stack[1]), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(before, after)


def test_other_dtypes_devices_and_the_switch_take_the_default_gemm():
    stack, x = torch.randn(2, 8, 4), torch.randn(3, 4)
    assert not packed_linear.applies(x.bfloat16(), stack.bfloat16())
    assert not packed_linear.applies(x.requires_grad_(), stack)
    packed_linear.set_enabled(False)
    assert not packed_linear.applies(torch.randn(3, 4), stack)
    assert torch.equal(packed_linear.linear_row(torch.ones(3, 4), stack, 0), F.linear(torch.ones(3, 4), stack[0]))


def test_grouped_swiglu_rows_do_not_depend_on_their_neighbours():
    # What makes a placement unable to change an output: the same token's row through the same
    # expert gives the same bits whether it shares the expert with 0 or 20 other rows.
    generator = torch.Generator().manual_seed(1)
    w13 = torch.randn(2, 64, 32, generator=generator) / 6
    w2 = torch.randn(2, 32, 32, generator=generator) / 6
    x = torch.randn(21, 32, generator=generator)
    together = grouped_swiglu(x, [21, 0], w13, w2)
    for row in (0, 7, 20):
        alone = grouped_swiglu(x[row:row + 1], [1, 0], w13, w2)
        assert torch.equal(alone[0], together[row]), row


def test_a_large_dense_weight_is_packed_and_a_small_one_is_not():
    generator = torch.Generator().manual_seed(2)
    large = torch.randn(packed_linear.DENSE_MIN_BYTES // (4 * 256), 256, generator=generator) / 16  # 4 MiB
    bias = torch.randn(large.shape[0], generator=generator)
    x = torch.randn(2, 5, 256, generator=generator)  # any leading shape
    out = packed_linear.linear(x, large, bias)
    torch.testing.assert_close(out, F.linear(x, large, bias), rtol=1e-5, atol=1e-4)
    assert id(large) in weight_cache._cache  # it took the packed path
    assert torch.equal(packed_linear.linear(x[:1, :2], large, bias), out[:1, :2])  # row-invariant
    small = torch.randn(64, 256, generator=generator)
    assert torch.equal(packed_linear.linear(x, small), F.linear(x, small))  # sgemm, exactly
    assert id(small) not in weight_cache._cache


def test_a_stack_collected_while_another_is_packed_does_not_deadlock(monkeypatch):
    # A CI run hung here: packing one stack allocates under the cache's lock; that allocation
    # can start a garbage collection which frees another stack kept alive only by a reference
    # cycle, and that stack's finalizer takes the same lock on the same thread.
    import gc
    import threading

    x = torch.randn(2, 16)
    doomed = torch.randn(2, 8, 16)
    packed_linear.linear_row(x, doomed, 0)  # cached, with a finalizer on `doomed`
    cycle: list = [doomed]
    cycle.append(cycle)
    del doomed, cycle  # now only garbage collection frees it
    collected = []

    class CollectingPacked(weight_cache._Packed):  # a collection at the allocation under the lock
        def __init__(self, *args):
            collected.append(gc.collect())
            super().__init__(*args)

    monkeypatch.setattr(weight_cache, "_Packed", CollectingPacked)
    fresh = torch.randn(2, 8, 16)
    worker = threading.Thread(target=packed_linear.linear_row, args=(x, fresh, 1), daemon=True)
    worker.start()
    worker.join(timeout=30)
    assert not worker.is_alive(), "packing deadlocked on the cache's lock"
    assert collected and collected[0] > 0  # the cycle was collected inside the locked region
    torch.testing.assert_close(packed_linear.linear_row(x, fresh, 1), F.linear(x, fresh[1]), rtol=1e-5, atol=1e-5)
