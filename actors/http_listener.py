"""What raymoe changes in the HTTP listener a Serve replica runs itself (direct ingress).

Two things Ray 2.60 leaves out, both applied in the replica process before Serve starts its
server (:func:`harden_direct_ingress`, called by the ingress' constructor):

**SO_REUSEADDR**, so a restart right after a stop works. A direct-ingress replica binds its
port with a bare ``socket.socket`` (``ray/serve/_private/http_util.py``,
``start_asgi_http_server`` with ``enable_so_reuseport=False``). Every connection the server
closes first (``Connection: close`` clients, keep-alive timeouts, the shutdown) then sits
in TIME-WAIT for 60 s on that port, and Linux refuses any new bind of the port while one
does unless both the old and the new socket set SO_REUSEADDR: a `raymoe serve` started
within a minute of a stop failed with "Address already in use". uvicorn, nginx and Serve's
own proxy set it on their listeners; on Linux it never lets two processes listen on one port
at once (that is SO_REUSEPORT, which stays off), it only lets TIME-WAIT pass.

**A header deadline** (``serve.header_timeout_s``). uvicorn reads a request's headers for as
long as the client takes (1 byte a second held a connection forever). Each connection of
uvicorn's httptools protocol (the one Serve's uvicorn picks here) gets a timer when it opens
and when a new request on it begins; the headers' end stops it; past it the client gets a
408 and the connection is closed. The body's deadline is the front door's
(actors/front_door.py).

Where Ray's or uvicorn's modules no longer look as expected, each part does nothing and says
so once in the log.
"""

from __future__ import annotations

import json
import logging
import socket
import types

from raymoe.engine.api.openai_protocol import RequestError

LOG = logging.getLogger("raymoe.ingress")


class ReusableSocket(socket.socket):
    """A socket that sets SO_REUSEADDR when it is a stream socket (before any bind)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.type == socket.SOCK_STREAM:
            self.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)


def harden_direct_ingress(header_timeout_s: float) -> None:
    """Both changes, in this process (idempotent; the timeout is this process's latest)."""
    reuse_address_for_direct_ingress()
    header_deadline(header_timeout_s)


def reuse_address_for_direct_ingress() -> bool:
    """Make Serve's direct-ingress listener reuse addresses; True when applied (idempotent)."""
    try:
        from ray.serve._private import http_util
    except ImportError as error:
        LOG.info("direct ingress keeps Ray's socket options (%s)", error)
        return False
    current = getattr(http_util, "socket", None)
    if isinstance(current, types.SimpleNamespace) and current.socket is ReusableSocket:
        return True
    if current is not socket or not hasattr(http_util, "start_asgi_http_server"):
        LOG.info("direct ingress keeps Ray's socket options: ray.serve._private.http_util changed")
        return False
    http_util.socket = types.SimpleNamespace(**{**vars(socket), "socket": ReusableSocket})
    return True


_TIMEOUT_BODY = json.dumps(RequestError("request headers not received within serve.header_timeout_s", status=408,
                                        code="request_timeout").body()).encode()
_TIMEOUT_RESPONSE = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
                     b"content-length: " + str(len(_TIMEOUT_BODY)).encode() + b"\r\n\r\n" + _TIMEOUT_BODY)


class _HeaderDeadline:
    timeout_s = 10.0
    patched = False


def header_deadline(timeout_s: float) -> bool:
    """Give uvicorn's httptools connections a deadline for each request's headers; True when applied."""
    _HeaderDeadline.timeout_s = timeout_s
    if _HeaderDeadline.patched:
        return True
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    except ImportError as error:
        LOG.info("no header deadline: uvicorn's httptools protocol is not available (%s)", error)
        return False
    needed = ("connection_made", "connection_lost", "on_message_begin", "on_headers_complete")
    if not all(callable(getattr(HttpToolsProtocol, name, None)) for name in needed):
        LOG.info("no header deadline: uvicorn's HttpToolsProtocol changed")
        return False
    made, lost = HttpToolsProtocol.connection_made, HttpToolsProtocol.connection_lost
    begin, complete = HttpToolsProtocol.on_message_begin, HttpToolsProtocol.on_headers_complete

    def arm(self) -> None:
        disarm(self)
        self._raymoe_header_timer = self.loop.call_later(_HeaderDeadline.timeout_s, expire, self)

    def disarm(self) -> None:
        timer = getattr(self, "_raymoe_header_timer", None)
        if timer is not None:
            timer.cancel()
            self._raymoe_header_timer = None

    def expire(self) -> None:
        self._raymoe_header_timer = None
        transport = getattr(self, "transport", None)
        if transport is not None and not transport.is_closing():
            client = getattr(self, "client", None)
            LOG.info("closed a connection from %s: its request headers took over %g s (serve.header_timeout_s)",
                     f"{client[0]}:{client[1]}" if client else "unknown", _HeaderDeadline.timeout_s)
            transport.write(_TIMEOUT_RESPONSE)
            transport.close()

    def connection_made(self, transport) -> None:
        made(self, transport)
        arm(self)

    def connection_lost(self, exc) -> None:
        disarm(self)
        lost(self, exc)

    def on_message_begin(self) -> None:
        begin(self)
        if getattr(self, "_raymoe_header_timer", None) is None:
            arm(self)

    def on_headers_complete(self) -> None:
        disarm(self)
        complete(self)

    HttpToolsProtocol.connection_made = connection_made
    HttpToolsProtocol.connection_lost = connection_lost
    HttpToolsProtocol.on_message_begin = on_message_begin
    HttpToolsProtocol.on_headers_complete = on_headers_complete
    _HeaderDeadline.patched = True
    return True
