"""`ray up` / `ray down` on hosts you already have, stopping only this cluster's Ray.

Ray's own on-premise provider (``provider: local``) runs a literal ``ray stop`` on the head
when you `ray down`: that stops every Ray process on the host (other users' clusters, a
service, a test's cluster) when a ``ray`` is on the login shell's PATH, and fails, leaving
the cluster running while `ray down` still says "No nodes remaining.", when none is. It
stops nothing on the workers.

:class:`OnPremNodeProvider` is that same provider (same ``head_ip``/``worker_ips``, same state
files, same SSH), with two changes, selected in cluster/ray-up/local.yaml by::

    provider:
      type: external
      module: raymoe.cluster.ray_up_provider.OnPremNodeProvider
      ray_stop_command: <what stops this cluster's Ray on one node>

- every ``ray stop`` that Ray itself sends to a node (`ray down`, `ray kill-random-node`)
  runs ``ray_stop_command`` instead (cluster/ray-up/local.yaml: ``python -m
  raymoe.cluster.ray_up_node stop CLUSTER`` from the cluster's own virtualenv);
- terminating a node (`ray down` does it for the head and every worker, the head's
  autoscaler for a worker it replaces) runs ``ray_stop_command`` on that node over SSH
  before marking it terminated, so `ray down` leaves no Ray of this cluster on any host.

It must be importable where `ray up`/`ray down` run (``pip install -e .`` in the repository)
and on the head (the setup commands install raymoe into the head's virtualenv, whose Python
runs the autoscaler).
"""

from __future__ import annotations

import logging
import subprocess
from typing import Any

from ray.autoscaler._private.command_runner import SSHCommandRunner
from ray.autoscaler._private.local.node_provider import LocalNodeProvider

logger = logging.getLogger(__name__)


class _QuietLegacyFields(logging.Filter):
    """Ray's defaults for ``type: external`` carry empty legacy fields (head_node,
    worker_nodes) that its config preparation drops with a warning, every 5 s on the head's
    autoscaler: nothing to act on, so not logged."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Dropping the empty legacy field" not in record.getMessage()


logging.getLogger("ray.autoscaler._private.util").addFilter(_QuietLegacyFields())

RAY_STOP = "ray stop"
# cluster name -> the auth section Ray last handed this process for it (ssh_user,
# ssh_private_key, ssh_proxy_command): terminate_node is not given it, the runners are.
_AUTH: dict[str, dict[str, Any]] = {}


class _ScopedStopRunner(SSHCommandRunner):
    """Ray's SSH runner, with Ray's own host-wide ``ray stop`` replaced by the cluster's."""

    def __init__(self, stop_command: str, **kwargs):
        super().__init__(**kwargs)
        self._stop_command = stop_command

    def run(self, cmd: str | None = None, *args, **kwargs):
        if cmd is not None and cmd.strip() == RAY_STOP:
            cmd = self._stop_command
        return super().run(cmd, *args, **kwargs)


class OnPremNodeProvider(LocalNodeProvider):
    """Ray's LocalNodeProvider whose `ray stop` and node termination stop only this cluster."""

    def __init__(self, provider_config: dict[str, Any], cluster_name: str):
        super().__init__(provider_config, cluster_name)
        self.stop_command = provider_config.get("ray_stop_command")
        if not self.stop_command:
            raise ValueError("provider.ray_stop_command is required: the command that stops this cluster's "
                             "Ray on one node (cluster/ray-up/local.yaml)")

    @staticmethod
    def bootstrap_config(cluster_config: dict[str, Any]) -> dict[str, Any]:
        return cluster_config

    def get_command_runner(self, log_prefix, node_id, auth_config, cluster_name, process_runner,
                           use_internal_ip, docker_config=None):
        if docker_config and docker_config.get("container_name"):
            raise ValueError("raymoe's on-premise provider does not run Ray in Docker containers")
        _AUTH[cluster_name] = dict(auth_config)
        return _ScopedStopRunner(
            self.stop_command, log_prefix=log_prefix, node_id=node_id, provider=self, auth_config=auth_config,
            cluster_name=cluster_name, process_runner=process_runner, use_internal_ip=use_internal_ip)

    def terminate_node(self, node_id: str) -> None:
        auth = _AUTH.get(self.cluster_name)
        if auth is None:
            logger.warning("raymoe: no SSH settings known for %s; marking %s terminated without stopping its Ray",
                           self.cluster_name, node_id)
        else:
            runner = self.get_command_runner(f"raymoe terminate {node_id}: ", node_id, auth, self.cluster_name,
                                             subprocess, use_internal_ip=False)
            try:
                runner.run(self.stop_command, timeout=120)
            except Exception as error:  # an unreachable host must not keep the rest from being torn down
                logger.warning("raymoe: could not stop Ray of %s on %s: %s", self.cluster_name, node_id, error)
        super().terminate_node(node_id)

