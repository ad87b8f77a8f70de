"""The CPU transports (GlooCommunicator, SocketCommunicator) against a plain reference, with
real ranks in spawned processes: every test runs on both, and both must behave the same
(errors naming the collective and the peer, deadlines, abort and rebuild).

Each table case is a counts matrix counts[source][destination] (rows `source` sends to
`destination`), a dtype and a row shape. Every rank builds its inputs from a seed, so the
test process can rebuild all ranks' inputs and compute each rank's expected output.
One group of processes per world size runs the whole table (spawning is the slow part).
"""

from __future__ import annotations

import datetime
import os
import signal
import socket
import threading
import time
import zlib

import pytest
import torch
from torch import distributed

from comm_harness import run_ranks, values
from raymoe.kernels.comm import sockets as sockets_module
from raymoe.kernels.comm import (
    CollectiveMismatch,
    CollectiveTimeout,
    CommClosedError,
    CommError,
    Communicator,
    GlooCommunicator,
    PeerLostError,
    SocketCommunicator,
)
from raymoe.kernels.comm.ports import free_port
from timing import deadline_margin_s

HOST = "127.0.0.1"


class TcpSockets(SocketCommunicator):
    """The sockets transport as between machines: TCP even where the ranks share one (where
    they do, SocketCommunicator connects them over Unix sockets)."""

    @classmethod
    def create(cls, *args, **kwargs):
        return super().create(*args, local_connections=False, **kwargs)


TRANSPORTS = {"gloo": GlooCommunicator, "sockets": SocketCommunicator, "sockets_tcp": TcpSockets}
TIMEOUT_S = 2.0
FORM_TIMEOUT_S = 30.0  # forming a group (its rendezvous) on a loaded machine; its collectives then take TIMEOUT_S
DETECTION_BASE_S = 1.0  # on an idle machine a timeout is raised within TIMEOUT_S + this (tests/timing.py)

COUNT_PATTERNS = {
    2: {
        "even": [[2, 2], [2, 2]],
        "uneven_with_zeros": [[0, 3], [1, 0]],
        "rank1_sends_nothing": [[3, 2], [0, 0]],
    },
    3: {
        "uneven": [[1, 2, 3], [4, 0, 1], [0, 5, 2]],
        "rank2_sends_nothing": [[2, 0, 1], [1, 1, 3], [0, 0, 0]],
        "all_zero": [[0, 0, 0], [0, 0, 0], [0, 0, 0]],
    },
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "int64": torch.int64}
ROW_SHAPES = {"scalar": (), "H4": (4,)}


def table(world_size: int) -> list[tuple[str, list[list[int]], torch.dtype, tuple[int, ...]]]:
    return [
        (f"w{world_size}-{pattern}-{dtype_name}-{shape_name}", counts, dtype, row_shape)
        for pattern, counts in COUNT_PATTERNS[world_size].items()
        for dtype_name, dtype in DTYPES.items()
        for shape_name, row_shape in ROW_SHAPES.items()
    ]


def make_input(case_id: str, source: int, counts, dtype, row_shape) -> torch.Tensor:
    """Rank `source`'s send buffer: [sum(counts[source]), *row_shape], random per case and rank."""
    generator = torch.Generator().manual_seed(zlib.crc32(f"{case_id}/{source}".encode()))
    shape = (sum(counts[source]), *row_shape)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=generator).to(dtype)
    return torch.randint(-(2**40), 2**40, shape, generator=generator, dtype=dtype)


def reference_output(case_id: str, destination: int, counts, dtype, row_shape) -> torch.Tensor:
    """What `destination` must receive: from each source in rank order, that source's rows for it."""
    pieces = []
    for source in range(len(counts)):
        start = sum(counts[source][:destination])
        rows = make_input(case_id, source, counts, dtype, row_shape)
        pieces.append(rows[start : start + counts[source][destination]])
    return torch.cat(pieces)


