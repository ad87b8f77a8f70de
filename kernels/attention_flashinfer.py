"""FlashInfer's paged attention kernels on CUDA (``pip install flashinfer-python``).

Legend as in kernels/attention.py: T new tokens, B sequences, H query heads, Hkv kv heads,
D head size, N cache blocks of ``bs`` slots (FlashInfer's pages), R MLA's latent rank, P its
roped key size.

The same paged cache and :class:`~raymoe.kernels.attention.AttentionMetadata` as the generic
path; planned once per step (page tables in FlashInfer's CSR form: ``indptr [B + 1]``,
``indices`` the blocks of every sequence one after another, ``last_page_len [B]``), run by
every layer:

- GQA: ``BatchDecodeWithPagedKVCacheWrapper`` when every sequence of the step decodes one
  token, else ``BatchPrefillWithPagedKVCacheWrapper`` with ``causal`` (FlashInfer aligns the
  causal mask to each sequence's end, so a prompt chunk after cached context attends to it);
  a sliding window w is ``window_left = w - 1``.
- MLA: ``flashinfer.mla.BatchMLAPagedAttentionWrapper`` over the latent cache, the query
  absorbed (``q_nope = [T, H, R]`` and ``q_pe = [T, H, P]``), the output ``[T, H, R]``.

:func:`flashinfer_unsupported` says why a model cannot use it here (no CUDA, no flashinfer,
float32, head sizes its kernels are not built for); the engine then keeps the generic path.

FlashInfer compiles (JIT) or loads a kernel module the first time a wrapper is planned and
run for a dtype / head size / page size: seconds to minutes, inside the first step of a
router already in the expert-parallel group, where every worker waits under its deadline.
:func:`warm_up_attention` runs each kind of step a router meets (a prompt, a prompt chunk
after cached context, a decode batch) once on the real cache before the router joins
(actors/router.py); on the generic path it costs milliseconds.
"""

from __future__ import annotations

import time

import torch

from raymoe.kernels.attention import AttentionMetadata, AttentionSpec
from raymoe.moe.model_config import AttentionKind

WORKSPACE_BYTES = 128 * 2**20  # FlashInfer's recommended float workspace (split-k partials)
HEAD_DIMS = (64, 128, 256)  # head sizes of FlashInfer's prebuilt GQA kernels
MLA_DIMS = ((512, 64),)  # (R, P) of its MLA kernels: DeepSeek-V2/V3's shapes
DTYPES = (torch.float16, torch.bfloat16)


def flashinfer_unsupported(spec: AttentionSpec, dtype: torch.dtype, device: torch.device) -> str | None:
    """Why FlashInfer cannot run this attention here, or None when it can."""
    if device.type != "cuda":
        return f"the device is {device.type}, FlashInfer runs on CUDA only"
    try:
        import flashinfer  # noqa: F401
        import flashinfer.mla  # noqa: F401
    except Exception as error:  # ImportError, or its own error when its CUDA libraries don't load
        return f"cannot import flashinfer ({type(error).__name__}: {error}); pip install flashinfer-python"
    if dtype not in DTYPES:
        return f"the model runs in {dtype}; FlashInfer takes float16 or bfloat16"
    if spec.kind is AttentionKind.MLA:
        dims = (spec.value_dim, spec.key_dim - spec.value_dim)
        if dims not in MLA_DIMS:
            return f"MLA latent (kv_lora_rank, qk_rope_head_dim) = {dims}; FlashInfer's MLA kernels take {MLA_DIMS}"
    elif spec.key_dim != spec.value_dim or spec.key_dim not in HEAD_DIMS:
        return f"head sizes (k {spec.key_dim}, v {spec.value_dim}); FlashInfer's kernels take equal sizes in {HEAD_DIMS}"
    return None


