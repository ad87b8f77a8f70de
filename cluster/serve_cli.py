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
import socket
import sys
import threading
import time
import urllib.request

import msgspec

from raymoe.cluster.config import ClusterConfig, ConfigError, IngressMode, load_cluster_config, parse_cluster_config
from raymoe.kernels.comm.ports import free_port

READY_TIMEOUT_S = 900
DEPLOYMENT_NAME = "raymoe"  # the named actors HTTP replicas attach to (raymoe status finds them too)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("serve", help="serve the OpenAI-compatible HTTP endpoint")
    parser.add_argument("config", nargs="?", help="cluster config YAML (default: the embedded demo config)")
    parser.add_argument("--host", default=None, help="override serve.host")
    parser.add_argument("--port", type=int, default=None, help="override serve.port")
    parser.add_argument("--address", default=None,
                        help="Ray cluster to join, HOST:PORT, used as given (default: RAY_ADDRESS, else a Ray of its own; "
                             "'auto' joins the cluster this machine started last)")
    parser.add_argument("--api-key", action="append", default=[], metavar="KEY",
                        help="an API key clients must send (Authorization: Bearer KEY); repeatable; also "
                             "serve.api_keys / serve.api_key_file in the YAML and RAYMOE_API_KEY")
    parser.set_defaults(func=_run)


DEMO_MODEL = "~/.cache/raymoe/demo-mixtral"  # a config's `model:` naming the demo checkpoint (configs/)


def demo_model_dir() -> str:
    """Where the demo checkpoint lives: RAYMOE_CACHE/demo-mixtral, else ~/.cache/raymoe/demo-mixtral."""
    cache = os.environ.get("RAYMOE_CACHE") or os.path.expanduser("~/.cache/raymoe")
    return os.path.join(cache, "demo-mixtral")


def ensure_demo_model(config: ClusterConfig) -> ClusterConfig:
    """A config whose ``model`` is ``~/.cache/raymoe/demo-mixtral`` (the embedded default and
    the CPU examples under configs/examples) gets the demo checkpoint, at demo_model_dir(),
    written on first use; any other model path is left as it is (never a random checkpoint
    where a real one was meant)."""
    if config.model != os.path.normpath(os.path.expanduser(DEMO_MODEL)):
        return config
    from raymoe.engine.demo_model import write_demo_model

    model = demo_model_dir()
    if not os.path.isfile(os.path.join(model, "config.json")):
        print(f"raymoe: writing the demo checkpoint to {model}", file=sys.stderr)
        write_demo_model(model, "mixtral")
    return msgspec.structs.replace(config, model=model)


def default_config() -> ClusterConfig:
    """configs/default.yaml, with the demo checkpoint in the cache directory (written if missing)."""
    import yaml

    text = importlib.resources.files("raymoe.configs").joinpath("default.yaml").read_text()
    return ensure_demo_model(parse_cluster_config(yaml.safe_load(text), "configs/default.yaml"))


