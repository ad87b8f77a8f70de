"""NcclCommunicator: import and guards on any machine; a world-size-1 group on a GPU.

The CPU tests check what needs no GPU (the module imports without cupy, the guards before
any CUDA call). The `gpu` tests run one rank on one GPU. With a world of 1, ``transfer`` (and
so ``exchange_counts``, ``exchange_payload`` and ``barrier``) turns every message to self into
a local copy and never reaches NCCL: those tests check the collectives' bookkeeping, the
stream ordering of the copy and init / close. The NCCL path itself is tested through
``NcclCommunicator.loopback``: one group of ``ncclSend`` to this rank and ``ncclRecv`` from it
(groupStart / send / recv / groupEnd on the communicator's stream, waited under the
deadline), the path a message to a peer takes; a counting proxy around the cupy handle and
around ``groupStart``/``groupEnd`` proves each call was made. Multi-GPU groups are not tested
here (benchmarks/gpu_check_2gpu.py runs one router and one worker on two GPUs).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

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


class CountingHandle:
    """Forwards to cupy's NcclCommunicator, counting the calls the loopback must make."""

    def __init__(self, handle):
        self.handle = handle
        self.calls: list[tuple[str, int]] = []

    def send(self, pointer, count, datatype, peer, stream):
        self.calls.append(("send", peer))
        return self.handle.send(pointer, count, datatype, peer, stream)

    def recv(self, pointer, count, datatype, peer, stream):
        self.calls.append(("recv", peer))
        return self.handle.recv(pointer, count, datatype, peer, stream)

    def __getattr__(self, name):
        return getattr(self.handle, name)


@pytest.fixture
def counted_groups(monkeypatch):
    from cupy.cuda import nccl

    calls = []
    for name in ("groupStart", "groupEnd"):
        original = getattr(nccl, name)

        def counted(_original=original, _name=name):
            calls.append(_name)
            return _original()

        monkeypatch.setattr(nccl, name, counted)
    return calls


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("dtype, shape", [(torch.bfloat16, (37, 7168)), (torch.float32, (1,)),
                                          (torch.int64, (4096, 8))])
def test_loopback_really_goes_through_nccl_send_and_recv(single_rank, counted_groups, dtype, shape):
    single_rank._nccl_comm = handle = CountingHandle(single_rank._nccl_comm)
    send = (torch.randn(*shape, device="cuda:0") * 100).to(dtype)
    received = torch.full_like(send, -7)  # poisoned: every element must be written
    single_rank.loopback(send, received, tag="loopback")
    assert torch.equal(received, send)
    assert handle.calls == [("send", 0), ("recv", 0)]
    assert counted_groups == ["groupStart", "groupEnd"]


@pytest.mark.gpu
@needs_gpu
def test_loopback_orders_after_torch_stream(single_rank):
    send = torch.zeros(4096, 64, device="cuda:0")
    send.add_(torch.arange(4096, device="cuda:0").unsqueeze(1).float())  # queued right before the call
    received = torch.empty_like(send)
    single_rank.loopback(send, received, tag="ordering")
    assert torch.equal(received, send)
    with pytest.raises(Exception, match="loopback sends 1048576 bytes into 4"):
        single_rank.loopback(send, torch.empty(1, device="cuda:0"), tag="sizes")


@pytest.mark.gpu
@needs_gpu
def test_a_real_abort_is_within_its_bound_and_a_new_group_works(single_rank, monkeypatch):
    from raymoe.kernels.comm import nccl as nccl_module
    from raymoe.kernels.comm import nccl_unique_id

    hung = []
    monkeypatch.setattr(nccl_module, "on_abort_hung", hung.append)
    send = torch.randn(64, 7168, device="cuda:0").to(torch.bfloat16)
    received = torch.empty_like(send)
    single_rank.loopback(send, received, tag="before abort")
    started = time.monotonic()
    single_rank.abort()
    assert time.monotonic() - started < single_rank.abort_bound_s and hung == []
    with pytest.raises(CommClosedError):
        single_rank.loopback(send, received, tag="after abort")
    fresh = NcclCommunicator.create(0, 1, nccl_unique_id(), timeout_s=10.0, device=0)
    try:
        fresh.loopback(send, received, tag="new group")
        assert torch.equal(received, send)
    finally:
        fresh.close()
