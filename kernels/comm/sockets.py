"""A socket transport for CPU ranks: one stream socket per pair, no library in between.

Why: on CPU the expert-parallel exchange pays one to two round trips per MoE layer, and
gloo's round trip over loopback costs ~6x a bare socket's (benchmarks/bench_cpu_floor.py:
135 vs 22 us for 4 KiB), because each send or receive goes through gloo's own threads and
a completion wait. Here the calling thread moves the bytes itself: non-blocking sockets and
``poll``, sends written as soon as they are posted, receives read straight into the
destination tensor.

Like gloo.py this module is only the transport under `PointToPointCommunicator`
(kernels/comm/p2p.py): ``_post`` queues a batch of messages, ``_wait`` moves them under the
deadline. Each message is a 16-byte header (the pair's message number, the byte count: the
frame of kernels/comm/wire.py) and the bytes; a stream per pair keeps them in order, and the
numbers check that both sides agree. A closed connection is `PeerLostError` naming the
peer; a deadline that passes is `CollectiveTimeout` naming the first peer still owing or owed
bytes; `abort()` from another thread wakes a waiting one (a pipe in every poll). Native code
may move the same framed messages on these sockets itself (``run_native``: the exchange's
layer calls, kernels/csrc/cpu_exchange.c); this module runs none and imports none.

Rendezvous: rank 0 serves a c10d TCPStore on ``host:port`` (that address only); every rank
listens on its own address (``bind_host``, an ephemeral port), publishes it under the
group's name (which carries the group's secret), connects to each lower rank and accepts
each higher one. A connection starts with the connecting rank and a digest of the group
name, so a stranger's connection is refused. Ranks on the same machine (the same kernel boot
id) connect over a Unix socket instead (Linux's abstract namespace, named after that digest):
the same stream without the TCP stack, measured 5-8% off the 4-layer exchange of one router
and one worker on one core at one token (benchmarks/bench_exchange_chain.py, which also runs
it over TCP); where that connection cannot be made (another network namespace), TCP as elsewhere.
"""

from __future__ import annotations

import array
import datetime
import errno
import hashlib
import os
import select
import socket
import struct
import sys
from collections import deque

import torch
import torch.distributed as distributed

from raymoe.kernels.comm.base import Deadline, validate_group, validate_timeout
from raymoe.kernels.comm.errors import RECOVERY_HINT, CollectiveTimeout, CommClosedError, CommError, PeerLostError
from raymoe.kernels.comm.p2p import Message, PointToPointCommunicator
from raymoe.kernels.comm.store import first_line, listen, open_store
from raymoe.kernels.comm.wire import FRAME, Info, Status

HEADER = FRAME  # each message's frame: message number, bytes (kernels/comm/wire.py)
HELLO = struct.Struct("<q32s")  # connecting rank, sha256 of the group name
POLL_SLICE_S = 0.5  # a wait re-checks the communicator's state at least this often
MAX_IOVECS = 512  # buffers per sendmsg (Linux takes up to 1024)


class _Incoming:
    """One message being read: its 16-byte frame header, then its body (plain slotted
    classes here: a few are made per MoE layer)."""

    __slots__ = ("message", "header", "header_got", "body", "body_got")

    def __init__(self, message: Message) -> None:
        self.message = message
        self.header = bytearray(HEADER.size)
        self.header_got = 0
        self.body: memoryview | None = None  # set once the header checked out
        self.body_got = 0


class _Pending:
    __slots__ = ("sends", "recvs")

    def __init__(self) -> None:
        self.sends: dict[int, list[memoryview]] = {}  # peer -> what is left to write, frame headers and bodies in order
        self.recvs: dict[int, deque] = {}  # peer -> _Incoming, in order

    @property
    def done(self) -> bool:
        return not self.sends and not self.recvs


