"""The rendezvous store of the CPU transports (gloo, sockets), and their socket helpers.

Rank 0 serves a c10d ``TCPStore`` on ``host:port``, listening on that address only (c10d's
own listener binds every interface); the other ranks connect to it. Keys live under the
group's name, which carries the group's secret (factory.new_rendezvous).
"""

from __future__ import annotations

import datetime
import os
import socket

import torch.distributed as distributed


def open_store(rank: int, world_size: int, host: str, port: int, timeout_s: float) -> distributed.TCPStore:
    """Rank 0 serves the store on host:port (that address only); the others connect, each
    waiting at most ``timeout_s``."""
    listen_fd = None
    if rank == 0:
        # The store closes the fd it is given when it is destroyed, so Python must not own
        # it too: a second close, later, could close a newer group's socket that reused the
        # number (a gloo abort on a bad fd).
        listen_fd = listen(host, port).detach()
    try:
        return distributed.TCPStore(
            host, port, world_size, rank == 0, timeout=datetime.timedelta(seconds=timeout_s),
            wait_for_workers=False, **({"master_listen_fd": listen_fd} if listen_fd is not None else {}),
        )
    except Exception:
        if listen_fd is not None:
            os.close(listen_fd)  # never handed over: ours to close
        raise


def listen(host: str, port: int) -> socket.socket:
    """A socket listening on host:port only (port 0: an ephemeral one)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listener.bind((host, port))
        listener.listen(1024)
    except OSError:
        listener.close()
        raise
    return listener


def first_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return lines[0] if lines else type(error).__name__
