"""NcclCommunicator: import and guards on any machine; a world-size-1 group on a GPU.

The CPU tests check what needs no GPU (the module imports without cupy, the guards before
any CUDA call). The `gpu` tests run one rank on one GPU, sending to itself through the same
groupStart / send / recv / groupEnd path that a multi-GPU group uses. Multi-GPU groups are
not tested here (see docs/COMMUNICATORS.md, "Unverified").
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from raymoe.kernels.comm import CommClosedError, Communicator, NcclCommunicator
from raymoe.kernels.comm.layout import NcclDataType
from raymoe.kernels.comm.nccl import cuda_device, validate_unique_id

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

BLOCK_CUPY = textwrap.dedent(
    """
    import sys
    class BlockCupy:
        def find_spec(self, name, path=None, target=None):
            if name == "cupy" or name.startswith(("cupy.", "cupy_backends")):
                raise ImportError("cupy blocked by the test")
    sys.meta_path.insert(0, BlockCupy())
    """
)


def test_module_imports_without_cupy_and_says_what_is_missing():
    program = BLOCK_CUPY + textwrap.dedent(
        """
        import raymoe.kernels.comm.nccl as module
        assert "cupy" not in sys.modules
        try:
            module.nccl_unique_id()
        except ImportError as error:
            print("IMPORT ERROR:", error)
        """
    )
    finished = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=60)
    assert finished.returncode == 0, finished.stderr
    assert "IMPORT ERROR: the NCCL communicator needs cupy with NCCL" in finished.stdout


def test_unique_id_must_be_128_ints():
    assert validate_unique_id(range(128)) == tuple(range(128))
    with pytest.raises(ValueError, match="128 ints, got 3 values"):
        validate_unique_id((1, 2, 3))
    with pytest.raises(ValueError, match="128 ints"):
        validate_unique_id([1.5] * 128)


def test_an_nccl_rank_needs_a_cuda_device():
    with pytest.raises(ValueError, match="needs a CUDA device, got cpu"):
        cuda_device("cpu")
    assert cuda_device(1) == torch.device("cuda", 1)


def test_closed_communicator_raises_before_touching_the_device():
    comm = NcclCommunicator(
        rank=0, world_size=1, timeout_s=1.0, device=torch.device("cuda", 0), nccl_comm=None, stream=None
    )
    assert isinstance(comm, Communicator)
    with pytest.raises(CommClosedError, match="'layer 1 dispatch'"):
        comm.exchange_counts(torch.tensor([1]), tag="layer 1 dispatch")
    with pytest.raises(CommClosedError, match="'layer 1 combine'"):
        comm.exchange_payload(torch.zeros(1), [1], [1], tag="layer 1 combine")
    with pytest.raises(CommClosedError):
        comm.barrier(tag="end")
    comm.close()
    comm.abort()  # both idempotent on a closed communicator


@pytest.fixture
def single_rank():
    from raymoe.kernels.comm import nccl_unique_id

    comm = NcclCommunicator.create(0, 1, nccl_unique_id(), timeout_s=10.0, device=0)
    yield comm
    comm.close()


@pytest.mark.gpu
@needs_gpu
def test_nccl_constants_match_cupy():
    from cupy.cuda import nccl

    for name in ["INT8", "UINT8", "INT32", "INT64", "FLOAT16", "FLOAT32", "FLOAT64", "BFLOAT16"]:
        if hasattr(nccl, f"NCCL_{name}"):
            assert getattr(nccl, f"NCCL_{name}") == int(NcclDataType[name]), name


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
@pytest.mark.parametrize("row_shape", [(), (8,)])
@pytest.mark.parametrize("rows", [0, 5])
def test_single_rank_sends_to_itself(single_rank, dtype, row_shape, rows):
    recv_counts = single_rank.exchange_counts(torch.tensor([rows]), tag="counts")
    assert recv_counts.device.type == "cpu" and recv_counts.tolist() == [rows]
    send = (torch.randn(rows, *row_shape, device="cuda:0") * 100).to(dtype)
    received = single_rank.exchange_payload(send, [rows], recv_counts.tolist(), tag="payload")
    assert received.dtype == dtype and received.device == send.device
    assert torch.equal(received, send)
    single_rank.barrier(tag="after payload")


@pytest.mark.gpu
@needs_gpu
def test_single_rank_orders_after_torch_stream_and_closes(single_rank):
    # Work queued on torch's stream right before the call must be visible to the send.
    send = torch.zeros(4096, 64, device="cuda:0")
    send.add_(torch.arange(4096, device="cuda:0").unsqueeze(1).float())
    received = single_rank.exchange_payload(send, [4096], [4096], tag="ordering")
    assert torch.equal(received, send)
    single_rank.close()
    single_rank.close()
    with pytest.raises(CommClosedError, match="'after close'"):
        single_rank.exchange_payload(send, [4096], [4096], tag="after close")
