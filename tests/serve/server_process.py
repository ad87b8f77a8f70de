"""Start `raymoe serve CONFIG` as a subprocess on a free loopback port, and stop it: the project's
launcher (cluster/serve_process.py) with the tests' probes (its Ray, its actors' pids)."""

from __future__ import annotations

import os

from raymoe.cluster import procfs
from raymoe.cluster.serve_process import READY_LINE, ServeProcess, serve_argv
from raymoe.kernels.comm.ports import free_port


def merged_env(env: dict | None) -> dict:
    """This process's environment with ``env`` on top; a value of None removes the variable."""
    merged = {**os.environ, **(env or {})}
    return {key: value for key, value in merged.items() if value is not None}


class ServerProcess(ServeProcess):
    def __init__(self, config_path: str | None, log_path: str, port: int | None = None, env: dict | None = None):
        """Started at once; ``config_path=None`` runs `raymoe serve` with no config: the embedded
        default. The port is below the kernel's ephemeral range (`free_port`'s ``below_ephemeral``)."""
        port = port or free_port(below_ephemeral=True)
        super().__init__(serve_argv(config_path, port), port, log_path=log_path, env=merged_env(env))
        self.start()

    def wait_ready(self, timeout_s: float = 300) -> None:
        """/health answers 200 and the log says it is ready."""
        super().wait_ready(timeout_s, ready_line=READY_LINE)

    def ray_address(self) -> str:
        """HOST:PORT of the Ray this server started: its GCS's session is named after the
        server's pid (on a shared machine, "the latest cluster" may be someone else's)."""
        suffix = f"_{self.process.pid}"
        for pid in procfs.pids():
            try:
                args = procfs.arguments(procfs.read_bytes(pid, "cmdline"))
            except OSError:  # gone
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
        processes = procfs.processes()
        raylets = {pid for pid, p in processes.items() if p.parent == self.process.pid and "raylet" in p.command}
        return sorted(pid for pid, p in processes.items()
                      if p.parent in raylets and p.command.startswith(f"ray::{class_name}"))


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
