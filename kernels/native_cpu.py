"""raymoe's native CPU kernels: float32 on AVX-512F (kernels/csrc/cpu_f32.c), the compute wrappers.
The library is built and loaded by kernels/native_library.py; the exchange's native layer calls
(kernels/csrc/cpu_exchange.c) have their own ctypes face, kernels/native_exchange.py.

Legend (docs/ARCHITECTURE.md's letters): Sp stacked experts (a stack's rows: a worker's pool, or a
layer's experts), D hidden, I expert intermediate, No/Ni a dense layer's out/in sizes, B decoding
sequences, H/Hkv query/kv heads, Dk/Dv key/value sizes, T tokens, k experts per token, W workers,
S slots per worker, N rows of an exchange message.

Why: at decode sizes every matmul here is a few rows, and torch's CPU kernels pay a fixed cost
per call and run those shapes far below the core: on the 2-vCPU EPYC of docs/BENCHMARKS.md a
dense layer's sgemm at 32 rows ran at ~50 GFLOP/s, oneDNN's packed expert GEMMs streamed their
weights at ~15 GB/s at 8 rows where a plain read runs at ~45, a SwiGLU expert was ~5 calls from
Python, and a batch of decodes gathered its keys into a padded copy before SDPA. The kernels:

- :func:`swiglu_jobs`: a layer's experts in one call (kernels/expert_mlp.py), each expert's
  weights streamed once per 32 rows with software prefetch, gate, up, SiLU and down fused: 32
  experts x 8 rows (one decode step at 32 sequences of the bench model) 1.1-1.3 ms against
  oneDNN's 3.3 ms; at one row 1.0-1.2 against 2.3-3.0 (benchmarks/bench_cpu_floor.py (6));
- :func:`linear`: a dense layer over a weight packed once (kernels/packed_linear.py), 2-3.5x
  sgemm's speed at 1-256 rows of the bench model's [512, 256] layers;
- :func:`decode_attention`: a batch of decodes (or a lone one) straight from the paged cache
  (kernels/attention.py), no gathered copy, no padding;
- :func:`rms_norm` (with the residual add before it) and :func:`rope`: one call each where
  torch took ~5 small ops (kernels/norm.py, kernels/rope.py); at one sequence a decode step's
  dispatch overhead, not its math, is what these remove (in-process step at one sequence
  2.14-2.35 -> 1.99-2.20 ms with the lone-decode attention, alternating blocks, 12:00);
- :func:`run_rows` and :func:`plan_pack`: a worker's received rows through its experts, and a
  router's plan of a layer with its rows packed for the wire, one call each (the exchange's layer
  calls, kernels/native_exchange.py, run the former inside theirs).

Contracts:
- **Row-invariant.** Every output element is one chain of fused multiply-adds in a fixed
  order, and attention reduces each (sequence, head) on its own in key order: a row's result
  does not depend on which rows share its call (so placement, replicas and batching cannot
  change a bit of it, as with oneDNN's packed path before).
- **One kernel per machine.** Results differ from torch's kernels in the last bits; the
  in-process engine, the routers and the workers of one machine all take these where they
  apply, and kernels/expert_mlp.py::kernel_name says which runs the experts (a worker's
  ``info()["expert_kernel"]``). A cluster whose nodes differ (one without AVX-512F or without a
  C compiler) mixes kernels, as it mixed oneDNN's ISA-specific ones before.

Where the library is unavailable (kernels/native_library.py: no compiler, no AVX-512F,
``RAYMOE_NATIVE_KERNELS=0``), torch's kernels run as before (oneDNN, sgemm, SDPA); shapes a kernel
does not take (see each ``*_applies``) go to torch's too. Weights are packed once into the
kernels' layouts, kept in kernels/weight_cache.py (as oneDNN's packed rows are).
"""

from __future__ import annotations

import array

import torch

from raymoe.kernels import weight_cache
from raymoe.kernels.comm.wire import Status, row_bytes
from raymoe.kernels.huge_pages import HUGE_PAGE, huge_page_empty  # noqa: F401 (HUGE_PAGE: tests)
# set_enabled and unavailable_reason are the loader's: this module's callers (attention, norms) ask them here
from raymoe.kernels.native_library import CHUNK_ROWS, STATE, set_enabled, unavailable_reason  # noqa: F401
from raymoe.kernels.native_library import check as _check

KERNEL = "native-avx512"


def _takes(*tensors: torch.Tensor) -> bool:
    return STATE.enabled and all(t.device.type == "cpu" and t.dtype == torch.float32 and not t.requires_grad
                            for t in tensors)


