"""Linux's /proc, read in one place: the process table, a process's memory and sockets, and the
kernel's TCP socket table (proc(5)).

Used by `ray down`'s node stop (ray_up_node.py), the launch check (cluster/ray-up/try-local.py),
the tests (processes of a server's session, its listeners, an actor's peak memory) and the
benchmarks (soak.py's RSS per process, the CPU time per process or thread of cpu_by_process.py,
bench_gc_freeze.py and bench_ingress_loop.py). Readers of
one file that nothing else reads stay beside their one user: the mappings of this process
(engine/host_memory.py), the host's memory (cluster/memory_check.py), the ephemeral port range
(kernels/comm/ports.py), the boot id (kernels/comm/sockets.py).

A process can end between two reads: the readers of one process raise OSError then (or
ValueError / IndexError on a half-gone entry); the readers of many skip it.
"""

from __future__ import annotations

import os
import socket
from typing import NamedTuple

PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")  # /proc's CPU times count these a second
TCP_LISTEN, TCP_TIME_WAIT = "0A", "06"  # socket states in /proc/net/tcp


def read_text(pid: int | str, name: str) -> str:
    """/proc/PID/NAME as text (``pid`` may be "self"; ``name`` e.g. "status", "task/TID/stat")."""
    with open(f"/proc/{pid}/{name}") as handle:
        return handle.read()


def read_bytes(pid: int | str, name: str) -> bytes:
    with open(f"/proc/{pid}/{name}", "rb") as handle:
        return handle.read()


def pids() -> list[int]:
    """Every process visible now."""
    return [int(entry) for entry in os.listdir("/proc") if entry.isdigit()]


def threads(pid: int | str) -> list[str]:
    """The thread ids of ``pid`` (its /proc/PID/task entries)."""
    return os.listdir(f"/proc/{pid}/task")


def exists(pid: int) -> bool:
    """Whether /proc still has an entry for ``pid`` (a zombie has one)."""
    return os.path.exists(f"/proc/{pid}")


def parse_stat(text: str) -> tuple[str, list[str]]:
    """(command name, the fields after it) of a stat line: fields[0] is the state (proc(5)'s field
    3), [1] the parent, [3] the session, [19] the start time in clock ticks after boot."""
    return text[text.find("(") + 1:text.rfind(")")], text[text.rfind(")") + 1:].split()


def stat(pid: int | str, name: str = "stat") -> list[str]:
    """The fields of /proc/PID/stat after the command name (see `parse_stat`)."""
    return parse_stat(read_text(pid, name))[1]


def cpu_seconds(fields: list[str]) -> float:
    """User plus system CPU seconds of a parsed stat line's ``fields`` (a process's or a thread's)."""
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def status(pid: int | str, name: str = "status") -> dict[str, str]:
    """/proc/PID/status as {field: value}, e.g. "Uid" -> "1000\\t1000\\t1000\\t1000"."""
    fields = {}
    for line in read_text(pid, name).splitlines():
        key, _, value = line.partition(":")
        fields[key] = value.strip()
    return fields


def command_line(raw: bytes) -> str:
    """A raw cmdline as one string: every NUL a space (as the tests and checks match on it)."""
    return raw.replace(b"\0", b" ").decode(errors="replace")


def arguments(raw: bytes) -> list[str]:
    """A raw cmdline's non-empty arguments."""
    return [word.decode(errors="replace") for word in raw.split(b"\0") if word]


class Process(NamedTuple):
    parent: int
    session: int
    state: str  # "R", "S", ..., "Z" for a zombie
    start_time: int  # clock ticks after boot: with the pid, names one process (pids are reused)
    cmdline: bytes  # raw, NUL-separated

    @property
    def command(self) -> str:
        return command_line(self.cmdline)

    @property
    def arguments(self) -> list[str]:
        return arguments(self.cmdline)


def processes() -> dict[int, Process]:
    """pid -> `Process` for every process visible now (those that end meanwhile are left out)."""
    table = {}
    for pid in pids():
        try:
            fields = stat(pid)
            table[pid] = Process(int(fields[1]), int(fields[3]), fields[0], int(fields[19]),
                                 read_bytes(pid, "cmdline"))
        except (OSError, ValueError, IndexError):
            continue
    return table


def descendants(roots: set[int], table: dict[int, Process]) -> set[int]:
    """``roots`` and every descendant of theirs in ``table``."""
    found = set(roots)
    while True:
        more = {pid for pid, process in table.items() if process.parent in found} - found
        if not more:
            return found
        found |= more


def memory_kib(pid: int | str = "self", names: tuple[str, ...] = ("VmRSS", "VmHWM")) -> dict[str, int]:
    """Memory fields of /proc/PID/status in KiB: by default the resident size (VmRSS) and its
    peak (VmHWM)."""
    fields = status(pid)
    return {name: int(fields[name].split()[0]) for name in names if name in fields}


def resident_bytes(pid: int | str = "self") -> int:
    """Resident memory in bytes (/proc/PID/statm)."""
    return int(read_text(pid, "statm").split()[1]) * PAGE_SIZE


def reset_peak_resident() -> None:
    """Start this process's peak (VmHWM) again from its current resident memory (clear_refs 5)."""
    with open("/proc/self/clear_refs", "w") as handle:
        handle.write("5")


def socket_inodes(pid: int) -> list[int]:
    """Inodes of the sockets ``pid`` holds open (its descriptors that link to "socket:[N]");
    OSError when its descriptors cannot be listed."""
    inodes = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:  # closed meanwhile
            continue
        if target.startswith("socket:["):
            inodes.append(int(target[8:-1]))
    return inodes


def tcp_sockets(state: str) -> list[tuple[str, int, int]]:
    """(local address, port, inode) of every TCP socket in ``state`` (`TCP_LISTEN`, ...), from
    /proc/net/tcp and tcp6 (a table that cannot be read, e.g. without IPv6, is skipped).
    Addresses as ``inet_ntop`` writes them: "127.0.0.1", "::", "::ffff:127.0.0.1"."""
    found = []
    for table, family in (("/proc/net/tcp", socket.AF_INET), ("/proc/net/tcp6", socket.AF_INET6)):
        try:
            with open(table) as handle:
                lines = handle.read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[3] != state:
                continue
            address, port = fields[1].split(":")
            raw = bytes.fromhex(address)
            words = [raw[i:i + 4][::-1] for i in range(0, len(raw), 4)]  # little-endian 32-bit words
            found.append((socket.inet_ntop(family, b"".join(words)), int(port, 16), int(fields[9])))
    return found
