"""RMSNorm as the reference implementations compute it: statistics in float32.

On a float32 CPU with raymoe's native kernels (kernels/native_cpu.py) a norm is one call, and
:func:`add_rms_norm` folds the residual add before it into that call: at one sequence a decode
step's norms and adds were ~17 small torch calls, whose cost was their dispatch, not their math.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from raymoe.kernels import native_cpu


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x: [..., D]`` normalised over its last dim, then scaled by ``weight: [D]``."""
    if native_cpu.norm_applies(x, weight):
        return native_cpu.rms_norm(x, weight, eps)[1]
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)  # one fused kernel, same math
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(s, rms_norm(s, weight))`` with ``s = x + delta`` (``x`` when ``delta`` is None): a
    residual stream's add and the norm after it."""
    if native_cpu.norm_applies(x, weight) and (delta is None or (delta.shape == x.shape
                                                               and delta.dtype == x.dtype
                                                               and delta.device == x.device)):
        return native_cpu.rms_norm(x, weight, eps, delta)
    total = x if delta is None else x + delta
    return total, rms_norm(total, weight, eps)
