"""A cluster config's memory per rank, as deploy builds it, against the memory it will get.

The byte math is raymoe.moe.memory_plan (pure); this module reads a ClusterConfig and a
model (a checkpoint directory or a preset), builds the placement exactly as
cluster/deploy.py does (``ClusterConfig.initial_placement``; the spare rows are
``memory_plan.worker_pool_rows``, which deploy passes to its workers), and knows where memory is measured:
a GPU's total memory, or on CPU this host's /proc/meminfo (every rank of a local Ray shares it).
Used by ``raymoe plan memory --config`` and by ``raymoe serve`` before anything starts.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from raymoe.cluster.config import ClusterConfig
from raymoe.cluster.units import bytes_text
from raymoe.moe.memory_plan import (DTYPE_BYTES, DeploymentShape, MemoryPlan, RouterMemory, WorkerMemory, lower_what,
                                    plan_memory)
from raymoe.engine.hf_config import parse_model_config


def read_model(model: str) -> tuple[dict[str, Any], str]:
    """A model's config.json as a dict, and its name: a preset (case-insensitive), a
    directory holding config.json, or that file."""
    from raymoe.moe.model_presets import model_presets

    presets = {name.lower(): (name, raw) for name, raw in model_presets().items()}
    if model.lower() in presets:
        name, raw = presets[model.lower()]
        return raw, name
    path = Path(model).expanduser()
    path = path / "config.json" if path.is_dir() else path
    if not path.is_file():
        raise ValueError(f"{model!r} is neither a preset ({', '.join(model_presets())}) nor a checkpoint "
                         "directory with config.json")
    return json.loads(path.read_text()), path.parent.name


def plan_config_memory(config: ClusterConfig, raw_model: dict[str, Any], device: str) -> MemoryPlan:
    """Bytes per router and worker of ``config`` serving the model whose config.json is
    ``raw_model``, on ``device`` (cuda | cpu)."""
    import torch

    from raymoe.engine.engine import resolve_dtype
    from raymoe.engine.scheduler import SchedulerConfig
    from raymoe.moe.cost_model import shape_from_config

    model_config = parse_model_config(raw_model)
    dtype = resolve_dtype(config.dtype.value, model_config, torch.device(device))
    bytes_per_value = DTYPE_BYTES[str(dtype).removeprefix("torch.")]
    engine = config.engine
    shape = DeploymentShape(
        routers=config.routers,
        expert_workers=config.expert_workers,
        slots_per_worker=config.initial_placement(len(model_config.moe_layers), model_config.num_experts).slots_per_worker,
        balancer_enabled=config.balancer.enabled,
        max_copies_per_rebalance=config.balancer.max_copies_per_rebalance,
        bytes_per_value=bytes_per_value,
        device=device,
        kv_cache_bytes=engine.kv_cache_bytes,
        block_size=engine.block_size,
        max_model_len=engine.max_model_len or model_config.max_position_embeddings,
        max_num_seqs=engine.max_num_seqs,
        max_num_batched_tokens=SchedulerConfig(engine.max_num_seqs, engine.max_num_batched_tokens).token_budget(device),
        packed_experts=config.cpu.packed_experts,
    )
    return plan_memory(model_config, shape_from_config(raw_model).other_params, shape)


def host_memory() -> tuple[int, int]:
    """(MemTotal, MemAvailable) of this host in bytes, from /proc/meminfo."""
    values = {}
    with open("/proc/meminfo") as handle:
        for line in handle:
            name, _, rest = line.partition(":")
            if name in ("MemTotal", "MemAvailable"):
                values[name] = int(rest.split()[0]) * 1024
    return values["MemTotal"], values.get("MemAvailable", values["MemTotal"])


def local_gpu_memory() -> int | None:
    """Total memory of this machine's smallest GPU in bytes (nvidia-smi), or None without one.

    Asked of nvidia-smi rather than torch: torch.cuda would open a CUDA context on GPU 0 in
    the serving process for its whole life, memory a router or worker then lacks."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        done = subprocess.run([smi, "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                              capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    sizes = [int(value) for value in done.stdout.split() if value.isdigit()] if done.returncode == 0 else []
    return min(sizes) * 2**20 if sizes else None  # MiB


@dataclass(frozen=True)
class Verdict:
    fits: bool
    capacity_bytes: int
    shared_host: bool  # True: every rank shares capacity_bytes (CPU, one host); else each rank gets it
    capacity_source: str
    problem: str | None


def judge(plan: MemoryPlan, capacity_bytes: float, shared_host: bool, capacity_source: str) -> Verdict:
    """Whether every rank fits: each in ``capacity_bytes`` (one GPU each), or, on one
    shared host, all of them together. ``problem`` names the rank, its bytes, the memory and
    the setting to lower."""
    capacity = int(capacity_bytes)
    if shared_host:
        total = plan.total_bytes
        if total <= capacity:
            return Verdict(True, capacity, True, capacity_source, None)
        largest = max(plan.ranks, key=lambda rank: rank.peak_bytes)
        problem = (f"not enough memory: {largest.rank} needs {bytes_text(largest.peak_bytes)} "
                   f"({largest.peak_bytes} bytes: {_parts(largest)}), all {len(plan.ranks)} ranks on this host "
                   f"{bytes_text(total)} ({total} bytes), but it has {bytes_text(capacity)} ({capacity} bytes, "
                   f"{capacity_source}): lower {lower_what(largest)}")
        return Verdict(False, capacity, True, capacity_source, problem)
    over = [rank for rank in plan.ranks if rank.peak_bytes > capacity]
    if not over:
        return Verdict(True, capacity, False, capacity_source, None)
    rank = max(over, key=lambda r: r.peak_bytes)
    others = f" (and {len(over) - 1} more ranks)" if len(over) > 1 else ""
    problem = (f"not enough memory: {rank.rank} needs {bytes_text(rank.peak_bytes)} ({rank.peak_bytes} bytes: "
               f"{_parts(rank)}) but has {bytes_text(capacity)} ({capacity} bytes, {capacity_source}){others}: "
               f"lower {lower_what(rank)}")
    return Verdict(False, capacity, False, capacity_source, problem)


def _parts(rank: WorkerMemory | RouterMemory) -> str:
    if isinstance(rank, RouterMemory):
        parts = [("dense weights", rank.dense_bytes), ("KV cache", rank.kv_cache_bytes),
                 ("activations", rank.activation_bytes), ("score logits", rank.score_logits_bytes),
                 ("CUDA reserve", rank.reserve_bytes)]
    else:
        rows = f"{rank.slots}+{rank.spare_rows} rows/layer"
        parts = [(f"expert pool, {rows}", rank.pool_bytes), ("packed copy", rank.packed_bytes),
                 ("staging", rank.staging_bytes), ("activations", rank.activation_bytes),
                 ("CUDA reserve", rank.reserve_bytes)]
        if rank.reload_peak_bytes > rank.serving_bytes:
            parts = [("recovery reload peak, the pool and a row aside", rank.reload_peak_bytes)]
    return ", ".join(f"{name} {bytes_text(value)}" for name, value in parts if value)

