"""Shared fixtures: tiny checkpoints written once per session; skips for `gpu` tests; the
`fast` marker for the tests tests/fast_tier.py names; the heaviest modules scheduled first."""

from __future__ import annotations

import functools
import gc
import os

import pytest

from fast_tier import FAST_TIER, UNMATCHED, in_fast_tier

# Ray listeners on loopback only, for every test that starts Ray (must precede ray.init).
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")


@pytest.fixture(scope="session")
def tiny_mixtral_dir(tmp_path_factory) -> str:
    from tiny_models import build_reference_model, write_checkpoint

    return write_checkpoint(build_reference_model("mixtral"), str(tmp_path_factory.mktemp("tiny-mixtral")))


@pytest.fixture(autouse=True)
def _collector_unfrozen():
    """A router or worker built in this process (threads instead of actors) freezes the heap it
    finds (actors/heap_freeze.py); the test process does not keep that past the test: what
    was frozen could never be collected for the rest of the session."""
    yield
    if gc.get_freeze_count():
        gc.unfreeze()


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


# ---- the fast tier ----------------------------------------------------------------------
# `python -m pytest -m fast` runs the tests tests/fast_tier.py names (FAST_TIER); the marks go
# on here, before `-m` deselects. tests/test_fast_tier.py checks that every entry names a test.

# ---- the order modules start in -------------------------------------------------------
# With pytest-xdist (`-n 2 --dist loadfile`, the README's command) each module runs whole on
# one worker, in the order collected: the long ones go first, so that the end of the run is
# many short modules shared by both workers rather than one long one on a single worker.
# Measured with --durations on the 2-core machine (2026-12-05, `-n 2`, under other runs' load;
# seconds per module, set-up included); the modules not listed keep their order after these.
HEAVY_FIRST = [
    "tests/kernels/test_comm_cpu.py",  # 766: 151 multi-process collectives, timeouts and stalls
    "tests/cluster/test_launch_local.py",  # 671: `ray up` over loopback ssh, one test
    "tests/actors/test_recovery.py",  # ~330 (serial run)
    "tests/serve/test_first_hour.py",  # 320
    "tests/actors/test_migration_faults.py",  # 305
    "tests/serve/test_http.py",  # 252
    "tests/actors/test_multinode.py",  # 233
    "tests/engine/test_parity_variants.py",  # 210
    "tests/engine/test_parity_transformers.py",  # 208
    "tests/actors/test_recovery_retries.py",  # 189
    "tests/actors/test_expert_parallel.py",  # ~180 (serial run)
    "tests/serve/test_clients_lmeval.py",  # 151
    "tests/engine/test_score_budget.py",  # 140
    "tests/actors/test_controller.py",  # 138
    "tests/serve/test_completions_api.py",  # 136
    "tests/serve/test_default_and_builder.py",  # 129
    "tests/serve/test_serve_demo.py",  # 127
    "tests/serve/test_router_failure.py",  # 120
    "tests/serve/test_ingress_replicas.py",  # 117
    "tests/actors/test_recovery_memory.py",  # 112
]


def module_rank(nodeid: str) -> int:
    path = nodeid.split("::", 1)[0]
    return HEAVY_FIRST.index(path) if path in HEAVY_FIRST else len(HEAVY_FIRST)


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects: the fast tier's marks must be on by then
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    entries = FAST_TIER
    for item in items:
        reason = gpu_skip_reason(item)
        if reason is not None:
            item.add_marker(pytest.mark.skip(reason=reason))
        if in_fast_tier(item.nodeid, entries):
            item.add_marker(pytest.mark.fast)
    # fast-tier lines that match none of the tests collected from their file (a renamed test
    # or parameter): tests/test_fast_tier.py fails on them
    collected = {item.nodeid.split("::", 1)[0] for item in items}
    config.stash[UNMATCHED] = [
        e for e in entries if e.split("::", 1)[0] in collected and not any(in_fast_tier(i.nodeid, [e]) for i in items)]


class HeavyFirst:
    @pytest.hookimpl(trylast=True)  # after pytest's own reordering (module-scoped parameters)
    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        items.sort(key=lambda item: module_rank(item.nodeid))  # stable: a module's tests stay in order


def pytest_configure(config: pytest.Config) -> None:
    config.pluginmanager.register(HeavyFirst(), "raymoe-heavy-first")
    if getattr(config.option, "dist", "no") == "loadfile":
        # xdist would send the modules with the most tests first instead (many, but quick ones)
        config.option.loadscopereorder = False