def run_table(rank: int, world_size: int, port: int, transport: str) -> dict:
    """Rank program: the whole table, then barrier, close, and a call after close."""
    comm = formed(transport, rank, world_size, port, "table")
    outputs = {}
    for case_id, counts, dtype, row_shape in table(world_size):
        send_counts = torch.tensor(counts[rank], dtype=torch.int64)
        recv_counts = comm.exchange_counts(send_counts, tag=f"{case_id} counts")
        send = make_input(case_id, rank, counts, dtype, row_shape)
        received = comm.exchange_payload(
            send, counts[rank], recv_counts.tolist(), tag=f"{case_id} payload"
        )
        outputs[case_id] = (recv_counts, received)
    comm.barrier(tag="end of table")
    comm.close()
    comm.close()  # idempotent
    closed_errors = []
    for call in (
        lambda: comm.exchange_counts(torch.zeros(world_size, dtype=torch.int64), tag="after close"),
        lambda: comm.exchange_payload(torch.zeros(0), [0] * world_size, [0] * world_size, tag="after close"),
        lambda: comm.barrier(tag="after close"),
    ):
        try:
            call()
            closed_errors.append(None)
        except CommClosedError as error:
            closed_errors.append(str(error))
    return {"outputs": outputs, "closed_errors": closed_errors, "is_communicator": isinstance(comm, Communicator)}


@pytest.fixture(scope="module", params=sorted(TRANSPORTS))
def table_results(request) -> dict[int, list[dict]]:
    return {
        world_size: values(run_ranks(run_table, world_size, (free_port(), request.param), timeout_s=90))
        for world_size in COUNT_PATTERNS
    }


@pytest.mark.parametrize(
    "world_size,case_id,counts,dtype,row_shape",
    [(world_size, *case) for world_size in COUNT_PATTERNS for case in table(world_size)],
    ids=[case[0] for world_size in COUNT_PATTERNS for case in table(world_size)],
)
def test_exchange_matches_reference(table_results, world_size, case_id, counts, dtype, row_shape):
    for rank, result in enumerate(table_results[world_size]):
        recv_counts, received = result["outputs"][case_id]
        expected_counts = [counts[source][rank] for source in range(world_size)]
        assert recv_counts.dtype == torch.int64 and recv_counts.tolist() == expected_counts
        expected = reference_output(case_id, rank, counts, dtype, row_shape)
        assert received.dtype == dtype and received.shape == expected.shape, case_id
        assert torch.equal(received, expected), f"{case_id}: rank {rank} got wrong rows"


@pytest.mark.parametrize("world_size", sorted(COUNT_PATTERNS))
def test_satisfies_protocol_and_closed_calls_raise(table_results, world_size):
    for result in table_results[world_size]:
        assert result["is_communicator"]
        assert len(result["closed_errors"]) == 3
        for message in result["closed_errors"]:
            assert message is not None and "after close" in message


def formed(transport: str, rank: int, world_size: int, port: int, group_name: str):
    """A group formed under ``FORM_TIMEOUT_S`` (under load, connecting alone can take seconds),
    whose collectives then have the tests' deadline, ``TIMEOUT_S``."""
    comm = TRANSPORTS[transport].create(rank, world_size, HOST, port, FORM_TIMEOUT_S, group_name=group_name)
    comm.timeout_s = TIMEOUT_S
    return comm


def stalled_peer(rank: int, world_size: int, port: int, rebuild_port: int, mode: str, transport: str) -> dict:
    """Rank program: rank 2 stalls (stops itself, or skips the collective); the others must
    time out naming rank 2, abort, and rebuild a two-rank group that works."""
    comm = formed(transport, rank, world_size, port, "stalled")
    comm.barrier(tag="warm up")
    if rank == 2:
        if mode == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)  # the harness kills it later
        time.sleep(TIMEOUT_S + 1.5)  # skip the collective until the others gave up
        return {"returned_at": time.time()}
    send = torch.arange(6, dtype=torch.float32).reshape(3, 2) + 10 * rank
    started = time.monotonic()
    try:
        comm.exchange_payload(send, [1, 1, 1], [1, 1, 1], tag="layer 3 dispatch")
        return {"error": None}
    except CollectiveTimeout as error:
        elapsed = time.monotonic() - started
        caught = {"peer": error.peer, "tag": error.tag, "timeout_s": error.timeout_s, "message": str(error)}
    comm.abort()
    comm.abort()  # idempotent
    try:
        comm.barrier(tag="after abort")
        after_abort = None
    except CommClosedError as error:
        after_abort = str(error)
    rebuilt = formed(transport, rank, 2, rebuild_port, "rebuilt")
    recv_counts = rebuilt.exchange_counts(torch.tensor([1, 2], dtype=torch.int64), tag="rebuilt counts")
    received = rebuilt.exchange_payload(send, [1, 2], recv_counts.tolist(), tag="rebuilt payload")
    rebuilt.close()
    return {"error": caught, "elapsed": elapsed, "after_abort": after_abort, "received": received}


