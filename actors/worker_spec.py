"""How an expert worker actor is started: one recipe for deploy (cluster/deploy.py) and for a
resize (actors/resize.py), so a worker added at runtime gets exactly the resources and options
the deploy-time ones got.

:class:`WorkerSpec` is plain data (it travels to the controller actor); :func:`start_worker`
starts worker ``w`` as ``{name}-worker-{w}`` in the Ray namespace, with the placement it is
built with (a worker loads only the experts that placement gives it: none, for a worker a
resize adds, whose slots start empty and are filled by copies from live workers).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import ray

from raymoe.actors.live_actors import LiveActors, live_handles

from raymoe.actors.expert_worker import ExpertWorker

CPU_SLIVER = 0.01  # CPU share of an actor on a CPU-only machine


def worker_bundle(gpus: bool, resources: dict[str, float], workers: int = 1) -> dict[str, float]:
    """The placement-group bundle of ``workers`` expert workers: a GPU each (else a CPU
    sliver each), plus each worker's custom ``resources`` (placement.worker_resources)."""
    bundle = {"GPU": workers, "CPU": CPU_SLIVER * workers} if gpus else {"CPU": CPU_SLIVER * workers}
    return {**bundle, **{name: amount * workers for name, amount in resources.items()}}


@dataclass(frozen=True)
class WorkerSpec:
    name: str  # the deployment's name: actors are {name}-worker-{w}
    namespace: str
    model: str
    dtype: str
    gpus: bool
    spare_rows: int  # extra pool rows per MoE layer (moe/memory_plan.py::worker_pool_rows)
    threads: int | None  # cpu.worker_threads (None on GPUs, and on CPUs where it is unset: the worker chooses)
    packed_experts: bool
    pin_threads: bool  # cpu.pin_threads: worker w's serving thread pins itself to core w
    max_concurrency: int
    runtime_env: dict[str, Any] = field(default_factory=dict)  # {"runtime_env": {...}} or {}
    # placement.worker_resources: custom Ray resources each worker's bundle asks for, so that
    # bundles fit only the nodes that have them (a `ray up` file's expert node type), and
    # Ray's autoscaler launches such a node when none has room (docs/DEPLOY.md)
    resources: dict[str, float] = field(default_factory=dict)

    def bundle(self, workers: int = 1) -> dict[str, float]:
        """One placement-group bundle for ``workers`` workers (a GPU each; a CPU sliver; each
        worker's ``resources``)."""
        return worker_bundle(self.gpus, self.resources, workers)

    def actor_name(self, worker: int) -> str:
        return f"{self.name}-worker-{worker}"


def start_worker(spec: WorkerSpec, worker: int, placement: dict[str, Any], scheduling_strategy: Any,
                 detached: bool = False) -> Any:
    """Start expert worker ``worker`` (its constructor loads its experts of ``placement``).

    ``detached``: the actor outlives the process that starts it. A resize starts workers from
    the controller actor, and a non-detached actor dies with its owner: a restarted
    controller must not take the workers it added with it (deploy's shutdown kills them)."""
    # (the worker pins itself only where it computes on one thread: actors/expert_worker.py)
    pin = worker if not spec.gpus and spec.pin_threads else None
    options = dict(
        num_cpus=0 if spec.gpus else CPU_SLIVER, num_gpus=1 if spec.gpus else 0, max_concurrency=spec.max_concurrency,
        max_restarts=-1,  # a crashed worker is restarted; the controller reloads its experts
        name=spec.actor_name(worker), namespace=spec.namespace, scheduling_strategy=scheduling_strategy,
        **spec.runtime_env,
    )
    if detached:
        options["lifetime"] = "detached"
    return ray.remote(ExpertWorker).options(**options).remote(
        worker, spec.model, spec.dtype, "cuda" if spec.gpus else "cpu", placement, spec.spare_rows, spec.threads,
        spec.packed_experts, pin)


class LiveWorkers(LiveActors):
    """The deployment's expert workers' handles, looked up by name where unpickled
    (actors/live_actors.py): a restarted router or controller sees the pool a resize left."""

    role = "worker"


def live_worker_handles(name: str, namespace: str) -> list[Any]:
    """``{name}-worker-0``, ``-1``, ... up to the first name Ray does not know."""
    return live_handles(name, namespace, "worker")