def _run(args: argparse.Namespace) -> int:
    try:
        config = ensure_demo_model(load_cluster_config(args.config)) if args.config else default_config()
    except (ConfigError, OSError) as error:
        print(f"raymoe serve: {error}", file=sys.stderr)
        return 2
    problem = _checkpoint_problem(config.model)
    if problem is not None:  # before Ray or any actor starts: one line, exit 2
        print(f"raymoe serve: {problem}", file=sys.stderr)
        return 2
    serve_section = msgspec.structs.replace(
        config.serve,
        host=args.host or config.serve.host,
        port=args.port or config.serve.port,
    )
    config = msgspec.structs.replace(config, serve=serve_section)
    started_ray = not _ray_initialized() and not (args.address or os.environ.get("RAY_ADDRESS"))
    problem = _memory_problem(config, started_ray)
    if problem is not None:  # before Ray or any actor starts, with the rank and its bytes: exit 2
        print(f"raymoe serve: {problem}", file=sys.stderr)
        return 2
    problem = _port_problem(config.serve.host, config.serve.port) if started_ray else None
    if problem is not None:  # a local server: its port must be free before anything starts
        print(f"raymoe serve: {problem}", file=sys.stderr)
        return 2
    from raymoe.actors.front_door import ApiKeyError
    from raymoe.cluster.serve_app import config_key_digests

    try:
        key_digests = config_key_digests(config, tuple(args.api_key))
    except ApiKeyError as error:
        print(f"raymoe serve: {error}", file=sys.stderr)
        return 2
    direct = _direct_ingress(config, started_ray)
    import ray
    from ray import serve

    from raymoe.cluster.serve_app import ingress_app
    from raymoe.cluster.deploy import deploy, ensure_ray
    from raymoe.cluster.ray_connect import ClusterUnreachable

    stop = threading.Event()
    deployment = None

    def on_signals() -> None:
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, lambda *_: stop.set())

    on_signals()
    url = f"http://{config.serve.host}:{config.serve.port}"
    try:
        try:
            ensure_ray(args.address)
        except ClusterUnreachable as error:  # AuthenticationFailed says "authentication failed: ..."
            print(f"raymoe serve: {error}", file=sys.stderr)
            return 1
        on_signals()  # ray.init installs Ray's own SIGTERM handler (it aborts the process): ours again
        gcs = ray.get_runtime_context().gcs_address
        print(f"raymoe serve: on the Ray cluster at {gcs} ({'its own' if started_ray else 'joined'}; "
              f"raymoe status --address {gcs})", file=sys.stderr)
        print(f"raymoe serve: starting {config.routers} routers and {config.expert_workers} expert workers "
              f"for {config.model}", file=sys.stderr)
        # Direct ingress: the replica listens on serve.port itself; Serve still starts its
        # proxy, which then gets a free loopback port of its own that nothing uses.
        proxy_port = free_port(config.serve.host) if direct else config.serve.port
        # The cluster first (routers, workers, controller: named actors this process owns, so
        # they go when it goes), then the stateless HTTP replicas that attach to it by name.
        deployment = deploy(config, name=DEPLOYMENT_NAME)
        http_options = {"host": config.serve.host, "port": proxy_port}
        if config.serve.keep_alive_timeout_s is not None:
            http_options["keep_alive_timeout_s"] = config.serve.keep_alive_timeout_s
        serve.start(http_options=http_options)
        admin_token = os.environ.get("RAYMOE_ADMIN_TOKEN")
        serve.run(ingress_app(config, admin_token, DEPLOYMENT_NAME, key_digests), name="raymoe", route_prefix="/")
        if not _wait_healthy(url, stop):
            if stop.is_set():
                print("raymoe serve: interrupted before the endpoint was ready; shutting down", file=sys.stderr)
                return 0
            hint = (" (serve.ingress: direct on an existing cluster needs every node started with "
                    "RAY_SERVE_ENABLE_DIRECT_INGRESS=1 and the port range of docs/DEPLOY.md; or use serve.ingress: proxy)"
                    if direct and not started_ray else "")
            print(f"raymoe serve: the endpoint did not become healthy in {READY_TIMEOUT_S} s{hint}", file=sys.stderr)
            return 1
        print(f"raymoe serve: ready at {url}/v1 (OpenAI API; health at {url}/health, metrics at {url}/metrics)",
              flush=True)
        stop.wait()
        print("raymoe serve: shutting down", file=sys.stderr)
        return 0
    finally:
        if ray.is_initialized():  # serve.shutdown() without Ray would ray.init() and attach anywhere
            try:
                _shutdown_serve()
                if deployment is not None:
                    deployment.shutdown()
            finally:
                if started_ray:
                    ray.shutdown()


def _shutdown_serve(timeout_s: float = 30.0) -> None:
    """serve.shutdown() without its error-looking lines. serve.shutdown() waits on the Serve
    controller's graceful_shutdown call until the controller, having stopped every replica
    and proxy, kills itself under it: the raylet then logs "Task
    ServeController.graceful_shutdown failed ... killed by `ray.kill`" on every clean stop.
    Here the call only raises the shutdown flag (wait=False) and returns; the controller's
    exit is seen by its name going away, and then only this process's cached client is
    dropped (serve.shutdown() would first ping the dead controller and log its death). If
    the controller outlives the deadline, serve.shutdown() as before."""
    import ray
    from ray import serve
    from ray.serve import context
    from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE

    deadline = time.monotonic() + timeout_s
    try:
        controller = ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
        ray.get(controller.graceful_shutdown.remote(False), timeout=timeout_s)
        while time.monotonic() < deadline:
            ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)  # ValueError once it is gone
            time.sleep(0.2)
    except ValueError:  # no Serve controller (never started, or gone): everything Serve ran has stopped
        context._set_global_client(None)
        return
    except (ray.exceptions.RayError, TimeoutError):
        pass
    serve.shutdown()


