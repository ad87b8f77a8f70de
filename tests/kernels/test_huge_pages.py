"""Weights on 2 MiB pages (kernels/huge_pages.py, engine/weights.py::read_stacked): where the bytes
lie, and that they are the checkpoint's bytes."""

from __future__ import annotations

import ctypes
import os

import pytest
import torch
from safetensors.torch import save_file

from raymoe.engine.checkpoint import Checkpoint, CheckpointError
from raymoe.engine.weights import read_stacked
from raymoe.kernels import huge_pages
from raymoe.kernels.huge_pages import HUGE_PAGE, huge_page_empty

THP = "/sys/kernel/mm/transparent_hugepage/enabled"


def thp_mode() -> str | None:
    """The bracketed mode of Linux's transparent huge pages, None where there is none."""
    try:
        with open(THP) as handle:
            return handle.read().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        return None


def anon_huge_kb(address: int) -> int:
    """AnonHugePages of the mapping of this process that holds ``address`` (/proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as handle:
        for line in handle:
            head = line.split()[0]
            if "-" in head and all(c in "0123456789abcdef-" for c in head):
                start, end = (int(part, 16) for part in head.split("-"))
                inside = start <= address < end
            elif inside and line.startswith("AnonHugePages:"):
                return int(line.split()[1])
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_large_tensor_starts_on_a_huge_page_and_gets_huge_pages(dtype):
    tensor = huge_page_empty(((8 << 20) // 2,), dtype)
    assert tensor.dtype == dtype and tensor.is_contiguous()
    assert tensor.data_ptr() % HUGE_PAGE == 0
    assert not tensor.untyped_storage().resizable()  # its own mapping, not the allocator's
    tensor.fill_(1)
    assert float(tensor.sum()) == tensor.numel()
    if thp_mode() in ("always", "madvise"):
        assert anon_huge_kb(tensor.data_ptr()) >= HUGE_PAGE // 1024, "the kernel gave the mapping no huge page"


def test_small_tensors_and_the_switch_off_take_torch_empty(monkeypatch):
    small = huge_page_empty((16, 16), torch.bfloat16)
    assert small.untyped_storage().resizable() and small.shape == (16, 16)
    monkeypatch.setenv(huge_pages.ENV, "0")
    assert not huge_pages.enabled()
    large = huge_page_empty((4 << 20,), torch.bfloat16)
    assert large.untyped_storage().resizable() and large.numel() == 4 << 20


def test_read_stacked_is_the_checkpoints_tensors_concatenated(tmp_path):
    torch.manual_seed(0)
    tensors = {"q": torch.randn(1024, 1024, dtype=torch.bfloat16),  # 2 MiB each: the stack is on huge pages
               "k": torch.randn(256, 1024, dtype=torch.bfloat16),
               "norm": torch.randn(1024, dtype=torch.bfloat16),
               "f32": torch.randn(1536, 1024)}
    save_file(tensors, os.path.join(tmp_path, "model.safetensors"))
    checkpoint = Checkpoint(str(tmp_path))
    stacked = read_stacked(checkpoint, ("q", "k"), torch.bfloat16)
    assert torch.equal(stacked, torch.cat([tensors["q"], tensors["k"]]))
    assert stacked.data_ptr() % HUGE_PAGE == 0
    assert torch.equal(read_stacked(checkpoint, ("norm",), torch.bfloat16), tensors["norm"])
    converted = read_stacked(checkpoint, ("f32",), torch.bfloat16)  # a stored float32 read as bfloat16
    assert torch.equal(converted, tensors["f32"].to(torch.bfloat16)) and converted.data_ptr() % HUGE_PAGE == 0
    with pytest.raises(CheckpointError, match="'v' is missing"):
        read_stacked(checkpoint, ("q", "v"), torch.bfloat16)
    with pytest.raises(CheckpointError, match="do not stack"):
        read_stacked(checkpoint, ("q", "norm"), torch.bfloat16)


def test_coverage_counts_the_resident_weights_and_their_huge_pages(caplog):
    tensor = huge_page_empty(((16 << 20) // 2,), torch.bfloat16)  # 16 MiB
    before_resident, _ = huge_pages.coverage()
    tensor.fill_(1)  # resident only once written
    resident, huge = huge_pages.coverage()
    assert resident - before_resident >= 16 << 20 and 0 <= huge <= resident
    if thp_mode() in ("always", "madvise"):
        assert huge >= HUGE_PAGE
    with caplog.at_level("WARNING", logger="raymoe.kernels"):
        assert huge_pages.report("test") == {"resident_bytes": resident, "huge_bytes": huge}


def test_a_mapping_the_kernel_keeps_on_small_pages_is_reported_with_the_remedy(caplog):
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    size = 128 << 20  # more than this process' other huge-page tensors together (tiny test models)
    tensor = huge_page_empty((size // 2,), torch.bfloat16)
    before_resident, before_huge = huge_pages.coverage()
    assert libc.madvise(tensor.data_ptr(), size, 15) == 0  # MADV_NOHUGEPAGE before a page is touched
    tensor.fill_(1)
    resident, huge = huge_pages.coverage()
    assert resident - before_resident >= size and huge == before_huge and huge * 2 < resident
    with caplog.at_level("WARNING", logger="raymoe.kernels"):
        assert huge_pages.report("worker 3") == {"resident_bytes": resident, "huge_bytes": huge}
    assert "worker 3" in caplog.text and "compact_memory" in caplog.text
