"""The native CPU kernels (kernels/native_cpu.py) against float64 references and torch's kernels."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch.nn.functional as F

from raymoe.kernels import native_cpu, native_exchange, native_library, packed_linear
from raymoe.kernels.comm import wire
from raymoe.kernels.expert_mlp import grouped_swiglu, kernel_name


def _cpu_has_avx512f() -> bool:
    with open("/proc/cpuinfo") as handle:
        return " avx512f" in handle.read()


CAN_RUN = sys.platform.startswith("linux") and shutil.which(os.environ.get("CC") or "cc") is not None \
    and os.path.exists("/proc/cpuinfo") and _cpu_has_avx512f() and packed_linear.available()
needs_kernel = pytest.mark.skipif(not CAN_RUN, reason="needs Linux, a C compiler, AVX-512F and torch's oneDNN")


@pytest.fixture(autouse=True)
def _switches_on():
    native_cpu.set_enabled(True)
    packed_linear.set_enabled(True)
    yield
    native_cpu.set_enabled(True)
    packed_linear.set_enabled(True)


def _stacks(experts: int, hidden: int, intermediate: int, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    w13 = torch.randn(experts, 2 * intermediate, hidden, generator=generator) / hidden ** 0.5
    w2 = torch.randn(experts, hidden, intermediate, generator=generator) / intermediate ** 0.5
    return w13, w2


def _reference(x: torch.Tensor, counts: list[int], w13: torch.Tensor, w2: torch.Tensor, slot_rows: list[int]):
    out, start, inter = [], 0, w2.shape[2]
    for slot, count in enumerate(counts):
        rows = x[start:start + count].double()
        gate_up = rows @ w13[slot_rows[slot]].double().T
        out.append((F.silu(gate_up[:, :inter]) * gate_up[:, inter:]) @ w2[slot_rows[slot]].double().T)
        start += count
    return torch.cat(out)


@needs_kernel
def test_the_kernel_builds_and_runs_where_the_machine_allows_it():
    assert native_cpu.unavailable_reason() is None
    w13, w2 = _stacks(2, 64, 48)
    assert kernel_name(torch.randn(3, 64), w13, w2) == native_cpu.KERNEL


@needs_kernel
@pytest.mark.parametrize("hidden,intermediate", [(64, 48), (256, 512), (96, 32)])
@pytest.mark.parametrize("counts", [[1, 0, 2, 0], [8, 3, 0, 9], [40, 1, 33, 0]])  # row blocks of 8, chunks of 32
def test_matches_a_float64_reference_and_onednn(hidden, intermediate, counts):
    w13, w2 = _stacks(6, hidden, intermediate)
    slot_rows = [5, 0, 3, 2]  # slots served by other stacked rows, as while a migration stages experts
    x = torch.randn(sum(counts), hidden, generator=torch.Generator().manual_seed(1))
    assert native_cpu.experts_apply(x, w13, w2)
    native = grouped_swiglu(x, counts, w13, w2, slot_rows)
    reference = _reference(x, counts, w13, w2, slot_rows)
    torch.testing.assert_close(native.double(), reference, rtol=1e-5, atol=2e-6)
    native_cpu.set_enabled(False)
    assert kernel_name(x, w13, w2) == "onednn"
    onednn = grouped_swiglu(x, counts, w13, w2, slot_rows)
    torch.testing.assert_close(native, onednn, rtol=1e-5, atol=2e-6)
    assert not torch.equal(native, onednn)  # (it is another kernel: the switch did switch)


@needs_kernel
def test_a_rows_result_does_not_depend_on_the_rows_beside_it_or_the_threads():
    w13, w2 = _stacks(3, 64, 96)
    x = torch.randn(45, 64, generator=torch.Generator().manual_seed(2))
    together = grouped_swiglu(x, [45, 0, 0], w13, w2, [1, 0, 2])
    for rows in (1, 2, 7, 8, 9, 31, 32, 33):
        for first in (0, 45 - rows, 5):
            if first + rows <= 45:
                alone = grouped_swiglu(x[first:first + rows], [rows, 0, 0], w13, w2, [1, 0, 2])
                assert torch.equal(alone, together[first:first + rows]), (first, rows)
    split = grouped_swiglu(x, [20, 25, 0], w13, w2, [1, 1, 2], executor=ThreadPoolExecutor(1))
    assert torch.equal(split, together)


@needs_kernel
def test_a_stack_written_in_place_is_packed_again():
    w13, w2 = _stacks(2, 64, 48)
    x = torch.randn(4, 64)
    before = grouped_swiglu(x, [4, 0], w13, w2)
    w13[0].mul_(2.0)  # a migration staging an expert writes the stack in place
    w2[0].mul_(0.5)
    after = grouped_swiglu(x, [4, 0], w13, w2)
    torch.testing.assert_close(after.double(), _reference(x, [4, 0], w13, w2, [0, 1]), rtol=1e-5, atol=2e-6)
    assert not torch.equal(before, after)


def test_shapes_dtypes_and_the_switch_it_does_not_take_go_to_onednn_or_torch():
    w13, w2 = _stacks(2, 48, 48)  # hidden not a multiple of 32
    x = torch.randn(3, 48)
    assert not native_cpu.experts_apply(x, w13, w2)
    assert kernel_name(x, w13, w2) == ("onednn" if packed_linear.available() else "torch")
    w13, w2 = _stacks(2, 64, 40)  # intermediate not a multiple of 16
    assert not native_cpu.experts_apply(torch.randn(3, 64), w13, w2)
    w13, w2 = _stacks(2, 64, 48)
    assert not native_cpu.experts_apply(torch.randn(3, 64).bfloat16(), w13.bfloat16(), w2.bfloat16())
    assert kernel_name(torch.randn(3, 64).bfloat16(), w13.bfloat16(), w2.bfloat16()) == "torch"
    if CAN_RUN:  # the same question asked of sizes (a worker's exchange, at join)
        cpu = torch.device("cpu")
        assert native_cpu.experts_fit(torch.float32, cpu, 64, 48)
        assert not native_cpu.experts_fit(torch.float32, cpu, 48, 48)  # D not a multiple of 32
        assert not native_cpu.experts_fit(torch.float32, cpu, 64, 40)  # I not a multiple of 16
        assert not native_cpu.experts_fit(torch.bfloat16, cpu, 64, 48)
    native_cpu.set_enabled(False)
    assert not native_cpu.experts_apply(torch.randn(3, 64), w13, w2)
    assert not native_cpu.experts_fit(torch.float32, torch.device("cpu"), 64, 48)
    assert "turned off" in native_cpu.unavailable_reason()


def test_without_a_compiler_experts_run_on_onednn_and_say_why(tmp_path):
    """A fresh process with no compiler and an empty build directory: the reason names the
    compiler, and grouped_swiglu still returns the right rows."""
    script = textwrap.dedent("""
        import torch, torch.nn.functional as F
        from raymoe.kernels import native_cpu
        from raymoe.kernels.expert_mlp import grouped_swiglu, kernel_name
        w13, w2 = torch.randn(2, 96, 64) / 8, torch.randn(2, 64, 48) / 7
        x = torch.randn(5, 64)
        out = grouped_swiglu(x, [2, 3], w13, w2)
        gate_up = x[2:] @ w13[1].T
        torch.testing.assert_close(out[2:], (F.silu(gate_up[:, :48]) * gate_up[:, 48:]) @ w2[1].T, rtol=1e-5, atol=1e-5)
        print("REASON:", native_cpu.unavailable_reason())
        print("KERNEL:", kernel_name(x, w13, w2))
    """)
    env = dict(os.environ, CC="raymoe-no-such-compiler", RAYMOE_NATIVE_DIR=str(tmp_path))
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "REASON: no C compiler ('raymoe-no-such-compiler' not found; set CC)" in result.stdout
    assert "KERNEL: onednn" in result.stdout or ("KERNEL: torch" in result.stdout and not packed_linear.available())
    assert "native CPU kernels unavailable" in result.stderr  # logged once, with the reason
    assert not list(tmp_path.iterdir())


@needs_kernel
def test_a_compiler_that_cannot_build_the_bf16_kernels_still_builds_the_f32_ones(tmp_path):
    """A compiler without AMX's intrinsics (GCC before 11) fails on cpu_bf16.c: the float32 kernels
    are built without it, and the bfloat16 ones say why they do not run."""
    wrapper = tmp_path / "cc"
    wrapper.write_text('#!/bin/sh\nfor a in "$@"; do case "$a" in *cpu_bf16.c) '
                       'echo "cpu_bf16.c:1: error: no AMX intrinsics here" >&2; exit 1;; esac; done\nexec cc "$@"\n')
    wrapper.chmod(0o755)
    code = textwrap.dedent("""
        from raymoe.kernels import native_library
        assert native_library.unavailable_reason() is None, native_library.unavailable_reason()
        reason = native_library.bf16_unavailable_reason()
        assert reason and "cpu_bf16.c" in reason and "no AMX intrinsics" in reason, reason
        print("ok")
    """)
    env = dict(os.environ, CC=str(wrapper), RAYMOE_NATIVE_DIR=str(tmp_path / "build"))
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr


@needs_kernel
def test_the_library_reports_every_shared_constant_as_the_python_side_defines_it():
    """One source: the library was compiled from a header generated out of kernels/comm/wire.py
    and CHUNK_ROWS, and reports what its C code sees (the frame's and trailer's sizes measured
    with sizeof): every constant, one by one, equals the Python side's, and none is missing or extra."""
    assert native_cpu.unavailable_reason() is None
    reported, expected = native_library.reported_constants(), native_library.constants()
    assert set(reported) == set(expected)
    for name, value in expected.items():
        assert reported[name] == value, name
    # the Python definitions themselves, as the transport, the exchange and the kernels use them
    assert reported["FRAME_BYTES"] == wire.FRAME.size and reported["TRAILER_BYTES"] == wire.TRAILER.size
    assert reported["HEADER_FIELDS"] == wire.HEADER_FIELDS and reported["KIND_IDLE"] == wire.KIND_IDLE
    assert reported["CHUNK_ROWS"] == native_cpu.CHUNK_ROWS
    assert all(reported[f"STATUS_{status.name}"] == status for status in wire.Status)
    assert all(reported[f"INFO_{field.name}"] == field for field in wire.Info)
    assert set(wire.STATUSES) == set(wire.Status)  # every status has its row in the table
    # and the check that refuses a library whose constants disagree would notice one that did
    assert native_library.constant_differences({**reported, "KIND_STEP": 7}, expected) == [
        "KIND_STEP: library 7, Python 1"]
    assert native_library.constant_differences({k: v for k, v in reported.items() if k != "INFO_A"}, expected) == [
        "INFO_A: library missing, Python 1"]


