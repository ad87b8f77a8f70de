"""The cloud files' GPU networking and packages (issue 34, item 8); no cloud API is called.

- AWS p5: 32 EFA interfaces, one per network card, in AWS's P5 layout (card 0 device 0 an
  EFA with ENA, cards 1-31 device 1 EFA or EFA-only), each with the subnet and security group
  Ray's AWS bootstrap requires of every interface (its own function checks them here); no
  public IP with several interfaces, so internal IPs; setup refuses a node without EFA or
  without the aws-ofi-nccl plugin.
- Google Cloud A3: 5 gVNIC NICs (host + 4 GPU networks), an external IP on nic0 only.
- Both: torch pinned at 2.13.0, which PyPI builds for CUDA 13, so the cupy extra is gpu-cu13
  (pyproject's cupy-cuda13x); the comm.nccl_env blocks their comments give load as a raymoe
  cluster config.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest
import yaml

from raymoe.cluster.config import parse_cluster_config
from raymoe.cluster.gpu_env import gpu_actor_env

ROOT = Path(__file__).resolve().parents[2]
RAY_UP = ROOT / "cluster" / "ray-up"
VENV = "$HOME/.raymoe/venv/bin/"
# PyPI's torch 2.13.0 requires nvidia-nccl-cu13 and cuda-toolkit 13.0 (its metadata, read with
# `pip install --dry-run --report torch==2.13.0`): a CUDA 13 build.
TORCH_PIN, TORCH_CUDA_MAJOR = "2.13.0", 13


def load(name: str) -> dict:
    return yaml.safe_load((RAY_UP / name).read_text())


def node_types(config: dict) -> list[dict]:
    return [t["node_config"] for t in config["available_node_types"].values()]


def test_aws_p5_has_efa_on_every_network_card():
    from ray.autoscaler._private.aws.config import _configure_subnets_and_groups_from_network_interfaces

    config = load("aws-p5.yaml")
    assert config["provider"]["use_internal_ips"] is True
    for node in node_types(config):
        interfaces = node["NetworkInterfaces"]
        assert [i["NetworkCardIndex"] for i in interfaces] == list(range(32))
        assert interfaces[0]["DeviceIndex"] == 0 and interfaces[0]["InterfaceType"] == "efa"
        assert all(i["DeviceIndex"] == 1 and i["InterfaceType"] in ("efa", "efa-only") for i in interfaces[1:])
        assert not any("AssociatePublicIpAddress" in i for i in interfaces)
        checked = _configure_subnets_and_groups_from_network_interfaces(node)  # Ray's own rule
        assert checked["SubnetIds"] == ["subnet-0123456789abcdef0"] * 32
        assert "SubnetId" not in node and "SecurityGroupIds" not in node


def test_aws_setup_refuses_a_node_without_efa_or_the_plugin():
    setup = " ".join(load("aws-p5.yaml")["setup_commands"])
    assert "/opt/amazon/efa/bin/fi_info -p efa -t FI_EP_RDM > /dev/null || {" in setup
    assert 'ln -sfn "$f" "$HOME/.raymoe/nccl-net/libnccl-net.so"' in setup
    assert "no aws-ofi-nccl plugin" in setup and "exit 1" in setup


def test_gcp_a3_has_a_host_nic_and_four_gpu_nics():
    for node in node_types(load("gcp-a3.yaml")):
        nics = node["networkInterfaces"]
        assert len(nics) == 5 and all(n["nicType"] == "GVNIC" for n in nics)
        assert nics[0]["accessConfigs"][0]["type"] == "ONE_TO_ONE_NAT"
        assert not any("accessConfigs" in n for n in nics[1:])
        assert len({n["subnetwork"] for n in nics}) == 5


@pytest.mark.parametrize("name", ["aws-p5.yaml", "gcp-a3.yaml"])
def test_the_cupy_extra_pairs_with_the_pinned_torch(name):
    setup = load(name)["setup_commands"]
    assert f"{VENV}pip install -q torch=={TORCH_PIN}" in " ".join(setup)
    extra = "gpu" if TORCH_CUDA_MAJOR == 12 else f"gpu-cu{TORCH_CUDA_MAJOR}"
    assert f'{VENV}pip install -q -e "$HOME/raymoe[{extra}]"' in " ".join(setup)
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert any(req.startswith(f"cupy-cuda{TORCH_CUDA_MAJOR}x") for req in extras[extra])


def commented_nccl_env(name: str) -> dict:
    """The `comm: nccl_env:` block a cloud file's comments give, as YAML."""
    lines = (RAY_UP / name).read_text().splitlines()
    start = lines.index("#   comm:")
    block = []
    for line in lines[start:]:
        if not line.startswith("#   "):
            break
        block.append(re.sub(r"\s+# .*$", "", line[2:]))  # inline comments out
    return yaml.safe_load("\n".join(block))


@pytest.mark.parametrize("name, expected", [
    ("aws-p5.yaml", {"FI_PROVIDER": "efa", "FI_EFA_USE_DEVICE_RDMA": "1", "NCCL_NET": "AWS Libfabric"}),
    ("gcp-a3.yaml", {"NCCL_GPUDIRECTTCPX_SOCKET_IFNAME": "eth1,eth2,eth3,eth4", "NCCL_SOCKET_IFNAME": "eth0"}),
])
def test_the_documented_nccl_env_loads_as_a_cluster_config(name, expected):
    comm = commented_nccl_env(name)["comm"]
    config = parse_cluster_config({"model": "/m", "device": "cuda", "comm": comm})
    env = gpu_actor_env(config)
    assert expected.items() <= env.items()
    assert "${LD_LIBRARY_PATH}" in env["LD_LIBRARY_PATH"]  # appended to the node's, never replacing it