@pytest.mark.parametrize("transport", sorted(TRANSPORTS))
@pytest.mark.parametrize("mode", ["stop", "skip"])
def test_stalled_peer_times_out_naming_it_then_rebuild_works(mode, transport):
    outcome = run_ranks(
        stalled_peer, 3, (free_port(), free_port(), mode, transport), timeout_s=60,
        silent_ranks=(2,) if mode == "stop" else (),
    )
    survivors = values(outcome[:2])
    for rank, result in enumerate(survivors):
        error = result["error"]
        assert error is not None, f"rank {rank} did not time out"
        assert error["peer"] == 2 and error["tag"] == "layer 3 dispatch" and error["timeout_s"] == TIMEOUT_S
        assert "'layer 3 dispatch'" in error["message"] and "rank 2 (of 3)" in error["message"]
        assert "abort()" in error["message"]
        margin = deadline_margin_s(DETECTION_BASE_S)
        assert TIMEOUT_S - 0.1 <= result["elapsed"] <= TIMEOUT_S + margin, (result["elapsed"], margin)
        assert result["after_abort"] is not None and "after abort" in result["after_abort"]
    # The rebuilt group of ranks 0 and 1: rank 0 sends 1 row to itself, 2 to rank 1; rank 1 likewise.
    send0 = torch.arange(6, dtype=torch.float32).reshape(3, 2)
    send1 = send0 + 10
    assert torch.equal(survivors[0]["received"], torch.cat([send0[:1], send1[:1]]))
    assert torch.equal(survivors[1]["received"], torch.cat([send0[1:], send1[1:]]))
    for result in outcome[:2]:
        assert result.exit_code == 0, f"rank {result.rank} did not exit cleanly (hung or crashed)"


def mismatched_tags(rank: int, world_size: int, port: int, transport: str) -> str | None:
    """Rank program: the ranks' programs diverged: they enter different collectives."""
    comm = formed(transport, rank, world_size, port, "mismatch")
    tag = "layer 3 dispatch" if rank == 0 else "layer 3 combine"
    try:
        comm.exchange_counts(torch.ones(world_size, dtype=torch.int64), tag=tag)
    except CollectiveMismatch as error:
        return f"{error.peer}|{error}"
    finally:
        comm.abort()
    return None


@pytest.mark.parametrize("transport", sorted(TRANSPORTS))
def test_ranks_in_different_collectives_raise_mismatch(transport):
    messages = values(run_ranks(mismatched_tags, 2, (free_port(), transport), timeout_s=60))
    assert messages[0] is not None and messages[0].startswith("1|") and "'layer 3 dispatch'" in messages[0]
    assert messages[1] is not None and messages[1].startswith("0|") and "'layer 3 combine'" in messages[1]


def dying_peer(rank: int, world_size: int, port: int, transport: str) -> dict:
    """Rank program: rank 1 dies after joining; rank 0 must name it well before the deadline."""
    comm = TRANSPORTS[transport].create(rank, world_size, HOST, port, TIMEOUT_S * 5, group_name="dying")
    comm.barrier(tag="warm up")
    if rank == 1:
        os._exit(17)
    started = time.monotonic()
    try:
        comm.exchange_counts(torch.ones(world_size, dtype=torch.int64), tag="layer 5 combine")
        return {"error": None}
    except PeerLostError as error:
        return {"peer": error.peer, "message": str(error), "elapsed": time.monotonic() - started}
    finally:
        comm.abort()


@pytest.mark.parametrize("transport", sorted(TRANSPORTS))
def test_dead_peer_raises_peer_lost_naming_it(transport):
    outcome = run_ranks(dying_peer, 2, (free_port(), transport), timeout_s=60, silent_ranks=(1,))
    result = values(outcome[:1])[0]
    assert result.get("peer") == 1, result
    assert "'layer 5 combine'" in result["message"] and "rank 1 (of 2)" in result["message"]
    assert result["elapsed"] < TIMEOUT_S * 5  # detected from the closed connection, not the deadline


