"""The cluster config: YAML in, frozen typed structs out, validated once at load.

A minimal file::

    model: /path/to/checkpoint
    device: cpu            # auto | cpu | cuda
    dtype: float32         # auto | float32 | bfloat16 | float16
    routers: 2             # router actors (data parallel over requests)
    expert_workers: 3      # one per GPU
    placement:
      strategy: round_robin        # contiguous | round_robin | explicit
      redundant_slots_per_worker: 1
    serve:
      host: 127.0.0.1
      port: 8000

An explicit placement maps worker id -> logical experts it holds; ``layers`` replaces that
map for the given MoE-layer indices (0-based over MoE layers)::

    placement:
      strategy: explicit
      experts: {0: [0, 1, 2], 1: [3, 4, 5]}
      layers:
        3: {0: [3, 4, 5], 1: [0, 1, 2]}

Every error names the file and the field's YAML path (see ``config_errors``). The structs
hold plain values only, never live handles; each component receives its own sub-struct.
"""

from __future__ import annotations

import enum
import os
from collections.abc import Hashable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import msgspec
import numpy as np
import yaml

from raymoe.cluster.config_errors import ConfigError, describe_validation_error
from raymoe.cluster.gpu_env import nccl_env_problem
from raymoe.engine.prefill_pacer import DEFAULT_PREFILL_STEP_SLOWDOWN
from raymoe.kernels.comm.factory import CommBackend
from raymoe.moe.balancer import BalancerAlgorithm
from raymoe.moe.capacity import OverflowPolicy

if TYPE_CHECKING:
    from raymoe.moe.autoscale_policy import AutoscalePolicy
    from raymoe.moe.placement import PlacementTable

__all__ = [
    "AutoscaleSection",
    "CapacitySection",
    "ClusterConfig",
    "CommBackend",
    "CommSection",
    "ConfigError",
    "DType",
    "Device",
    "EngineSection",
    "NodeStrategy",
    "OverflowPolicy",
    "PlacementSection",
    "PlacementStrategy",
    "ServeSection",
    "load_cluster_config",
    "parse_cluster_config",
]

NonNegative = Annotated[int, msgspec.Meta(ge=0)]
Positive = Annotated[int, msgspec.Meta(ge=1)]
PositiveFloat = Annotated[float, msgspec.Meta(gt=0)]
WorkerMap = dict[NonNegative, list[NonNegative]]  # worker id -> logical experts
# custom Ray resources an actor asks for: name -> amount (placement.worker_resources)
RayResources = dict[str, PositiveFloat]
RAY_BUILTIN_RESOURCES = ("CPU", "GPU", "memory", "object_store_memory")


class Device(enum.Enum):
    AUTO = "auto"  # cuda when available, else cpu
    CPU = "cpu"
    CUDA = "cuda"


class DType(enum.Enum):
    AUTO = "auto"  # the checkpoint's dtype (float16 becomes float32 on the CPU)
    FLOAT32 = "float32"
    BFLOAT16 = "bfloat16"
    FLOAT16 = "float16"


class PlacementStrategy(enum.Enum):
    CONTIGUOUS = "contiguous"  # expert e on worker e // ceil(E / W)
    ROUND_ROBIN = "round_robin"  # expert e on worker e % W
    EXPLICIT = "explicit"  # placement.experts (and placement.layers) say where


class NodeStrategy(enum.Enum):
    """How expert workers spread over nodes: Ray placement group strategies."""

    PACK = "PACK"
    SPREAD = "SPREAD"
    STRICT_SPREAD = "STRICT_SPREAD"


class Allocator(enum.Enum):
    """The malloc of a CPU deployment's router and worker processes (engine/host_memory.py)."""

    JEMALLOC = "jemalloc"  # preloaded where one is found (Ray ships one), else the system's
    SYSTEM = "system"  # the C library's own malloc


