"""The `serve run` app builder, and `raymoe serve` refusing bad configs and busy ports (with no
config, the README's command: tests/serve/test_serve_demo.py)."""

from __future__ import annotations

import json
import os
import urllib.request

import pytest
import ray
from ray import serve

from raymoe.cluster.serve_app import build_app
from raymoe.cluster.config import ConfigError
from raymoe.kernels.comm.ports import free_port


def complete(url: str, body: dict) -> dict:
    request = urllib.request.Request(f"{url}/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())


def test_app_builder_serves_the_same_config(tiny_mixtral_dir):
    port = free_port(below_ephemeral=True)
    ray.init(address="local", num_cpus=2, include_dashboard=False)  # a Ray of our own, never a neighbour's
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        args = {"model": tiny_mixtral_dir, "device": "cpu", "dtype": "float32", "routers": 1, "expert_workers": 2}
        serve.run(build_app(args), name="raymoe", route_prefix="/")
        body = complete(f"http://127.0.0.1:{port}", {"prompt": [5, 6, 7], "max_tokens": 3, "temperature": 0})
        assert body["object"] == "text_completion" and body["usage"]["completion_tokens"] <= 3
    finally:
        serve.shutdown()
        ray.shutdown()


def test_app_builder_refuses_a_bad_config_before_starting_anything():
    with pytest.raises(ConfigError, match="routers"):
        build_app({"model": "/nowhere", "routers": 0})


def test_serve_refuses_a_port_in_use_before_starting_anything(tmp_path, tiny_mixtral_dir):
    """A port another server holds: one line naming it and what to do, exit 2, no Ray started."""
    import socket
    import subprocess
    import sys

    config = tmp_path / "cluster.yaml"
    config.write_text(f"model: {tiny_mixtral_dir}\ndevice: cpu\ndtype: float32\n")
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", free_port(below_ephemeral=True)))
        holder.listen(1)
        port = holder.getsockname()[1]
        done = subprocess.run(
            [sys.executable, "-m", "raymoe.cluster.cli", "serve", str(config), "--host", "127.0.0.1",
             "--port", str(port)],
            capture_output=True, text=True, timeout=120, env={**os.environ, "RAY_TMPDIR": str(tmp_path)},
        )
    assert done.returncode == 2, done.stderr[-2000:]
    assert f"cannot listen on 127.0.0.1:{port}" in done.stderr and "--port" in done.stderr
    assert "Ray cluster" not in done.stderr  # refused before any Ray started
