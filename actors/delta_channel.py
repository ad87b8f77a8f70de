"""An ingress replica's requests to a router and their token deltas back, over a socket of their own.

Why: a Ray actor call, or an item of a Ray streaming generator, costs ~1 ms of CPU in each of
the two processes on the 2-vCPU machines of docs/BENCHMARKS.md. A router sent one item a step
to every ingress replica with requests on it, and each request was one ``submit`` call: at 32
streams of 64 tokens that was tens of microseconds of CPU for every streamed token, in both
processes. A frame on a socket costs a few. Ray still carries the address and the secret,
scoring, the router's state and the admin calls.

Wire: the ingress replica connects to the address :meth:`Router.delta_channel` gives it (the
router's node address, an ephemeral port, a secret that only travels over Ray) and says
hello: the secret (16 bytes), then its subscriber id (a 2-byte length and UTF-8). The router
registers a fresh delta queue for that subscriber and answers with one empty frame. Every frame
is a 4-byte big-endian length and a pickle. The ingress sends ``(SUBMIT, request id, prompt ids,
sampling params, resumed tokens or None)`` and ``(ABORT, request id)``; the router answers one
frame a step: the list of the step's :class:`TokenDelta` and :class:`StepFailure` items of this
connection's requests (all queued steps at once when the ingress fell behind). A request the
router refuses (``validate_prompt``) comes back as a ``StepFailure`` of status 400. A request
with a grammar to compile is submitted on a thread of its own, so that it holds up no other
(an abort that comes first cancels it). A wrong secret, or no hello within
``HELLO_TIMEOUT_S``, closes the connection unanswered; nothing is unpickled before the secret
matched.

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
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable

from raymoe.kernels.comm.sockets import receive_exactly

LOG = logging.getLogger("raymoe.router")

SECRET_BYTES = 16
HELLO_TIMEOUT_S = 10.0
IDLE_WAIT_S = 1.0  # a writer re-checks for shutdown this often
LENGTH = struct.Struct(">I")
NAME_LENGTH = struct.Struct(">H")
SUBMIT, ABORT = "submit", "abort"
CLOSED_IN_HELLO, CLOSED = "closed before the hello ended", "the ingress closed the delta channel"
SLOW_SUBMIT_THREADS = 4  # submits with a grammar to compile, at once, per router
KEEPALIVE = ((socket.TCP_KEEPIDLE, 5), (socket.TCP_KEEPINTVL, 2), (socket.TCP_KEEPCNT, 3)) if hasattr(
    socket, "TCP_KEEPIDLE") else ()


@dataclass(frozen=True)
class ChannelAddress:
    """Where an ingress replica connects for a router's deltas (from ``Router.delta_channel``)."""

    host: str
    port: int
    secret: bytes


def frame(message: Any) -> bytes:
    payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return LENGTH.pack(len(payload)) + payload


