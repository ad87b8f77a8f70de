"""NCCL's settings reach every GPU actor through Ray's runtime_env (issue 34, item 8).

``comm.nccl_env`` is validated at load (cluster/gpu_env.py: NCCL's, libfabric's, aws-ofi-nccl's
and CUDA's names, and LD_LIBRARY_PATH, nothing else) and becomes the ``env_vars`` of the
routers and workers that deploy() starts on GPUs; CPU actors keep their allocator settings.
deploy() runs here up to the first actor's creation, over a stand-in Ray (no GPU, no cluster).
"""

from __future__ import annotations

import types

import pytest
import ray

import raymoe.actors.worker_spec as worker_spec
import raymoe.cluster.deploy as deploy_module
from raymoe.cluster.config import ConfigError, parse_cluster_config
from raymoe.cluster.gpu_env import gpu_actor_env, nccl_env_problem

EFA = {"FI_PROVIDER": "efa", "FI_EFA_USE_DEVICE_RDMA": 1, "NCCL_SOCKET_IFNAME": "^lo,docker",
       "LD_LIBRARY_PATH": "/opt/amazon/ofi-nccl/lib:${LD_LIBRARY_PATH}"}


def test_the_env_is_the_configs_with_values_as_strings():
    config = parse_cluster_config({"model": "/m", "device": "cuda", "comm": {"nccl_env": EFA}})
    assert gpu_actor_env(config) == {"FI_PROVIDER": "efa", "FI_EFA_USE_DEVICE_RDMA": "1",
                                     "NCCL_SOCKET_IFNAME": "^lo,docker",
                                     "LD_LIBRARY_PATH": "/opt/amazon/ofi-nccl/lib:${LD_LIBRARY_PATH}"}
    assert gpu_actor_env(parse_cluster_config({"model": "/m"})) == {}
    assert parse_cluster_config(config.to_dict()) == config  # round trip


@pytest.mark.parametrize("env, message", [
    ({"nccl_debug": "INFO"}, "comm.nccl_env.nccl_debug: an environment variable name is upper case"),
    ({"PATH": "/x"}, "comm.nccl_env.PATH: only NCCL's settings reach the GPU actors"),
    ({"CUDA_VISIBLE_DEVICES": "0"}, "comm.nccl_env.CUDA_VISIBLE_DEVICES: not settable here"),
    ({"NCCL_DEBUG": "a\nb"}, "comm.nccl_env.NCCL_DEBUG: a value cannot hold a newline"),
])
def test_names_outside_nccls_settings_are_refused(env, message):
    assert nccl_env_problem(env).startswith(message)
    with pytest.raises(ConfigError, match=message.replace(".", r"\.").replace("(", r"\(")):
        parse_cluster_config({"model": "/m", "comm": {"nccl_env": env}})


@pytest.mark.parametrize("fields, served", [({"device": "cpu"}, "device: cpu"),
                                            ({"comm": {"backend": "sockets"}}, "comm.backend: sockets")])
def test_a_config_that_never_runs_nccl_refuses_nccl_env(fields, served):
    data = {"model": "/m", **fields}
    data["comm"] = {**data.get("comm", {}), "nccl_env": {"NCCL_DEBUG": "INFO"}}
    with pytest.raises(ConfigError, match=f"never runs NCCL \\({served}\\)"):
        parse_cluster_config(data)


class Created(Exception):
    """Raised by the stand-in actor class: deploy() got as far as creating the first actor."""


def run_deploy_until_the_first_actor(monkeypatch, config) -> dict:
    options = {}

    class FakeClass:
        def options(self, **kwargs):
            options.update(kwargs)
            return self

        def remote(self, *args, **kwargs):
            raise Created()

    class FakeGroup:
        def ready(self):
            return None

    fake_ray = types.SimpleNamespace(get=lambda value, timeout=None: value, remote=lambda cls: FakeClass(),
                                     exceptions=ray.exceptions, cluster_resources=lambda: {"GPU": 2.0},
                                     nodes=lambda: [{}])
    monkeypatch.setattr(deploy_module, "ray", fake_ray)
    monkeypatch.setattr(worker_spec, "ray", fake_ray)  # the workers are started there (deploy and resize alike)
    monkeypatch.setattr(deploy_module, "placement_group", lambda bundles, **kwargs: FakeGroup())
    monkeypatch.setattr(deploy_module, "placement_group_table", lambda group: {"bundles_to_node_id": {0: "n0"}})
    monkeypatch.setattr(deploy_module, "PlacementGroupSchedulingStrategy", lambda *args: "strategy")
    with pytest.raises(Created):
        deploy_module.deploy(config)
    return options


def test_gpu_actors_get_nccl_env_as_runtime_env(tiny_mixtral_dir, monkeypatch):
    config = parse_cluster_config({"model": tiny_mixtral_dir, "device": "cuda", "comm": {"nccl_env": EFA}})
    options = run_deploy_until_the_first_actor(monkeypatch, config)
    assert options["num_gpus"] == 1
    assert options["runtime_env"] == {"env_vars": gpu_actor_env(config)}


def test_gpu_actors_without_nccl_env_get_no_runtime_env(tiny_mixtral_dir, monkeypatch):
    config = parse_cluster_config({"model": tiny_mixtral_dir, "device": "cuda"})
    options = run_deploy_until_the_first_actor(monkeypatch, config)
    assert options["num_gpus"] == 1 and "runtime_env" not in options
