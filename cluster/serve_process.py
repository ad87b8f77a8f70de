"""A server as a child process: started in a session of its own, ready once it answers, stopped
as a user's Ctrl-C stops it. The one launcher of `raymoe serve` for `raymoe bench --compare`
(bench_cli.py), the launch check (cluster/ray-up/try-local.py), the benchmarks (soak.py,
bench_e2e_concurrency.py, bench_vs_vllm.py, which starts `vllm serve` with it too) and the
tests (tests/serve/server_process.py adds the tests' probes).

    with ServeProcess.raymoe("cluster.yaml", host="127.0.0.1") as server:   # a free loopback port
        urllib.request.urlopen(f"{server.url}/v1/models")

The child leads its own session (``start_new_session``), so its process group holds what it
starts (Ray's daemons and actors) and nothing of the caller's; a terminal's Ctrl-C does not
reach it. Its output goes to ``log_path`` (appended) or, without one, to our stderr. Every wait
is bounded.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from typing import Any, Callable

from raymoe.kernels.comm.ports import free_port

READY_LINE = "raymoe serve: ready at"  # what `raymoe serve` prints once it serves (serve_cli.py)


class ServerNotReady(RuntimeError, TimeoutError):
    """The server did not become ready within its time (a RuntimeError and a TimeoutError)."""


def serve_argv(config: str | None, port: int, host: str | None = None, python: str = sys.executable) -> list[str]:
    """``python -m raymoe.cluster.cli serve [CONFIG] [--host HOST] --port PORT``; no config: the
    embedded default (the demo checkpoint)."""
    return [python, "-m", "raymoe.cluster.cli", "serve", *([config] if config else []),
            *(["--host", host] if host else []), "--port", str(port)]


def health(url: str) -> bool:
    """True when ``url``/health answers 200 (raises OSError while nothing answers)."""
    with urllib.request.urlopen(f"{url}/health", timeout=5) as response:
        return response.status == 200


class ServeProcess:
    """One server process on 127.0.0.1:``port``: ``start``, ``wait_ready``, ``stop`` (or a
    ``with`` block: started and ready inside, stopped on leaving). ``env`` is the child's whole
    environment (None: ours)."""

    def __init__(self, argv: list[str], port: int, *, log_path: str | None = None, env: dict | None = None,
                 cwd: str | None = None, name: str = "raymoe serve", ready_timeout_s: float = 300):
        self.argv, self.port, self.log_path, self.env, self.cwd = argv, port, log_path, env, cwd
        self.name, self.ready_timeout_s = name, ready_timeout_s
        self.url = f"http://127.0.0.1:{port}"
        self.process: subprocess.Popen | None = None

    @classmethod
    def raymoe(cls, config: str | None, *, port: int | None = None, host: str | None = None,
               python: str = sys.executable, **options: Any) -> "ServeProcess":
        """`raymoe serve CONFIG` on ``port`` (default: a free one, `free_port`); ``options`` as
        for the constructor."""
        port = port or free_port()
        return cls(serve_argv(config, port, host, python), port, **options)

    def start(self) -> None:
        output = open(self.log_path, "ab") if self.log_path else None
        try:  # the child keeps its own descriptor of the log
            self.process = subprocess.Popen(
                self.argv, env=self.env, cwd=self.cwd, stdin=subprocess.DEVNULL, stdout=output or sys.stderr,
                stderr=subprocess.STDOUT if output else sys.stderr, start_new_session=True)
        finally:
            if output:
                output.close()

    def wait_ready(self, timeout_s: float | None = None, *, probe: Callable[[str], Any] | None = health,
                   ready_line: str | None = None, interval_s: float = 0.5) -> Any:
        """Poll until ``probe(url)`` returns something true (returned) and, with ``ready_line``,
        the log holds that line; ``probe=None``: the line alone. A probe that raises OSError or
        ValueError is not ready yet. Raises RuntimeError when the process exits first, and
        `ServerNotReady` after ``timeout_s`` (default: the constructor's ``ready_timeout_s``)."""
        assert self.process is not None, "start() first"
        timeout_s = self.ready_timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.process.returncode} before it was ready"
                                   f"{self._tail_note()}")
            if ready_line is None or ready_line in self.tail(10**6):
                if probe is None:
                    return True
                try:
                    answer = probe(self.url)
                except (OSError, ValueError):
                    answer = None
                if answer:
                    return answer
            time.sleep(interval_s)
        raise ServerNotReady(f"{self.name} was not ready within {timeout_s:g} s{self._tail_note()}")

    def tail(self, chars: int = 4000) -> str:
        """The last ``chars`` characters of the log ("" without one)."""
        if self.log_path is None:
            return ""
        try:
            with open(self.log_path, errors="replace") as handle:
                return handle.read()[-chars:]
        except OSError:
            return ""

    def _tail_note(self) -> str:
        return f"; last lines of {self.log_path}:\n{self.tail()}" if self.log_path else ""

    def stop(self, timeout_s: float = 60) -> int | None:
        """SIGINT, as a user's Ctrl-C; then SIGKILL to the process group if it has not exited
        within ``timeout_s``. Returns the exit code."""
        process = self.process
        if process is None:
            return None
        if process.poll() is None:
            process.send_signal(signal.SIGINT)
            try:
                process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(10)
        return process.returncode

    def __enter__(self) -> "ServeProcess":
        self.start()
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *_: Any) -> None:
        self.stop()
