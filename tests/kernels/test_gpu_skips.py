"""How `gpu` and `nccl` tests are skipped (tests/conftest.py); runs on any machine.

A `gpu` test needs torch to see a CUDA device; an NCCL one (marker `nccl`, or a `gpu` test in
a file named *nccl*) also needs cupy with a loadable libnccl. Where either is missing the
test is skipped before its fixtures run, with a reason naming what is missing, never errors.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest
import torch

TESTS = Path(__file__).resolve().parents[1]


@pytest.fixture
def skips():
    """tests/conftest.py as a fresh module (pytest's own copy keeps its caches)."""
    spec = importlib.util.spec_from_file_location("raymoe_tests_conftest_copy", TESTS / "conftest.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class FakeItem:
    def __init__(self, *markers: str, file: str = "test_something.py"):
        self.markers = set(markers)
        self.path = Path("/tests") / file

    def get_closest_marker(self, name):
        return name if name in self.markers else None


def fake_cupy(monkeypatch, *, available: bool, version_error: Exception | None = None):
    cupy = types.ModuleType("cupy")
    cupy.__version__ = "13.4.0"
    cuda = types.ModuleType("cupy.cuda")
    nccl = types.ModuleType("cupy.cuda.nccl")
    nccl.available = available

    def get_version():
        if version_error is not None:
            raise version_error
        return 22005

    nccl.get_version = get_version
    cupy.cuda, cuda.nccl = cuda, nccl
    for name, module in [("cupy", cupy), ("cupy.cuda", cuda), ("cupy.cuda.nccl", nccl)]:
        monkeypatch.setitem(sys.modules, name, module)


def test_cuda_missing_says_which_torch(skips, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.version, "cuda", None)
    assert skips.cuda_missing() == f"needs a CUDA GPU: torch {torch.__version__} is a CPU-only build"
    skips.cuda_missing.cache_clear()
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    assert skips.cuda_missing() == f"needs a CUDA GPU: torch {torch.__version__} (CUDA 12.8) sees no device"
    skips.cuda_missing.cache_clear()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert skips.cuda_missing() is None


def test_nccl_missing_without_cupy(skips, monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)  # import cupy raises ImportError
    reason = skips.nccl_missing()
    assert reason.startswith("needs cupy with NCCL: cannot import cupy.cuda.nccl (ModuleNotFoundError: import of cupy")
    assert reason.endswith("pip install -e '.[gpu]'")


@pytest.mark.parametrize(
    "available, version_error, expected",
    [
        (False, None, "needs cupy with NCCL: cupy 13.4.0 is installed but cannot load libnccl"),
        (True, RuntimeError("libnccl.so.2: cannot open"),
         "needs cupy with NCCL: cupy 13.4.0 cannot call NCCL (RuntimeError: libnccl.so.2: cannot open)"),
        (True, None, None),
    ],
)
def test_nccl_missing_with_cupy(skips, monkeypatch, available, version_error, expected):
    fake_cupy(monkeypatch, available=available, version_error=version_error)
    assert skips.nccl_missing() == expected


@pytest.mark.parametrize(
    "item, cuda, nccl, expected",
    [
        (FakeItem(), "no cuda", "no nccl", None),  # unmarked tests always run
        (FakeItem("gpu"), "no cuda", None, "no cuda"),
        (FakeItem("gpu"), None, "no nccl", None),  # plain gpu tests do not need cupy
        (FakeItem("gpu", "nccl"), None, "no nccl", "no nccl"),
        (FakeItem("nccl"), "no cuda", "no nccl", "no cuda"),  # nccl implies gpu
        (FakeItem("gpu", file="test_comm_nccl_gpu.py"), None, "no nccl", "no nccl"),
        (FakeItem("gpu", "nccl"), None, None, None),
    ],
)
def test_gpu_skip_reason(skips, monkeypatch, item, cuda, nccl, expected):
    monkeypatch.setattr(skips, "cuda_missing", lambda: cuda)
    monkeypatch.setattr(skips, "nccl_missing", lambda: nccl)
    assert skips.gpu_skip_reason(item) == expected


def test_nccl_gpu_tests_skip_cleanly_where_cuda_is_present_but_cupy_is_not(tmp_path):
    # A CUDA machine without the `gpu` extra, faked: torch says CUDA, cupy does not import.
    # Every gpu test of the NCCL file must be skipped (not error in its fixture or body).
    (tmp_path / "fake_cuda_no_cupy.py").write_text(textwrap.dedent(
        """
        import sys
        import torch

        torch.cuda.is_available = lambda: True

        class BlockCupy:
            def find_spec(self, name, path=None, target=None):
                if name == "cupy" or name.startswith(("cupy.", "cupy_backends")):
                    raise ImportError("cupy blocked by the test")

        sys.meta_path.insert(0, BlockCupy())
        """
    ))
    finished = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "-p", "fake_cuda_no_cupy",
         "-m", "gpu", str(TESTS / "kernels" / "test_comm_nccl_gpu.py")],
        capture_output=True, text=True, timeout=300, cwd=TESTS.parent,
        env={**os.environ, "PYTHONPATH": str(tmp_path)},
    )
    out = finished.stdout + finished.stderr
    assert finished.returncode == 0, out
    assert "needs cupy with NCCL: cannot import cupy.cuda.nccl" in out, out
    assert re.search(r"^\d+ skipped, \d+ deselected in ", out, re.M), out  # nothing passed, failed or errored