class _Section(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    pass


class PlacementSection(_Section):
    strategy: PlacementStrategy = PlacementStrategy.CONTIGUOUS
    redundant_slots_per_worker: NonNegative = 0
    node_strategy: NodeStrategy = NodeStrategy.PACK
    workers_per_node: Positive = 1  # workers sharing one placement-group bundle (one node)
    experts: WorkerMap | None = None  # explicit only: worker -> logical experts
    layers: dict[NonNegative, WorkerMap] | None = None  # explicit only: MoE layer -> map
    # Custom Ray resources added to each expert worker's placement-group bundle (amounts per
    # worker) and to each router actor: with a `ray up` file whose expert node type carries
    # the worker resource (cluster/ray-up/, docs/DEPLOY.md), workers are placed only on
    # expert nodes, and Ray's autoscaler launches one when a deploy or a grow finds no room.
    worker_resources: RayResources = {}
    router_resources: RayResources = {}


# A rank silent this long, and not stepping, is wedged (actors/rank_watch.py), unless comm.wedge_after_s says
# otherwise: WEDGE_FRACTION of comm.timeout_s (found within the exchange deadline), at most
# WEDGE_CAP_S (a probe is answered by the rank's own call threads, whatever its step is doing,
# so a long deadline for slow steps need not mean a long wait for a frozen process).
WEDGE_FRACTION = 0.8
WEDGE_CAP_S = 10.0


class CommSection(_Section):
    backend: CommBackend = CommBackend.AUTO
    timeout_s: PositiveFloat = 30.0
    wedge_after_s: PositiveFloat | None = None  # None: min(0.8 x timeout_s, 10 s)
    # NCCL's settings for every GPU actor (routers, workers), through Ray's runtime_env
    # env_vars: network plugin, interfaces, libfabric (cluster/gpu_env.py, docs/DEPLOY.md).
    nccl_env: dict[str, str | int] = msgspec.field(default_factory=dict)

    def wedge_limit_s(self) -> float:
        """How long a rank may leave the controller's probe unanswered before it is wedged."""
        if self.wedge_after_s is not None:
            return self.wedge_after_s
        return min(WEDGE_FRACTION * self.timeout_s, WEDGE_CAP_S)


class CapacitySection(_Section):
    factor: PositiveFloat = 1.0
    overflow: OverflowPolicy = OverflowPolicy.NONE


class BalancerSection(_Section):
    """The controller: telemetry-driven replication and migration of hot experts."""

    enabled: bool = True
    window_steps: Positive = 1000  # sliding window of router steps (vLLM's default)
    interval_steps: Positive = 100  # router steps between two decisions
    threshold: Annotated[float, msgspec.Meta(gt=0, le=1)] = 0.8  # rebalance only below this balancedness
    min_gain: Annotated[float, msgspec.Meta(ge=0, le=1)] = 0.05  # ...and when the plan gains at least this
    algorithm: BalancerAlgorithm = BalancerAlgorithm.MIGRATION
    max_copies_per_rebalance: Positive = 8  # expert copies per layer and rebalance
    poll_interval_s: PositiveFloat = 1.0  # how often the controller reads the routers' telemetry


class EngineSection(_Section):
    max_num_seqs: Positive = 256
    max_num_batched_tokens: Positive | None = None  # tokens per step; default 512 on CPU, 2048 on GPU
    # while sequences decode, prompt chunks are sized so a step takes about this many times a
    # decode-only step (measured); 0: chunks take the whole max_num_batched_tokens
    prefill_step_slowdown: Annotated[float, msgspec.Meta(ge=0)] = DEFAULT_PREFILL_STEP_SLOWDOWN
    enable_prefix_caching: bool = True
    block_size: Positive = 16
    max_model_len: Positive | None = None  # default: the model's max_position_embeddings
    kv_cache_bytes: Positive = 512 * 2**20
    # a step runs in two ping-ponged micro-batches (one half's attention beside the other's
    # experts) once a router holds this many running sequences; 0: never (docs/BENCHMARKS.md)
    micro_batch_min_seqs: Annotated[int, msgspec.Meta(ge=0)] = 0


class IngressMode(enum.Enum):
    AUTO = "auto"  # direct when `raymoe serve` starts its own Ray, proxy on an existing cluster
    DIRECT = "direct"  # the ingress replica serves HTTP itself (Ray Serve's direct ingress)
    PROXY = "proxy"  # Ray Serve's HTTP proxy in front of the replica


class ServeSection(_Section):
    host: str = "127.0.0.1"  # loopback unless you mean to expose the endpoint
    ingress: IngressMode = IngressMode.AUTO
    port: Annotated[int, msgspec.Meta(ge=1, le=65535)] = 8000
    max_body_bytes: Positive = 1 << 20  # larger request bodies get 413
    max_queued_per_router: Annotated[int, msgspec.Meta(ge=0)] = 256  # beyond max_num_seqs + this: 503
    served_model_name: str | None = None  # default: the checkpoint directory's name
    replicas: Positive = 1  # HTTP ingress replicas (Serve); they share one cluster
    autoscaling: dict[str, Any] | None = None  # Serve's autoscaling_config, passed through (replaces replicas)
    # The edge (actors/front_door.py): keys, content types, docs, CORS, body deadlines.
    api_keys: tuple[str, ...] = ()  # Bearer keys; set: every route but /health (and /admin/*: its own token) needs one
    api_key_file: str | None = None  # one key a line, '#' comments (and RAYMOE_API_KEY, and --api-key)
    metrics_need_key: bool = False  # /metrics behind the API key too
    enable_docs: bool = False  # /docs, /redoc, /openapi.json (off: 404)
    cors_allow_origins: tuple[str, ...] = ()  # origins a browser page may call from; none: CORS off
    header_timeout_s: PositiveFloat = 10.0  # a request's headers must have arrived by then (else 408, closed)
    body_timeout_s: PositiveFloat = 30.0  # a request body must have arrived by then (else 408)
    body_min_bytes_per_s: Annotated[float, msgspec.Meta(ge=0)] = 1024.0  # and this fast after 5 s (0: no minimum)
    max_open_requests: Positive = 4096  # requests in one ingress replica at once (503 beyond; /health, /metrics exempt)
    max_requests_per_client: Positive = 1024  # from one client address at once (429 beyond; raise it behind a load balancer)
    keep_alive_timeout_s: PositiveFloat | None = None  # idle keep-alive connections closed after this (Serve's default)
    max_migrations: Annotated[int, msgspec.Meta(ge=0)] = 3  # moves of one request to another router when its router is lost
    delta_channel: bool = True  # routers' token deltas to the ingress over a socket of their own (false: Ray's stream)


class CpuSection(_Section):
    """Compute threads per actor on CPU-only deployments (GPU deployments ignore it).

    ``router_threads``: torch's intra-op threads for the router's dense part.
    ``worker_threads``: threads that run a layer's experts side by side in a worker (each
    expert's GEMMs stay single-threaded calls, so outputs do not depend on it). Unset, each
    worker chooses by its experts' size (moe/worker_threads.py): 2 where one expert takes
    64 MiB or more in the serving dtype (Mixtral-8x7B's shapes served on 2 cores: TPOT at one
    request 76-77 against 92-96 ms), else 1 (smaller experts measured no gain or a loss).
    ``packed_experts``: workers run float32 experts with oneDNN over a prepacked copy of their
    weights (kernels/packed_linear.py: ~2x faster at decode sizes here, and row-invariant);
    the copy costs the experts' size once more in memory; ``false`` uses torch's default GEMM.
    ``pin_threads``: router ``r``'s step thread and worker ``w``'s serving thread are pinned to
    the ``r``-th and ``w``-th core (actors/cpu_affinity.py): a router and the worker it takes
    turns with share a core, so their hand-offs are same-core wake-ups; only for actors that
    compute on one thread (``router_threads`` / ``worker_threads`` 1).
    ``allocator``: ``jemalloc`` starts the router and worker processes with jemalloc preloaded
    (engine/host_memory.py: a decode step allocates a few hundred small tensors; measured 1-7%
    off a served step here), where a jemalloc library is found; ``system`` keeps the C library's."""

    router_threads: Positive = 1
    worker_threads: Positive | None = None  # None: by the experts' size (moe/worker_threads.py)
    packed_experts: bool = True  # float32 experts over oneDNN-prepacked weights (kernels/packed_linear.py)
    pin_threads: bool = True  # compute threads pinned so a router and a worker share a core (actors/cpu_affinity.py)
    allocator: Allocator = Allocator.JEMALLOC  # the actors' malloc (engine/host_memory.py)


class AutoscaleSection(_Section):
    """Load-driven sizing of the expert pool (moe/autoscale_policy.py; absent: off).

    ``target_rows_per_worker``: expert rows (token x expert assignments) each worker runs per
    MoE layer per router step, averaged over ``window_s``; the pool grows when its workers run
    more than ``target * (1 + band)`` and shrinks when they run fewer than ``target * (1 - band)``,
    to ``ceil(rows / target)`` workers within ``[min_workers, max_workers]``, at most once per
    ``cooldown_s``.

    Routers (on when ``target_requests_per_router`` is set, with ``min_routers`` and
    ``max_routers``): the requests the routers hold (running + waiting sequences), averaged
    over ``window_s``, want ``ceil(requests / target_requests_per_router)`` routers, with the
    same band and cooldown (counted from the last router resize); ``target_queue_s``
    (optional) also grows the pool by one when the mean queue time is above it by the band.
    Without a router target, ``min_routers``/``max_routers`` may only repeat ``routers``."""

    min_workers: Positive
    max_workers: Positive
    target_rows_per_worker: PositiveFloat
    band: Annotated[float, msgspec.Meta(ge=0, lt=1)] = 0.25
    cooldown_s: Annotated[float, msgspec.Meta(ge=0)] = 30.0
    window_s: PositiveFloat = 10.0
    interval_s: PositiveFloat = 2.0
    min_routers: Positive | None = None
    max_routers: Positive | None = None
    target_requests_per_router: PositiveFloat | None = None  # running + waiting sequences a router holds
    target_queue_s: PositiveFloat | None = None  # mean seconds a sequence waits for a place in a batch

    def policy(self) -> "AutoscalePolicy":
        from raymoe.moe.autoscale_policy import AutoscalePolicy

        on = self.target_requests_per_router is not None
        return AutoscalePolicy(self.min_workers, self.max_workers, self.target_rows_per_worker, self.band,
                               self.cooldown_s, self.window_s, self.interval_s,
                               min_routers=self.min_routers if on else None,
                               max_routers=self.max_routers if on else None,
                               target_requests_per_router=self.target_requests_per_router,
                               target_queue_s=self.target_queue_s)


class ClusterConfig(_Section):
    model: str  # checkpoint directory; absolute after loading
    device: Device = Device.AUTO
    dtype: DType = DType.AUTO
    routers: Positive = 1
    expert_workers: Positive = 1
    placement: PlacementSection = PlacementSection()
    comm: CommSection = CommSection()
    capacity: CapacitySection = CapacitySection()
    balancer: BalancerSection = BalancerSection()
    engine: EngineSection = EngineSection()
    serve: ServeSection = ServeSection()
    cpu: CpuSection = CpuSection()
    autoscale: AutoscaleSection | None = None  # absent: the pool keeps its size (raymoe scale still resizes)

    def to_dict(self) -> dict[str, Any]:
        """Plain builtins (enums as their values); ``parse_cluster_config`` reads it back.

        Explicit maps keep their integer keys: ``json.dumps`` and YAML both accept them.
        """
        return msgspec.to_builtins(self)

    def initial_placement(
        self,
        num_layers: int,
        num_experts: int,
        *,
        worker2node: list[int] | np.ndarray | None = None,
        load: np.ndarray | None = None,
    ) -> "PlacementTable":
        """The placement this config asks for, for a model with these MoE dimensions."""
        from raymoe.moe.initial_placement import initial_placement

        placement = self.placement
        return initial_placement(
            num_layers,
            num_experts,
            self.expert_workers,
            placement.strategy,
            redundant_slots_per_worker=placement.redundant_slots_per_worker,
            explicit=placement.experts,
            explicit_layers=placement.layers,
            worker2node=worker2node,
            load=load,
        )


def load_cluster_config(
    path_or_text: str | os.PathLike, *, base_dir: str | os.PathLike | None = None
) -> ClusterConfig:
    """Loads and validates a cluster config from a YAML file (or YAML text).

    A ``str`` holding a newline is taken as YAML text, any other ``str`` or path as a file
    name. A relative ``model`` path is resolved against ``base_dir``, which defaults to the
    file's directory (the working directory for text). Raises :class:`ConfigError`.
    """
    if isinstance(path_or_text, str) and "\n" in path_or_text:
        source, text = "<string>", path_or_text
        default_dir = Path.cwd()
    else:
        path = Path(path_or_text).expanduser()
        source = str(path)
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as exc:
            raise ConfigError(f"{source}: cannot read config: {exc.strerror or exc}") from None
        except UnicodeDecodeError as exc:
            raise ConfigError(f"{source}: a config must be UTF-8 text; byte {exc.start} is not "
                              f"({exc.object[exc.start:exc.start + 1]!r})") from None
        default_dir = path.resolve().parent
    data = _parse_yaml(text, source)
    return parse_cluster_config(data, source, base_dir=base_dir or default_dir)


def parse_cluster_config(
    data: Any, source: str = "<config>", *, base_dir: str | os.PathLike | None = None
) -> ClusterConfig:
    """Validates already-parsed YAML/JSON builtins; the first problem raises ConfigError."""
    if data is None:
        raise ConfigError(f"{source}: the config is empty; at least `model:` is required")
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: expected a mapping at the top level; got {type(data).__name__}")
    try:
        config = msgspec.convert(data, ClusterConfig, strict=True)
    except msgspec.ValidationError as exc:
        message = describe_validation_error(exc, data, ClusterConfig)
        raise ConfigError(f"{source}: {message}") from None
    problem = _cross_field_problem(config)
    if problem:
        raise ConfigError(f"{source}: {problem}")
    model = Path(config.model).expanduser()
    if not model.is_absolute():
        model = Path(base_dir or Path.cwd()) / model
    return msgspec.structs.replace(config, model=os.path.normpath(model))


def _cross_field_problem(config: ClusterConfig) -> str | None:
    """Checks that span fields; the message starts with the YAML path of the culprit."""
    placement = config.placement
    is_explicit = placement.strategy is PlacementStrategy.EXPLICIT
    if not config.model:
        return "model: expected a checkpoint path; got ''"
    several = config.serve.replicas > 1 or config.serve.autoscaling is not None
    if several and config.serve.ingress is IngressMode.DIRECT:
        return ("serve.ingress: direct serves one replica on serve.port; with serve.replicas > 1 or "
                "serve.autoscaling use proxy (or auto), which balances requests over the replicas")
    if 0 < config.engine.prefill_step_slowdown <= 1:
        return (f"engine.prefill_step_slowdown: expected a factor > 1 (a step with prompt chunks may take "
                f"that many times a decode-only step) or 0 (off); got {config.engine.prefill_step_slowdown}")
    if config.comm.nccl_env:
        problem = nccl_env_problem(config.comm.nccl_env)
        if problem:
            return problem
        if config.device is Device.CPU or config.comm.backend in (CommBackend.GLOO, CommBackend.SOCKETS):
            served = "device: cpu" if config.device is Device.CPU else f"comm.backend: {config.comm.backend.value}"
            return (f"comm.nccl_env: NCCL's settings for GPU actors, but this config never runs NCCL ({served}); "
                    f"remove comm.nccl_env or serve on GPUs")
    if config.comm.backend in (CommBackend.GLOO, CommBackend.SOCKETS) and config.device is Device.CUDA:
        # gloo and sockets move CPU tensors only: every dispatch on GPU activations would
        # fail, and recovery would rebuild the same group and fail again, forever. (device
        # auto resolves at deploy time, where the backend follows it.)
        backend = config.comm.backend.value
        return (
            f"comm.backend: {backend} moves CPU tensors only, so it cannot serve device: cuda; "
            f"set comm.backend: nccl (or auto) for GPUs, or device: cpu to keep {backend}"
        )
    for field_name in ("worker_resources", "router_resources"):
        for resource in getattr(placement, field_name):
            if not resource.strip():
                return f"placement.{field_name}: expected resource names that are non-empty strings; got {resource!r}"
            if resource in RAY_BUILTIN_RESOURCES or resource.startswith("node:"):
                return (f"placement.{field_name}.{resource}: a custom Ray resource name is expected (the name a "
                        f"node type's `resources:` gives, e.g. raymoe_expert); {resource} is Ray's own, set "
                        f"by raymoe from device and the worker counts")
    if config.autoscale is not None:
        problem = _autoscale_problem(config)
        if problem:
            return problem
    if is_explicit and placement.experts is None:
        return "placement.experts: required when placement.strategy is explicit"
    if not is_explicit:
        for name in ("experts", "layers"):
            if getattr(placement, name) is not None:
                return (
                    f"placement.{name}: only allowed with placement.strategy explicit; "
                    f"got strategy {placement.strategy.value!r}"
                )
        return None
    maps = [("placement.experts", placement.experts)]
    maps += [(f"placement.layers.{layer}", m) for layer, m in (placement.layers or {}).items()]
    for path, worker_map in maps:
        if not worker_map:
            return f"{path}: expected a mapping of worker id -> list of experts; got {{}}"
        for worker, experts in worker_map.items():
            if worker >= config.expert_workers:
                return (
                    f"{path}.{worker}: worker {worker} does not exist "
                    f"(expert_workers: {config.expert_workers}, ids 0..{config.expert_workers - 1})"
                )
            if not experts:
                return f"{path}.{worker}: expected a non-empty list of expert ids; got []"
            repeated = sorted({e for e in experts if experts.count(e) > 1})
            if repeated:
                return f"{path}.{worker}: experts listed more than once: {repeated}"
    return None


def _autoscale_problem(config: ClusterConfig) -> str | None:
    auto = config.autoscale
    if auto.target_requests_per_router is None:
        if auto.target_queue_s is not None:
            return ("autoscale.target_queue_s: needs autoscale.target_requests_per_router (the requests a router "
                    "holds size the router pool; queue time only adds growth); set both, or leave target_queue_s out")
        for name in ("min_routers", "max_routers"):
            value = getattr(auto, name)
            if value is not None and value != config.routers:
                return (f"autoscale.{name}: router autoscaling needs autoscale.target_requests_per_router (running + "
                        f"waiting requests per router); set it, or set {name} to routers ({config.routers}) or leave "
                        f"it out; got {value}")
    else:
        for name in ("min_routers", "max_routers"):
            if getattr(auto, name) is None:
                return (f"autoscale.{name}: required with autoscale.target_requests_per_router (the router pool's "
                        f"limits; routers: {config.routers} is the starting size)")
        problem = _pool_limits_problem("routers", "routers", config.routers, auto.min_routers, auto.max_routers)
        if problem:
            return problem
    return _pool_limits_problem("expert_workers", "workers", config.expert_workers, auto.min_workers,
                                auto.max_workers)


def _pool_limits_problem(field: str, pool: str, start: int, lo: int, hi: int) -> str | None:
    """An autoscaled pool's limits inverted, or its starting size (the config's ``field``)
    outside them; ``pool``: "workers" or "routers" (autoscale.min_{pool}/max_{pool})."""
    if hi < lo:
        return f"autoscale.max_{pool}: expected >= autoscale.min_{pool} ({lo}); got {hi}"
    if not lo <= start <= hi:
        return (f"{field}: the deployment starts with {start} {pool}, outside autoscale's [{lo}, {hi}]; set {field} "
                f"within autoscale.min_{pool}..max_{pool}")
    return None


def _parse_yaml(text: str, source: str) -> Any:
    try:
        return yaml.load(text, Loader=_UniqueKeyLoader)
    except yaml.MarkedYAMLError as exc:
        mark, context = exc.problem_mark or exc.context_mark, ""
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        if exc.context and exc.context_mark and exc.problem_mark:
            start = exc.context_mark
            context = f" ({exc.context} at line {start.line + 1}, column {start.column + 1})"
        problem = exc.problem or exc.context
        raise ConfigError(f"{source}: {where}invalid YAML: {problem}{context}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{source}: invalid YAML: {exc}") from None


MAX_YAML_ALIASES = 64  # a config needs few; 9 levels of 9 make a 400-byte billion-laughs bomb
MAX_YAML_NODES = 100_000


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that rejects a key given twice in one mapping (PyYAML keeps the last), and
    bounds aliases and nodes while composing, before anything expands."""

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            self._aliases = getattr(self, "_aliases", 0) + 1
            if self._aliases > MAX_YAML_ALIASES:
                event = self.peek_event()
                raise yaml.composer.ComposerError(None, None, f"more than {MAX_YAML_ALIASES} aliases (*name)",
                                                  event.start_mark)
        self._nodes = getattr(self, "_nodes", 0) + 1
        if self._nodes > MAX_YAML_NODES:
            raise yaml.composer.ComposerError(None, None, f"more than {MAX_YAML_NODES} YAML nodes",
                                              self.peek_event().start_mark)
        return super().compose_node(parent, index)

    def construct_sequence(self, node, deep=False):
        self._expanded = getattr(self, "_expanded", 0) + len(node.value)
        if self._expanded > MAX_YAML_NODES:
            raise yaml.constructor.ConstructorError(None, None, f"the YAML expands to more than {MAX_YAML_NODES} "
                                                    "values (aliases nested in aliases?)", node.start_mark)
        return super().construct_sequence(node, deep=deep)

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if not isinstance(key, Hashable):
                continue  # SafeLoader's own error names it
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} appears twice in one mapping", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)
