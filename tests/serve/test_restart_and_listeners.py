"""Where a local `raymoe serve` listens, and a restart on the same port right after a stop.

Every listening socket of the server's processes (the CLI, Ray's daemons, every actor) is
listed by address; in local mode all are on loopback but one per Serve replica: Ray 2.60's
inter-deployment gRPC server, which Serve binds to ``[::]:0`` in code with no setting
(docs/DEPLOY.md, the security model, says to firewall it). Then the server stops and a new
one binds the same port within seconds, though the old one left connections in TIME-WAIT
there (actors/http_listener.py).
"""

from __future__ import annotations

import ipaddress
import os
import socket
import time

import pytest

from raymoe.cluster import procfs
from raymoe.cluster.procfs import TCP_LISTEN, TCP_TIME_WAIT, tcp_sockets
from raymoe.kernels.comm.ports import free_port
from server_process import ServerProcess

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/net/tcp"), reason="reads Linux's /proc/net/tcp")


def is_loopback(address: str) -> bool:
    parsed = ipaddress.ip_address(address)
    return (getattr(parsed, "ipv4_mapped", None) or parsed).is_loopback  # ::ffff:127.0.0.1 too


def session_processes(session: int) -> dict[int, str]:
    """pid -> its command's first word for every process in ``session``."""
    return {pid: process.cmdline.split(b"\0")[0].decode(errors="replace")
            for pid, process in procfs.processes().items() if process.session == session}


def listeners(session: int) -> list[tuple[str, str, int]]:
    """(process, address, port) of every listening socket that a process of ``session`` holds."""
    by_inode = {inode: (address, port) for address, port, inode in tcp_sockets(TCP_LISTEN)}
    found = []
    for pid, name in session_processes(session).items():
        try:
            inodes = procfs.socket_inodes(pid)
        except OSError:  # gone meanwhile
            continue
        for inode in inodes:
            if inode in by_inode:
                found.append((name, *by_inode[inode]))
    return sorted(set(found))


def test_every_listener_is_on_loopback_and_a_restart_right_after_a_stop_binds(tiny_mixtral_dir, tmp_path):
    config = tmp_path / "cluster.yaml"
    config.write_text(f"model: {tiny_mixtral_dir}\ndevice: cpu\ndtype: float32\nrouters: 1\nexpert_workers: 1\n")
    port = free_port(below_ephemeral=True)
    first = ServerProcess(str(config), str(tmp_path / "first.log"), port=port)
    try:
        first.wait_ready()
        found = listeners(first.process.pid)  # start_new_session: the CLI leads the session
        for name, address, listening_port in found:
            print(f"{address:>15} {listening_port:>6}  {name}")
        assert (port in {p for _, _, p in found}) and len(found) > 5, found
        wildcard = [(name, address) for name, address, _ in found if not is_loopback(address)]
        # Serve's inter-deployment gRPC server, one per replica ("ray::ServeReplica:raymoe:raymoe").
        assert len(wildcard) <= 1 and all(name.startswith("ray::ServeReplica") and address in ("::", "0.0.0.0")
                                          for name, address in wildcard), wildcard
        # A keep-alive connection left open through the stop: the server's side closes first,
        # so its end waits in TIME-WAIT on the port (the clients of wait_ready close first,
        # which leaves theirs on their own ports: whether any was on the server's was chance).
        held = socket.create_connection(("127.0.0.1", port), timeout=30)
        held.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        assert held.recv(65536).startswith(b"HTTP/1.1")
    finally:
        assert first.stop() == 0, first.tail()
    stopped = time.monotonic()
    held.close()  # (the server closed first: this completes its close)
    deadline = time.monotonic() + 2
    while not (waiting := [s for s in tcp_sockets(TCP_TIME_WAIT) if s[1] == port]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert waiting, "no connection of the old server in TIME-WAIT on its port: the restart would prove nothing"
    second = ServerProcess(str(config), str(tmp_path / "second.log"), port=port)
    try:
        assert time.monotonic() - stopped < 5
        second.wait_ready()
    finally:
        assert second.stop() == 0, second.tail()
