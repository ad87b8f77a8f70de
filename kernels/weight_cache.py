"""Derived copies of weights (packed layouts), made once per weight version and dropped with it.

Legend: Sp stacked experts (a stack's rows: a worker's pool, or a layer's experts).

oneDNN's packed rows (kernels/packed_linear.py) and the native kernels' layouts
(kernels/native_cpu.py) are both copies of a weight in another layout. They are cached here by
the weight tensor's identity, made again when the weight is written in place (a migration staging
an expert bumps the tensor's version counter) or moved, and dropped when the weight goes.
``cpu.packed_experts: false`` turns every such copy off (:func:`set_enabled`): they cost the
weights' size once more in memory. Both compute modules import this one; neither imports the other
for it.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass, field

import torch

_enabled = True
# Reentrant: a stack's finalizer (_forget) can run on the thread that holds the lock, when a
# garbage collection triggered by an allocation in a caller's packing frees a stack kept in a cycle
# (a plain Lock deadlocked the test suite that way).
_lock = threading.RLock()


@dataclass
class _Packed:
    version: int
    data_ptr: int
    rows: dict[int | str | None, torch.Tensor] = field(default_factory=dict)  # str: other kernels' layouts


_cache: dict[int, _Packed] = {}  # id(stack) -> its derived copies


def set_enabled(enabled: bool) -> None:
    """Keep packed copies of weights where a kernel takes them (the default), or none (each
    kernel that needs one then declines: torch's default GEMM runs)."""
    global _enabled
    _enabled = bool(enabled)
    if not _enabled:
        with _lock:
            _cache.clear()


def enabled() -> bool:
    return _enabled


def cached_rows(stack: torch.Tensor) -> dict:
    """The cache of derived copies of ``stack``, emptied when the stack is written or moved and
    dropped with it: packed rows by row index (kernels/packed_linear.py), whole-stack layouts of
    other kernels by name (kernels/native_cpu.py)."""
    return _entry(stack).rows


def _entry(stack: torch.Tensor) -> _Packed:
    """The cache entry of ``stack``, renewed when the stack was written or moved."""
    key = id(stack)
    entry = _cache.get(key)
    version, pointer = stack._version, stack.data_ptr()
    if entry is None or entry.version != version or entry.data_ptr != pointer:
        with _lock:
            entry = _cache.get(key)
            if entry is None or entry.version != version or entry.data_ptr != pointer:
                if key not in _cache:
                    weakref.finalize(stack, _forget, key)
                entry = _cache[key] = _Packed(version, pointer)
    return entry


def _forget(key: int) -> None:
    with _lock:
        _cache.pop(key, None)
