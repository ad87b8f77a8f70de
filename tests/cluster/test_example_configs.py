"""Every YAML under configs/ loads with the cluster-config loader, and the GPU examples say
what their comments claim."""

from __future__ import annotations

from pathlib import Path

import pytest

from raymoe.cluster.config import ConfigError, Device, NodeStrategy, load_cluster_config, parse_cluster_config

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
ALL_YAML = sorted(CONFIGS.rglob("*.yaml"))
MIXTRAL_LAYERS, MIXTRAL_EXPERTS = 32, 8


def test_the_examples_are_all_there():
    names = {path.name for path in ALL_YAML}
    assert {"default.yaml", "1node-8gpu.yaml", "2node-16gpu-strict-spread.yaml", "disaggregated-routers.yaml",
            "redundant-slots.yaml"} <= names


@pytest.mark.parametrize("path", ALL_YAML, ids=lambda p: str(p.relative_to(CONFIGS)))
def test_every_config_loads(path):
    config = load_cluster_config(path)
    assert config.routers >= 1 and config.expert_workers >= 1


@pytest.mark.parametrize("name, gpus, node_strategy, redundant", [
    ("1node-8gpu.yaml", 8, NodeStrategy.PACK, 0),
    ("2node-16gpu-strict-spread.yaml", 16, NodeStrategy.STRICT_SPREAD, 0),
    ("disaggregated-routers.yaml", 8, NodeStrategy.PACK, 0),
    ("redundant-slots.yaml", 8, NodeStrategy.PACK, 1),
])
def test_gpu_examples_fill_their_gpus_and_place_every_expert(name, gpus, node_strategy, redundant):
    config = load_cluster_config(CONFIGS / "examples" / name)
    assert config.device is Device.CUDA
    assert config.routers + config.expert_workers == gpus  # routers and workers hold one GPU each
    assert config.placement.node_strategy is node_strategy
    assert config.placement.redundant_slots_per_worker == redundant
    nodes = list(range(config.expert_workers)) if node_strategy is NodeStrategy.STRICT_SPREAD else None
    table = config.initial_placement(MIXTRAL_LAYERS, MIXTRAL_EXPERTS, worker2node=nodes)
    assert (table.logcnt >= 1).all()  # every expert of every layer lives somewhere
    assert table.num_workers == config.expert_workers


def test_redundant_slots_example_replicates_four_experts_per_layer():
    table = load_cluster_config(CONFIGS / "examples" / "redundant-slots.yaml").initial_placement(
        MIXTRAL_LAYERS, MIXTRAL_EXPERTS)
    assert table.slots_per_worker == 3 and table.num_slots == 12
    assert (table.logcnt.sum(axis=1) == 12).all() and ((table.logcnt == 2).sum(axis=1) == 4).all()


def test_the_loader_rejects_a_broken_example(tmp_path):
    text = (CONFIGS / "examples" / "1node-8gpu.yaml").read_text().replace("node_strategy: PACK", "node_strategy: PAK")
    broken = tmp_path / "broken.yaml"
    broken.write_text(text)
    with pytest.raises(ConfigError, match="placement.node_strategy"):
        load_cluster_config(broken)
    with pytest.raises(ConfigError):
        parse_cluster_config({"model": "/m", "routers": 0})