class SocketCommunicator(PointToPointCommunicator):
    """One rank of a socket group: the transport under `PointToPointCommunicator`."""

    backend_name = "sockets"
    native_routines = True  # run_native lends native code these sockets

    def __init__(self, *, rank: int, world_size: int, timeout_s: float, group_name: str,
                 store: distributed.Store | None, peers: dict[int, socket.socket]) -> None:
        super().__init__(rank=rank, world_size=world_size, timeout_s=timeout_s)
        self.group_name = group_name
        self._store = store  # rank 0 hosts the rendezvous server: keep it alive with the group
        self._peers = peers
        for connection in peers.values():
            connection.setblocking(False)
        self._wake_read, self._wake_write = os.pipe()  # abort() wakes a thread inside _wait
        os.set_blocking(self._wake_read, False)
        os.set_blocking(self._wake_write, False)

    @classmethod
    def create(cls, rank: int, world_size: int, host: str, port: int, timeout_s: float, *,
               group_name: str = "raymoe", bind_host: str | None = None,
               local_connections: bool = True) -> "SocketCommunicator":
        """Joins the group whose rendezvous server rank 0 hosts at host:port; blocks until
        this rank is connected to every other, at most ``timeout_s``. ``bind_host``: the
        address this rank listens on for higher ranks (its node's; default ``host``).
        ``local_connections`` False: TCP to every rank, as between machines, even to ranks on
        this one (tests and benchmarks of the TCP path)."""
        validate_group(rank, world_size)
        timeout_s = validate_timeout(timeout_s)
        deadline = Deadline(timeout_s)
        peers: dict[int, socket.socket] = {}
        listener = local = None
        store = None
        try:
            store = open_store(rank, world_size, host, port, timeout_s)
            keys = distributed.PrefixStore(group_name, store)
            digest = hashlib.sha256(group_name.encode()).digest()
            listener = listen(bind_host or host, 0)
            own_host, own_port = listener.getsockname()[:2]
            machine = _machine_id() if local_connections else ""
            local_name = f"raymoe-{digest.hex()[:32]}-{rank}" if machine else ""
            local = _listen_local(local_name) if local_name else None
            keys.set(f"address/{rank}", f"{own_host}|{own_port}|{local_name if local else ''}|{machine}")
            for peer in range(rank):  # connect to every lower rank
                keys.wait([f"address/{peer}"], datetime.timedelta(seconds=max(deadline.remaining_s(), 0.001)))
                peer_host, peer_port, peer_local, peer_machine = keys.get(f"address/{peer}").decode().rsplit("|", 3)
                connection = None
                if peer_local and peer_machine == machine:  # the same machine: a Unix socket, if it connects
                    connection = _connect_local(peer_local, max(deadline.remaining_s(), 0.001))
                if connection is None:
                    connection = socket.create_connection((peer_host, int(peer_port)),
                                                          timeout=max(deadline.remaining_s(), 0.001))
                _tune(connection)
                connection.sendall(HELLO.pack(rank, digest))
                peers[peer] = connection
            listeners = {listener.fileno(): listener}
            if local is not None:
                listeners[local.fileno()] = local
            accepting = select.poll()  # (poll, not select: a busy process's descriptors may pass 1024)
            for fd in listeners:
                accepting.register(fd, select.POLLIN)
            while len(peers) < world_size - 1:  # accept every higher rank, on either listener
                ready = accepting.poll(1000 * max(deadline.remaining_s(), 0.001))
                if not ready:
                    raise TimeoutError(f"ranks {sorted(set(range(rank + 1, world_size)) - set(peers))} did not connect")
                connection, _ = listeners[ready[0][0]].accept()
                connection.settimeout(max(deadline.remaining_s(), 0.001))
                hello = receive_exactly(connection, HELLO.size)
                other, their_digest = HELLO.unpack(hello)
                if their_digest != digest or not rank < other < world_size or other in peers:
                    connection.close()  # not a member of this group (or a duplicate): refused
                    continue
                _tune(connection)
                peers[other] = connection
        except (OSError, RuntimeError, ValueError) as error:
            for connection in peers.values():
                connection.close()
            raise CommError(
                f"rank {rank} could not join sockets group {group_name!r} of {world_size} ranks "
                f"at {host}:{port} within {timeout_s:.1f} s: {first_line(error)}"
            ) from error
        finally:
            if listener is not None:
                listener.close()
            if local is not None:
                local.close()
        return cls(rank=rank, world_size=world_size, timeout_s=timeout_s, group_name=group_name,
                   store=store, peers=peers)

    # ---- native routines on these sockets --------------------------------------------------
    def run_native(self, peers: list[int], tag: str, routine):
        """Runs ``routine(fds, wake_fd, recv_numbers, send_numbers)``: native code that moves
        messages to and from ``peers`` on their sockets itself, framed as here (e.g. a worker's
        layer, kernels/csrc/cpu_exchange.c). ``fds`` (int32) are the peers' sockets in order,
        ``wake_fd`` turns readable once this communicator is aborted, and the per-peer message
        numbers (int64) are taken from this communicator and given back, as the routine
        advanced them. It runs holding the issue lock, as a transfer's posting does; `abort()`
        wakes it first. Returns what the routine returns."""
        self._check_usable(tag)
        fds = array.array("i", [self._peers[peer].fileno() for peer in peers])
        received = array.array("q", [self._received[peer] for peer in peers])
        sent = array.array("q", [self._sent[peer] for peer in peers])
        with self._issue_lock:
            self._check_usable(tag)
            try:
                return routine(fds, self._wake_read, received, sent)
            finally:
                for index, peer in enumerate(peers):
                    self._received[peer], self._sent[peer] = received[index], sent[index]

    def native_failure(self, status: int, info: array.array, peers: list[int], tag: str,
                       timeout_s: float) -> CommError | None:
        """The error a native routine's transport status stands for (the ``"transport"`` rows of
        kernels/comm/wire.py's ``STATUSES``; ``info[Info.PEER]`` indexes ``peers``), this
        communicator marked broken by it; None for a status that is not the transport's."""
        index = info[Info.PEER]
        peer = peers[index] if 0 <= index < len(peers) else None
        if status == Status.ABORTED:
            return self._broken(CommClosedError(tag))
        if status == Status.TIMEOUT:
            return self._broken(CollectiveTimeout(tag=tag, timeout_s=timeout_s, peer=peer, world_size=self.world_size))
        if status == Status.LOST:
            code = info[Info.A]
            detail = (f"the connection failed: {os.strerror(code)} ({errno.errorcode.get(code, code)})" if code
                      else "the connection was closed (the peer process most likely died)")
            return self._lost(peer if peer is not None else -1, tag, detail)
        if status == Status.FRAME:
            return self._out_of_order(tag, peer, info[Info.A], info[Info.B], info[Info.C], info[Info.D])
        return None

    def abort(self) -> None:
        self._wake()  # a native routine holding the issue lock returns now (run_native)
        super().abort()

    def close(self) -> None:
        self._wake()
        super().close()

    def _wake(self) -> None:
        try:
            os.write(self._wake_write, b"x")
        except OSError:
            pass

    # ---- the transport ------------------------------------------------------------------
    def _check_device(self, tensor: torch.Tensor, tag: str) -> None:
        if tensor.device.type != "cpu":
            raise CommError(f"collective {tag!r}: the sockets transport moves CPU tensors, got one on {tensor.device}")

    def _post(self, sends: list[Message], recvs: list[Message], tag: str) -> _Pending:
        pending = _Pending()
        incoming = pending.recvs
        for message in recvs:
            queue = incoming.get(message.peer)
            if queue is None:
                queue = incoming[message.peer] = deque()
            queue.append(_Incoming(message))
        outgoing = pending.sends
        for message in sends:
            size = message.buffer.numel()
            views = outgoing.get(message.peer)
            if views is None:
                views = outgoing[message.peer] = []
            views.append(memoryview(HEADER.pack(message.number, size)))
            if size:
                views.append(_view(message.buffer))
        for peer in list(outgoing):  # most messages fit the socket buffer: out right away
            self._write(pending, peer, tag)
        return pending

    def _wait(self, pending: _Pending, deadline: Deadline, tag: str) -> None:
        while True:
            if self._closed:  # aborted from another thread (its sockets are closed)
                raise self._broken(CommClosedError(tag))
            for peer in list(pending.recvs):
                self._read(pending, peer, tag)
            if pending.done:
                return
            remaining = deadline.remaining_s()
            if remaining <= 0:
                waiting_for = next(iter(pending.recvs), None)
                if waiting_for is None:
                    waiting_for = next(iter(pending.sends))
                raise self._broken(CollectiveTimeout(tag=tag, timeout_s=deadline.timeout_s, peer=waiting_for,
                                                     world_size=self.world_size))
            poller = select.poll()
            poller.register(self._wake_read, select.POLLIN)
            events: dict[int, int] = {}
            for peer in pending.recvs:
                events[peer] = select.POLLIN
            for peer in pending.sends:
                events[peer] = events.get(peer, 0) | select.POLLOUT
            by_fd = {}
            for peer, mask in events.items():
                fd = self._peers[peer].fileno()  # -1 once abort() from another thread closed it
                if fd < 0:
                    raise self._gone(peer, tag)
                by_fd[fd] = peer
                poller.register(fd, mask)  # (the number, not the socket: it may close meanwhile)
            ready = poller.poll(1000 * min(remaining, POLL_SLICE_S))
            for fd, flags in ready:
                peer = by_fd.get(fd)
                if peer is None or self._closed:
                    continue
                if flags & select.POLLOUT and peer in pending.sends:
                    self._write(pending, peer, tag)
                elif flags & (select.POLLERR | select.POLLHUP | select.POLLNVAL) and peer not in pending.recvs:
                    raise self._lost(peer, tag)  # (a peer we read from hears its end at the top)

    def _write(self, pending: _Pending, peer: int, tag: str) -> None:
        """Writes what ``peer``'s socket takes now of its queued messages: all of them in one
        ``sendmsg`` when they fit (a layer's header and rows wake the peer once, not twice)."""
        views = pending.sends[peer]
        connection = self._peers[peer]
        while views:
            batch = views if len(views) <= MAX_IOVECS else views[:MAX_IOVECS]
            try:
                sent = connection.sendmsg(batch)
            except BlockingIOError:
                return
            except OSError as error:
                raise self._gone(peer, tag, f"sending failed: {first_line(error)}") from error
            written = 0  # whole views written
            while written < len(batch) and sent >= len(batch[written]):
                sent -= len(batch[written])
                written += 1
            del views[:written]
            if sent:  # a view written in part: the socket is full, the rest when it is writable again
                views[0] = views[0][sent:]
                return
            if written < len(batch):
                return
        del pending.sends[peer]

    def _read(self, pending: _Pending, peer: int, tag: str) -> None:
        """Reads what ``peer``'s socket holds now into its posted receives, in order."""
        queue = pending.recvs[peer]
        connection = self._peers[peer]
        while queue:
            incoming = queue[0]
            try:
                if incoming.body is None:
                    body = _view(incoming.message.buffer)
                    if incoming.header_got == 0 and len(body):
                        # Frame header and body in one call (both are usually there): the body
                        # lands where it is expected and counts only once the header checks out
                        # (a header that does not breaks the communicator either way).
                        got = connection.recvmsg_into([incoming.header, body])[0]
                        incoming.header_got, incoming.body_got = min(got, HEADER.size), max(got - HEADER.size, 0)
                    else:
                        got = connection.recv_into(memoryview(incoming.header)[incoming.header_got:])
                        incoming.header_got += got
                    if got == 0:
                        raise self._lost(peer, tag)
                    if incoming.header_got < HEADER.size:
                        return
                    self._check_header(incoming, tag)
                    incoming.body = body
                if incoming.body_got < len(incoming.body):
                    got = connection.recv_into(incoming.body[incoming.body_got:])
                    if got == 0:
                        raise self._lost(peer, tag)
                    incoming.body_got += got
                    if incoming.body_got < len(incoming.body):
                        continue  # read on while the socket has bytes
            except BlockingIOError:
                return
            except OSError as error:
                raise self._gone(peer, tag, f"receiving failed: {first_line(error)}") from error
            queue.popleft()
        del pending.recvs[peer]

    def _check_header(self, incoming: _Incoming, tag: str) -> None:
        number, size = HEADER.unpack(incoming.header)
        message = incoming.message
        expected = message.buffer.numel()
        if number != message.number or size != expected:
            raise self._out_of_order(tag, message.peer, number, size, message.number, expected)

    def _out_of_order(self, tag: str, peer: int | None, number: int, size: int, expected_number: int,
                      expected_size: int) -> CommError:
        """A frame that is not the one expected from ``peer`` (this communicator marked broken)."""
        return self._broken(CommError(
            f"collective {tag!r}: rank {peer} (of {self.world_size}) sent message {number} of {size} bytes "
            f"where this rank expects message {expected_number} of {expected_size} bytes; the ranks called "
            f"collectives in different orders. {RECOVERY_HINT}"
        ))

    def _lost(self, peer: int, tag: str,
              detail: str = "the connection was closed (the peer process most likely died)") -> CommError:
        return self._broken(PeerLostError(tag=tag, peer=peer, world_size=self.world_size, detail=detail))

    def _gone(self, peer: int, tag: str, detail: str = "the connection was closed") -> CommError:
        """A socket that failed or closed under a wait: `CommClosedError` where this rank's own
        abort() or close() (from another thread) closed it, else the peer lost."""
        if self._closed:
            return self._broken(CommClosedError(tag))
        return self._lost(peer, tag, detail)

    def _teardown(self, abort: bool) -> None:
        self._wake()  # a thread inside _wait wakes and sees the state
        for connection in self._peers.values():
            if abort:
                try:
                    connection.shutdown(socket.SHUT_RDWR)  # the peers hear it now
                except OSError:
                    pass
            connection.close()
        self._store = None

    def __del__(self, _close=os.close) -> None:  # os.close bound now: at interpreter exit `os` may be gone
        for fd in (getattr(self, "_wake_read", None), getattr(self, "_wake_write", None)):
            if fd is not None:
                try:
                    _close(fd)
                except OSError:
                    pass


