"""The HTTP ingress as a Ray Serve application, built from a cluster config.

The ingress (actors/ingress.py) only attaches by name to a deployment that is running; the
deployment's lifecycle is the cluster's:

- :func:`ingress_app` (``raymoe serve``, cluster/serve_cli.py, which starts the deployment
  first): ``serve.replicas`` replicas (or Serve's autoscaling, ``serve.autoscaling`` passed
  through), each attached to the deployment by name.
- :func:`build_app`, the app builder for ``serve run`` / ``serve deploy``
  (``import_path: raymoe.cluster.serve_app:build_app``, the config's fields under ``args``):
  one replica, :class:`DeployingIngress`, that starts the deployment itself
  (cluster/deploy.py) and then attaches to it, so the deployment lives and dies with it.

Replicas get :class:`raymoe.actors.ingress.IngressSettings` (:func:`ingress_settings`): the
config's API keys reach them only as digests (:func:`config_key_digests`).
"""

from __future__ import annotations

import os
from typing import Any

import msgspec
from ray import serve

from raymoe.actors.front_door import PROBE_HEADROOM, FrontDoorPolicy, api_key_digests
from raymoe.actors.ingress import IngressSettings, OpenAIIngress
from raymoe.cluster.config import ClusterConfig, parse_cluster_config
from raymoe.cluster.deploy import deploy

BUILD_APP_DEPLOYMENT = "raymoe"  # the name of the deployment a `serve run` replica starts


def serve_slots(config: ClusterConfig) -> int:
    """Serve's ``max_ongoing_requests`` for a replica: above the front door's own cap, so the
    probes it never refuses (/health, /metrics) find a slot when the cap is reached."""
    return config.serve.max_open_requests + PROBE_HEADROOM


def public_config(config: ClusterConfig) -> dict[str, Any]:
    """The config as a replica receives it: without API keys or the key file's path (they get digests)."""
    serve_section = msgspec.structs.replace(config.serve, api_keys=(), api_key_file=None)
    return msgspec.structs.replace(config, serve=serve_section).to_dict()


def config_key_digests(config: ClusterConfig, extra_keys: tuple[str, ...] = ()) -> tuple[bytes, ...]:
    """Digests of the config's API keys, its key file's, ``RAYMOE_API_KEY`` and ``extra_keys``
    (raises :class:`raymoe.actors.front_door.ApiKeyError` naming a source that cannot be used)."""
    return api_key_digests((*config.serve.api_keys, *extra_keys), config.serve.api_key_file)


def ingress_settings(config: ClusterConfig, attach_to: str, key_digests: tuple[bytes, ...] = ()) -> IngressSettings:
    """What each replica of ``config``'s ingress needs: the deployment ``attach_to`` to attach
    to, the model, the edge (``key_digests``: SHA-256 of each API key)."""
    edge = config.serve
    # A router batches max_num_seqs requests and queues at most max_queued_per_router more;
    # each replica admits its share of that (it sees only its own requests in flight).
    replicas = edge.replicas if edge.autoscaling is None else max(1, int(edge.autoscaling.get("min_replicas", 1)))
    return IngressSettings(
        deployment=attach_to, routers=config.routers, expert_workers=config.expert_workers, model=config.model,
        served_model_name=edge.served_model_name or config.model.rstrip("/").rsplit("/", 1)[-1],
        max_model_len=config.engine.max_model_len,
        admission_limit=-(-(config.engine.max_num_seqs + edge.max_queued_per_router) // replicas),
        max_body_bytes=edge.max_body_bytes, header_timeout_s=edge.header_timeout_s,
        max_migrations=edge.max_migrations, delta_channel=edge.delta_channel,
        front_door=FrontDoorPolicy(
            key_digests=tuple(key_digests), metrics_need_key=edge.metrics_need_key, enable_docs=edge.enable_docs,
            cors_allow_origins=edge.cors_allow_origins, body_timeout_s=edge.body_timeout_s,
            body_min_bytes_per_s=edge.body_min_bytes_per_s, max_open_requests=edge.max_open_requests,
            max_requests_per_client=edge.max_requests_per_client))


def ingress_app(config: ClusterConfig, admin_token: str | None, attach_to: str,
                key_digests: tuple[bytes, ...] = ()) -> serve.Application:
    """The HTTP ingress of a running deployment: ``serve.replicas`` replicas (or Serve's
    autoscaling, ``serve.autoscaling`` passed through), each attached to it by name."""
    options: dict[str, Any] = {"num_replicas": config.serve.replicas}
    if config.serve.autoscaling is not None:
        options = {"autoscaling_config": dict(config.serve.autoscaling)}
    options["max_ongoing_requests"] = serve_slots(config)
    return OpenAIIngress.options(**options).bind(ingress_settings(config, attach_to, key_digests), admin_token)


class DeployingIngress(OpenAIIngress.func_or_class):
    """An ingress replica that first starts the deployment it serves (``serve run``), then
    attaches to it like any replica: the actors are this replica's, so they live and die with it."""

    async def __init__(self, config: dict[str, Any], settings: IngressSettings, admin_token: str | None = None):
        self.owned_deployment = deploy(parse_cluster_config(config), name=settings.deployment,
                                       namespace=settings.namespace)
        await super().__init__(settings, admin_token)


def build_app(args: dict[str, Any]) -> serve.Application:
    """App builder for ``serve run`` / ``serve deploy``: ``args`` is a raymoe cluster config.

    ``import_path: raymoe.cluster.serve_app:build_app`` with the config's fields under ``args``.
    """
    config = parse_cluster_config(dict(args))  # validate here: errors surface before any actor starts
    return OpenAIIngress.options(func_or_class=DeployingIngress, max_ongoing_requests=serve_slots(config)).bind(
        public_config(config), ingress_settings(config, BUILD_APP_DEPLOYMENT, config_key_digests(config)),
        os.environ.get("RAYMOE_ADMIN_TOKEN"))
