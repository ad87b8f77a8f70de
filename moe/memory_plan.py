"""Memory per rank of a deployment, planned before anything is allocated (pure math).

Legend: s bytes per value of the serving dtype, D hidden size, I an expert's intermediate
size, L MoE layers, E routed experts, k experts per token, V vocabulary, R routers,
T tokens per step (``engine.max_num_batched_tokens``), S slots per worker, Xs spare pool rows.

Expert worker (one GPU, or one process on a CPU host):

- **pool**: ``(S + Xs) * L`` expert rows of ``3 * D * I * s`` bytes (gate, up, down). The Xs
  spare rows are what :func:`worker_pool_rows` gives (cluster/deploy.py passes exactly that
  to every worker): a migration stages incoming experts into them.
- **packed**: CPU float32 workers with ``cpu.packed_experts`` keep the pool once more in the
  native kernel's layout.
- **staging** (balancer on): one layer's migration buffers, transient: the rows it sends
  (a list of them and their stacked copy, at most ``min(max_copies, S)``) and the rows it
  receives (at most Xs).
- **activations**: one step's exchange at T tokens from each of R routers: the ``R * T * k``
  dispatched rows in and their results out (``D`` values each), and one expert's SwiGLU
  intermediate (``3 * I`` values) for every one of the ``R * T`` tokens (an expert sees a
  token at most once).
- **reload peak**: a recovery reload (``ExpertWorker.load_placement`` in a restarted worker)
  rewrites the pool in place, one MoE layer at a time, with at most one row copied aside
  (a cycle of moves); a packed copy is remade one layer at a time (that layer's old layout
  held until its new one is made). Not serving meanwhile.

Router:

- **dense**: every weight but the routed experts (attention, gates, shared/dense MLPs,
  embeddings, the output projection), ``s`` bytes each.
- **KV cache**: as the engine allocates it (:func:`kv_cache_blocks`): ``engine.kv_cache_bytes``
  in whole blocks, at most ``max_num_seqs`` sequences of ``max_model_len``.
- **activations** at T tokens: per token ``5 D`` (residual, normed, MoE output, ...), q/k/v,
  the attention output and ``2 k D`` dispatch/combine values of ``s`` bytes, ``E`` float32
  gate logits; plus one sequence's context of one layer gathered for attention.
- **score logits**: ``score()``/prompt logprobs project up to T positions to the vocabulary:
  ``T * V`` in the serving dtype, its float32 copy and the float32 log-softmax (``s + 8``
  bytes per value); a step's sampling logits are no more (``min(max_num_seqs, T) <= T`` rows).

On a GPU every rank also reserves ``CUDA_RESERVE_BYTES`` (CUDA context, cuBLAS and NCCL
workspaces, allocator slack). A rank's need is its peak: the larger of its serving bytes
and (workers) its reload peak.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from raymoe.moe.model_config import ModelConfig

CUDA_RESERVE_BYTES = 2 * 2**30
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class PoolRows:
    """Expert rows a worker allocates per MoE layer: its slots and the spare rows migrations stage into."""

    slots: int
    spare: int

    @property
    def total(self) -> int:
        return self.slots + self.spare


def worker_pool_rows(slots_per_worker: int, balancer_enabled: bool, max_copies_per_rebalance: int) -> PoolRows:
    """Per MoE layer, a worker's rows: ``slots_per_worker`` plus ``min(slots, max_copies)``
    spare rows when the balancer runs (a rebalance copies at most ``max_copies`` experts per
    layer, and a worker receives no more than it has slots), else none. cluster/deploy.py
    gives every worker exactly these."""
    spare = min(slots_per_worker, max_copies_per_rebalance) if balancer_enabled else 0
    return PoolRows(slots_per_worker, spare)


def kv_cache_blocks(kv_cache_bytes: int, bytes_per_block: int, max_model_len: int, block_size: int,
                    max_num_seqs: int) -> int:
    """KV-cache blocks the engine allocates: ``kv_cache_bytes`` in whole blocks, capped at
    ``max_num_seqs`` sequences of ``max_model_len`` tokens (more could never be used)."""
    max_blocks = -(-max_model_len // block_size) * max_num_seqs
    return min(kv_cache_bytes // bytes_per_block, max_blocks)


@dataclass(frozen=True)
class DeploymentShape:
    """The numbers of a cluster config that size memory (cluster/memory_check.py reads them)."""

    routers: int
    expert_workers: int
    slots_per_worker: int
    balancer_enabled: bool
    max_copies_per_rebalance: int
    bytes_per_value: int  # the serving dtype's
    device: str  # cuda | cpu
    kv_cache_bytes: int
    block_size: int
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    packed_experts: bool = False  # CPU float32 workers keep a prepacked copy of their pool


@dataclass(frozen=True)
class WorkerMemory:
    rank: str
    slots: int
    spare_rows: int
    row_bytes: int  # one expert of one MoE layer
    pool_bytes: int
    packed_bytes: int
    staging_bytes: int
    activation_bytes: int
    reserve_bytes: int
    serving_bytes: int
    reload_peak_bytes: int
    peak_bytes: int


@dataclass(frozen=True)
class RouterMemory:
    rank: str
    dense_bytes: int
    kv_cache_bytes: int  # as allocated
    kv_cache_tokens: int
    kv_cache_capped: bool  # engine.kv_cache_bytes is more than max_num_seqs full-length sequences use
    activation_bytes: int
    score_logits_bytes: int
    reserve_bytes: int
    peak_bytes: int


@dataclass(frozen=True)
class MemoryPlan:
    workers: list[WorkerMemory]
    routers: list[RouterMemory]

    @property
    def ranks(self) -> list[WorkerMemory | RouterMemory]:
        return [*self.routers, *self.workers]

    @property
    def total_bytes(self) -> int:
        return sum(rank.peak_bytes for rank in self.ranks)

    def to_dict(self) -> dict[str, Any]:
        return {"routers": [asdict(r) for r in self.routers], "workers": [asdict(w) for w in self.workers],
                "total_bytes": self.total_bytes}


def plan_memory(model: ModelConfig, dense_params: int, shape: DeploymentShape) -> MemoryPlan:
    """Bytes per router and per expert worker (see the module docstring for what is counted)."""
    s = shape.bytes_per_value
    hidden, inter, top_k = model.hidden_size, model.moe_intermediate_size, model.top_k
    num_moe_layers = len(model.moe_layers)
    reserve = CUDA_RESERVE_BYTES if shape.device == "cuda" else 0
    tokens = shape.max_num_batched_tokens
    # Step 1: an expert worker.
    rows = worker_pool_rows(shape.slots_per_worker, shape.balancer_enabled, shape.max_copies_per_rebalance)
    row_bytes = 3 * hidden * inter * s
    pool = rows.total * num_moe_layers * row_bytes
    packed = pool if shape.packed_experts and shape.device == "cpu" and s == 4 else 0
    staging = 0
    if shape.balancer_enabled:
        staging = (2 * min(shape.max_copies_per_rebalance, rows.slots) + rows.spare) * row_bytes
    arriving = shape.routers * tokens  # tokens of one step, all routers together
    activations = (2 * arriving * top_k * hidden + arriving * 3 * inter) * s
    serving = pool + packed + staging + activations + reserve
    reload_peak = pool + packed + row_bytes + (rows.total * row_bytes if packed else 0) + reserve
    workers = [WorkerMemory(f"worker {w}", rows.slots, rows.spare, row_bytes, pool, packed, staging, activations,
                            reserve, serving, reload_peak, max(serving, reload_peak))
               for w in range(shape.expert_workers)]
    # Step 2: a router.
    kv_per_token = model.kv_cache_values_per_token * s
    max_model_len = min(shape.max_model_len, model.max_position_embeddings)
    blocks = kv_cache_blocks(shape.kv_cache_bytes, kv_per_token * shape.block_size, max_model_len,
                             shape.block_size, shape.max_num_seqs)
    kv_bytes = blocks * shape.block_size * kv_per_token
    qkv = model.num_heads * model.head_dim + model.num_kv_heads * (model.head_dim + model.v_head_dim)
    per_token = (5 * hidden + qkv + model.num_heads * model.v_head_dim + 2 * top_k * hidden) * s
    per_token += 4 * model.num_experts + 8 * top_k  # float32 gate logits, top-k ids and weights
    context = max_model_len * (model.kv_cache_values_per_token // model.num_layers) * s
    router_activations = tokens * per_token + context
    score_logits = tokens * model.vocab_size * (s + 8)
    dense = dense_params * s
    peak = dense + kv_bytes + router_activations + score_logits + reserve
    capped = kv_bytes + kv_per_token * shape.block_size <= shape.kv_cache_bytes
    routers = [RouterMemory(f"router {r}", dense, kv_bytes, blocks * shape.block_size, capped, router_activations,
                            score_logits, reserve, peak) for r in range(shape.routers)]
    return MemoryPlan(workers, routers)


def lower_what(rank: WorkerMemory | RouterMemory) -> str:
    """The setting that lowers this rank's largest part, in words."""
    if isinstance(rank, RouterMemory):
        parts = {"engine.kv_cache_bytes": rank.kv_cache_bytes, "engine.max_num_batched_tokens":
                 rank.activation_bytes + rank.score_logits_bytes}
        if rank.dense_bytes > max(parts.values()):
            return "a smaller dtype, or a larger GPU (a router holds every dense weight)"
        return max(parts, key=parts.get)
    if rank.staging_bytes + rank.activation_bytes > rank.pool_bytes:
        return "engine.max_num_batched_tokens or balancer.max_copies_per_rebalance"
    return ("the expert rows per worker: more expert_workers, fewer placement.redundant_slots_per_worker, "
            "or balancer.max_copies_per_rebalance (spare rows; balancer.enabled: false keeps none)")
