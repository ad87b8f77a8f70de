"""Ray's own autoscaler over simulated nodes on this machine, without touching anyone else's Ray.

:class:`ray.cluster_utils.AutoscalingCluster` starts a head whose monitor runs Ray's real
(v1) autoscaler with the ``fake_multinode`` node provider: a node it launches is a raylet
process here, with the resources of its node type. Its own ``start``/``shutdown`` do not fit
a shared machine, so :class:`ScopedAutoscalingCluster` keeps the class and changes only that:

- Ray's ``start`` runs ``ray stop --force`` first and its ``shutdown`` is that command again,
  which kill every Ray process of the host (a neighbour's tests, another cluster). Here the
  head starts with ``RAYMOE_RAY_UP_CLUSTER=<unique name>`` in its environment and is stopped
  by :func:`raymoe.cluster.ray_up_node.stop`, which stops that name's processes (the head's,
  and the simulated nodes the monitor forked) and nothing else.
- Ray's listens on port 6379 and writes /tmp/ray: here a free port, a temp dir of its own,
  and the provider is told the head's GCS address (``provider.gcs_address``).
- Ray's config starts from ``fake_multi_node/example.yaml``, which the installed wheel lacks;
  the same fields are spelled out in :data:`BASE`.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import uuid

from ray.cluster_utils import AutoscalingCluster

from raymoe.cluster.ray_up_node import MARKER, stop

BASE = {  # ray/autoscaler/_private/fake_multi_node/example.yaml, less its node types
    "cluster_name": "fake_multinode", "max_workers": 8,
    "provider": {"type": "fake_multinode", "use_node_id_as_ip": True, "disable_node_updaters": True,
                 "disable_launch_config_check": True},
    "head_node_type": "ray.head.default", "auth": {}, "upscaling_speed": 1.0, "idle_timeout_minutes": 0.1,
    "docker": {}, "initialization_commands": [], "setup_commands": [], "head_setup_commands": [],
    "worker_setup_commands": [], "head_start_ray_commands": [], "worker_start_ray_commands": [],
    "file_mounts": {}, "cluster_synced_files": [], "file_mounts_sync_continuously": False, "rsync_exclude": [],
    "rsync_filter": [],
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ScopedAutoscalingCluster(AutoscalingCluster):
    """``AutoscalingCluster(head_resources, worker_node_types, **config)``, started on a port
    and temp dir of its own and stopped alone (see the module's docstring). ``address`` is
    the head's GCS address, for ``ray.init(address=...)``."""

    def __init__(self, head_resources: dict, worker_node_types: dict, **config_kwargs):
        self.name = f"raymoe-autoscaling-{uuid.uuid4().hex[:8]}"
        self.port = _free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.temp_dir = tempfile.mkdtemp(prefix="ray-autoscaling-")
        super().__init__(head_resources, worker_node_types, **config_kwargs)

    def _generate_config(self, head_resources, worker_node_types, autoscaler_v2=False, **config_kwargs):
        config = json.loads(json.dumps(BASE))
        config["provider"]["gcs_address"] = self.address
        config["available_node_types"] = dict(worker_node_types)
        config["available_node_types"]["ray.head.default"] = {"resources": dict(head_resources), "node_config": {},
                                                              "max_workers": 0}
        config.update(config_kwargs)
        return config

    def start(self, _system_config=None, override_env=None):
        config_path = os.path.join(self.temp_dir, "autoscaling.json")
        with open(config_path, "w") as f:
            json.dump(self._config, f)
        head = dict(self._head_resources)
        cmd = [sys.executable, "-m", "ray.scripts.scripts", "start", "--head", f"--port={self.port}",
               f"--temp-dir={self.temp_dir}", f"--autoscaling-config={config_path}", "--include-dashboard=false",
               f"--num-cpus={head.pop('CPU', 0)}", f"--num-gpus={head.pop('GPU', 0)}"]
        if head:
            cmd.append(f"--resources={json.dumps(head)}")
        if _system_config is not None:
            cmd.append(f"--system-config={json.dumps(_system_config, separators=(',', ':'))}")
        env = dict(os.environ, AUTOSCALER_UPDATE_INTERVAL_S="1", RAY_FAKE_CLUSTER="1",
                   RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", RAY_AUTH_MODE="disabled", **{MARKER: self.name}, **(override_env or {}))
        subprocess.run(cmd, env=env, check=True, timeout=120, stdout=subprocess.DEVNULL)

    def connect(self) -> None:
        """``ray.init`` this process as the cluster's driver, without Ray's token authentication,
        as the cluster runs (``RAY_AUTH_MODE=disabled`` in ``start``). A process that has
        turned token mode on before (cluster/ray_connect.py's ``use_token_if_available`` does,
        in ``os.environ``, wherever ~/.ray/auth_token exists: an earlier test in the same
        pytest process) would otherwise connect with a token, and the GCS takes that driver for
        dead: its first actor is "cancelled before it started running" (reproduced alone with
        RAY_AUTH_MODE=token). The mode stays disabled in this process afterwards."""
        import ray
        from ray._raylet import Config

        os.environ["RAY_AUTH_MODE"] = "disabled"
        Config.initialize("")  # Ray caches its config in C++: re-read the environment
        ray.init(address=self.address)

    def shutdown(self):
        stop(self.name, grace_s=6)
        shutil.rmtree(self.temp_dir, ignore_errors=True)
