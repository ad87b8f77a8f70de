"""The pure parts every backend shares (layout, counts, headers, dtypes, errors, factory),
checked on the CPU against plain references."""

from __future__ import annotations

import pickle
import time

import pytest
import torch

from raymoe.kernels.comm import (
    CollectiveMismatch,
    CollectiveTimeout,
    CommBackend,
    CommClosedError,
    CommError,
    GlooCommunicator,
    GlooRendezvous,
    NcclRendezvous,
    PeerLostError,
    SocketCommunicator,
    SocketRendezvous,
    make_communicator,
    new_rendezvous,
)
from raymoe.kernels.comm.base import Deadline, validate_timeout
from raymoe.kernels.comm.layout import (
    NcclDataType,
    nccl_data_type,
    pack_count_header,
    plan_all_to_all,
    plan_payload,
    row_offsets,
    unpack_count_header,
    validate_counts,
)
from raymoe.kernels.comm.ports import free_port

# Bytes per element of each ncclDataType_t, from nccl.h.
NCCL_ELEMENT_BYTES = {0: 1, 1: 1, 2: 4, 3: 4, 4: 8, 5: 8, 6: 2, 7: 4, 8: 8, 9: 2}

LAYOUT_CASES = [
    ([2, 0, 3], [1, 4, 0], ()),
    ([0, 0], [0, 0], (4,)),
    ([1, 2, 3, 4], [4, 3, 2, 1], (2, 3)),
    ([5], [5], (7,)),
]


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64,
              torch.int32, torch.int8, torch.uint8, torch.bool]
)
def test_nccl_type_moves_whole_elements(dtype):
    data_type = nccl_data_type(dtype)
    assert isinstance(data_type, NcclDataType)
    assert NCCL_ELEMENT_BYTES[int(data_type)] == torch.empty(0, dtype=dtype).element_size()


def test_nccl_types_keep_their_meaning():
    assert nccl_data_type(torch.bfloat16) is NcclDataType.BFLOAT16 and int(NcclDataType.BFLOAT16) == 9
    assert nccl_data_type(torch.float16) is NcclDataType.FLOAT16  # not bfloat16: same size, other bits
    assert nccl_data_type(torch.int64) is NcclDataType.INT64 and int(NcclDataType.INT64) == 4
    assert int(nccl_data_type(torch.float32)) == 7


@pytest.mark.parametrize("dtype", [torch.complex64, torch.uint16])
def test_unsupported_dtype_is_a_clear_error(dtype):
    with pytest.raises(TypeError, match=f"dtype {dtype} has no NCCL equivalent; supported: .*torch.bfloat16"):
        nccl_data_type(dtype)


@pytest.mark.parametrize("send_counts,recv_counts,row_shape", LAYOUT_CASES)
def test_layout_slices_match_split(send_counts, recv_counts, row_shape):
    layout = plan_all_to_all(send_counts, recv_counts, row_shape)
    send = torch.randn(sum(send_counts), *row_shape)
    flat = send.reshape(-1)
    for peer, rows in enumerate(torch.split(send, send_counts)):
        piece = layout.peers[peer]
        assert torch.equal(flat[piece.send_offset : piece.send_offset + piece.send_numel], rows.reshape(-1))
        assert piece.recv_numel == recv_counts[peer] * layout.row_numel
        assert piece.recv_offset == sum(recv_counts[:peer]) * layout.row_numel
        send_bytes, recv_bytes = layout.byte_offsets(peer, 2)
        assert (send_bytes, recv_bytes) == (2 * piece.send_offset, 2 * piece.recv_offset)
    assert layout.recv_shape() == (sum(recv_counts), *row_shape)


def test_row_offsets_are_an_exclusive_prefix_sum():
    assert row_offsets([2, 0, 3]) == (0, 2, 2, 5)
    assert row_offsets([]) == (0,)


@pytest.mark.parametrize(
    "counts,message",
    [
        ([1, 2], "has 2 entries, expected one per rank \\(3\\)"),
        ([1, -1, 0], "send_counts\\[1\\] must be a non-negative int, got -1"),
        ([1, 2.0, 0], "send_counts\\[1\\] must be a non-negative int"),
        ([True, 1, 0], "send_counts\\[0\\] must be a non-negative int"),
        (torch.tensor([1.0, 2.0, 3.0]), "1-D integer tensor"),
        (torch.ones(3, 1, dtype=torch.int64), "1-D integer tensor"),
    ],
)
def test_bad_counts_are_rejected(counts, message):
    with pytest.raises(CommError, match=message):
        validate_counts(counts, 3, name="send_counts")


def test_counts_accept_tensors_and_sequences():
    assert validate_counts(torch.tensor([3, 0], dtype=torch.int64), 2, name="c") == (3, 0)
    assert validate_counts((3, 0), 2, name="c") == (3, 0)


def test_payload_rows_must_match_counts():
    with pytest.raises(CommError, match="send has 4 rows but send_counts sum to 5"):
        plan_payload(torch.zeros(4, 2), [2, 3], [1, 1], 2)
    with pytest.raises(CommError, match="0-d tensor"):
        plan_payload(torch.tensor(1.0), [1], [1], 1)
    with pytest.raises(CommError, match="recv_counts\\[0\\]"):
        plan_payload(torch.zeros(5, 2), [2, 3], [-1, 1], 2)


