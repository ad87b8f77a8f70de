"""Shared fixtures: tiny checkpoints written once per session; skips for `gpu` tests."""

from __future__ import annotations

import functools
import os

import pytest

# Ray listeners on loopback only, for every test that starts Ray (must precede ray.init).
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")


@pytest.fixture(scope="session")
def tiny_mixtral_dir(tmp_path_factory) -> str:
    from tiny_models import build_reference_model, write_checkpoint

    return write_checkpoint(build_reference_model("mixtral"), str(tmp_path_factory.mktemp("tiny-mixtral")))


# ---- gpu / nccl skips ------------------------------------------------------------------
# A test marked `gpu` runs only where torch sees a CUDA device. One that needs NCCL as well
# (marked `nccl`, or any `gpu` test in a file whose name holds "nccl", such as
# tests/kernels/test_comm_nccl_gpu.py) also needs cupy with a loadable libnccl: the `gpu`
# extra (`pip install -e '.[gpu]'`), never the `test` one. Elsewhere such tests are
# skipped before their fixtures run, the reason naming what is missing.


@functools.lru_cache(maxsize=None)
def cuda_missing() -> str | None:
    """Why CUDA cannot be used here, or None when torch sees a device."""
    import torch

    if torch.cuda.is_available():
        return None
    if torch.version.cuda is None:
        return f"needs a CUDA GPU: torch {torch.__version__} is a CPU-only build"
    return f"needs a CUDA GPU: torch {torch.__version__} (CUDA {torch.version.cuda}) sees no device"


@functools.lru_cache(maxsize=None)
def nccl_missing() -> str | None:
    """Why cupy's NCCL cannot be used here, or None when it can."""
    hint = "pip install -e '.[gpu]'"
    try:
        import cupy
        from cupy.cuda import nccl
    except Exception as error:  # ImportError, or cupy's own error when its CUDA libraries don't load
        return f"needs cupy with NCCL: cannot import cupy.cuda.nccl ({_short(error)}); {hint}"
    if not getattr(nccl, "available", False):
        return f"needs cupy with NCCL: cupy {cupy.__version__} is installed but cannot load libnccl"
    try:
        nccl.get_version()
    except Exception as error:
        return f"needs cupy with NCCL: cupy {cupy.__version__} cannot call NCCL ({_short(error)})"
    return None


def needs_nccl(item: pytest.Item) -> bool:
    return item.get_closest_marker("nccl") is not None or "nccl" in item.path.name


def gpu_skip_reason(item: pytest.Item) -> str | None:
    """The reason to skip `item` here, or None to run it (tests with neither marker run)."""
    if item.get_closest_marker("gpu") is None and item.get_closest_marker("nccl") is None:
        return None
    return cuda_missing() or (nccl_missing() if needs_nccl(item) else None)


def _short(error: BaseException, limit: int = 200) -> str:
    text = f"{type(error).__name__}: {error}".replace("\n", " ")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        reason = gpu_skip_reason(item)
        if reason is not None:
            item.add_marker(pytest.mark.skip(reason=reason))
