"""A running deployment's actors, found by name.

cluster/deploy.py starts a deployment's actors as ``{name}-router-{r}``, ``{name}-worker-{w}``
and ``{name}-controller`` in the Ray namespace :data:`NAMESPACE`; :func:`attach_actors` finds
them again, however many processes look: each HTTP ingress replica (actors/ingress.py)
attaches this way, and ``cluster/deploy.py::attach`` builds its ``Deployment`` on it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import ray

NAMESPACE = "raymoe"  # where named actors live, whoever created them (a CLI, a Serve replica)
ATTACH_TIMEOUT_S = 60.0  # for the controller's status and the workers' info


@dataclass
class AttachedActors:
    """Handles of a running deployment's actors, with the controller's status and each
    worker's info as they answered when found."""

    routers: list[Any]
    workers: list[Any]
    controller: Any
    status: dict[str, Any]
    worker_infos: list[dict[str, Any]]


def attach_actors(name: str, routers: int, workers: int, namespace: str = NAMESPACE) -> AttachedActors:
    """The running deployment ``name`` (``routers`` routers, ``workers`` expert workers, or as
    many as its controller reports live after a resize), found by its actors' names; raises
    RuntimeError naming the first actor not found."""
    def actor(suffix: str) -> Any:
        try:
            return ray.get_actor(f"{name}-{suffix}", namespace=namespace)
        except ValueError:
            raise RuntimeError(f"no running raymoe deployment {name!r} in Ray namespace {namespace!r}: "
                               f"actor {name}-{suffix} not found (start it with raymoe serve)") from None

    controller = actor("controller")
    status = ray.get(controller.status.remote(), timeout=ATTACH_TIMEOUT_S)
    routers = status.get("num_routers", routers)  # the live sizes: a resize may have changed them
    router_handles = [actor(f"router-{r}") for r in range(routers)]
    workers = status.get("workers", workers)  # (actors/resize.py, actors/router_resize.py)
    worker_handles = [actor(f"worker-{w}") for w in range(workers)]
    infos = ray.get([w.info.remote() for w in worker_handles], timeout=ATTACH_TIMEOUT_S)
    return AttachedActors(router_handles, worker_handles, controller, status, infos)
