"""Bring a cluster config up on Ray: expert workers in a placement group, routers, groups.

1. Check the checkpoint against its config before any actor starts.
2. Reserve one bundle per ``placement.workers_per_node`` expert workers (a GPU each; a sliver
   of CPU on CPU-only machines, so the config's counts decide how many actors start, whatever
   the core count), spread over nodes by ``placement.node_strategy``.
3. Build the one :class:`PlacementTable` from the config and the bundles' nodes.
4. Start the workers (each loads only its own experts) and the routers.
5. Once every actor has loaded its weights, routers and workers join the deployment's one
   expert-parallel group (router 0 makes the rendezvous).
"""

from __future__ import annotations

import itertools
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from raymoe.actors.attach import NAMESPACE, attach_actors
from raymoe.actors.controller import Controller
from raymoe.actors.recovery import join_ep_group
from raymoe.actors.router import StepFailure
from raymoe.actors.router_spec import LiveRouters, RouterSpec, live_router_handles, start_router
from raymoe.actors.worker_spec import (CPU_SLIVER, LiveWorkers, WorkerSpec, live_worker_handles, start_worker,
                                       worker_bundle)
from raymoe.cluster.config import ClusterConfig
from raymoe.cluster.gpu_env import gpu_actor_env
from raymoe.cluster.ray_connect import connect, requested_address
from raymoe.engine.checkpoint import Checkpoint
from raymoe.engine.engine import EngineConfig, RequestOutput
from raymoe.engine.host_memory import allocator_env
from raymoe.engine.sampling_params import SamplingParams
from raymoe.engine.scheduler import SchedulerConfig
from raymoe.engine.weights import validate_checkpoint
from raymoe.kernels.comm import CommBackend
from raymoe.moe.capacity import CapacityConfig
from raymoe.moe.memory_plan import worker_pool_rows
from raymoe.moe.model_config import ModelConfig
from raymoe.engine.hf_config import load_model_config
from raymoe.moe.placement import PlacementTable
from raymoe.moe.rebalance_policy import RebalancePolicy

class RequestFailed(RuntimeError):
    """A request's step failed on its router (for example a collective's deadline passed)."""


ACTOR_CONCURRENCY_SLACK = 4  # calls a worker must answer at once (info, migration, re-join)


def engine_config(config: ClusterConfig) -> EngineConfig:
    return EngineConfig(
        dtype=config.dtype.value,
        device="cuda" if _uses_gpus(config) else "cpu",
        block_size=config.engine.block_size,
        max_model_len=config.engine.max_model_len,
        kv_cache_bytes=config.engine.kv_cache_bytes,
        enable_prefix_caching=config.engine.enable_prefix_caching,
        scheduler=SchedulerConfig(config.engine.max_num_seqs, config.engine.max_num_batched_tokens,
                                  config.engine.prefill_step_slowdown),
        capacity=CapacityConfig(config.capacity.factor, config.capacity.overflow),
        micro_batch_min_seqs=config.engine.micro_batch_min_seqs,
    )


def _uses_gpus(config: ClusterConfig) -> bool:
    device = config.device.value
    if device == "auto":
        return bool(ray.cluster_resources().get("GPU", 0))
    return device == "cuda"