def _port_problem(host: str, port: int) -> str | None:
    """Why the endpoint cannot listen on host:port, in one line, or None (bound and released
    at once; otherwise Serve reports only "Failed to update the deployments" minutes later)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as error:
            return (f"cannot listen on {host}:{port} ({error.strerror or error}): another server may hold it; "
                    f"pick another with --port or serve.port")
    return None


def _checkpoint_problem(model_dir: str) -> str | None:
    """What is wrong with the checkpoint, in one line naming it, or None (headers only: fast)."""
    from raymoe.engine.checkpoint import Checkpoint
    from raymoe.engine.weights import validate_checkpoint
    from raymoe.engine.hf_config import load_model_config

    if not os.path.isdir(model_dir):
        return (f"checkpoint {model_dir} does not exist: put a Hugging Face checkpoint there (config.json, "
                f"*.safetensors, tokenizer.json), or write the random-weight demo there with "
                f"`raymoe demo-model {model_dir}` (or set model: {DEMO_MODEL}, written on first use)")
    try:
        validate_checkpoint(Checkpoint(model_dir), load_model_config(model_dir))
    except (OSError, ValueError, KeyError) as error:
        lines = [line.strip() for line in str(error).splitlines() if line.strip()]
        detail = "; ".join(lines[:3]) + (f" (and {len(lines) - 3} more)" if len(lines) > 3 else "")
        return f"checkpoint {model_dir}: {detail or type(error).__name__}"
    return None


def _memory_problem(config: ClusterConfig, started_ray: bool) -> str | None:
    """Why some rank cannot fit its memory, in one line naming the rank, the bytes it needs and
    has, and the setting to lower (cluster/memory_check.py, as `raymoe plan memory --config`),
    or None. On GPUs each rank is held to this machine's smallest GPU (none here: not checked); on CPU
    with a Ray of its own every rank shares this host's MemTotal (on a cluster it joins, the
    ranks' nodes are not known here: not checked)."""
    from raymoe.cluster.memory_check import host_memory, judge, local_gpu_memory, plan_config_memory, read_model

    device = config.device.value
    gpu_memory = local_gpu_memory() if device in ("cuda", "auto") else None
    if device == "auto" and gpu_memory is None:
        device = "cpu"
    if device == "cpu" and not started_ray:
        return None
    if device != "cpu" and gpu_memory is None:
        return None
    device = "cpu" if device == "cpu" else "cuda"
    try:
        plan = plan_config_memory(config, read_model(config.model)[0], device)
    except (ValueError, KeyError, OSError) as error:  # a model the planner cannot size: serve, unchecked
        print(f"raymoe serve: memory not checked ({type(error).__name__}: {error})", file=sys.stderr)
        return None
    if device == "cpu":
        total, available = host_memory()
        verdict = judge(plan, total, True, "this host's MemTotal")
        if verdict.fits and plan.total_bytes > available:
            print(f"raymoe serve: the ranks may need up to {plan.total_bytes} bytes of memory, more than the "
                  f"{available} available now (MemAvailable)", file=sys.stderr)
    else:
        verdict = judge(plan, gpu_memory, False, "this machine's GPU (nvidia-smi)")
    return verdict.problem


def _ray_initialized() -> bool:
    import ray

    return ray.is_initialized()


def _direct_ingress(config: ClusterConfig, started_ray: bool) -> bool:
    """Whether the ingress replica serves HTTP itself (no proxy hop: ~20% more tokens/s at 32
    streams on 2 cores, docs/BENCHMARKS.md). Ray Serve reads this from the environment of its
    controller and replicas, so it is set here, before this process starts a local Ray; on an
    existing cluster the nodes must have been started with it (docs/DEPLOY.md)."""
    mode = config.serve.ingress
    one_replica = config.serve.replicas == 1 and config.serve.autoscaling is None
    direct = mode is IngressMode.DIRECT or (mode is IngressMode.AUTO and started_ray and one_replica)
    if started_ray and not direct:  # an inherited setting must not turn a local proxy into direct ingress
        os.environ["RAY_SERVE_ENABLE_DIRECT_INGRESS"] = "0"
    if direct and started_ray:
        port = config.serve.port
        os.environ.update({
            "RAY_SERVE_ENABLE_DIRECT_INGRESS": "1",
            "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": str(port),
            "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT": str(port + 1),
            "RAY_SERVE_DIRECT_INGRESS_MIN_GRPC_PORT": str(free_port(config.serve.host)),
            "RAY_SERVE_DIRECT_INGRESS_PORT_RETRY_COUNT": "3",
            "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "0",  # no load balancer to drain from
        })
        os.environ["RAY_SERVE_DIRECT_INGRESS_MAX_GRPC_PORT"] = str(
            int(os.environ["RAY_SERVE_DIRECT_INGRESS_MIN_GRPC_PORT"]) + 1)
    return direct


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
