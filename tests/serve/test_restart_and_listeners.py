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
import time

import pytest

from server_process import ServerProcess, free_port

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/net/tcp"), reason="reads Linux's /proc/net/tcp")
LISTEN, TIME_WAIT = "0A", "06"


def _address(hex_address: str) -> str:
    raw = bytes.fromhex(hex_address)
    address = ipaddress.ip_address(b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4)))
    mapped = getattr(address, "ipv4_mapped", None)  # ::ffff:127.0.0.1 is loopback too
    return str(mapped or address)


def sockets(state: str) -> list[tuple[str, int, int]]:
    """(address, port, inode) of every TCP socket in ``state`` (/proc/net/tcp and tcp6)."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as handle:
            for line in handle.read().splitlines()[1:]:
                fields = line.split()
                if fields[3] == state:
                    address, port = fields[1].split(":")
                    found.append((_address(address), int(port, 16), int(fields[9])))
    return found


def session_processes(session: int) -> dict[int, str]:
    """pid -> its command's first word for every process in ``session``."""
    found = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as handle:
                stat = handle.read()
            if int(stat[stat.rindex(")") + 2:].split()[3]) != session:
                continue
            with open(f"/proc/{entry}/cmdline", "rb") as handle:
                found[int(entry)] = handle.read().split(b"\0")[0].decode(errors="replace")
        except (OSError, ValueError, IndexError):  # gone meanwhile
            continue
    return found


def listeners(session: int) -> list[tuple[str, str, int]]:
    """(process, address, port) of every listening socket that a process of ``session`` holds."""
    by_inode = {inode: (address, port) for address, port, inode in sockets(LISTEN)}
    found = []
    for pid, name in session_processes(session).items():
        try:
            links = [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")]
        except OSError:
            continue
        for link in links:
            if link.startswith("socket:[") and int(link[8:-1]) in by_inode:
                found.append((name, *by_inode[int(link[8:-1])]))
    return sorted(set(found))


def test_every_listener_is_on_loopback_and_a_restart_right_after_a_stop_binds(tiny_mixtral_dir, tmp_path):
    config = tmp_path / "cluster.yaml"
    config.write_text(f"model: {tiny_mixtral_dir}\ndevice: cpu\ndtype: float32\nrouters: 1\nexpert_workers: 1\n")
    port = free_port()
    first = ServerProcess(str(config), str(tmp_path / "first.log"), port=port)
    try:
        first.wait_ready()
        found = listeners(first.process.pid)  # start_new_session: the CLI leads the session
        for name, address, listening_port in found:
            print(f"{address:>15} {listening_port:>6}  {name}")
        assert (port in {p for _, _, p in found}) and len(found) > 5, found
        wildcard = [(name, address) for name, address, _ in found if not ipaddress.ip_address(address).is_loopback]
        # Serve's inter-deployment gRPC server, one per replica ("ray::ServeReplica:raymoe:raymoe").
        assert len(wildcard) <= 1 and all(name.startswith("ray::ServeReplica") and address in ("::", "0.0.0.0")
                                          for name, address in wildcard), wildcard
    finally:
        assert first.stop() == 0, first.tail()
    stopped = time.monotonic()
    waiting = [s for s in sockets(TIME_WAIT) if s[1] == port]
    assert waiting, "no connection of the old server in TIME-WAIT on its port: the restart would prove nothing"
    second = ServerProcess(str(config), str(tmp_path / "second.log"), port=port)
    try:
        assert time.monotonic() - stopped < 5
        second.wait_ready()
    finally:
        assert second.stop() == 0, second.tail()
