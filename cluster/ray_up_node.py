"""Stop one `ray up` cluster's Ray on this node, and nothing else.

Ray's own `ray stop` stops every Ray process on the host, whoever started it: other users'
clusters, a test's cluster, a service. The files under cluster/ray-up/ start each node's Ray
with ``RAYMOE_RAY_UP_CLUSTER=<cluster_name>`` in its environment, so the processes that
`ray start` launches (gcs_server, raylet, dashboard, autoscaler monitor, log monitor, client
server) carry that name; the workers and agents the raylet forks are their descendants
(their titles, ``ray::IDLE`` and the like, overwrite the environment block, so they are
found through their parents). This module finds exactly those processes of the calling user
and stops them in Ray's own order: raylet first, then the rest, the GCS last; SIGTERM, then
SIGKILL after a grace period.

    python -m raymoe.cluster.ray_up_node stop CLUSTER_NAME [--grace S]
    python -m raymoe.cluster.ray_up_node list CLUSTER_NAME

Linux only (it reads /proc). The start commands run ``stop`` first (what Ray's examples do
with a host-wide ``ray stop``), and `ray down` runs it in place of ``ray stop`` through
:mod:`raymoe.cluster.ray_up_provider` (cluster/ray-up/local.yaml).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time

from raymoe.cluster import procfs

MARKER = "RAYMOE_RAY_UP_CLUSTER"
FIRST = ("raylet",)  # the raylet goes first, taking its workers and agents with it
LAST = ("gcs_server",)  # the GCS goes last, as in `ray stop`


def _process_table() -> dict[int, tuple[int, int, str, bytes]]:
    """pid -> (parent pid, real uid, comm, environment block) for every visible process."""
    table = {}
    for pid in procfs.pids():
        try:
            parent = int(procfs.stat(pid)[1])
            uid = int(procfs.status(pid)["Uid"].split()[0])
            comm = procfs.read_text(pid, "comm").strip()
        except (OSError, ValueError, IndexError, KeyError):
            continue
        try:
            environ = procfs.read_bytes(pid, "environ")
        except OSError:  # another user's process, or a kernel thread
            environ = b""
        table[pid] = (parent, uid, comm, environ)
    return table


def cluster_processes(cluster_name: str, uid: int | None = None) -> dict[int, str]:
    """pid -> comm of this user's processes of ``cluster_name`` on this node: those whose
    environment carries the marker, and all their descendants."""
    uid = os.getuid() if uid is None else uid
    table = _process_table()
    marker = f"{MARKER}={cluster_name}".encode()
    found = {pid for pid, (_, owner, _, environ) in table.items()
             if owner == uid and pid != os.getpid() and marker in environ.split(b"\0")}
    children: dict[int, list[int]] = {}
    for pid, (parent, owner, _, _) in table.items():
        if owner == uid:
            children.setdefault(parent, []).append(pid)
    stack = list(found)
    while stack:
        for child in children.get(stack.pop(), ()):
            if child not in found and child != os.getpid():
                found.add(child)
                stack.append(child)
    return {pid: table[pid][2] for pid in sorted(found)}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie has exited; its parent (maybe init) has yet to reap it
        return procfs.stat(pid)[0] != "Z"
    except OSError:
        return False


def _signal_and_wait(pids: list[int], grace_s: float) -> list[int]:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.1)
    stubborn = [p for p in pids if _alive(p)]
    for pid in stubborn:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return stubborn


def stop(cluster_name: str, grace_s: float = 10.0, rounds: int = 3) -> int:
    """Stop this user's processes of ``cluster_name`` here. Returns how many were found."""
    seen: set[int] = set()
    for _ in range(rounds):  # a worker forked while the raylet was stopping is found next round
        processes = cluster_processes(cluster_name)
        if not processes:
            break
        seen.update(processes)
        first = [p for p, comm in processes.items() if comm in FIRST]
        last = [p for p, comm in processes.items() if comm in LAST]
        rest = [p for p in processes if p not in first and p not in last]
        killed = []
        for group in (first, rest, last):
            if group:
                killed += _signal_and_wait(group, grace_s / 3)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and any(_alive(p) for p in processes):
            time.sleep(0.1)
        if killed:
            print(f"raymoe: {len(killed)} process(es) of {cluster_name} needed SIGKILL", file=sys.stderr)
    return len(seen)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m raymoe.cluster.ray_up_node", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    stop_parser = sub.add_parser("stop", help="stop this user's processes of one ray-up cluster on this node")
    stop_parser.add_argument("cluster_name")
    stop_parser.add_argument("--grace", type=float, default=10.0, help="seconds before SIGKILL (default 10)")
    list_parser = sub.add_parser("list", help="list them")
    list_parser.add_argument("cluster_name")
    args = parser.parse_args(argv)
    if args.command == "list":
        for pid, comm in cluster_processes(args.cluster_name).items():
            print(pid, comm)
        return 0
    found = stop(args.cluster_name, args.grace)
    left = cluster_processes(args.cluster_name)
    print(f"raymoe: stopped {found - len(left)} process(es) of ray-up cluster {args.cluster_name} on this node"
          + (f"; {len(left)} still running" if left else ""))
    return 1 if left else 0


if __name__ == "__main__":
    sys.exit(main())
