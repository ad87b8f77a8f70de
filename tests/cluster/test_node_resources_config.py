"""placement.worker_resources / router_resources: custom Ray resources that keep expert
workers on a `ray up` file's expert nodes and routers on its router node (docs/DEPLOY.md,
"Ray's autoscaler and the ray-up node types"); validated at load; absent, nothing changes."""

from __future__ import annotations

import pytest

from raymoe.actors.worker_spec import CPU_SLIVER, WorkerSpec, worker_bundle
from raymoe.cluster.config import ConfigError, load_cluster_config

MINIMUM = "model: /ckpt\nplacement:\n"


def spec(gpus: bool, resources: dict) -> WorkerSpec:
    return WorkerSpec(name="d", namespace="raymoe", model="/ckpt", dtype="float32", gpus=gpus, spare_rows=0,
                      threads=1, packed_experts=True, pin_threads=False, max_concurrency=4, resources=resources)


def test_absent_they_are_empty_and_the_bundle_is_as_before():
    config = load_cluster_config("model: /ckpt\n")
    assert config.placement.worker_resources == {} and config.placement.router_resources == {}
    assert worker_bundle(False, {}, 3) == {"CPU": 3 * CPU_SLIVER}
    assert worker_bundle(True, {}, 8) == {"GPU": 8, "CPU": 8 * CPU_SLIVER}


def test_they_load_and_each_worker_of_a_bundle_asks_for_its_amount():
    config = load_cluster_config(MINIMUM + "  worker_resources: {raymoe_expert: 1, big_memory: 0.5}\n"
                                           "  router_resources: {raymoe_router: 1}\n")
    assert config.placement.worker_resources == {"raymoe_expert": 1.0, "big_memory": 0.5}
    assert config.placement.router_resources == {"raymoe_router": 1.0}
    assert config.to_dict()["placement"]["worker_resources"] == {"raymoe_expert": 1.0, "big_memory": 0.5}
    resources = dict(config.placement.worker_resources)
    assert worker_bundle(True, resources, 8) == {"GPU": 8, "CPU": 8 * CPU_SLIVER, "raymoe_expert": 8.0,
                                                 "big_memory": 4.0}
    # a resize's bundles (one worker each) ask for the same as deploy's
    assert spec(True, resources).bundle() == {"GPU": 1, "CPU": CPU_SLIVER, "raymoe_expert": 1.0, "big_memory": 0.5}
    assert spec(False, resources).bundle(2) == worker_bundle(False, resources, 2)


@pytest.mark.parametrize("lines, message", [
    ("  worker_resources: {raymoe_expert: 0}\n", "placement.worker_resources.raymoe_expert: expected a number > 0; got 0"),
    ("  router_resources: {raymoe_router: -1}\n", "placement.router_resources.raymoe_router: expected a number > 0; got -1"),
    ("  worker_resources: {raymoe_expert: many}\n",
     "placement.worker_resources.raymoe_expert: expected a number > 0; got 'many'"),
    ("  worker_resources: {'': 1}\n", "placement.worker_resources: expected resource names that are non-empty strings; got ''"),
    ("  worker_resources: {3: 1}\n", "placement.worker_resources: expected each key to be a string; got 3"),
    ("  worker_resources: [raymoe_expert]\n", "placement.worker_resources: expected a mapping; got ['raymoe_expert']"),
    ("  worker_resources: {GPU: 1}\n", "placement.worker_resources.GPU: a custom Ray resource name is expected"),
    ("  router_resources: {CPU: 1}\n", "placement.router_resources.CPU: a custom Ray resource name is expected"),
    ("  worker_resources: {'node:10.0.0.2': 1}\n",
     "placement.worker_resources.node:10.0.0.2: a custom Ray resource name is expected"),
])
def test_bad_values_are_refused_at_load_naming_the_field(lines, message):
    with pytest.raises(ConfigError) as error:
        load_cluster_config(MINIMUM + lines)
    assert message in str(error.value), str(error.value)
