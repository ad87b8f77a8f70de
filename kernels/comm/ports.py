"""A free TCP port: the one place that picks one.

Production code (the rendezvous store's port, kernels/comm/factory.py; Serve's proxy and gRPC
ports, cluster/serve_cli.py), `raymoe bench --compare`, the launch check, the tests and the
benchmarks all call `free_port`. A port is only free the moment it is probed: whoever binds it
next may lose a race, as with any such helper.
"""

from __future__ import annotations

import random
import socket

EPHEMERAL_LOW_DEFAULT = 32768  # Linux's default start of the ephemeral range
BELOW_EPHEMERAL_FROM = 20000  # where the ports below the ephemeral range are drawn from


def free_port(host: str = "127.0.0.1", *, below_ephemeral: bool = False) -> int:
    """A TCP port that was free on ``host`` (this machine) a moment ago.

    By default the kernel picks it (bind to port 0), so it comes from the kernel's ephemeral
    range. With ``below_ephemeral``, a random free port below that range (20000 up to its start,
    read from /proc/sys/net/ipv4/ip_local_port_range, 32768 where unreadable): the kernel may hand
    a port from its range to the next socket that binds to 0, e.g. one of Ray's or gloo's while a
    server starts, and the server's own bind then fails (seen once: "Failed to bind to address
    '127.0.0.1:44217'"). Falls back to the kernel's pick when nothing below the range is free.
    """
    if below_ephemeral:
        try:
            with open("/proc/sys/net/ipv4/ip_local_port_range") as handle:
                ephemeral_low = int(handle.read().split()[0])
        except (OSError, ValueError, IndexError):
            ephemeral_low = EPHEMERAL_LOW_DEFAULT
        chooser = random.Random()
        for _ in range(200):
            port = chooser.randrange(BELOW_EPHEMERAL_FROM,
                                     max(BELOW_EPHEMERAL_FROM + 1, min(ephemeral_low, EPHEMERAL_LOW_DEFAULT)))
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
                try:
                    probe.bind((host, port))
                except OSError:
                    continue
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]
