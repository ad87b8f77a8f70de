"""Start `raymoe serve CONFIG` as a subprocess on a free loopback port, and stop it."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ServerProcess:
    def __init__(self, config_path: str | None, log_path: str, port: int | None = None, env: dict | None = None):
        """``config_path=None`` runs `raymoe serve` with no config: the embedded default."""
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(log_path, "w")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "raymoe.cluster.cli", "serve", *([config_path] if config_path else []),
             "--port", str(self.port)],
            stdout=self.log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})},
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