@pytest.mark.parametrize("transport", sorted(TRANSPORTS))
def test_join_without_peers_fails_within_timeout(transport):
    started = time.monotonic()
    name = TRANSPORTS[transport].backend_name
    with pytest.raises(CommError, match=f"could not join {name} group 'lonely' of 2 ranks"):
        TRANSPORTS[transport].create(0, 2, HOST, free_port(), 1.0, group_name="lonely")
    elapsed = time.monotonic() - started
    margin = deadline_margin_s(DETECTION_BASE_S)
    assert elapsed <= 1.0 + margin, (elapsed, margin)


@pytest.mark.parametrize("transport", sorted(TRANSPORTS))
def test_single_rank_validates_inputs_and_sends_to_itself(transport):
    comm = TRANSPORTS[transport].create(0, 1, HOST, free_port(), TIMEOUT_S, group_name="single")
    send = torch.arange(8, dtype=torch.bfloat16).reshape(4, 2)
    assert torch.equal(comm.exchange_payload(send, [4], [4], tag="self"), send)
    assert comm.exchange_counts(torch.tensor([4]), tag="self counts").tolist() == [4]
    with pytest.raises(CommError, match="send has 4 rows but send_counts sum to 3"):
        comm.exchange_payload(send, [3], [3], tag="bad rows")
    with pytest.raises(CommError, match="expected one per rank"):
        comm.exchange_payload(send, [2, 2], [4], tag="bad length")
    with pytest.raises(CommError, match="non-negative"):
        comm.exchange_counts(torch.tensor([-1]), tag="negative")
    comm.close()
    with pytest.raises(CommClosedError, match="'closed call'"):
        comm.exchange_payload(send, [4], [4], tag="closed call")


@pytest.mark.parametrize("transport", sorted(TRANSPORTS))
@pytest.mark.parametrize("timeout_s", [0, -1.0, float("inf"), "2"])
def test_rejects_a_missing_deadline(timeout_s, transport):
    with pytest.raises(ValueError, match="timeout_s"):
        TRANSPORTS[transport].create(0, 1, HOST, free_port(), timeout_s)


def large_both_ways(rank: int, world_size: int, port: int, transport: str) -> dict:
    """Rank program: every rank sends 8 MiB to every other at once (far more than a socket
    buffer holds), so each must read while it writes; then a burst of small messages."""
    comm = TRANSPORTS[transport].create(rank, world_size, HOST, port, TIMEOUT_S * 5, group_name="large")
    rows = 2 * 1024 * 1024  # float32: 8 MiB per peer
    send = torch.arange(world_size * rows, dtype=torch.float32) + 1e7 * rank
    received = comm.exchange_payload(send, [rows] * world_size, [rows] * world_size, tag="large")
    checks = [torch.equal(received[p * rows:(p + 1) * rows], torch.arange(rank * rows, (rank + 1) * rows,
                                                                           dtype=torch.float32) + 1e7 * p)
              for p in range(world_size)]
    for step in range(200):
        comm.exchange_counts(torch.full((world_size,), step, dtype=torch.int64), tag=f"burst {step}")
    comm.close()
    return {"checks": checks}


@pytest.mark.parametrize("transport", sorted(TRANSPORTS))
def test_large_messages_both_ways_at_once(transport):
    for result in values(run_ranks(large_both_ways, 3, (free_port(), transport), timeout_s=90)):
        assert result["checks"] == [True, True, True]


def abort_while_waiting(rank: int, world_size: int, port: int) -> dict:
    """Rank program: rank 0 waits for a message rank 1 never sends; another thread aborts
    rank 0's communicator: the wait must end at once, well before the deadline."""
    comm = SocketCommunicator.create(rank, world_size, HOST, port, 30.0, group_name="abort")
    comm.barrier(tag="warm up")
    if rank == 1:
        time.sleep(3.0)
        return {}
    threading.Timer(0.5, comm.abort).start()
    started = time.monotonic()
    try:
        comm.exchange_counts(torch.ones(world_size, dtype=torch.int64), tag="layer 0 dispatch")
        return {"error": None}
    except CommError as error:
        return {"error": type(error).__name__, "message": str(error), "elapsed": time.monotonic() - started}


def test_sockets_abort_from_another_thread_wakes_a_waiting_collective():
    result = values(run_ranks(abort_while_waiting, 2, (free_port(),), timeout_s=60))[0]
    assert result["error"] == "CommClosedError" and "'layer 0 dispatch'" in result["message"], result
    assert 0.4 <= result["elapsed"] < 5.0, result  # woken by abort(), not by the 30 s deadline