class DeltaChannelServer:
    """A router's listener: a reader and a writer thread per connected ingress replica.

    ``attach(subscriber)`` registers and returns a fresh delta queue for that subscriber (the
    router's per-step batches of its requests land there); ``detach(subscriber, queue)`` runs
    when that connection ends; ``submit(request_id, prompt_ids, params, resume_ids, queue)``
    adds a request whose deltas go to that queue (a refusal is put there as a StepFailure);
    ``abort(request_id)`` stops one; ``stopped()`` says the router is shutting down.
    ``slow(params)``: whether submitting takes long (a grammar to compile); such a request is
    ``prepare``d (compiled) on a pool thread first, then submitted unless an abort came meanwhile."""

    def __init__(self, host: str, attach: Callable[[str], queue.Queue],
                 detach: Callable[[str, queue.Queue], None], stopped: Callable[[], bool],
                 submit: Callable[[str, list[int], Any, list[int] | None, queue.Queue], None],
                 abort: Callable[[str], None], slow: Callable[[Any], bool] = lambda params: False,
                 prepare: Callable[[Any], None] = lambda params: None):
        self.secret = secrets.token_bytes(SECRET_BYTES)
        self.attach, self.detach, self.stopped = attach, detach, stopped
        self.submit, self.abort, self.slow, self.prepare = submit, abort, slow, prepare
        self.listener = socket.create_server((host, 0), family=socket.AF_INET6 if ":" in host else socket.AF_INET)
        self.address = ChannelAddress(host, self.listener.getsockname()[1], self.secret)
        self.connections = 0  # open now (Router.info)
        self._lock = threading.Lock()
        self._slow_pool = ThreadPoolExecutor(SLOW_SUBMIT_THREADS, thread_name_prefix="delta-channel-submit")
        threading.Thread(target=self._accept, name="delta-channel-accept", daemon=True).start()

    def close(self) -> None:
        try:
            self.listener.close()
        except OSError:
            pass
        self._slow_pool.shutdown(wait=False, cancel_futures=True)

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
                given = receive_exactly(connection, SECRET_BYTES, CLOSED_IN_HELLO)
                if not hmac.compare_digest(given, self.secret):
                    LOG.warning("delta channel: a connection from %s gave a wrong secret; closed",
                                _peer(connection))
                    return
                (size,) = NAME_LENGTH.unpack(receive_exactly(connection, NAME_LENGTH.size, CLOSED_IN_HELLO))
                subscriber = receive_exactly(connection, size, CLOSED_IN_HELLO).decode()
                connection.settimeout(None)
                connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except (OSError, UnicodeDecodeError) as error:  # (ConnectionError is an OSError)
                LOG.info("delta channel: no valid hello from %s (%s); closed", _peer(connection), error)
                return
            target = self.attach(subscriber)
            ended = threading.Event()
            with self._lock:
                self.connections += 1
            try:
                connection.sendall(frame([]))  # registered: the subscriber may submit now
                threading.Thread(target=self._read, args=(connection, target, ended), name="delta-channel-read",
                                 daemon=True).start()
                self._write(connection, target, ended)
            except OSError as error:
                LOG.info("delta channel to %s (%s) ended: %s", subscriber, _peer(connection), error)
            finally:
                ended.set()
                try:
                    connection.shutdown(socket.SHUT_RDWR)  # wakes the reader's recv
                except OSError:
                    pass
                with self._lock:
                    self.connections -= 1
                self.detach(subscriber, target)

    def _write(self, connection: socket.socket, target: queue.Queue, ended: threading.Event) -> None:
        while not self.stopped() and not ended.is_set():
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

    def _read(self, connection: socket.socket, target: queue.Queue, ended: threading.Event) -> None:
        """The ingress' submits and aborts, in order, until it closes the connection."""
        slow: dict[str, bool] = {}  # request id -> cancelled, for submits still on the slow pool
        lock = threading.Lock()

        def submit_later(request_id: str, message: tuple) -> None:
            try:
                self.prepare(message[3])
            except Exception:  # noqa: BLE001 (submit meets it again and sends the refusal)
                pass
            with lock:
                cancelled = slow.pop(request_id, False)
            if not cancelled:
                self.submit(*message[1:], target)

        try:
            while not ended.is_set():
                (size,) = LENGTH.unpack(receive_exactly(connection, LENGTH.size, CLOSED))
                message = pickle.loads(receive_exactly(connection, size, CLOSED))
                if message[0] == SUBMIT:
                    if self.slow(message[3]):
                        with lock:
                            slow[message[1]] = False
                        self._slow_pool.submit(submit_later, message[1], message)
                    else:
                        self.submit(*message[1:], target)
                elif message[0] == ABORT:
                    with lock:
                        if message[1] in slow:
                            slow[message[1]] = True
                    self.abort(message[1])
        except (OSError, RuntimeError):  # closed (RuntimeError: the pool, at shutdown)
            pass
        except Exception:  # a frame it cannot read: a bug on one side; the connection ends, its requests move
            LOG.exception("delta channel: a frame from the ingress could not be read; closing")
        finally:
            ended.set()
            try:
                connection.shutdown(socket.SHUT_RDWR)  # the writer's next send fails at once
            except OSError:
                pass


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

    def submit(self, request_id: str, prompt_ids: list[int], params: Any, resume_ids: list[int] | None) -> None:
        self.writer.write(frame((SUBMIT, request_id, prompt_ids, params, resume_ids)))

    def abort(self, request_id: str) -> None:
        self.writer.write(frame((ABORT, request_id)))

    async def read(self) -> list:
        """The next frame's items; ``asyncio.IncompleteReadError`` when the router closed it."""
        (size,) = LENGTH.unpack(await self.reader.readexactly(LENGTH.size))
        return pickle.loads(await self.reader.readexactly(size))

    def close(self) -> None:
        self.writer.close()


def _peer(connection: socket.socket) -> str:
    try:
        return "%s:%s" % connection.getpeername()[:2]
    except OSError:
        return "a peer that left"
