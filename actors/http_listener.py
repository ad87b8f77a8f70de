"""The direct-ingress listener binds with SO_REUSEADDR, so a restart right after a stop works.

In Ray 2.60 a Serve replica serving HTTP itself (direct ingress, ``serve.ingress: direct``)
binds its port with a bare ``socket.socket`` (``ray/serve/_private/http_util.py``,
``start_asgi_http_server`` with ``enable_so_reuseport=False``). Every connection the server
closes first (``Connection: close`` clients, keep-alive timeouts, the shutdown) then sits
in TIME-WAIT for 60 s on that port, and Linux refuses any new bind of the port while one
does unless both the old and the new socket set SO_REUSEADDR: a `raymoe serve` started
within a minute of a stop failed with "Address already in use". uvicorn, nginx and Serve's
own proxy set SO_REUSEADDR on their listeners; on Linux it never lets two processes listen on
one port at once (that is SO_REUSEPORT, which stays off), it only lets TIME-WAIT pass.

:func:`reuse_address_for_direct_ingress` gives that module a ``socket`` namespace whose
stream sockets set SO_REUSEADDR when made; the replica process calls it at import of the
ingress, before Serve binds. Where Ray's module no longer looks as expected it does nothing
and says so once in the log.
"""

from __future__ import annotations

import logging
import socket
import types

LOG = logging.getLogger("raymoe.ingress")


class ReusableSocket(socket.socket):
    """A socket that sets SO_REUSEADDR when it is a stream socket (before any bind)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.type == socket.SOCK_STREAM:
            self.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)


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
