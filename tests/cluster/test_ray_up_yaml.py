"""The `ray up` cluster YAMLs under cluster/ray-up/ pass Ray's own cluster-config validation:
``prepare_config`` (defaults merged, as `ray up` does first) then ``validate_config`` (Ray's
JSON schema and node-type checks). No cloud API is called."""

from __future__ import annotations

import copy
from pathlib import Path

import jsonschema
import pytest
import yaml
from ray.autoscaler._private.util import prepare_config, validate_config

RAY_UP = Path(__file__).resolve().parents[2] / "cluster" / "ray-up"
FILES = sorted(RAY_UP.glob("*.yaml"))


def prepared(config: dict) -> dict:
    config = prepare_config(copy.deepcopy(config))
    validate_config(config)
    return config


def test_aws_gcp_and_local_are_there():
    assert {p.name for p in FILES} == {"aws-p5.yaml", "gcp-a3.yaml", "local.yaml"}


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_rays_validator_accepts_the_file(path):
    raw = yaml.safe_load(path.read_text())
    config = prepared(raw)
    assert config["provider"]["type"] == {"aws-p5.yaml": "aws", "gcp-a3.yaml": "gcp", "local.yaml": "local"}[path.name]
    setup = " ".join(config["head_setup_commands"] + config["worker_setup_commands"])
    assert "pip install torch==" in setup and "raymoe[gpu]" in setup  # both node kinds install raymoe
    assert any("ray start --head --port=6379" in c for c in config["head_start_ray_commands"])
    assert any("ray start --address=$RAY_HEAD_IP:6379" in c for c in config["worker_start_ray_commands"])


@pytest.mark.parametrize("name, instance_key", [("aws-p5.yaml", "InstanceType"), ("gcp-a3.yaml", "machineType")])
def test_cloud_files_are_two_eight_gpu_nodes(name, instance_key):
    config = prepared(yaml.safe_load((RAY_UP / name).read_text()))
    types = config["available_node_types"]
    head = types[config["head_node_type"]]
    workers = [t for n, t in types.items() if n != config["head_node_type"]]
    assert head["resources"]["GPU"] == 8 and [w["resources"]["GPU"] for w in workers] == [8]
    assert workers[0]["min_workers"] == workers[0]["max_workers"] == 1
    assert head["node_config"][instance_key] == workers[0]["node_config"][instance_key]


def test_local_file_lists_its_hosts():
    raw = yaml.safe_load((RAY_UP / "local.yaml").read_text())
    assert raw["provider"]["head_ip"] and raw["provider"]["worker_ips"]
    prepared(raw)


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_the_validator_rejects_an_unknown_field(path):
    raw = yaml.safe_load(path.read_text())
    raw["setup_comands"] = ["typo"]
    with pytest.raises(jsonschema.ValidationError):
        prepared(raw)
