"""The `ray up` cluster YAMLs under cluster/ray-up/ pass Ray's own cluster-config validation:
``prepare_config`` (defaults merged, as `ray up` does first) then ``validate_config`` (Ray's
JSON schema and node-type checks), and keep the rules of docs/DEPLOY.md: a virtualenv of
their own whose `ray` every start command uses, no host-wide `ray stop`, the dashboard on
loopback, token authentication, no privileged ulimit, paths from $HOME, GPU extras only in
the GPU files. No cloud API is called. The on-premise provider that makes `ray down` stop
only its own cluster, and the node-side stop, are tested here without SSH; the whole flow
over loopback SSH is tests/cluster/test_launch_local.py."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import jsonschema
import pytest
import yaml
from ray.autoscaler._private.util import prepare_config, validate_config

RAY_UP = Path(__file__).resolve().parents[2] / "cluster" / "ray-up"
FILES = sorted(RAY_UP.glob("*.yaml"))
VENV = "$HOME/.raymoe/venv/bin/"
GPU_FILES = {"aws-p5.yaml", "gcp-a3.yaml"}


def prepared(config: dict) -> dict:
    config = prepare_config(copy.deepcopy(config))
    validate_config(config)
    return config


def raw(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def commands(config: dict) -> list[str]:
    return [c for key in ("initialization_commands", "setup_commands", "head_setup_commands", "worker_setup_commands",
                          "head_start_ray_commands", "worker_start_ray_commands") for c in config.get(key, [])]


def test_aws_gcp_and_local_are_there():
    assert {p.name for p in FILES} == {"aws-p5.yaml", "gcp-a3.yaml", "local.yaml"}


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_rays_validator_accepts_the_file(path):
    config = prepared(raw(path))
    assert config["provider"]["type"] == {"aws-p5.yaml": "aws", "gcp-a3.yaml": "gcp", "local.yaml": "external"}[path.name]
    for setup in (config["head_setup_commands"], config["worker_setup_commands"]):  # both node kinds install raymoe
        text = " ".join(setup)
        assert 'python3 -m venv "$HOME/.raymoe/venv"' in text
        assert f"{VENV}pip install -q torch==" in text
        extra = "[gpu-cu13]" if path.name in GPU_FILES else ""  # torch 2.13.0 is CUDA 13 (test_ray_up_gpu_network.py)
        assert f'{VENV}pip install -q -e "$HOME/raymoe{extra}"' in text
    assert any("ray start --head --port=6379" in c for c in config["head_start_ray_commands"])
    assert any("ray start --address=$RAY_HEAD_IP:6379" in c for c in config["worker_start_ray_commands"])


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_every_start_command_uses_the_venv_and_stops_only_its_own_cluster(path):
    config = raw(path)
    name = config["cluster_name"]
    stop = f"{VENV}python -m raymoe.cluster.ray_up_node stop {name}"
    for key in ("head_start_ray_commands", "worker_start_ray_commands"):
        first, start = config[key]
        assert first == stop  # a restart stops this cluster's previous Ray, not every Ray on the host
        # Serving actors at normal priority (Ray would start its workers at niceness 15), and a
        # GCS that keeps the events of 10,000 tasks, not hundreds of MB of them.
        assert start.startswith(f"RAYMOE_RAY_UP_CLUSTER={name} RAY_AUTH_MODE=token RAY_worker_niceness=0 "
                                f"RAY_task_events_max_num_task_in_gcs=10000 {VENV}ray start ")
    for command in commands(config):
        words = command.replace(";", " ; ").split()
        assert not any(w == "ray" for w in words), command  # no `ray` from the login shell's PATH
        assert "ulimit" not in command and "0.0.0.0" not in command and "/home/" not in command, command
        assert "pip install" not in command or command.startswith(f"{VENV}pip install"), command
    head = config["head_start_ray_commands"][1]
    assert "--dashboard-host=127.0.0.1" in head and "--autoscaling-config=~/ray_bootstrap_config.yaml" in head


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_paths_come_from_home_and_the_token_goes_to_every_node(path):
    config = raw(path)
    assert config["file_mounts"] == {"~/raymoe": ".", "~/.ray/auth_token": "~/.ray/auth_token"}
    assert "/home/ubuntu" not in path.read_text() and "**/.git" in config["rsync_exclude"]
    assert ("[gpu" in " ".join(commands(config))) == (path.name in GPU_FILES)  # GPU extras in GPU files only


def node_types(config: dict) -> tuple[dict, dict, dict]:
    """The head, the expert node type (``raymoe_expert``) and the router node type (``raymoe_router``,
    not the head) of a cloud file."""
    types = config["available_node_types"]
    head = types[config["head_node_type"]]
    others = [t for n, t in types.items() if n != config["head_node_type"]]
    (expert,) = [t for t in others if "raymoe_expert" in t["resources"]]
    (router,) = [t for t in others if "raymoe_router" in t["resources"]]
    assert len(others) == 2
    return head, expert, router


@pytest.mark.parametrize("name, instance_key", [("aws-p5.yaml", "InstanceType"), ("gcp-a3.yaml", "machineType")])
def test_cloud_files_are_a_router_head_and_autoscaled_eight_gpu_expert_and_router_nodes(name, instance_key):
    config = prepared(raw(RAY_UP / name))
    head, expert, router = node_types(config)
    assert head["resources"]["GPU"] == expert["resources"]["GPU"] == router["resources"]["GPU"] == 8
    # the head is a router node, the expert nodes hold no router and the router nodes no worker (docs/DEPLOY.md)
    assert head["resources"]["raymoe_router"] == router["resources"]["raymoe_router"] == 8
    assert "raymoe_expert" not in head["resources"] and "raymoe_expert" not in router["resources"]
    assert expert["resources"]["raymoe_expert"] == 8 and "raymoe_router" not in expert["resources"]
    # one expert node always (a config without the resources gets 16 GPUs, as before), up to 3;
    # router nodes only when the routers outgrow the head, up to 1
    assert head["min_workers"] == head["max_workers"] == 0
    assert expert["min_workers"] == 1 and expert["max_workers"] == 3
    assert router["min_workers"] == 0 and router["max_workers"] == 1
    assert config["max_workers"] == expert["max_workers"] + router["max_workers"]
    assert head["node_config"][instance_key] == expert["node_config"][instance_key] == router["node_config"][instance_key]
    autoscaler_client = {"aws-p5.yaml": "boto3", "gcp-a3.yaml": "google-api-python-client"}[name]
    assert any(c.startswith(f"{VENV}pip install") and autoscaler_client in c for c in raw(RAY_UP / name)["head_setup_commands"])


@pytest.mark.parametrize("name", sorted(GPU_FILES))
def test_node_counts_match_the_autoscale_example(name):
    """configs/examples/p5-autoscale.yaml asks for what the file's node types give: its
    workers only on expert nodes, its routers only on the head and router nodes, and the
    autoscale limits over what a node holds are the node types' min_workers / max_workers
    (routers: beyond the head's)."""
    from raymoe.cluster.config import load_cluster_config

    example = load_cluster_config(RAY_UP.parents[1] / "configs" / "examples" / "p5-autoscale.yaml")
    config = prepared(raw(RAY_UP / name))
    head, expert, router = node_types(config)
    (worker_resource, per_worker), = example.placement.worker_resources.items()
    (router_resource, per_router), = example.placement.router_resources.items()
    workers_a_node = int(min(expert["resources"]["GPU"], expert["resources"][worker_resource] / per_worker))
    assert expert["min_workers"] == -(-example.autoscale.min_workers // workers_a_node)
    assert expert["max_workers"] == -(-example.autoscale.max_workers // workers_a_node)
    assert example.expert_workers <= expert["min_workers"] * workers_a_node  # the start fits without a launch
    assert worker_resource not in head["resources"] and worker_resource not in router["resources"]
    on_head = int(min(head["resources"]["GPU"], head["resources"][router_resource] / per_router))
    routers_a_node = int(min(router["resources"]["GPU"], router["resources"][router_resource] / per_router))
    assert example.routers <= on_head  # the start fits on the head
    assert router["min_workers"] == max(0, -(-(example.autoscale.min_routers - on_head) // routers_a_node))
    assert router["max_workers"] == -(-(example.autoscale.max_routers - on_head) // routers_a_node)


def test_local_file_lists_its_hosts_and_its_node_type_agrees():
    config = raw(RAY_UP / "local.yaml")
    provider = config["provider"]
    assert provider["head_ip"] and provider["worker_ips"]
    assert provider["module"] == "raymoe.cluster.ray_up_provider.OnPremNodeProvider"
    assert provider["ray_stop_command"] == f"{VENV}python -m raymoe.cluster.ray_up_node stop {config['cluster_name']}"
    assert f"--temp-dir=/tmp/ray-{config['cluster_name']} " in config["head_start_ray_commands"][1] + " "
    assert config["setup_commands"] == [] and config["head_setup_commands"] == config["worker_setup_commands"]
    # what Ray's own `provider: local` would have filled in: one node type, the list is the cluster
    from ray.autoscaler._private.local.config import prepare_local

    local, _ = prepare_local({k: v for k, v in dict(config, provider=dict(provider, type="local")).items()
                              if k not in ("available_node_types", "head_node_type")})
    assert config["available_node_types"] == local["available_node_types"]
    assert config["head_node_type"] == local["head_node_type"] and config["max_workers"] == local["max_workers"]
    prepared(config)


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_the_validator_rejects_an_unknown_field(path):
    config = raw(path)
    config["setup_comands"] = ["typo"]
    with pytest.raises(jsonschema.ValidationError):
        prepared(config)


# ---- the on-premise provider: `ray stop` and node termination stop only this cluster ---------------


@pytest.fixture
def provider():
    from ray.autoscaler._private.local.config import get_lock_path, get_state_path

    from raymoe.cluster.ray_up_provider import OnPremNodeProvider

    name = f"raymoe-test-{uuid.uuid4().hex[:8]}"
    config = {"type": "external", "module": "raymoe.cluster.ray_up_provider.OnPremNodeProvider",
              "head_ip": "127.0.0.1", "worker_ips": ["127.0.0.2"], "ray_stop_command": f"STOP {name}"}
    yield OnPremNodeProvider(config, name)
    for path in (get_lock_path(name), get_state_path(name)):
        Path(path).unlink(missing_ok=True)


def test_the_provider_replaces_rays_own_ray_stop_and_nothing_else(provider, monkeypatch):
    from ray.autoscaler._private.command_runner import SSHCommandRunner

    sent = []
    monkeypatch.setattr(SSHCommandRunner, "run", lambda self, cmd=None, *a, **k: sent.append((self.node_id, cmd)))
    auth = {"ssh_user": "someone", "ssh_private_key": "/dev/null"}
    runner = provider.get_command_runner("", "127.0.0.1", auth, provider.cluster_name, subprocess, False)
    runner.run("ray stop")
    runner.run("  ray stop ")
    runner.run("ray status")
    runner.run("echo ray stop")
    assert [cmd for _, cmd in sent] == [f"STOP {provider.cluster_name}"] * 2 + ["ray status", "echo ray stop"]


def test_terminating_a_node_stops_its_ray_then_marks_it_terminated(provider, monkeypatch):
    from ray.autoscaler._private.command_runner import SSHCommandRunner

    sent = []
    monkeypatch.setattr(SSHCommandRunner, "run", lambda self, cmd=None, *a, **k: sent.append((self.node_id, cmd)))
    auth = {"ssh_user": "someone", "ssh_private_key": "/dev/null"}
    provider.get_command_runner("", "127.0.0.1", auth, provider.cluster_name, subprocess, False)  # as `ray down` does
    workers = provider.nodes_for_teardown({"ray-node-type": "worker"})
    assert workers == ["127.0.0.2"]
    provider.terminate_node("127.0.0.2")
    assert sent == [("127.0.0.2", f"STOP {provider.cluster_name}")]
    assert provider.nodes_for_teardown({"ray-node-type": "worker"}) == []


def test_the_provider_refuses_a_file_without_a_stop_command(provider):
    from raymoe.cluster.ray_up_provider import OnPremNodeProvider

    with pytest.raises(ValueError, match="ray_stop_command"):
        OnPremNodeProvider(dict(provider.provider_config, ray_stop_command=""), provider.cluster_name)


# ---- the node side: python -m raymoe.cluster.ray_up_node stop NAME ----------------------------------

TREE = """
import os, subprocess, sys, time
# a child whose environment is wiped, as Ray's workers overwrite theirs with their titles
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"], env={})
print("up", flush=True)
time.sleep(300)
"""


def spawn(env_extra: dict) -> subprocess.Popen:
    env = dict(os.environ, **env_extra)
    process = subprocess.Popen([sys.executable, "-c", TREE], env=env, stdout=subprocess.PIPE, text=True)
    assert process.stdout.readline().strip() == "up"
    return process


def test_node_stop_stops_the_marked_tree_and_nothing_else():
    from raymoe.cluster import procfs
    from raymoe.cluster.ray_up_node import MARKER, cluster_processes, stop

    name = f"raymoe-test-{uuid.uuid4().hex[:8]}"
    ours = spawn({MARKER: name})
    other_cluster = spawn({MARKER: name + "-other"})
    unmarked = spawn({})
    try:
        time.sleep(0.5)
        found = cluster_processes(name)
        assert ours.pid in found and len(found) == 2  # the marked process and its env-less child
        child = next(pid for pid in found if pid != ours.pid)
        assert stop(name, grace_s=5) == 2
        assert ours.wait(10) is not None and not cluster_processes(name)
        assert not procfs.exists(child) or procfs.stat(child)[0] == "Z"  # gone, or a zombie
        assert other_cluster.poll() is None and unmarked.poll() is None
        assert len(cluster_processes(name + "-other")) == 2
        done = subprocess.run([sys.executable, "-m", "raymoe.cluster.ray_up_node", "stop", name], capture_output=True,
                              text=True, timeout=60)
        assert done.returncode == 0 and "stopped 0 process(es)" in done.stdout  # idempotent, as a start command
    finally:
        for process in (ours, other_cluster, unmarked):
            for pid in [process.pid, *[p for p in _children(process.pid)]]:
                try:
                    os.kill(pid, 9)
                except ProcessLookupError:
                    pass
            process.wait(10)


def _children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]