# ---- experts -------------------------------------------------------------------------------
def experts_apply(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> bool:
    """Whether :func:`swiglu_jobs` takes these rows and stacks (``[Sp, 2I, D]``, ``[Sp, D, I]``):
    float32 on the CPU, D a multiple of 32 and I of 16, and packed weights not turned off
    (kernels/weight_cache.py: ``cpu.packed_experts``)."""
    if not (_takes(x, w13, w2) and x.numel() > 0 and weight_cache.enabled()):
        return False
    hidden, intermediate = w13.shape[2], w2.shape[2]
    if hidden % 32 or intermediate % 16 or w13.shape[1] != 2 * intermediate or w2.shape[1] != hidden:
        return False
    return unavailable_reason() is None


def experts_fit(dtype: torch.dtype, device: torch.device, hidden_size: int, intermediate_size: int) -> bool:
    """Whether :func:`experts_apply` takes experts of these sizes and rows of ``dtype`` on
    ``device`` (asked of stand-ins of the stacks' shapes: no memory)."""
    one = torch.empty(1, dtype=dtype, device=device)
    return experts_apply(one.expand(1, hidden_size), one.expand(1, 2 * intermediate_size, hidden_size),
                         one.expand(1, hidden_size, intermediate_size))


def swiglu_jobs(x: torch.Tensor, out: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                jobs: list[tuple[int, int, int]]) -> None:
    """``out[b:e] = swiglu_r(x[b:e])`` for each job ``(r, b, e)`` (:func:`experts_apply` checked by
    the caller; ``x`` and ``out`` contiguous ``[A, D]``). Releases the GIL while it runs."""
    if not jobs:
        return
    packed13, packed2 = packed_experts(w13, w2)
    flat = array.array("q", [value for job in jobs for value in job])
    scratch = torch.empty(CHUNK_ROWS, w2.shape[2], dtype=torch.float32)
    _check(STATE.library.raymoe_swiglu_experts(x.data_ptr(), out.data_ptr(), packed13.data_ptr(), packed2.data_ptr(),
                                                flat.buffer_info()[0], len(jobs), w13.shape[2], w2.shape[2],
                                                scratch.data_ptr()), "raymoe_swiglu_experts")


def run_rows(payload: torch.Tensor, top_k: int, maps: torch.Tensor, segment_rows: list[int], w13: torch.Tensor,
             w2: torch.Tensor, assignments: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """A worker's received rows through its experts in one call (engine/experts.py::run_rows's
    arithmetic, so its bits): ``payload: [N, row_bytes]`` uint8 rows as dispatched
    (kernels/comm/wire.py::RowFormat: activations, k int32 local slots, k float32 weights), in
    segments of ``segment_rows`` rows; ``maps: [segments, S]`` int64, the pool row serving each
    local slot for that segment; ``assignments``: what the routers' headers announced. Returns ``[N, D]`` float32, written into ``out`` (any
    contiguous float32 buffer of N * D) when given (:func:`experts_apply` checked for the pool,
    float32 rows)."""
    num_rows, width = payload.shape
    hidden, intermediate = w13.shape[2], w2.shape[2]
    packed13, packed2 = packed_experts(w13, w2)
    payload, maps = payload.contiguous(), maps.contiguous()
    counts = array.array("q", segment_rows)
    out = torch.empty(num_rows, hidden, dtype=torch.float32) if out is None else out.view(num_rows, hidden)
    status = STATE.library.raymoe_run_rows(payload.data_ptr(), num_rows, width, hidden, intermediate, top_k,
                                           maps.data_ptr(), counts.buffer_info()[0], len(segment_rows), maps.shape[1],
                                           packed13.data_ptr(), packed2.data_ptr(), w13.shape[0], assignments,
                                           out.data_ptr())
    if status < 0:
        if status == Status.BAD_SLOT:
            raise ValueError("a dispatched row names a local slot or pool row outside this worker's")
        if status == Status.ASSIGNMENTS:
            raise ValueError(f"the routers' headers announced {assignments} assignments but their rows hold others")
        _check(int(status), "raymoe_run_rows")
    return out


def plan_applies(hidden: torch.Tensor) -> bool:
    """Whether :func:`plan_pack` takes a layer whose activations are ``hidden``: float32 on the CPU."""
    return _takes(hidden) and hidden.dim() == 2 and unavailable_reason() is None


def plan_pack(topk_ids: torch.Tensor, topk_weights: torch.Tensor, kept: torch.Tensor | None, log2phy: torch.Tensor,
              logcnt: torch.Tensor, slots_per_worker: int, num_workers: int, hidden: torch.Tensor):
    """moe/exchange_plan.py's plan of one layer and its rows packed for the wire, in one call
    (:func:`plan_applies` checked). Returns ``(slot [T, k], send_counts, slot_counts, row_token [N],
    packed [N, row_bytes] uint8)`` (kernels/comm/wire.py::RowFormat): the same plan, bit for bit, as
    ``plan_exchange_on_host``."""
    num_tokens, top_k = topk_ids.shape
    width = hidden.shape[1]
    ids = topk_ids.to(torch.int64).contiguous()
    weights = topk_weights.to(torch.float32).contiguous()
    kept_bytes = kept.to(torch.uint8).contiguous() if kept is not None else None
    log2phy, logcnt, hidden = log2phy.contiguous(), logcnt.contiguous(), hidden.contiguous()
    slot = torch.empty(num_tokens, top_k, dtype=torch.int64)
    counts = torch.empty(num_workers + num_workers * slots_per_worker, dtype=torch.int64)
    most = num_tokens * num_workers
    row_token = torch.empty(most, dtype=torch.int64)
    packed = torch.empty(most, row_bytes(width, top_k), dtype=torch.uint8)
    rows = STATE.library.raymoe_plan_pack(
        ids.data_ptr(), weights.data_ptr(), kept_bytes.data_ptr() if kept_bytes is not None else None,
        log2phy.data_ptr(), logcnt.data_ptr(), num_tokens, top_k, log2phy.shape[0], log2phy.shape[1],
        slots_per_worker, num_workers, hidden.data_ptr(), width, slot.data_ptr(), counts.data_ptr(),
        counts[num_workers:].data_ptr(), row_token.data_ptr(), packed.data_ptr())
    if rows == -1:
        raise ValueError("a gate's expert, or the placement's replica or slot for it, is out of range")
    if rows < 0:
        _check(int(rows), "raymoe_plan_pack")
    counts = counts.tolist()
    return slot, counts[:num_workers], counts[num_workers:], row_token[:rows], packed[:rows]


def prepare_experts(w13: torch.Tensor, w2: torch.Tensor) -> bool:
    """Pack both stacks now (a worker loading its experts) where the kernel takes them, so that
    the first requests do not pay for it; True if it does."""
    if not experts_apply(torch.empty(1, w13.shape[2], dtype=w13.dtype, device=w13.device), w13, w2):
        return False
    packed_experts(w13, w2)
    return True


def packed_experts(w13: torch.Tensor, w2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Both stacks in the kernel's layouts, made once per stack version (kernels/weight_cache.py):
    w13 ``[Sp, I/16, D, 2, 16]`` (a panel's gate and up columns side by side, k-major) and
    w2 ``[Sp, D/32, I, 32]``."""
    return _layout(w13, _gate_up_panels), _layout(w2, lambda w2: _on_huge_pages(_panels(w2, contiguous=False)))


_packed_experts = packed_experts  # (the name tests/actors/test_reload_in_place.py knows)


def _layout(weight: torch.Tensor, make) -> torch.Tensor:
    """The kernel's layout of ``weight``, made by ``make`` once per weight version (kernels/weight_cache.py)."""
    rows = weight_cache.cached_rows(weight)
    layout = rows.get(KERNEL)
    if layout is None:
        layout = rows[KERNEL] = make(weight)
    return layout


def _gate_up_panels(w13: torch.Tensor) -> torch.Tensor:
    stacked, hidden = w13.shape[0], w13.shape[2]
    gate, up = w13.reshape(stacked, 2, -1, 16, hidden).unbind(1)  # [Sp, I/16, 16, D] each
    # [Sp, I/16, D, 2, 16], written in place: no stacked temporary the size of the layer's w13
    # (a worker packing its pool must not hold a third copy of a layer meanwhile)
    layout = huge_page_empty(torch.Size((stacked, gate.shape[1], hidden, 2, 16)), torch.float32)  # (see _on_huge_pages)
    layout.select(3, 0).copy_(gate.transpose(2, 3))
    layout.select(3, 1).copy_(up.transpose(2, 3))
    return layout


def _on_huge_pages(layout: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of ``layout`` on 2 MiB pages (kernels/huge_pages.py).

    A worker's experts stream from DRAM every step (12 MB a step at one sequence for the bench
    model, 48 MB at 32); through 4 KiB pages each expert also costs a few hundred TLB walks, and
    the walks miss the caches the other process emptied. Measured on the experts of 4 layers
    with 16 MB of other memory written between layers (the router's turn): 0.95-1.20 -> 0.70-0.94
    ms at one row an expert, 2.34-3.05 -> 2.03-2.84 at 8."""
    return huge_page_empty(layout.shape, torch.float32).copy_(layout)


def _panels(weight: torch.Tensor, contiguous: bool = True) -> torch.Tensor:
    """``[..., No, Ni]`` -> ``[..., No/32, Ni, 32]``: 32 output columns a panel, k-major (a view
    when not ``contiguous``)."""
    *lead, out_features, in_features = weight.shape
    panels = weight.reshape(*lead, out_features // 32, 32, in_features).transpose(-1, -2)
    return panels.contiguous() if contiguous else panels


# ---- dense layers --------------------------------------------------------------------------
def linear_applies(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether :func:`linear` takes it: float32 on the CPU, a ``[No, Ni]`` weight with No a multiple of 32."""
    return (_takes(x, weight) and x.numel() > 0 and weight.dim() == 2 and weight.shape[0] % 32 == 0
            and (bias is None or _takes(bias)) and unavailable_reason() is None)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` over the weight packed once (:func:`linear_applies` checked)."""
    packed = _layout(weight, _panels)
    shape = x.shape
    flat = x.reshape(-1, shape[-1]).contiguous()
    out = torch.empty(flat.shape[0], weight.shape[0], dtype=torch.float32)
    bias = bias.contiguous() if bias is not None else None  # (kept alive through the call)
    bias_pointer = bias.data_ptr() if bias is not None else None
    _check(STATE.library.raymoe_linear(flat.data_ptr(), out.data_ptr(), packed.data_ptr(), bias_pointer,
                                        flat.shape[0], flat.shape[1], weight.shape[0]), "raymoe_linear")
    return out.view(*shape[:-1], weight.shape[0])


# ---- norms and rotary embeddings -------------------------------------------------------------
def norm_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether :func:`rms_norm` takes it: float32 on the CPU, contiguous rows, D a multiple of 16."""
    return (_takes(x, weight) and x.numel() > 0 and x.is_contiguous() and weight.dim() == 1
            and weight.shape[0] == x.shape[-1] and x.shape[-1] % 16 == 0 and unavailable_reason() is None)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             delta: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(s, rms_norm(s) * weight)`` with ``s = x + delta`` (``x`` itself without ``delta``), one
    call (:func:`norm_applies` checked for ``x``; ``delta``, if given, the same shape)."""
    h = torch.empty_like(x)
    total = x
    if delta is not None:
        delta = delta.contiguous()
        total = torch.empty_like(x)
    _check(STATE.library.raymoe_rms_norm(x.data_ptr(), delta.data_ptr() if delta is not None else None,
                                          weight.contiguous().data_ptr(), total.data_ptr(), h.data_ptr(),
                                          x.numel() // x.shape[-1], x.shape[-1], eps), "raymoe_rms_norm")
    return total, h


def rope_applies(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Whether :func:`rope` takes ``x: [T, heads, d]`` (rows may be strided, each token's heads
    contiguous) with ``cos, sin: [T, 1, d]`` contiguous: float32 on the CPU."""
    return (_takes(x, cos, sin) and x.dim() == 3 and x.numel() > 0 and x.stride(2) == 1
            and x.stride(1) == x.shape[2] and cos.is_contiguous() and sin.is_contiguous()
            and cos.shape[-1] == x.shape[2] and unavailable_reason() is None)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x * cos + x.roll(d / 2, -1) * sin`` as a new contiguous ``[T, heads, d]``: the same
    operations in the same order as torch's, so the same bits (:func:`rope_applies` checked)."""
    tokens, heads, size = x.shape
    out = torch.empty(tokens, heads, size, dtype=torch.float32)
    _check(STATE.library.raymoe_rope(x.data_ptr(), x.stride(0), cos.data_ptr(), sin.data_ptr(), out.data_ptr(),
                                      tokens, heads, size), "raymoe_rope")
    return out


# ---- attention -----------------------------------------------------------------------------
def attention_applies(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor) -> bool:
    """Whether :func:`decode_attention` takes these: float32 on the CPU, contiguous caches, key and
    value sizes multiples of 16."""
    return (_takes(q, key_cache, value_cache) and key_cache.is_contiguous() and value_cache.is_contiguous()
            and q.shape[-1] % 16 == 0 and value_cache.shape[-1] % 16 == 0 and unavailable_reason() is None)


def decode_attention(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, rows: torch.Tensor,
                     slots: torch.Tensor, counts: torch.Tensor, scale: float, out: torch.Tensor) -> None:
    """Rows ``rows[b]`` of ``out: [T, H, Dv]`` from ``q: [T, H, Dk]`` against the first ``counts[b]``
    keys of sequence b at cache slots ``slots[b]`` (``[B, Kc]`` int64, Kc the most keys of one) of
    the paged caches (:func:`attention_applies` checked by the caller)."""
    q = q.contiguous()
    heads, kv_heads = q.shape[1], key_cache.shape[-2]
    _check(STATE.library.raymoe_decode_attention(
        q.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(), rows.data_ptr(), slots.data_ptr(),
        counts.data_ptr(), out.data_ptr(), rows.shape[0], heads, kv_heads, q.shape[-1], value_cache.shape[-1],
        slots.shape[1], scale), "raymoe_decode_attention")