class AbortedBetweenReadAndPoll(SocketCommunicator):
    """Its abort() lands, as one from another thread can, after the wait loop read its sockets
    and before it polls them (a resize or recovery aborts routers mid-step): the sockets it is
    about to poll are closed by then."""

    def _read(self, pending, peer, tag):
        super()._read(pending, peer, tag)
        if not getattr(self, "aborted_once", False):
            self.aborted_once = True
            self.abort()


def abort_between_read_and_poll(rank: int, world_size: int, port: int) -> dict:
    """Rank program: rank 0's wait is aborted inside its loop; it must raise CommClosedError (a
    ValueError from polling a closed socket failed a step's requests instead of retrying it)."""
    cls = AbortedBetweenReadAndPoll if rank == 0 else SocketCommunicator
    comm = cls.create(rank, world_size, HOST, port, 30.0, group_name="abort-in-loop")
    comm.aborted_once = True  # not during the warm-up
    comm.barrier(tag="warm up")
    if rank == 1:
        time.sleep(2.0)
        return {}
    comm.aborted_once = False
    try:
        comm.exchange_counts(torch.ones(world_size, dtype=torch.int64), tag="layer 0 dispatch")
        return {"error": None}
    except Exception as error:  # any type: the test checks which
        return {"error": type(error).__name__, "message": str(error)}


def test_sockets_abort_inside_the_wait_loop_is_comm_closed():
    result = values(run_ranks(abort_between_read_and_poll, 2, (free_port(),), timeout_s=60))[0]
    assert result["error"] == "CommClosedError" and "'layer 0 dispatch'" in result["message"], result


def test_sockets_refuse_a_connection_that_does_not_know_the_group():
    port = free_port()
    outcome: dict = {}

    def rank0():
        try:
            outcome["comm"] = SocketCommunicator.create(0, 2, HOST, port, 5.0, group_name="secret/abc")
        except CommError as error:
            outcome["error"] = str(error)

    joiner = threading.Thread(target=rank0)
    joiner.start()
    store = distributed.TCPStore(HOST, port, 2, False, timeout=datetime.timedelta(seconds=5))
    keys = distributed.PrefixStore("secret/abc", store)
    keys.wait(["address/0"], datetime.timedelta(seconds=5))
    host, listen_port, local_name, _ = keys.get("address/0").decode().split("|")
    if local_name:  # the same machine's Unix listener refuses a stranger as well
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as stranger:
            stranger.settimeout(5)
            stranger.connect("\0" + local_name)
            stranger.sendall(b"\x01" + b"\x00" * 7 + b"\x00" * 32)
            assert stranger.recv(1) == b""
    with socket.create_connection((host, int(listen_port)), timeout=5) as stranger:
        stranger.sendall(b"\x01" + b"\x00" * 7 + b"\x00" * 32)  # rank 1, but a wrong digest
        stranger.settimeout(5)
        assert stranger.recv(1) == b""  # refused: closed without a word
    joiner.join(timeout=15)
    assert "comm" not in outcome and "could not join sockets group" in outcome.get("error", ""), outcome


def connection_families(rank: int, world_size: int, port: int, transport: str) -> dict:
    """Rank program: the address family of each of this rank's connections, and one exchange over them."""
    comm = TRANSPORTS[transport].create(rank, world_size, HOST, port, TIMEOUT_S * 5, group_name="families")
    received = comm.exchange_payload(torch.full((world_size, 3), rank, dtype=torch.int64), [1] * world_size,
                                     [1] * world_size, tag="families")
    families = sorted({connection.family.name for connection in comm._peers.values()})
    comm.close()
    return {"families": families, "received": received[:, 0].tolist()}


@pytest.mark.skipif(not sockets_module._machine_id(), reason="no kernel boot id here: every connection is TCP")
@pytest.mark.parametrize("transport, family", [("sockets", "AF_UNIX"), ("sockets_tcp", "AF_INET")])
def test_ranks_on_one_machine_connect_over_unix_sockets_and_tcp_stays_for_the_rest(transport, family):
    for result in values(run_ranks(connection_families, 3, (free_port(), transport), timeout_s=60)):
        assert result == {"families": [family], "received": [0, 1, 2]}, result