def test_count_header_round_trip():
    header = pack_count_header([3, 0, 7], "layer 3 dispatch", 3)
    assert header.shape == (3, 2) and header.dtype == torch.int64
    assert unpack_count_header(header, "layer 3 dispatch", 3).tolist() == [3, 0, 7]


def test_count_header_names_the_peer_in_another_collective():
    header = pack_count_header([1, 1, 1], "layer 3 dispatch", 3)
    header[2, 1] = pack_count_header([1, 1, 1], "layer 3 combine", 3)[2, 1]
    with pytest.raises(CollectiveMismatch, match="'layer 3 dispatch': rank 2 \\(of 3\\)") as caught:
        unpack_count_header(header, "layer 3 dispatch", 3)
    assert caught.value.peer == 2


def test_timeout_message_and_pickle():
    error = CollectiveTimeout(tag="layer 3 dispatch", timeout_s=2.0, peer=2, world_size=3)
    assert str(error).startswith(
        "collective 'layer 3 dispatch' timed out after 2.0 s waiting for rank 2 (of 3); "
        "the peer may be dead or stuck. Rebuild the communicator (abort(), then create a new one)"
    )
    unknown = CollectiveTimeout(tag="x", timeout_s=1.0, peer=None, world_size=4)
    assert "unknown peer" in str(unknown)
    for original in [
        error, unknown, CommClosedError("x"), CollectiveMismatch(tag="t", peer=1, world_size=2),
        PeerLostError(tag="t", peer=1, world_size=2, detail="connection closed"),
    ]:
        copy = pickle.loads(pickle.dumps(original))  # errors cross Ray actor boundaries
        assert type(copy) is type(original) and str(copy) == str(original)
        assert vars(copy) == vars(original) and isinstance(copy, CommError)


@pytest.mark.parametrize("timeout_s", [0, -2, float("nan"), float("inf"), None, "1"])
def test_every_collective_needs_a_finite_deadline(timeout_s):
    with pytest.raises(ValueError, match="timeout_s"):
        validate_timeout(timeout_s)


def test_deadline_counts_down():
    deadline = Deadline(60.0)
    assert 59.0 < deadline.remaining_s() <= 60.0 and not deadline.has_expired()
    expired = Deadline(0.001)
    time.sleep(0.01)
    assert expired.has_expired() and expired.remaining_s() == 0.0


def test_auto_backend_follows_cuda():
    expected = CommBackend.NCCL if torch.cuda.is_available() else CommBackend.SOCKETS
    assert CommBackend.AUTO.resolve() is expected
    assert CommBackend.GLOO.resolve() is CommBackend.GLOO and CommBackend.NCCL.resolve() is CommBackend.NCCL
    assert CommBackend.SOCKETS.resolve() is CommBackend.SOCKETS


def test_factory_builds_gloo_from_a_picklable_rendezvous():
    rendezvous = pickle.loads(pickle.dumps(new_rendezvous(CommBackend.GLOO, group_name="factory")))
    assert isinstance(rendezvous, GlooRendezvous) and rendezvous.port > 0
    comm = make_communicator(CommBackend.GLOO, rendezvous, rank=0, world_size=1, timeout_s=2.0)
    assert isinstance(comm, GlooCommunicator)
    assert comm.exchange_counts(torch.tensor([2]), tag="factory").tolist() == [2]
    comm.close()


def test_factory_builds_sockets_from_a_picklable_rendezvous():
    rendezvous = pickle.loads(pickle.dumps(new_rendezvous(CommBackend.SOCKETS, group_name="factory")))
    assert isinstance(rendezvous, SocketRendezvous) and rendezvous.port > 0
    assert rendezvous.group_name.startswith("factory/") and len(rendezvous.group_name) > len("factory/") + 16
    comm = make_communicator(CommBackend.SOCKETS, rendezvous, rank=0, world_size=1, timeout_s=2.0)
    assert isinstance(comm, SocketCommunicator)
    assert comm.exchange_counts(torch.tensor([2]), tag="factory").tolist() == [2]
    comm.close()
    with pytest.raises(TypeError, match="backend sockets needs a SocketRendezvous, got GlooRendezvous"):
        make_communicator(CommBackend.SOCKETS, GlooRendezvous("127.0.0.1", free_port()), rank=0, world_size=1,
                          timeout_s=1.0)


def test_factory_rejects_a_rendezvous_of_the_other_backend():
    with pytest.raises(TypeError, match="backend gloo needs a GlooRendezvous, got NcclRendezvous"):
        make_communicator(
            CommBackend.GLOO, NcclRendezvous(tuple(range(128))), rank=0, world_size=1, timeout_s=1.0
        )
    with pytest.raises(TypeError, match="backend nccl needs a NcclRendezvous"):
        make_communicator(
            CommBackend.NCCL, GlooRendezvous("127.0.0.1", free_port()), rank=0, world_size=1, timeout_s=1.0
        )
