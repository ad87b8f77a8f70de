"""The environment of GPU actors: NCCL's network settings, passed through Ray's runtime_env.

NCCL reads its configuration from the environment of the process that creates a
communicator: which interface bootstraps the group (``NCCL_SOCKET_IFNAME``), which network
plugin carries the data (aws-ofi-nccl over EFA on AWS, GPUDirect-TCPX on Google Cloud A3),
and that plugin's own settings (libfabric's ``FI_*``, ``OFI_NCCL_*``, ``NCCL_GPUDIRECTTCPX_*``),
with ``LD_LIBRARY_PATH`` naming where the plugin's library is. The routers and expert workers
are Ray actors, so these are set by the cluster config's ``comm.nccl_env`` and reach every GPU
actor as ``runtime_env={"env_vars": ...}`` (cluster/deploy.py). Ray expands ``${NAME}`` in a
value from the node's environment (``"/opt/amazon/ofi-nccl/lib:${LD_LIBRARY_PATH}"`` appends).

Only names that configure NCCL and its transports are accepted, so a typo or an unrelated
variable is a config error, not a silent no-op: ``NCCL_*``, ``FI_*`` (libfabric), ``OFI_NCCL_*``
(aws-ofi-nccl), ``CUDA_*`` except ``CUDA_VISIBLE_DEVICES`` (Ray assigns each actor its GPU),
and ``LD_LIBRARY_PATH``. cluster/ray-up/aws-p5.yaml and gcp-a3.yaml carry the settings for
their clouds in comments, with where each comes from; docs/DEPLOY.md, "GPU networking".
"""

from __future__ import annotations

import re
from typing import Any, Mapping

NAME = re.compile(r"[A-Z_][A-Z0-9_]*")
PREFIXES = ("NCCL_", "FI_", "OFI_NCCL_", "CUDA_")
EXACT = ("LD_LIBRARY_PATH",)
RESERVED = {"CUDA_VISIBLE_DEVICES": "Ray sets it to each actor's GPU"}


def nccl_env_problem(env: Mapping[str, object]) -> str | None:
    """The first problem of a ``comm.nccl_env`` mapping, starting with its YAML path; else None."""
    for name, value in env.items():
        path = f"comm.nccl_env.{name}"
        if not NAME.fullmatch(name):
            return f"{path}: an environment variable name is upper case letters, digits and '_'; got {name!r}"
        if name in RESERVED:
            return f"{path}: not settable here ({RESERVED[name]})"
        if not (name in EXACT or name.startswith(PREFIXES)):
            return (f"{path}: only NCCL's settings reach the GPU actors through nccl_env: NCCL_*, FI_* (libfabric), "
                    f"OFI_NCCL_* (aws-ofi-nccl), CUDA_* and LD_LIBRARY_PATH; got {name}")
        if isinstance(value, bool) or not isinstance(value, (str, int)):
            return f"{path}: expected a string or an integer; got {value!r}"
        if "\n" in str(value) or "\0" in str(value):
            return f"{path}: a value cannot hold a newline or a NUL"
    return None


def gpu_actor_env(config: Any) -> dict[str, str]:
    """The ``env_vars`` of every GPU actor (router, expert worker) of ``config`` (a
    cluster.config.ClusterConfig, which imports this module: not imported here, so no
    circle): its ``comm.nccl_env``, values as strings (validated when the config was loaded)."""
    return {name: str(value) for name, value in config.comm.nccl_env.items()}