@dataclass
class Deployment:
    config: ClusterConfig
    model_config: ModelConfig
    placement: PlacementTable
    routers: list[Any]
    workers: list[Any]
    controller: Any
    group: Any
    worker_nodes: list[str]
    name: str = "raymoe"
    namespace: str = NAMESPACE
    _next_request: Any = field(default_factory=itertools.count)

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[RequestOutput]:
        """Run prompts on the routers; outputs in prompt order."""
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        return self.run([(f"req-{next(self._next_request)}", p, sp) for p, sp in zip(prompts, params_list)])

    def run(self, requests: list[tuple[str, list[int], SamplingParams]]) -> list[RequestOutput]:
        """Spread ``(request_id, prompt_ids, params)`` over the routers round robin; outputs in order."""
        shares: list[list[int]] = [list(range(r, len(requests), len(self.routers))) for r in range(len(self.routers))]
        refs = [(share, router.generate.remote([requests[i] for i in share]))
                for router, share in zip(self.routers, shares) if share]
        results: list[RequestOutput | None] = [None] * len(requests)
        failures = []
        for share, ref in refs:
            for index, output in zip(share, ray.get(ref)):
                if isinstance(output, StepFailure):
                    failures.append(output)
                results[index] = output
        if failures:
            raise RequestFailed(f"{len(failures)} of {len(requests)} requests failed: {failures[0].message}")
        return results  # type: ignore[return-value]

    def score(self, prompts: list[list[int]], router: int = 0):
        return ray.get(self.routers[router].score.remote(prompts))

    def telemetry(self) -> list[dict[str, Any]]:
        return ray.get([router.get_telemetry.remote() for router in self.routers])

    def status(self) -> dict[str, Any]:
        return ray.get(self.controller.status.remote())

    def rebalance(self) -> dict[str, Any]:
        return ray.get(self.controller.rebalance.remote(True))

    def resize(self, workers: int, **options: Any) -> dict[str, Any]:
        """Grow or shrink the expert pool to ``workers`` while serving (the controller's
        ``resize``, actors/resize.py); ``self.workers`` then lists the live workers."""
        report = ray.get(self.controller.resize.remote(workers, **options))
        # (the handles this process made stay: dropping an owner's last handle ends the actor)
        live = live_worker_handles(self.name, self.namespace)
        self.workers = [*self.workers[:len(live)], *live[len(self.workers):]]
        return report

    def resize_routers(self, routers: int, **options: Any) -> dict[str, Any]:
        """Grow or shrink the router pool to ``routers`` while serving (the controller's
        ``resize_routers``, actors/router_resize.py); ``self.routers`` then lists the live ones."""
        report = ray.get(self.controller.resize_routers.remote(routers, **options))
        count = ray.get(self.controller.serving_routers.remote())["routers"]  # (an ended router's name may
        live = live_router_handles(self.name, self.namespace)[:count]  # still resolve for a moment)
        self.routers = [*self.routers[:count], *live[len(self.routers):]]
        return report

    def shutdown(self) -> None:
        # Workers and routers a resize added live on: find every live one by name, and the bundles.
        live = live_worker_handles(self.name, self.namespace)
        self.workers = list(self.workers) + [w for w in live if w not in self.workers]
        self.routers = list(self.routers) + [r for r in live_router_handles(self.name, self.namespace)
                                             if r not in self.routers]
        try:
            ray.get(self.controller.stop.remote(), timeout=15)
        except (ray.exceptions.RayError, TimeoutError):
            pass
        try:
            ray.get([router.shutdown.remote() for router in self.routers], timeout=15)
        except (ray.exceptions.RayError, TimeoutError):
            pass  # a dead or stuck router is killed below all the same
        for actor in [self.controller, *self.routers, *self.workers]:
            ray.kill(actor, no_restart=True)
        remove_placement_group(self.group)
        from ray._raylet import PlacementGroupID
        from ray.util.placement_group import PlacementGroup

        for group in placement_group_table().values():  # a grow's bundles (actors/resize.py)
            if (group.get("name") or "").startswith(f"{self.name}-resize-") and group.get("state") != "REMOVED":
                remove_placement_group(PlacementGroup(PlacementGroupID(bytes.fromhex(group["placement_group_id"]))))


def attach(config: ClusterConfig, name: str = "raymoe", namespace: str = NAMESPACE) -> Deployment:
    """The running deployment ``name`` (started by :func:`deploy`, e.g. by ``raymoe serve``),
    found by its actors' names (actors/attach.py, as each HTTP ingress replica finds it)."""
    found = attach_actors(name, config.routers, config.expert_workers, namespace)
    status = found.status
    placement = PlacementTable.from_phy2log(status["placement"], status["slots_per_worker"],
                                            load_model_config(config.model).num_experts, status["worker2node"],
                                            status["epoch"])
    from ray.util import get_placement_group

    return Deployment(config, load_model_config(config.model), placement, found.routers, found.workers,
                      found.controller, get_placement_group(f"{name}-workers"),
                      [info["node_id"] for info in found.worker_infos], name, namespace)


