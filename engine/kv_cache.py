"""The KV cache tensors: per layer, paged tensors addressed through block tables.

Legend: L layers, Nb blocks of ``bs`` slots, H query heads, Hkv kv heads, Dk / Dv head sizes,
C MLA's latent rank, Dr its roped key size.

The layout is FlashInfer's NHD, shared with kernels/attention.py: one layer's cache is a tuple
of ``[Nb, bs, ...]`` tensors (slot ``s`` is block ``s // bs``, row ``s % bs``):

- GQA: keys ``[Nb, bs, Hkv, Dk]`` and values ``[Nb, bs, Hkv, Dv]``;
- MLA: the latent ``[Nb, bs, C + Dr]`` alone (the normalised kv latent, then the roped key),
  ``H (Dk + Dv) / (C + Dr)`` times smaller than the heads' keys and values (71x for DeepSeek-V3).
"""

from __future__ import annotations

import math

import torch

from raymoe.moe.model_config import AttentionKind, ModelConfig


def row_shapes(config: ModelConfig) -> tuple[tuple[int, ...], ...]:
    """The per-token row of each cache tensor of one layer."""
    if config.attention is AttentionKind.MLA:
        return ((config.mla.kv_lora_rank + config.mla.qk_rope_head_dim,),)
    return (config.num_kv_heads, config.head_dim), (config.num_kv_heads, config.v_head_dim)


class KVCache:
    def __init__(self, config: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device):
        shapes = row_shapes(config)
        stored = config.num_layers * sum(math.prod(shape) for shape in shapes)
        if stored != config.kv_cache_values_per_token:  # the budget (bytes_per_token) must be what is allocated
            raise RuntimeError(f"KV cache rows hold {stored} values per token, the config counts "
                               f"{config.kv_cache_values_per_token}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.tensors = tuple(  # each [L, Nb, bs, *row]
            torch.zeros(config.num_layers, num_blocks, block_size, *shape, dtype=dtype, device=device)
            for shape in shapes
        )

    @property
    def dtype(self) -> torch.dtype:
        return self.tensors[0].dtype

    def layer(self, index: int) -> tuple[torch.Tensor, ...]:
        """Layer ``index``'s paged tensors, ``[Nb, bs, *row]`` each (views)."""
        return tuple(tensor[index] for tensor in self.tensors)

    @staticmethod
    def bytes_per_token(config: ModelConfig, dtype: torch.dtype) -> int:
        return config.kv_cache_values_per_token * torch.empty((), dtype=dtype).element_size()