def test_the_generated_header_defines_every_constant_and_the_row_format():
    header = native_library.c_header()
    for name, value in native_library.constants().items():
        assert f"#define {name} ({value})\n" in header
    row = wire.RowFormat(64, 2, torch.float32)
    assert row.row_bytes == 4 * 64 + (wire.SLOT_BYTES + wire.WEIGHT_BYTES) * 2 == wire.row_bytes(64, 2)
    assert "#define ROW_BYTES(D, k) (4 * (D) + (SLOT_BYTES + WEIGHT_BYTES) * (k))" in header
    assert wire.RowFormat(64, 2, torch.bfloat16).row_bytes == 2 * 64 + (wire.SLOT_BYTES + wire.WEIGHT_BYTES) * 2
    assert "#define ROW_BYTES_OF(A, D, k) ((A) * (D) + (SLOT_BYTES + WEIGHT_BYTES) * (k))" in header


@needs_kernel
def test_the_library_is_built_once_into_the_build_directory(tmp_path):
    script = "from raymoe.kernels import native_cpu; print(native_cpu.unavailable_reason())"
    env = dict(os.environ, RAYMOE_NATIVE_DIR=str(tmp_path))
    for _ in range(2):
        result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
        assert result.stdout.strip() == "None", result.stderr
        built = [path.name for path in tmp_path.iterdir()]
        assert len(built) == 1 and built[0].startswith("cpu_f32-") and built[0].endswith(".so"), built