class FlashInferAttention:
    name = "flashinfer"

    def __init__(self, spec: AttentionSpec, dtype: torch.dtype, device: torch.device):
        reason = flashinfer_unsupported(spec, dtype, device)
        if reason is not None:
            raise ValueError(f"FlashInfer cannot run this model's attention: {reason}")
        import flashinfer
        import flashinfer.mla

        self.spec = spec
        self.dtype = dtype
        self.device = device
        workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)  # one wrapper runs per step
        if spec.kind is AttentionKind.MLA:
            self._mla = flashinfer.mla.BatchMLAPagedAttentionWrapper(workspace, backend="auto")
        else:
            self._prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")
            self._decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD")

    def plan(self, metadata: AttentionMetadata, block_size: int) -> "FlashInferStep":
        spec, dtype = self.spec, self.dtype
        # Step 1: page tables in CSR form; lengths on the host (plan reads them there).
        q_lens, ctx_lens = metadata.query_lens.cpu(), metadata.context_lens.cpu()
        num_pages = (ctx_lens + block_size - 1) // block_size  # [B]
        qo_indptr = _indptr(q_lens)
        kv_indptr = _indptr(num_pages)
        tables = metadata.block_tables.to(self.device)
        used = torch.arange(tables.shape[1], device=self.device) < num_pages.to(self.device).unsqueeze(1)
        kv_indices = tables[used].to(torch.int32)  # row-major: each sequence's pages in order
        last_page_len = (ctx_lens - (num_pages - 1) * block_size).to(torch.int32)
        # Step 2: plan the wrapper this step runs.
        if spec.kind is AttentionKind.MLA:
            rank = spec.value_dim
            self._mla.plan(
                qo_indptr.to(self.device), kv_indptr.to(self.device), kv_indices, ctx_lens.to(torch.int32).to(self.device),
                spec.num_heads, rank, spec.key_dim - rank, block_size, True, spec.scale, dtype, dtype,
            )
            return FlashInferStep(spec, self._mla.run, latent=True)
        window_left = spec.sliding_window - 1 if spec.sliding_window else -1
        if bool((q_lens == 1).all()):
            self._decode.plan(
                kv_indptr, kv_indices, last_page_len, spec.num_heads, spec.num_kv_heads, spec.key_dim, block_size,
                pos_encoding_mode="NONE", window_left=window_left, q_data_type=dtype, kv_data_type=dtype,
                sm_scale=spec.scale,
            )
            return FlashInferStep(spec, self._decode.run, latent=False)
        self._prefill.plan(
            qo_indptr, kv_indptr, kv_indices, last_page_len, spec.num_heads, spec.num_kv_heads, spec.key_dim,
            block_size, head_dim_vo=spec.value_dim, causal=True, sm_scale=spec.scale, window_left=window_left,
            q_data_type=dtype, kv_data_type=dtype,
        )
        return FlashInferStep(spec, self._prefill.run, latent=False)


class FlashInferStep:
    def __init__(self, spec: AttentionSpec, run, latent: bool):
        self.spec = spec
        self._run = run  # the planned wrapper's run
        self._latent = latent

    def attend(self, q: torch.Tensor, cache: tuple[torch.Tensor, ...]) -> torch.Tensor:
        if self._latent:
            (latent,) = cache  # [N, bs, R + P]
            rank = self.spec.value_dim
            q_nope, q_pe = q[..., :rank].contiguous(), q[..., rank:].contiguous()
            return self._run(q_nope, q_pe, latent[..., :rank], latent[..., rank:])  # [T, H, R]
        k_cache, v_cache = cache  # [N, bs, Hkv, D] each
        return self._run(q.contiguous(), (k_cache, v_cache))


def _indptr(lengths: torch.Tensor) -> torch.Tensor:
    """``[B]`` -> ``[B + 1]`` int32 offsets, 0 first."""
    return torch.cat([lengths.new_zeros(1), torch.cumsum(lengths, 0)]).to(torch.int32)


def warm_up_attention(backend, cache: tuple[torch.Tensor, ...], block_size: int, dtype: torch.dtype,
                      device: torch.device) -> dict:
    """Plan and run ``backend`` once for each kind of step (a prompt; a chunk after cached
    context; a batch of decodes), reading ``cache`` (one layer's paged tensors, ``[N, bs, ...]``:
    read only, nothing is written), so that every kernel a first step needs is compiled or
    loaded now. Errors propagate: a kernel that cannot be built here must fail the start-up,
    not the first request. Returns what ran and how long it took."""
    from raymoe.kernels.attention import AttentionMetadata

    num_blocks, spec = cache[0].shape[0], backend.spec
    steps: list[tuple[str, list[int], list[int], list[list[int]]]] = [
        ("prompt", [3], [3], [[0]]),
    ]
    if num_blocks >= 2:
        steps += [
            ("chunk after context", [2], [block_size + 2], [[1, 0]]),
            ("decodes", [1, 1], [block_size + 1, 2], [[1, 0], [0]]),
        ]
    else:
        steps.append(("decodes", [1], [2], [[0]]))
    started = time.perf_counter()
    ran = []
    for name, new, total, tables in steps:
        metadata = AttentionMetadata.build(new, total, tables, block_size)
        metadata = AttentionMetadata(**{key: value.to(device) for key, value in vars(metadata).items()})
        q = torch.randn(sum(new), spec.num_heads, spec.key_dim, device=device).mul_(0.1).to(dtype)
        out = backend.plan(metadata, block_size).attend(q, cache)
        ran.append({"step": name, "tokens": sum(new), "sequences": len(new)})
        if out.shape[0] != sum(new):
            raise RuntimeError(f"attention warm-up ({name}): {out.shape[0]} output rows for {sum(new)} tokens")
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # a kernel that failed to launch fails here, not in step 1
    return {"backend": getattr(backend, "name", type(backend).__name__), "steps": ran,
            "seconds": time.perf_counter() - started}
