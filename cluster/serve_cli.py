"""`raymoe serve [CONFIG.yaml]`: the OpenAI-compatible endpoint on Ray Serve.

Starts a local Ray unless ``--address`` or ``RAY_ADDRESS`` names a cluster, deploys the
config (with none, the embedded ``configs/default.yaml`` and a demo checkpoint written on
first use), prints the URL, and on SIGINT or SIGTERM shuts down everything it started.
"""

from __future__ import annotations

import argparse
import importlib.resources
import os
import signal
import sys
import threading
import time
import urllib.request

import msgspec

from raymoe.cluster.config import ClusterConfig, ConfigError, load_cluster_config, parse_cluster_config

READY_TIMEOUT_S = 900


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("serve", help="serve the OpenAI-compatible HTTP endpoint")
    parser.add_argument("config", nargs="?", help="cluster config YAML (default: the embedded demo config)")
    parser.add_argument("--host", default=None, help="override serve.host")
    parser.add_argument("--port", type=int, default=None, help="override serve.port")
    parser.add_argument("--address", default=None, help="Ray cluster to join (default: RAY_ADDRESS, else a local Ray)")
    parser.set_defaults(func=_run)


def default_config() -> ClusterConfig:
    """configs/default.yaml, with the demo checkpoint in the cache directory (written if missing)."""
    import yaml

    from raymoe.engine.demo_model import write_demo_model

    text = importlib.resources.files("raymoe.configs").joinpath("default.yaml").read_text()
    data = yaml.safe_load(text)
    cache = os.environ.get("RAYMOE_CACHE") or os.path.expanduser("~/.cache/raymoe")
    data["model"] = os.path.join(cache, "demo-mixtral")
    if not os.path.isfile(os.path.join(data["model"], "config.json")):
        print(f"raymoe serve: writing the demo checkpoint to {data['model']}", file=sys.stderr)
        write_demo_model(data["model"], "mixtral")
    return parse_cluster_config(data, "configs/default.yaml")


def _run(args: argparse.Namespace) -> int:
    try:
        config = load_cluster_config(args.config) if args.config else default_config()
    except (ConfigError, OSError) as error:
        print(f"raymoe serve: {error}", file=sys.stderr)
        return 2
    serve_section = msgspec.structs.replace(
        config.serve,
        host=args.host or config.serve.host,
        port=args.port or config.serve.port,
    )
    config = msgspec.structs.replace(config, serve=serve_section)
    import ray
    from ray import serve

    from raymoe.actors.ingress import OpenAIIngress
    from raymoe.cluster.deploy import ensure_ray

    started_ray = not ray.is_initialized() and not (args.address or os.environ.get("RAY_ADDRESS"))
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    url = f"http://{config.serve.host}:{config.serve.port}"
    try:
        ensure_ray(args.address)
        print(f"raymoe serve: starting {config.routers} routers and {config.expert_workers} expert workers "
              f"for {config.model}", file=sys.stderr)
        serve.start(http_options={"host": config.serve.host, "port": config.serve.port})
        admin_token = os.environ.get("RAYMOE_ADMIN_TOKEN")
        serve.run(OpenAIIngress.bind(config.to_dict(), admin_token), name="raymoe", route_prefix="/")
        if not _wait_healthy(url, stop):
            if stop.is_set():
                print("raymoe serve: interrupted before the endpoint was ready; shutting down", file=sys.stderr)
                return 0
            print(f"raymoe serve: the endpoint did not become healthy in {READY_TIMEOUT_S} s", file=sys.stderr)
            return 1
        print(f"raymoe serve: ready at {url}/v1 (OpenAI API; health at {url}/health, metrics at {url}/metrics)",
              flush=True)
        stop.wait()
        print("raymoe serve: shutting down", file=sys.stderr)
        return 0
    finally:
        try:
            serve.shutdown()
        finally:
            if started_ray:
                ray.shutdown()


def _wait_healthy(url: str, stop: threading.Event) -> bool:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline and not stop.is_set():
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5) as response:
                if response.status == 200:
                    return True
        except OSError:
            pass
        time.sleep(0.5)
    return False