def _view(tensor: torch.Tensor) -> memoryview:
    """The bytes of a flat contiguous uint8 CPU tensor, writable, without a copy."""
    return memoryview(tensor.numpy()).cast("B")


def _machine_id() -> str:
    """This kernel's boot id: ranks that share it run on one machine. Empty off Linux (no
    abstract Unix sockets there): every connection is TCP."""
    if not sys.platform.startswith("linux") or not hasattr(socket, "AF_UNIX"):
        return ""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def _listen_local(name: str) -> socket.socket | None:
    """A Unix socket listening on ``name`` in the abstract namespace (nothing on disk), or None
    where it cannot be made (the name taken, no permission): then peers connect over TCP."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.bind("\0" + name)
        listener.listen(1024)
    except OSError:
        listener.close()
        return None
    return listener


def _connect_local(name: str, timeout_s: float) -> socket.socket | None:
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    connection.settimeout(timeout_s)
    try:
        connection.connect("\0" + name)
    except OSError:  # another network namespace on the same kernel: not reachable this way
        connection.close()
        return None
    return connection


def _tune(connection: socket.socket) -> None:
    if connection.family in (socket.AF_INET, socket.AF_INET6):
        connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # latency over batching


def receive_exactly(connection: socket.socket, size: int,
                    closed: str = "the connecting rank closed the connection before saying who it is") -> bytes:
    """``size`` bytes from a blocking socket; ``ConnectionError(closed)`` if it closes first."""
    data = bytearray()
    while len(data) < size:
        chunk = connection.recv(size - len(data))
        if not chunk:
            raise ConnectionError(closed)
        data += chunk
    return bytes(data)
