"""The KV cache tensors: one flat slot array per layer, addressed through block tables.

Legend: L layers, C = num_blocks * block_size slots, Hkv kv heads, Dk / Dv head sizes.
"""

from __future__ import annotations

import torch

from raymoe.moe.model_config import ModelConfig


class KVCache:
    def __init__(self, config: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device):
        slots = num_blocks * block_size
        self.num_blocks = num_blocks
        self.block_size = block_size
        # [L, C, Hkv, Dk] and [L, C, Hkv, Dv]
        self.k = torch.zeros(config.num_layers, slots, config.num_kv_heads, config.head_dim, dtype=dtype, device=device)
        self.v = torch.zeros(config.num_layers, slots, config.num_kv_heads, config.v_head_dim, dtype=dtype, device=device)

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[index], self.v[index]

    @staticmethod
    def bytes_per_token(config: ModelConfig, dtype: torch.dtype) -> int:
        per_layer = config.num_kv_heads * (config.head_dim + config.v_head_dim)
        return config.num_layers * per_layer * torch.empty((), dtype=dtype).element_size()
