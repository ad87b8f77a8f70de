"""Rotary position embeddings: cos/sin tables and their application.

Legend: T tokens, H query heads (keys, with Hkv KV heads, rotate the same way), Dr rotary dims
per head.

Tables follow the reference implementations: ``inv_freq`` per RoPE type (default, linear,
yarn), ``cos/sin = cos/sin(cat(freqs, freqs)) * attention_factor`` in float32, cast to
the activation dtype when applied. Two layouts of the rotated dimensions exist:
``rotate_half`` pairs ``(x[i], x[i + Dr/2])``; DeepSeek's interleaved layout pairs
``(x[2i], x[2i + 1])`` and returns them de-interleaved (the same for q and k, so their dot
products are unchanged).
"""

from __future__ import annotations

import math

import torch

from raymoe.kernels import native_cpu
from raymoe.moe.model_config import RopeConfig, yarn_get_mscale


def rope_tables(config: RopeConfig, max_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos, sin: [max_positions, Dr]`` float32."""
    inv_freq, attention_factor = _inv_freq(config)
    positions = torch.arange(max_positions, dtype=torch.float32)
    freqs = torch.outer(positions, inv_freq)  # [max_positions, Dr/2]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos() * attention_factor, emb.sin() * attention_factor


def rope_rows(cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype,
              interleaved: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """One step's rows of the tables, ready for :func:`apply_rope`: ``[T, 1, Dr]`` each in ``dtype``.

    For the ``rotate_half`` layout the sine's first half comes negated, which turns
    ``rotate_half(x) * sin`` into ``roll(x, Dr/2) * sin`` (a sign flip is exact: same bits).
    """
    cos = cos.index_select(0, positions).to(dtype).unsqueeze(1)
    sin = sin.index_select(0, positions).to(dtype).unsqueeze(1)
    if not interleaved:
        half = sin.shape[-1] // 2
        sin = torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)
    return cos, sin


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """Rotate ``x: [T, H, Dr]`` by ``cos, sin: [T, 1, Dr]`` from :func:`rope_rows` (same ``interleaved``)."""
    if not interleaved and native_cpu.rope_applies(x, cos, sin):  # float32 CPU: one call, the same bits
        return native_cpu.rope(x, cos, sin)
    half = x.shape[-1] // 2
    if interleaved:
        cos, sin = cos[..., :half], sin[..., :half]
        even, odd = x[..., 0::2], x[..., 1::2]
        return torch.cat([even * cos - odd * sin, odd * cos + even * sin], dim=-1)
    return x * cos + x.roll(half, -1) * sin  # x * cos + rotate_half(x) * sin


def _inv_freq(config: RopeConfig) -> tuple[torch.Tensor, float]:
    dim = config.rotary_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    inv_freq = 1.0 / (config.theta ** exponents)  # [Dr/2]
    if config.rope_type == "default":
        return inv_freq, 1.0
    if config.rope_type == "linear":
        return inv_freq / config.factor, 1.0
    return _yarn_inv_freq(config, exponents)


def _yarn_inv_freq(config: RopeConfig, exponents: torch.Tensor) -> tuple[torch.Tensor, float]:
    # YaRN: interpolate low frequencies, keep high ones, ramp linearly in between.
    dim, base, factor = config.rotary_dim, config.theta, config.factor
    if config.mscale and config.mscale_all_dim:
        attention_factor = yarn_get_mscale(factor, config.mscale) / yarn_get_mscale(factor, config.mscale_all_dim)
    else:
        attention_factor = yarn_get_mscale(factor, 1.0)

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(config.original_max_position / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low = max(math.floor(correction_dim(config.beta_fast)), 0)
    high = min(math.ceil(correction_dim(config.beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation_weight = 1 - ramp
    pos_freqs = base ** exponents
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation_weight) + (1.0 / pos_freqs) * extrapolation_weight
    return inv_freq, attention_factor
