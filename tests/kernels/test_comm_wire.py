"""The exchange's wire facts (kernels/comm/wire.py): the row format both sides and the planners
use, the header's fields, and the statuses -> errors table against who actually raises what."""

from __future__ import annotations

import array

import pytest
import torch

from raymoe.kernels.comm import wire
from raymoe.kernels.comm.errors import CollectiveTimeout, CommClosedError, CommError, PeerLostError
from raymoe.kernels.comm.p2p import PointToPointCommunicator
from raymoe.kernels.comm.sockets import SocketCommunicator


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_packs_and_unpacks_as_activations_then_slots_then_weights(dtype):
    row_format = wire.RowFormat(hidden_size=16, top_k=3, dtype=dtype)
    rows = torch.randn(5, 16).to(dtype)
    slots = torch.tensor([[0, -1, 2]] * 5, dtype=torch.int32)
    weights = torch.rand(5, 3)
    packed = row_format.pack(rows, slots, weights)
    assert packed.dtype == torch.uint8 and packed.shape == (5, row_format.row_bytes)
    assert row_format.row_bytes == 16 * dtype.itemsize + 8 * 3 == wire.row_bytes(16, 3, dtype.itemsize)
    assert row_format.activation_bytes == 16 * dtype.itemsize
    # the layout on the wire, byte for byte: activations, then k int32, then k float32
    expected = torch.cat([rows.view(torch.uint8), slots.view(torch.uint8), weights.view(torch.uint8)], dim=1)
    assert torch.equal(packed, expected)
    got_rows, got_slots, got_weights = row_format.unpack(packed)
    assert torch.equal(got_rows, rows) and torch.equal(got_slots, slots) and torch.equal(got_weights, weights)


def test_a_header_holds_its_fields_where_the_indices_say():
    header = wire.header(7, "layer 2 dispatch", 5, wire.KIND_STEP, [1, 0, 3], torch.device("cpu")).tolist()
    assert len(header) == wire.header_width(3) == wire.HEADER_FIELDS + 3
    assert header[wire.HEADER_ROWS] == 7 and header[wire.HEADER_EPOCH] == 5 and header[wire.HEADER_KIND] == wire.KIND_STEP
    assert header[wire.HEADER_CHECKSUM] == wire.layer_tags(2)[1] and header[wire.HEADER_FIELDS:] == [1, 0, 3]
    assert wire.FRAME.size == 16 and wire.TRAILER_BYTES == 16


def test_the_layout_numbers_routers_first_then_workers():
    layout = wire.GroupLayout(2, (4, 1))
    assert layout.world_size == 4 and layout.router_ranks == [0, 1] and layout.worker_ranks == [2, 3]
    assert layout.worker_rank(1) == 3


def _sockets_rank() -> SocketCommunicator:
    """A sockets communicator of rank 0 of 3 with no connections (native_failure needs none)."""
    return SocketCommunicator(rank=0, world_size=3, timeout_s=1.0, group_name="wire-test", store=None, peers={})


EXPECTED_TRANSPORT_ERRORS = {wire.Status.TIMEOUT: CollectiveTimeout, wire.Status.LOST: PeerLostError,
                             wire.Status.FRAME: CommError, wire.Status.ABORTED: CommClosedError}


def test_the_statuses_table_says_who_raises_each_and_the_sockets_transport_agrees():
    """Every status has a row; the rows the table gives the transport are exactly those the
    sockets transport turns into its errors (each breaking the communicator), and no other."""
    assert set(wire.STATUSES) == set(wire.Status)
    transport = {status for status, facts in wire.STATUSES.items() if facts.raised_by == "transport"}
    assert transport == set(EXPECTED_TRANSPORT_ERRORS)
    for status in wire.Status:
        comm = _sockets_rank()
        info = array.array("q", [0] * wire.INFO_FIELDS)
        info[wire.Info.PEER] = 1  # the second of the peers below
        error = comm.native_failure(status, info, [2, 1], "layer 0 dispatch", 1.0)
        if status in transport:
            assert isinstance(error, EXPECTED_TRANSPORT_ERRORS[status]), status
            assert not comm.usable  # marked broken by it
        else:
            assert error is None and comm.usable, status
        comm.close()


def test_a_transport_without_native_routines_says_so():
    comm = PointToPointCommunicator(rank=0, world_size=2, timeout_s=1.0)
    assert not comm.native_routines and SocketCommunicator.native_routines
    with pytest.raises(CommError, match="runs no native routines"):
        comm.run_native([1], "layer 0 dispatch", lambda *args: 0)
    assert comm.native_failure(int(wire.Status.TIMEOUT), array.array("q", [0] * wire.INFO_FIELDS), [1], "t", 1.0) is None