# ---- dense layers --------------------------------------------------------------------------
@needs_kernel
@pytest.mark.parametrize("rows", [1, 7, 8, 33, 300])
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_matches_float64_and_is_row_invariant(rows, with_bias):
    generator = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, 80, generator=generator) / 9
    bias = torch.randn(96, generator=generator) if with_bias else None
    x = torch.randn(rows, 80, generator=generator)
    assert native_cpu.linear_applies(x, weight, bias)
    out = packed_linear.linear(x, weight, bias)  # the dense layers' entry point takes the native kernel
    assert torch.equal(out, native_cpu.linear(x, weight, bias))
    expected = x.double() @ weight.double().T + (bias.double() if with_bias else 0)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=2e-6)
    for first, count in ((0, 1), (rows - 1, 1), (rows // 3, max(1, rows // 2))):
        assert torch.equal(packed_linear.linear(x[first:first + count], weight, bias), out[first:first + count])
    assert torch.equal(packed_linear.linear(x.view(1, rows, 80), weight, bias), out.view(1, rows, 96))


def test_linear_shapes_it_does_not_take_go_to_torch():
    x = torch.randn(3, 64)
    assert not native_cpu.linear_applies(x, torch.randn(40, 64), None)  # N not a multiple of 32
    assert not native_cpu.linear_applies(x.double(), torch.randn(64, 64).double(), None)
    small = torch.randn(8, 64)  # a router gate: 8 experts
    assert torch.equal(packed_linear.linear(x, small), F.linear(x, small))


# ---- decode attention ----------------------------------------------------------------------
@needs_kernel
@pytest.mark.parametrize("heads,kv_heads,head_dim,window", [(8, 4, 32, None), (4, 4, 16, None), (6, 2, 48, 20)])
def test_decode_attention_matches_sdpa_and_does_not_depend_on_the_batch(heads, kv_heads, head_dim, window):
    from raymoe.kernels.attention import AttentionMetadata, AttentionSpec, SdpaAttention
    from raymoe.moe.model_config import AttentionKind

    block_size, blocks = 16, 64
    spec = AttentionSpec(AttentionKind.GQA, heads, kv_heads, head_dim, head_dim, head_dim ** -0.5, window)
    generator = torch.Generator().manual_seed(heads * head_dim)
    contexts = [9, 17, 40, 33, 26, 58]  # padding within the batched path's bound
    order = torch.randperm(blocks - 1, generator=generator) + 1
    tables, used = [], 0
    for context in contexts:
        count = -(-context // block_size)
        tables.append(order[used:used + count].tolist())
        used += count
    metadata = AttentionMetadata.build([1] * len(contexts), contexts, tables, block_size)
    caches = (torch.randn(blocks, block_size, kv_heads, head_dim, generator=generator),
              torch.randn(blocks, block_size, kv_heads, head_dim, generator=generator))
    q = torch.randn(len(contexts), heads, head_dim, generator=generator)
    step = SdpaAttention(spec).plan(metadata, block_size)
    assert step.decodes is not None  # the batched decode path
    native = step.attend(q, caches)
    native_cpu.set_enabled(False)
    sdpa = SdpaAttention(spec).plan(metadata, block_size).attend(q, caches)
    native_cpu.set_enabled(True)
    torch.testing.assert_close(native, sdpa, rtol=1e-5, atol=1e-6)
    assert not torch.equal(native, sdpa)  # (another kernel ran)
    for index in range(len(contexts)):  # each sequence in a batch with one other: the same bits
        other = (index + 1) % len(contexts)
        pair = AttentionMetadata.build([1, 1], [contexts[index], contexts[other]], [tables[index], tables[other]],
                                       block_size)
        alone = SdpaAttention(spec).plan(pair, block_size).attend(q[[index, other]], caches)
        assert torch.equal(alone[0], native[index]), index


@needs_kernel
@pytest.mark.parametrize("single_decodes", [True, False])
def test_a_lone_decode_takes_the_native_kernel_with_the_bits_it_has_in_a_batch(single_decodes):
    from raymoe.kernels.attention import AttentionMetadata, AttentionSpec, SdpaAttention
    from raymoe.moe.model_config import AttentionKind

    block_size, heads, kv_heads, head_dim = 16, 8, 4, 32
    spec = AttentionSpec(AttentionKind.GQA, heads, kv_heads, head_dim, head_dim, head_dim ** -0.5, None)
    generator = torch.Generator().manual_seed(7)
    caches = (torch.randn(8, block_size, kv_heads, head_dim, generator=generator),
              torch.randn(8, block_size, kv_heads, head_dim, generator=generator))
    q = torch.randn(2, heads, head_dim, generator=generator)
    backend = SdpaAttention(spec, torch.float32, torch.device("cpu"))
    assert backend.single_decodes  # float32 GQA on this CPU
    backend.single_decodes = single_decodes
    alone = backend.plan(AttentionMetadata.build([1], [37], [[3, 1, 6]], block_size), block_size)
    assert (alone.decodes is not None) == single_decodes
    pair = backend.plan(AttentionMetadata.build([1, 1], [37, 20], [[3, 1, 6], [2, 5]], block_size), block_size)
    out_alone, out_pair = alone.attend(q[:1], caches), pair.attend(q, caches)
    torch.testing.assert_close(out_alone[0], out_pair[0], rtol=1e-5, atol=1e-6)
    assert torch.equal(out_alone[0], out_pair[0]) == single_decodes  # SDPA alone: other bits
    # bfloat16 takes its own native kernel where AVX512_BF16 runs (tests/kernels/test_native_bf16.py)
    assert SdpaAttention(spec, torch.bfloat16, torch.device("cpu")).single_decodes == \
        (native_library.bf16_unavailable_reason() is None)
    assert not SdpaAttention(spec, torch.float16, torch.device("cpu")).single_decodes
    assert not SdpaAttention(spec).single_decodes  # no dtype or device given: SDPA as before


# ---- a worker's rows ------------------------------------------------------------------------
@needs_kernel
@pytest.mark.parametrize("top_k", [1, 2, 4, 8])
@pytest.mark.parametrize("num_rows", [1, 6, 41])
def test_run_rows_in_one_call_gives_the_torch_paths_bits(top_k, num_rows):
    from raymoe.engine.experts import run_rows

    hidden, intermediate, pool, slots = 64, 48, 7, 5
    generator = torch.Generator().manual_seed(top_k * 100 + num_rows)
    w13, w2 = _stacks(pool, hidden, intermediate, seed=top_k)
    segments = [num_rows // 2, num_rows - num_rows // 2] if num_rows > 1 else [1]  # two routers' rows
    maps = torch.tensor([[3, 0, 6, 1, 2], [0, 1, 2, 3, 4]])[:len(segments)]  # a staged epoch, and identity
    x = torch.randn(num_rows, hidden, generator=generator)
    local = torch.randint(-1, slots, (num_rows, top_k), generator=generator, dtype=torch.int32)  # -1: not here
    weights = torch.rand(num_rows, top_k, generator=generator)
    payload = torch.cat([x.view(torch.uint8), local.view(torch.uint8), weights.view(torch.uint8)], dim=1)
    segment = torch.repeat_interleave(torch.arange(len(segments)), torch.tensor(segments))
    row_pool = torch.where(local >= 0, maps[segment.unsqueeze(1), local.long().clamp(min=0)], -1)
    pool_counts = [int((row_pool == p).sum()) for p in range(pool)]
    reference, assignments = run_rows(x, row_pool, weights, w13, w2, pool_counts)
    assert native_cpu.experts_apply(x, w13, w2)  # (the caller's check: it also builds the kernels)
    out = native_cpu.run_rows(payload, top_k, maps, segments, w13, w2, assignments)
    assert assignments == sum(pool_counts)
    assert torch.equal(out, reference)  # same plan order, kernel and sums: the same bits
    into = torch.full((num_rows * hidden + 4,), float("nan"))
    native_cpu.run_rows(payload, top_k, maps, segments, w13, w2, assignments, out=into[:-4])
    assert torch.equal(into[:-4].view(num_rows, hidden), reference) and into[-4:].isnan().all()
    with pytest.raises(ValueError, match="announced"):  # a header that disagrees with its rows
        native_cpu.run_rows(payload, top_k, maps, segments, w13, w2, assignments + 1)
    bad = payload.clone()
    bad[0, 4 * hidden:4 * hidden + 4] = torch.tensor([slots], dtype=torch.int32).view(torch.uint8)
    with pytest.raises(ValueError, match="outside"):
        native_cpu.run_rows(bad, top_k, maps, segments, w13, w2, assignments)


@needs_kernel
@pytest.mark.parametrize("seed", range(6))
def test_plan_pack_is_the_host_plan_bit_for_bit_with_its_rows_packed(seed):
    from raymoe.moe.exchange_plan import plan_exchange_on_host

    generator = torch.Generator().manual_seed(seed)
    experts, slots, hidden = 8, 4, 64
    workers, replicas = 1 + seed % 4, 1 + seed % 2
    for trial in range(25):
        tokens, top_k = int(torch.randint(1, 40, (), generator=generator)), 1 + trial % 4
        log2phy = torch.randint(0, workers * slots, (experts, replicas), generator=generator)
        logcnt = torch.randint(1, replicas + 1, (experts,), generator=generator)
        for expert in range(experts):
            log2phy[expert, logcnt[expert]:] = -1
        if trial % 5 == 0:  # an expert placed nowhere: its assignments are dropped
            log2phy[0], logcnt[0] = -1, 0
        ids = torch.stack([torch.randperm(experts, generator=generator)[:top_k] for _ in range(tokens)])
        weights = torch.rand(tokens, top_k, generator=generator)
        kept = torch.rand(tokens, top_k, generator=generator) > 0.2 if trial % 2 else None
        x = torch.randn(tokens, hidden, generator=generator)
        assert native_cpu.plan_applies(x)
        reference = plan_exchange_on_host(ids, weights, kept, log2phy.numpy(), logcnt.numpy(), slots, workers)
        slot, send_counts, slot_counts, row_token, packed = native_cpu.plan_pack(
            ids, weights, kept, log2phy, logcnt, slots, workers, x)
        assert torch.equal(slot, reference.slot)
        assert (send_counts, slot_counts) == (reference.send_counts, reference.slot_counts)
        assert torch.equal(row_token, reference.row_token)
        wire = torch.cat([x.index_select(0, reference.row_token).view(torch.uint8),
                          reference.row_slots.view(torch.uint8), reference.row_weights.view(torch.uint8)], dim=1)
        assert torch.equal(packed, wire)
    with pytest.raises(ValueError, match="out of range"):
        native_cpu.plan_pack(torch.tensor([[experts]]), torch.ones(1, 1), None, log2phy, logcnt, slots, workers,
                             torch.randn(1, hidden))
    assert not native_cpu.plan_applies(x.to(torch.bfloat16))


@needs_kernel
def test_the_exchange_calls_take_float32_and_bfloat16_on_the_cpu_only_and_obey_the_switch(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.setenv("RAYMOE_NATIVE_EXCHANGE", "0")  # the exchange's own switch: its Python sides
    checks = (native_exchange.applies, native_exchange.router_applies, native_exchange.worker_applies)
    assert not any(check(dtype, cpu) for dtype in (torch.float32, torch.bfloat16) for check in checks)
    monkeypatch.delenv("RAYMOE_NATIVE_EXCHANGE")
    assert native_exchange.applies(torch.float32, cpu)
    assert not native_exchange.applies(torch.bfloat16, cpu)
    assert not native_exchange.applies(torch.float32, torch.device("meta"))
    assert native_exchange.router_applies(torch.bfloat16, cpu)  # (bytes to a router's messages)
    assert not native_exchange.router_applies(torch.float16, cpu)
    assert native_exchange.worker_applies(torch.bfloat16, cpu) == (native_library.bf16_unavailable_reason() is None)
    native_cpu.set_enabled(False)
    assert not native_exchange.applies(torch.float32, cpu)
    assert not native_exchange.router_applies(torch.bfloat16, cpu)
    assert not native_exchange.worker_applies(torch.bfloat16, cpu)


# ---- norms and rotary embeddings -----------------------------------------------------------
@needs_kernel
@pytest.mark.parametrize("rows", [1, 5, 33])
def test_rms_norm_matches_float64_is_row_invariant_and_adds_the_residual_exactly(rows):
    from raymoe.kernels.norm import add_rms_norm, rms_norm

    generator = torch.Generator().manual_seed(rows)
    x, delta = torch.randn(rows, 256, generator=generator), torch.randn(rows, 256, generator=generator)
    weight, eps = torch.rand(256, generator=generator) + 0.5, 1e-5
    assert native_cpu.norm_applies(x, weight)
    total, h = add_rms_norm(x, delta, weight, eps)
    assert torch.equal(total, x + delta)  # one rounding per element, as torch's add
    s = total.double()
    reference = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + eps) * weight.double()
    torch.testing.assert_close(h.double(), reference, rtol=2e-6, atol=1e-6)
    torch.testing.assert_close(h, F.rms_norm(total, (256,), weight, eps), rtol=2e-6, atol=1e-6)
    assert torch.equal(rms_norm(total, weight, eps), h)
    assert add_rms_norm(x, None, weight, eps)[0] is x
    # a residual of another dtype is added as torch adds it (promoted), not read as float32 bytes
    total64, h64 = add_rms_norm(x, delta.double(), weight, eps)
    assert total64.dtype == torch.float64 and torch.equal(total64, x + delta.double())
    for row in range(rows):  # a row alone: the same bits
        assert torch.equal(rms_norm(total[row:row + 1].clone(), weight, eps)[0], h[row])
    native_cpu.set_enabled(False)  # torch's: the same within float32 rounding
    torch.testing.assert_close(rms_norm(total, weight, eps), h, rtol=2e-6, atol=1e-6)
    assert not native_cpu.norm_applies(x, weight)
    native_cpu.set_enabled(True)
    assert not native_cpu.norm_applies(torch.randn(3, 40), torch.rand(40))  # D not a multiple of 16
    assert not native_cpu.norm_applies(x.t(), weight)  # not contiguous rows


@needs_kernel
@pytest.mark.parametrize("tokens,heads,size", [(1, 12, 32), (7, 3, 64), (4, 2, 6)])
def test_rope_gives_torchs_bits_on_strided_heads(tokens, heads, size):
    from raymoe.kernels.rope import apply_rope

    generator = torch.Generator().manual_seed(size)
    qkv = torch.randn(tokens, (heads + 2) * size, generator=generator)
    x = qkv[:, :heads * size].view(tokens, heads, size)  # q and k heads inside a wider row, as the model has
    cos, sin = torch.randn(tokens, 1, size, generator=generator), torch.randn(tokens, 1, size, generator=generator)
    assert native_cpu.rope_applies(x, cos, sin)
    out = apply_rope(x, cos, sin, False)
    assert torch.equal(out, x * cos + x.roll(size // 2, -1) * sin)
    assert not native_cpu.rope_applies(x.transpose(0, 1), cos, sin)  # heads not contiguous per token


@needs_kernel
def test_a_large_stack_is_packed_on_huge_page_boundaries_with_the_same_results():
    w13, w2 = _stacks(4, 256, 512)  # 6 MiB of experts: each packed layout spans huge pages
    x = torch.randn(9, 256, generator=torch.Generator().manual_seed(3))
    out = grouped_swiglu(x, [4, 0, 5, 0], w13, w2)
    packed13, packed2 = native_cpu._packed_experts(w13, w2)
    for packed in (packed13, packed2):
        assert packed.data_ptr() % native_cpu.HUGE_PAGE == 0 and packed.is_contiguous()
    torch.testing.assert_close(out.double(), _reference(x, [4, 0, 5, 0], w13, w2, [0, 1, 2, 3]), rtol=1e-5, atol=2e-6)
    for packed in (packed13, packed2):  # each lies in a mapping advised for huge pages ("hg" in VmFlags)
        assert "hg" in _vm_flags(packed.data_ptr()).split(), _vm_flags(packed.data_ptr())


def _vm_flags(address: int) -> str:
    """The VmFlags of the mapping of this process that holds ``address`` (/proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as handle:
        for line in handle:
            head = line.split(" ", 1)[0]
            if "-" in head and ":" not in head:
                low, high = (int(part, 16) for part in head.split("-"))
                inside = low <= address < high
            elif inside and line.startswith("VmFlags:"):
                return line[len("VmFlags:"):].strip()
    raise AssertionError(f"no mapping holds {address:#x}")


@needs_kernel
def test_experts_prepared_at_load_are_not_packed_again_in_a_step():
    w13, w2 = _stacks(3, 64, 48)
    assert native_cpu.prepare_experts(w13, w2)
    packed = native_cpu._packed_experts(w13, w2)
    grouped_swiglu(torch.randn(4, 64), [1, 2, 1], w13, w2)
    assert all(a is b for a, b in zip(packed, native_cpu._packed_experts(w13, w2)))
    assert not native_cpu.prepare_experts(*_stacks(2, 48, 48))  # a shape it does not take: nothing packed
