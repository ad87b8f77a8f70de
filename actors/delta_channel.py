"""The router's token deltas to an ingress replica over a socket of their own, one frame a step.

Why: an item of a Ray streaming generator costs ~1 ms of CPU in each of the two processes on
the 2-vCPU machines of docs/BENCHMARKS.md (a long-polling actor call costs as much), and a
router sends one item a step to every ingress replica with requests on it: at 32 streams that
was ~45 us of the ingress' CPU and ~30 us of the router's for every streamed token. A frame
on a socket costs tens of microseconds. Ray still carries everything else (submit, abort,
scoring, the router's state) and still says when the router's actor died.

Wire: the ingress replica connects to the address :meth:`Router.delta_channel` gives it (the
router's node address, an ephemeral port, a secret that only travels over Ray) and says
hello: the secret (16 bytes), then its subscriber id (a 2-byte length and UTF-8). The router
registers a fresh delta queue for that subscriber and answers with one empty frame: a request
submitted after that answer has its deltas on this connection. Then one frame a step: a
4-byte big-endian length and the pickled list of the step's :class:`TokenDelta` and
:class:`StepFailure` items of that subscriber's requests (all queued steps at once when the
ingress fell behind). A wrong secret, or no hello within ``HELLO_TIMEOUT_S``, closes the
connection unanswered.

When the connection ends (the ingress went away, or the router is stopping), the requests of
that queue are aborted (``detach``); the ingress sees the end as its router lost and moves
them (actors/router_relay.py), as when the Ray stream broke. A router whose host vanished
sends no FIN: TCP keepalive on the ingress' side ends the connection within ~11 s.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import pickle
import queue
import secrets
import socket
import struct
import threading
from dataclasses import dataclass
from typing import Callable

LOG = logging.getLogger("raymoe.router")

SECRET_BYTES = 16
HELLO_TIMEOUT_S = 10.0
IDLE_WAIT_S = 1.0  # a writer re-checks for shutdown this often
LENGTH = struct.Struct(">I")
NAME_LENGTH = struct.Struct(">H")
KEEPALIVE = ((socket.TCP_KEEPIDLE, 5), (socket.TCP_KEEPINTVL, 2), (socket.TCP_KEEPCNT, 3)) if hasattr(
    socket, "TCP_KEEPIDLE") else ()


@dataclass(frozen=True)
class ChannelAddress:
    """Where an ingress replica connects for a router's deltas (from ``Router.delta_channel``)."""

    host: str
    port: int
    secret: bytes


def frame(items: list) -> bytes:
    payload = pickle.dumps(items, protocol=pickle.HIGHEST_PROTOCOL)
    return LENGTH.pack(len(payload)) + payload


class DeltaChannelServer:
    """A router's listener: one writer thread per connected ingress replica.

    ``attach(subscriber)`` registers and returns a fresh delta queue for that subscriber (the
    router's per-step batches of its requests land there); ``detach(subscriber, queue)`` runs
    when that connection ends; ``stopped()`` says the router is shutting down."""

    def __init__(self, host: str, attach: Callable[[str], queue.Queue],
                 detach: Callable[[str, queue.Queue], None], stopped: Callable[[], bool]):
        self.secret = secrets.token_bytes(SECRET_BYTES)
        self.attach, self.detach, self.stopped = attach, detach, stopped
        self.listener = socket.create_server((host, 0), family=socket.AF_INET6 if ":" in host else socket.AF_INET)
        self.address = ChannelAddress(host, self.listener.getsockname()[1], self.secret)
        self.connections = 0  # open now (Router.info)
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, name="delta-channel-accept", daemon=True).start()

    def close(self) -> None:
        try:
            self.listener.close()
        except OSError:
            pass

    def _accept(self) -> None:
        while True:
            try:
                connection, _ = self.listener.accept()
            except OSError:  # closed: the router is stopping
                return
            threading.Thread(target=self._serve, args=(connection,), name="delta-channel", daemon=True).start()

    def _serve(self, connection: socket.socket) -> None:
        with connection:
            try:
                connection.settimeout(HELLO_TIMEOUT_S)
                given = _receive_exactly(connection, SECRET_BYTES)
                if not hmac.compare_digest(given, self.secret):
                    LOG.warning("delta channel: a connection from %s gave a wrong secret; closed",
                                _peer(connection))
                    return
                (size,) = NAME_LENGTH.unpack(_receive_exactly(connection, NAME_LENGTH.size))
                subscriber = _receive_exactly(connection, size).decode()
                connection.settimeout(None)
                connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except (OSError, ConnectionError, UnicodeDecodeError) as error:
                LOG.info("delta channel: no valid hello from %s (%s); closed", _peer(connection), error)
                return
            target = self.attach(subscriber)
            with self._lock:
                self.connections += 1
            try:
                connection.sendall(frame([]))  # registered: the subscriber may submit now
                self._write(connection, target)
            except OSError as error:
                LOG.info("delta channel to %s (%s) ended: %s", subscriber, _peer(connection), error)
            finally:
                with self._lock:
                    self.connections -= 1
                self.detach(subscriber, target)

    def _write(self, connection: socket.socket, target: queue.Queue) -> None:
        while not self.stopped():
            try:
                batch = target.get(timeout=IDLE_WAIT_S)
            except queue.Empty:
                continue
            while True:  # every step queued meanwhile in one frame
                try:
                    batch += target.get_nowait()
                except queue.Empty:
                    break
            connection.sendall(frame(batch))


class DeltaChannel:
    """The ingress' end of one router's channel (asyncio)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.reader, self.writer = reader, writer

    @classmethod
    async def connect(cls, address: ChannelAddress, subscriber: str, timeout_s: float = HELLO_TIMEOUT_S) -> DeltaChannel:
        """Connected and registered: a request submitted after this returns has its deltas here."""
        reader, writer = await asyncio.wait_for(asyncio.open_connection(address.host, address.port), timeout_s)
        channel = cls(reader, writer)
        try:
            sock = writer.get_extra_info("socket")
            if sock is not None:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
                for option, value in KEEPALIVE:
                    sock.setsockopt(socket.IPPROTO_TCP, option, value)
            name = subscriber.encode()
            writer.write(address.secret + NAME_LENGTH.pack(len(name)) + name)
            await asyncio.wait_for(channel.read(), timeout_s)  # the router's answer: registered
        except BaseException:
            channel.close()
            raise
        return channel

    async def read(self) -> list:
        """The next frame's items; ``asyncio.IncompleteReadError`` when the router closed it."""
        (size,) = LENGTH.unpack(await self.reader.readexactly(LENGTH.size))
        return pickle.loads(await self.reader.readexactly(size))

    def close(self) -> None:
        self.writer.close()


def _receive_exactly(connection: socket.socket, size: int) -> bytes:
    data = bytearray()
    while len(data) < size:
        chunk = connection.recv(size - len(data))
        if not chunk:
            raise ConnectionError("closed before the hello ended")
        data += chunk
    return bytes(data)


def _peer(connection: socket.socket) -> str:
    try:
        return "%s:%s" % connection.getpeername()[:2]
    except OSError:
        return "a peer that left"