def _wait_loaded(workers: list[Any], routers: list[Any], timeout_s: float) -> None:
    """Wait until every actor is constructed (experts and dense weights loaded), saying how far along."""
    pending = {actor.info.remote(): name
               for actor, name in [*[(w, f"worker {i}") for i, w in enumerate(workers)],
                                   *[(r, f"router {i}") for i, r in enumerate(routers)]]}
    total, deadline = len(pending), time.monotonic() + timeout_s
    while pending:
        done, _ = ray.wait(list(pending), num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
        if not done:
            raise RuntimeError(f"{', '.join(pending.values())} did not finish loading within {timeout_s:.0f} s "
                               "(raise the load timeout for a large checkpoint, or check the actors' logs)")
        ray.get(done)  # raises the actor's own error if loading failed
        name = pending.pop(done[0])
        print(f"raymoe: {name} loaded ({total - len(pending)}/{total})", file=sys.stderr, flush=True)


def deploy(config: ClusterConfig, name: str = "raymoe", ready_timeout_s: float = 120.0,
           namespace: str = NAMESPACE, load_timeout_s: float = 3600.0) -> Deployment:
    """Start the actors a config describes on the connected Ray cluster.

    Actors are named ``{name}-worker-{w}``, ``{name}-router-{r}`` and ``{name}-controller`` in
    the Ray namespace ``namespace``, so ``raymoe status`` finds them (and Ray's own tools where
    the cluster runs a dashboard: docs/DEPLOY.md, section 4).
    """
    # Step 1: the checkpoint must match its config before anything starts.
    model_config = load_model_config(config.model)
    validate_checkpoint(Checkpoint(config.model), model_config)
    gpus = _uses_gpus(config)
    backend = CommBackend(config.comm.backend.value)
    if backend is CommBackend.NCCL and not gpus:
        raise ValueError("comm.backend: nccl needs device cuda (GPUs); use sockets, gloo or auto on CPU-only machines")
    if backend in (CommBackend.GLOO, CommBackend.SOCKETS) and gpus:
        raise ValueError(f"comm.backend: {backend.value} moves CPU tensors only, but this deployment runs on GPUs "
                         "(device resolved to cuda); set comm.backend: nccl (or auto), or device: cpu")
    backend = CommBackend.NCCL if backend is CommBackend.AUTO and gpus else (
        CommBackend.SOCKETS if backend is CommBackend.AUTO else backend)
    # Step 2: one bundle per node-share of `workers_per_node` workers (a GPU each; a sliver
    # of CPU on CPU-only machines), spread over nodes as asked; worker w goes into bundle
    # w // workers_per_node, so STRICT_SPREAD puts that many workers on each node.
    per_node = config.placement.workers_per_node
    num_bundles = -(-config.expert_workers // per_node)
    bundle = worker_bundle(gpus, dict(config.placement.worker_resources), per_node)
    group = placement_group([dict(bundle) for _ in range(num_bundles)],
                            strategy=config.placement.node_strategy.value, name=f"{name}-workers")
    try:
        ray.get(group.ready(), timeout=ready_timeout_s)
    except ray.exceptions.GetTimeoutError:
        remove_placement_group(group)
        raise RuntimeError(
            f"could not reserve {num_bundles} expert-worker bundles {bundle} ({per_node} workers each) with "
            f"{config.placement.node_strategy.value} within {ready_timeout_s:.0f} s; cluster resources: "
            f"{ray.cluster_resources()}, nodes: {len(ray.nodes())}. STRICT_SPREAD needs one node per bundle: "
            f"raise placement.workers_per_node to put more workers on each node."
        ) from None
    bundle_nodes = placement_group_table(group)["bundles_to_node_id"]
    worker_nodes = [bundle_nodes[w // per_node] for w in range(config.expert_workers)]
    node_index = {node: i for i, node in enumerate(dict.fromkeys(worker_nodes))}
    # Step 3: the one placement table.
    placement = config.initial_placement(len(model_config.moe_layers), model_config.num_experts,
                                         worker2node=[node_index[n] for n in worker_nodes])
    # Step 4: actors. Workers load their own experts; routers the dense weights.
    concurrency = config.routers + ACTOR_CONCURRENCY_SLACK
    balancer = config.balancer
    # The rows `raymoe plan memory --config` and serve's memory check count (moe/memory_plan.py).
    spare_rows = worker_pool_rows(placement.slots_per_worker, balancer.enabled, balancer.max_copies_per_rebalance).spare
    # CPU actors: the malloc they start with (engine/host_memory.py; jemalloc where found);
    # GPU actors: NCCL's network settings, comm.nccl_env (cluster/gpu_env.py).
    actor_env = gpu_actor_env(config) if gpus else allocator_env(config.cpu.allocator.value)
    runtime_env = {"runtime_env": {"env_vars": actor_env}} if actor_env else {}
    # One recipe for every worker, also those a resize adds later (actors/worker_spec.py).
    spec = WorkerSpec(name=name, namespace=namespace, model=config.model, dtype=config.dtype.value, gpus=gpus,
                      spare_rows=spare_rows, threads=None if gpus else config.cpu.worker_threads,
                      packed_experts=config.cpu.packed_experts, pin_threads=config.cpu.pin_threads,
                      max_concurrency=concurrency, runtime_env=runtime_env,
                      resources=dict(config.placement.worker_resources))
    workers = [start_worker(spec, w, placement.to_dict(), PlacementGroupSchedulingStrategy(group, w // per_node))
               for w in range(config.expert_workers)]
    # Peers travel by name, never as handles in constructor arguments (LiveWorkers, LiveRouters).
    # (workers by the deployment's name: a resize changes how many there are, actors/worker_spec.py)
    worker_refs = LiveWorkers(workers, name, namespace)
    # One recipe for every router, also those a resize adds later (actors/router_spec.py).
    router_spec = RouterSpec(name=name, namespace=namespace, model=config.model, engine_config=engine_config(config),
                             backend=backend.value, timeout_s=config.comm.timeout_s, gpus=gpus,
                             threads=None if gpus else config.cpu.router_threads,
                             pin_threads=config.cpu.pin_threads, runtime_env=runtime_env,
                             resources=dict(config.placement.router_resources))  # e.g. a `ray up` router node type
    routers = [start_router(router_spec, r, config.routers, placement.to_dict(), worker_refs)
               for r in range(config.routers)]
    # Step 5: every worker has loaded its experts (that can take long: no group deadline
    # covers it), then the one expert-parallel group: routers are ranks 0..R-1, workers follow.
    _wait_loaded(workers, routers, load_timeout_s)
    router_ids = [f"router-{r}" for r in range(config.routers)]
    join_ep_group(routers, workers, list(range(config.expert_workers)), backend.value, config.comm.timeout_s,
                  generation=0)
    # Step 6: the controller (it only reads telemetry and moves weights; it holds none).
    policy = RebalancePolicy(balancer.threshold, balancer.min_gain, balancer.algorithm, balancer.max_copies_per_rebalance)
    groups = {"router_ids": router_ids, "backend": backend.value, "timeout_s": config.comm.timeout_s,
              "wedge_after_s": config.comm.wedge_limit_s()}
    controller = ray.remote(Controller).options(
        # (a call per router may wait in recover(): room for a resize to add routers)
        num_cpus=0 if gpus else CPU_SLIVER, max_concurrency=CONTROLLER_CONCURRENCY + config.routers, max_restarts=-1,
        name=f"{name}-controller",
        namespace=namespace,
    ).remote(LiveRouters(routers, name, namespace), worker_refs,
             placement.to_dict(), policy, balancer.window_steps, balancer.interval_steps,
             balancer.poll_interval_s, balancer.enabled, groups, spec, router_spec=router_spec,
             autoscale=config.autoscale.policy() if config.autoscale is not None else None)
    ray.get(controller.status.remote())  # up and reading telemetry before the first request
    ray.get([router.set_supervisor.remote(controller) for router in routers])
    return Deployment(config, model_config, placement, routers, workers, controller, group, worker_nodes, name,
                      namespace)


CONTROLLER_CONCURRENCY = 36  # the controller's call threads, besides one per router at deploy
GCS_TASK_EVENTS = 10_000  # tasks whose events Ray's GCS keeps, on a Ray raymoe starts (ensure_ray)


def ensure_ray(address: str | None = None) -> None:
    """Connect to ``address`` (or RAY_ADDRESS) exactly as given, or start a Ray of this
    process's own, listening on loopback.

    With no address this never attaches to a cluster it finds by itself: ``ray.init()``
    would join /tmp/ray/ray_current_cluster's cluster or any other one on the machine (a
    test's, another user's), so a local run starts its own with ``address="local"``.
    ``auto`` is used only when it is the address given. Token authentication and errors:
    :mod:`raymoe.cluster.ray_connect` (AuthenticationFailed, ClusterUnreachable)."""
    if ray.is_initialized():
        return
    address = requested_address(address)
    if address:
        connect(address)
        return
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    # Ray starts worker processes at niceness 15 (background work); raymoe's actors are the
    # serving path, so its own Ray runs them at the default priority (an explicit
    # RAY_worker_niceness wins). `ray start` clusters: see cluster/ray-up/*.yaml.
    os.environ.setdefault("RAY_worker_niceness", "0")
    # Ray's GCS keeps the events of its last N tasks for `ray list tasks` (Ray's default N
    # holds hundreds of MB): every request is a few actor calls, so a busy server's GCS grew
    # 71 -> 246 MiB in a 10-minute soak. raymoe does not read them; keep the last 10,000.
    os.environ.setdefault("RAY_task_events_max_num_task_in_gcs", str(GCS_TASK_EVENTS))
    ray.init(address="local", include_dashboard=False)
