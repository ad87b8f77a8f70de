"""Start `raymoe serve CONFIG` as a subprocess on a free loopback port, and stop it."""

from __future__ import annotations

import ipaddress
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.request


def free_port() -> int:
    """A loopback port free a moment ago, below the kernel's ephemeral range. A port the kernel
    picks (bind to 0) comes from that range, and the kernel may hand it to the next socket
    that binds to 0, e.g. one of Ray's or gloo's while the server starts: the server's own
    bind then fails (seen once: "Failed to bind to address '127.0.0.1:44217'")."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as handle:
            ephemeral_low = int(handle.read().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral_low = 32768
    chooser = random.Random()
    for _ in range(200):
        port = chooser.randrange(20000, max(20001, min(ephemeral_low, 32768)))
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as sock:  # nothing free below the range: take the kernel's pick
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def merged_env(env: dict | None) -> dict:
    """This process's environment with ``env`` on top; a value of None removes the variable."""
    merged = {**os.environ, **(env or {})}
    return {key: value for key, value in merged.items() if value is not None}


class ServerProcess:
    def __init__(self, config_path: str | None, log_path: str, port: int | None = None, env: dict | None = None):
        """``config_path=None`` runs `raymoe serve` with no config: the embedded default."""
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(log_path, "w")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "raymoe.cluster.cli", "serve", *([config_path] if config_path else []),
             "--port", str(self.port)],
            stdout=self.log, stderr=subprocess.STDOUT, env=merged_env(env),
            start_new_session=True,
        )
        self.log_path = log_path

    def wait_ready(self, timeout_s: float = 300) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"raymoe serve exited with {self.process.returncode}:\n{self.tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=5) as response:
                    if response.status == 200 and "raymoe serve: ready at" in self.tail(10**6):
                        return
            except OSError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"raymoe serve did not become healthy in {timeout_s} s:\n{self.tail()}")

    def ray_address(self) -> str:
        """HOST:PORT of the Ray this server started: its GCS's session is named after the
        server's pid (on a shared machine, "the latest cluster" may be someone else's)."""
        suffix = f"_{self.process.pid}"
        for entry in os.listdir("/proc"):
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as handle:
                    args = [a.decode(errors="replace") for a in handle.read().split(b"\0") if a]
            except OSError:  # not a process, or gone
                continue
            if not args or not args[0].endswith("gcs_server"):
                continue
            options = dict(a[2:].split("=", 1) for a in args[1:] if a.startswith("--") and "=" in a)
            if options.get("session-name", "").endswith(suffix):
                port = options.get("gcs_server_port", "0")
                if port == "0":  # chosen at start-up: Ray writes it into the session folder
                    folder = options["session-dir"]
                    name = next(n for n in os.listdir(folder) if n.startswith("gcs_server_port_"))
                    with open(os.path.join(folder, name)) as handle:
                        port = handle.read().strip()
                return f"{options['node-ip-address']}:{port}"
        raise RuntimeError(f"no Ray GCS started by the server (pid {self.process.pid})")

    def actor_pids(self, class_name: str) -> list[int]:
        """Pids of this server's Ray actors of ``class_name``: children of the raylet that the
        server started (Ray titles an actor's process ``ray::ClassName``)."""
        def parent(pid: str) -> int:
            with open(f"/proc/{pid}/stat") as handle:
                return int(handle.read().rsplit(")", 1)[1].split()[1])

        def command(pid: str) -> str:
            with open(f"/proc/{pid}/cmdline", "rb") as handle:
                return handle.read().replace(b"\0", b" ").decode(errors="replace")

        processes = {}
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    processes[int(entry)] = (parent(entry), command(entry))
                except (OSError, IndexError, ValueError):  # gone meanwhile
                    continue
        raylets = {pid for pid, (ppid, cmd) in processes.items() if ppid == self.process.pid and "raylet" in cmd}
        return sorted(pid for pid, (ppid, cmd) in processes.items()
                      if ppid in raylets and cmd.startswith(f"ray::{class_name}"))

    def tail(self, chars: int = 4000) -> str:
        if not self.log.closed:
            self.log.flush()
        with open(self.log_path) as handle:
            return handle.read()[-chars:]

    def stop(self, timeout_s: float = 60) -> int:
        """SIGINT, as a user's Ctrl-C; then SIGKILL to our own process group if it hangs."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(10)
        self.log.close()
        return self.process.returncode


def served(folder, model_dir: str, settings: str, env: dict | None = None):
    """Fixture body: write a cluster YAML (``model``, CPU, float32, plus ``settings``), serve
    it for the fixture's lifetime, and check that SIGINT ends the server cleanly."""
    config = folder / "cluster.yaml"
    config.write_text(f"model: {model_dir}\ndevice: cpu\ndtype: float32\n{settings}")
    process = ServerProcess(str(config), str(folder / "serve.log"), env=env)
    try:
        process.wait_ready()
        yield process
    finally:
        code = process.stop()
        assert code == 0, process.tail()


TCP_LISTEN, TCP_TIME_WAIT = "0A", "06"  # states in Linux's /proc/net/tcp


def tcp_sockets(state: str) -> list[tuple[str, int, int]]:
    """(local address, port, inode) of every TCP socket in ``state`` (Linux /proc/net/tcp, tcp6)."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as handle:
            for line in handle.read().splitlines()[1:]:
                fields = line.split()
                if fields[3] == state:
                    address, port = fields[1].split(":")
                    raw = bytes.fromhex(address)
                    words = [raw[i:i + 4][::-1] for i in range(0, len(raw), 4)]  # little-endian words
                    found.append((str(ipaddress.ip_address(b"".join(words))), int(port, 16), int(fields[9])))
    return found
