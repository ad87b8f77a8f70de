"""How a router actor is started: one recipe for deploy (cluster/deploy.py) and for a resize
(actors/router_resize.py), so a router added at runtime gets exactly the resources, options and
engine settings the deploy-time ones got.

:class:`RouterSpec` is plain data (it travels to the controller actor); :func:`start_router`
starts router ``r`` as ``{name}-router-{r}`` in the Ray namespace. :class:`LiveRouters` is the
routers' handles as a restartable actor's constructor argument (actors/live_actors.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import ray

from raymoe.actors.live_actors import LiveActors, live_handles
from raymoe.actors.router import Router
from raymoe.actors.worker_spec import CPU_SLIVER
from raymoe.engine.engine import EngineConfig

ROUTER_CONCURRENCY = 32  # threads a router answers calls on


@dataclass(frozen=True)
class RouterSpec:
    name: str  # the deployment's name: actors are {name}-router-{r}
    namespace: str
    model: str
    engine_config: EngineConfig
    backend: str
    timeout_s: float
    gpus: bool
    threads: int | None  # cpu.router_threads (None on GPUs)
    pin_threads: bool  # cpu.pin_threads: router r's step thread pins itself to core r (one thread each)
    runtime_env: dict[str, Any] = field(default_factory=dict)  # {"runtime_env": {...}} or {}
    resources: dict[str, float] = field(default_factory=dict)  # placement.router_resources

    def actor_name(self, router: int) -> str:
        return f"{self.name}-router-{router}"


def start_router(spec: RouterSpec, router: int, num_routers: int, placement: dict[str, Any], workers: Any,
                 detached: bool = False) -> Any:
    """Start router ``router`` (its constructor loads the dense weights and warms its kernels);
    ``workers`` is the deployment's LiveWorkers. ``detached``: it outlives the process that
    starts it (a resize starts routers from the controller actor; a restarted controller must
    not take them with it)."""
    pin = router if not spec.gpus and spec.pin_threads and spec.threads == 1 else None
    options = dict(
        num_cpus=0 if spec.gpus else CPU_SLIVER, num_gpus=1 if spec.gpus else 0,
        # Calls return at once (requests and aborts wait in the router's inbox), except one
        # subscription stream per ingress replica and run-batch's generate calls.
        max_concurrency=ROUTER_CONCURRENCY, max_restarts=-1, resources=dict(spec.resources),
        name=spec.actor_name(router), namespace=spec.namespace, **spec.runtime_env,
    )
    if detached:
        options["lifetime"] = "detached"
    return ray.remote(Router).options(**options).remote(
        f"router-{router}", spec.model, spec.engine_config, placement, workers, spec.backend, spec.timeout_s,
        router, num_routers, spec.threads, pin)


def live_router_handles(name: str, namespace: str) -> list[Any]:
    """``{name}-router-0``, ``-1``, ... up to the first name Ray does not know."""
    return live_handles(name, namespace, "router")


class LiveRouters(LiveActors):
    """The deployment's routers' handles, looked up by name where unpickled
    (actors/live_actors.py): a restarted controller sees the routers a resize left."""

    role = "router"
