"""A link delay in user space, for kernels without sch_netem (`tc qdisc ... netem` answers
"Specified qdisc kind is unknown" on this machine's kernel): forwards every Ethernet frame
between two interfaces, each direction held ``delay_ms`` first, in order.

    python delay_relay.py IFACE_A IFACE_B DELAY_MS

Run inside the namespace that holds both interfaces (netns_cluster.py puts a member's bridge
port on one side and a veth into the bridge on the other). Frames are read and written with
their virtio-net header (PACKET_VNET_HDR), so TCP's large offloaded segments pass unchanged.
Ends on SIGTERM/SIGKILL; it holds no state worth keeping.
"""

from __future__ import annotations

import heapq
import itertools
import select
import socket
import sys
import time

ETH_P_ALL = 0x0003
SOL_PACKET = 263
PACKET_VNET_HDR = 15
PACKET_OUTGOING = 4


def open_raw(interface: str) -> socket.socket:
    raw = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
    raw.setsockopt(SOL_PACKET, PACKET_VNET_HDR, 1)
    raw.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
    raw.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 8 << 20)
    raw.bind((interface, ETH_P_ALL))
    raw.setblocking(False)
    return raw


def main(a: str, b: str, delay_ms: float) -> None:
    delay = delay_ms / 1000.0
    sockets = {a: open_raw(a), b: open_raw(b)}
    other = {sockets[a].fileno(): sockets[b], sockets[b].fileno(): sockets[a]}
    by_fd = {s.fileno(): s for s in sockets.values()}
    poller = select.poll()
    for fd in by_fd:
        poller.register(fd, select.POLLIN)
    due: list[tuple[float, int, socket.socket, bytes]] = []
    order = itertools.count()
    print("relay ready", flush=True)
    while True:
        now = time.monotonic()
        while due and due[0][0] <= now:
            _, _, out, frame = heapq.heappop(due)
            try:
                out.send(frame)
            except OSError:
                pass  # a frame the other side cannot take (link down): lost, as on a wire
        timeout_ms = max(0.0, (due[0][0] - time.monotonic()) * 1000) if due else 1000
        for fd, _ in poller.poll(timeout_ms):
            source = by_fd[fd]
            for _ in range(256):
                try:
                    frame, address = source.recvfrom(1 << 17)
                except BlockingIOError:
                    break
                if address[2] == PACKET_OUTGOING:  # our own sends, seen on the way out
                    continue
                heapq.heappush(due, (time.monotonic() + delay, next(order), other[fd], frame))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], float(sys.argv[3]))
