"""`raymoe plan`: placement planning, routing simulation and the cost model.

    raymoe plan payload  --tokens N --top-k K --hidden H --bytes-per-value S --ranks R
    raymoe plan balance  --load LOAD.json --workers W --slots-per-worker S [--current CUR.json]
    raymoe plan simulate --experts E --workers W --slots-per-worker S [--traffic zipf] [--plot F.png]
    raymoe plan memory   --model DIR|PRESET --gpus G [--redundant D]
    raymoe plan memory   --config FILE [--model DIR|PRESET] [--gpu-memory-gb G]

Every subcommand prints tables, or one JSON object with ``--json``. LOAD.json is
``{"load": [[per-expert load] per layer]}``; a placement's ``placement`` is, per layer,
the logical expert of each physical slot, slot ``s`` on worker ``s // S``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

from raymoe.cluster.units import bytes_text

_MIB = 1 << 20


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("plan", help="plan expert placement and estimate costs")
    parser.set_defaults(func=lambda args: parser.print_help() or 2)
    commands = parser.add_subparsers(dest="plan_command", metavar="PLAN_COMMAND")
    _add_payload(commands)
    _add_balance(commands)
    _add_simulate(commands)
    _add_memory(commands)


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def _emit(args: argparse.Namespace, result: dict[str, Any], rows: list[tuple[str, Any]]) -> int:
    if args.json:
        json.dump(result, sys.stdout, indent=None)
        sys.stdout.write("\n")
        return 0
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        shown = f"{value:.4f}" if isinstance(value, float) else str(value)
        print(f"{name:<{width}}  {shown}")
    return 0


# ---- payload ---------------------------------------------------------------------------
def _add_payload(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser("payload", help="dispatch/combine bytes of one MoE layer")
    parser.add_argument("--tokens", type=int, required=True)
    parser.add_argument("--top-k", type=int, required=True)
    parser.add_argument("--hidden", type=int, required=True)
    parser.add_argument("--bytes-per-value", type=int, default=2)
    parser.add_argument("--ranks", type=int, required=True)
    _common(parser)
    parser.set_defaults(func=_run_payload)


def _run_payload(args: argparse.Namespace) -> int:
    from raymoe.moe.cost_model import payload_bytes

    estimate = payload_bytes(args.tokens, args.top_k, args.hidden, args.bytes_per_value, args.ranks)
    rows = [
        ("dispatch", f"{estimate.dispatch_bytes} B ({estimate.dispatch_bytes / _MIB:g} MiB)"),
        ("combine", f"{estimate.combine_bytes} B ({estimate.combine_bytes / _MIB:g} MiB)"),
        ("remote fraction", estimate.remote_fraction),
        ("remote (both)", f"{estimate.remote_bytes:.0f} B ({estimate.remote_bytes / _MIB:g} MiB)"),
    ]
    return _emit(args, estimate.to_dict(), rows)


# ---- balance ---------------------------------------------------------------------------
def _add_balance(commands: argparse._SubParsersAction) -> None:
    from raymoe.moe.balancer import BalancerAlgorithm

    parser = commands.add_parser("balance", help="plan a placement from a load matrix")
    parser.add_argument("--load", type=Path, required=True, help='JSON: {"load": [[...] per layer]}')
    parser.add_argument("--workers", type=int, required=True)
    parser.add_argument("--slots-per-worker", type=int, required=True)
    parser.add_argument("--nodes", type=int, default=1)
    parser.add_argument("--groups", type=int, default=1, help="expert groups (hierarchical)")
    parser.add_argument("--current", type=Path, help='JSON with the placement in service: {"placement": ...}')
    parser.add_argument(
        "--algorithm",
        choices=[a.value for a in BalancerAlgorithm],
        help="default: migration with --current, hierarchical with --groups > 1, else global",
    )
    parser.add_argument("--max-copies-per-layer", type=int, help="migration budget")
    parser.add_argument("--tolerance", type=float, default=0.02, help="migration: slack over the optimum's max/mean")
    parser.add_argument("--assignments-per-step", type=float, help="activated: decode tokens per step x top-k")
    _common(parser)
    parser.set_defaults(func=_run_balance)


def read_placement(path: Path, num_experts: int, slots_per_worker: int, worker2node: np.ndarray):
    """A placement JSON: ``{"placement": [[...]]}`` or a PlacementTable dict (``phy2log``)."""
    from raymoe.moe.placement import PlacementTable

    data = json.loads(path.read_text())
    if "phy2log" in data:
        return PlacementTable.from_dict(data)
    if "placement" not in data:
        raise ValueError(f"{path}: expected a 'placement' (or 'phy2log') key")
    return PlacementTable.from_phy2log(
        data["placement"], slots_per_worker, num_experts, worker2node, int(data.get("epoch", 0))
    )


def _run_balance(args: argparse.Namespace) -> int:
    from raymoe.moe.balance_global import worker_to_node
    from raymoe.moe.balancer import BalancerAlgorithm, plan_placement
    from raymoe.moe.simulator import load_from_telemetry

    load = load_from_telemetry(json.loads(args.load.read_text()))
    worker2node = worker_to_node(args.workers, args.nodes)
    current = None
    if args.current is not None:
        current = read_placement(args.current, load.shape[1], args.slots_per_worker, worker2node)
    if args.algorithm:
        algorithm = BalancerAlgorithm(args.algorithm)
    elif current is not None:
        algorithm = BalancerAlgorithm.MIGRATION
    else:
        algorithm = BalancerAlgorithm.HIERARCHICAL if args.groups > 1 else BalancerAlgorithm.GLOBAL
    result = plan_placement(
        load,
        args.workers,
        args.slots_per_worker,
        algorithm,
        num_nodes=args.nodes,
        num_groups=args.groups,
        current=current,
        max_copies_per_layer=args.max_copies_per_layer,
        tolerance=args.tolerance,
        assignments_per_step=args.assignments_per_step,
    )
    copies = None if result.migration is None else result.migration.num_copies
    output = {
        "algorithm": algorithm.value,
        "placement": result.placement.phy2log.tolist(),
        "slots_per_worker": args.slots_per_worker,
        "worker2node": result.placement.worker2node.tolist(),
        "epoch": result.placement.epoch,
        "balancedness": result.balancedness,
        "max_over_mean": result.imbalance,
        "copies": copies,
        "migration": [] if result.migration is None else result.migration.to_list(),
    }
    rows = [("algorithm", algorithm.value), ("balancedness", result.balancedness), ("max/mean", result.imbalance)]
    rows.append(("copies", "n/a (no --current)" if copies is None else copies))
    for layer, row in enumerate(result.placement.phy2log):
        workers = row.reshape(args.workers, args.slots_per_worker)
        rows.append((f"layer {layer}", " | ".join(" ".join(str(e) for e in w) for w in workers)))
    return _emit(args, output, rows)


# ---- simulate --------------------------------------------------------------------------
def _add_simulate(commands: argparse._SubParsersAction) -> None:
    from raymoe.moe.balancer import BalancerAlgorithm
    from raymoe.moe.traffic import TrafficKind

    parser = commands.add_parser("simulate", help="route synthetic or recorded traffic, before/after balancing")
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--slots-per-worker", type=int, default=9)
    parser.add_argument("--nodes", type=int, default=1)
    parser.add_argument("--traffic", choices=[k.value for k in TrafficKind], default="zipf")
    parser.add_argument("--zipf-s", type=float, default=1.2)
    parser.add_argument("--num-hot", type=int, default=2)
    parser.add_argument("--hot-fraction", type=float, default=0.5)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--bytes-per-value", type=int, default=2)
    parser.add_argument("--capacity-factor", type=float)
    parser.add_argument("--algorithm", choices=[a.value for a in BalancerAlgorithm if a.value != "migration"], default="global")
    parser.add_argument("--load", type=Path, help="replay recorded loads instead of synthetic traffic")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--plot", type=Path, help="write per-worker load bars (PNG)")
    parser.add_argument("--plot-layer", type=int, default=0, help="the layer to draw")
    _common(parser)
    parser.set_defaults(func=_run_simulate)


def _run_simulate(args: argparse.Namespace) -> int:
    from raymoe.moe.balance_global import worker_to_node
    from raymoe.moe.balancer import BalancerAlgorithm, plan_placement
    from raymoe.moe.placement import PlacementTable
    from raymoe.moe.simulator import load_from_telemetry, replay_load, simulate_routing
    from raymoe.moe.traffic import TrafficSpec, popularity, routing_to_load, sample_routing

    rng = np.random.default_rng(args.seed)
    worker2node = worker_to_node(args.workers, args.nodes)
    # Step 1: a history to balance on, and a fresh batch to evaluate both placements on.
    if args.load is not None:
        history = load_from_telemetry(json.loads(args.load.read_text()))
        topk_ids = None
    else:
        spec = TrafficSpec(args.traffic, zipf_s=args.zipf_s, num_hot=args.num_hot, hot_fraction=args.hot_fraction)
        probabilities = popularity(spec, args.layers, args.experts, rng)
        history = routing_to_load(sample_routing(probabilities, args.tokens, args.top_k, rng), args.experts)
        topk_ids = sample_routing(probabilities, args.tokens, args.top_k, rng)
    num_layers, num_experts = history.shape
    num_slots = args.workers * args.slots_per_worker
    # Step 2: before = experts laid out in order, extra slots repeating from expert 0.
    linear = np.tile(np.arange(num_slots) % num_experts, (num_layers, 1))
    before = PlacementTable.from_phy2log(linear, args.slots_per_worker, num_experts, worker2node)
    after = plan_placement(
        history, args.workers, args.slots_per_worker, BalancerAlgorithm(args.algorithm),
        num_nodes=args.nodes, assignments_per_step=float(args.tokens * args.top_k),
    ).placement
    # Step 3: evaluate.
    results = {}
    for name, table in (("before", before), ("after", after)):
        if topk_ids is None:
            results[name] = replay_load(history, table, args.capacity_factor)
        else:
            results[name] = simulate_routing(
                topk_ids, table, args.hidden, args.bytes_per_value, args.capacity_factor
            ).to_dict()
    if args.plot is not None:
        plot_worker_loads(
            args.plot,
            results["before"]["assignments_per_worker"],
            results["after"]["assignments_per_worker"],
            args.algorithm,
            args.plot_layer,
        )
    rows = []
    for key in results["after"]:
        if key != "assignments_per_worker":
            rows.append((f"{key} (before -> after)", f"{_short(results['before'].get(key))} -> {_short(results['after'][key])}"))
    if args.plot is not None:
        rows.append(("plot", str(args.plot)))
    return _emit(args, {"before": results["before"], "after": results["after"], "placement": after.phy2log.tolist()}, rows)


def _short(value: Any) -> str:
    return f"{value:.4f}" if isinstance(value, float) else str(value)


def plot_worker_loads(path: Path, before: list, after: list, label: str, layer: int = 0) -> None:
    """Bars of one layer's per-worker load, before and after balancing, with the mean line.

    before, after: [L, W] assignments per worker."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    before_load = np.asarray(before, dtype=np.float64)
    after_load = np.asarray(after, dtype=np.float64)
    workers = np.arange(before_load.shape[1])
    figure, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    for axis, loads, title in ((axes[0], before_load, "before (experts in order)"), (axes[1], after_load, f"after ({label})")):
        row = loads[layer]
        mean = row.mean()
        axis.bar(workers, row, color="tab:blue" if axis is axes[1] else "tab:gray")
        axis.axhline(mean, color="black", linestyle="--", label=f"mean {mean:.0f}")
        axis.set_title(f"{title}\nlayer {layer}: max/mean = {row.max() / mean:.2f}" if mean else title)
        axis.set_xlabel("worker")
        axis.legend()
    axes[0].set_ylabel("assignments (tokens x top-k) per worker")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


# ---- memory ----------------------------------------------------------------------------
def _add_memory(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser("memory", help="memory per GPU and whether it fits (weights, or a whole config)")
    parser.add_argument("--config", type=Path,
                        help="a cluster config: every router and worker as deploy builds them (rows, KV cache, "
                             "activations); exit 1 when a rank does not fit")
    parser.add_argument("--model", help="directory with config.json, or a preset name (with --config: instead "
                                        "of the config's model)")
    parser.add_argument("--gpus", type=int, help="weights only (without --config): GPUs to spread over")
    parser.add_argument("--redundant", type=int, default=0, help="redundant expert slots per layer")
    parser.add_argument("--gpu-memory-gb", type=float, default=None,
                        help="per GPU, decimal GB (default 141, an H200; with --config 80, an H100, and on a "
                             "device: cpu config this host's memory shared by all ranks)")
    parser.add_argument("--bytes-per-param", type=float, help="override the checkpoint's dtype")
    parser.add_argument("--kv-bytes-per-value", type=int, default=2,
                        help="bytes per KV-cache value (2: a bfloat16/float16 cache, 4: float32)")
    _common(parser)
    parser.set_defaults(func=_run_memory)


def _run_memory(args: argparse.Namespace) -> int:
    from raymoe.moe.cost_model import load_model_shape, memory_per_rank

    if args.config is not None:
        return _run_config_memory(args)
    if args.model is None or args.gpus is None:
        print("raymoe plan memory: give --config FILE, or --model and --gpus", file=sys.stderr)
        return 2
    args.gpu_memory_gb = 141.0 if args.gpu_memory_gb is None else args.gpu_memory_gb
    shape = load_model_shape(args.model, args.bytes_per_param)
    estimate = memory_per_rank(shape, args.gpus, args.redundant, args.gpu_memory_gb * 1e9)
    gb = 1e9
    fits = estimate.fits
    rows = [
        ("model", f"{estimate.model}: {count_text(estimate.total_params)} params, {shape.bytes_per_param:g} B/param"),
        ("GPU memory", f"{args.gpu_memory_gb:g} GB x {args.gpus}"),
        ("replicated", f"{bytes_text(estimate.replicated_bytes)}/GPU  fits={fits['replicated']}"),
        ("expert-parallel", f"{bytes_text(estimate.expert_parallel_bytes)}/GPU ({estimate.experts_per_rank} experts/layer)  fits={fits['expert_parallel']}"),
        ("EP + redundant", f"{bytes_text(estimate.redundant_bytes)}/GPU ({estimate.slots_per_rank} slots/layer)  fits={fits['expert_parallel_redundant']}"),
        ("per redundant slot", f"{bytes_text(estimate.redundant_slot_bytes)} on the GPU that holds it"),
    ]
    kv_bytes, kv_layout = _kv_cache_per_token(args.model, args.kv_bytes_per_value)
    kv_tokens = int(gb // kv_bytes) if kv_bytes else None
    rows.append(("KV cache per token", f"{kv_bytes} B ({kv_layout})" if kv_bytes else kv_layout))
    rows.append(("KV tokens per GB", f"{kv_tokens:,}" if kv_tokens else "n/a"))
    output = {**estimate.to_dict(), "kv_cache_bytes_per_token": kv_bytes, "kv_cache_tokens_per_gb": kv_tokens}
    return _emit(args, output, rows)


def _run_config_memory(args: argparse.Namespace) -> int:
    """Every rank of a cluster config: exit 0 when each fits, 1 naming the one that does not."""
    from raymoe.cluster.config import ConfigError, load_cluster_config
    from raymoe.cluster.memory_check import host_memory, judge, plan_config_memory, read_model

    try:
        config = load_cluster_config(str(args.config))
        raw_model, model_name = read_model(args.model or config.model)
    except (ConfigError, OSError, ValueError) as error:
        hint = "" if args.model else " (name one with --model DIR|PRESET)"
        print(f"raymoe plan memory: {error}{hint}", file=sys.stderr)
        return 2
    # cuda unless the config says cpu (auto: cuda with --gpu-memory-gb or a GPU here).
    device = config.device.value
    if device == "auto":
        import torch

        device = "cuda" if args.gpu_memory_gb is not None or torch.cuda.is_available() else "cpu"
    plan = plan_config_memory(config, raw_model, device)
    if args.gpu_memory_gb is not None:
        verdict = judge(plan, args.gpu_memory_gb * 1e9, False, f"--gpu-memory-gb {args.gpu_memory_gb:g}")
    elif device == "cpu":
        verdict = judge(plan, host_memory()[0], True, "this host's MemTotal")
    else:
        verdict = judge(plan, 80e9, False, "an 80 GB H100 (--gpu-memory-gb)")
    output = {"fits": verdict.fits, "problem": verdict.problem, "config": str(args.config), "model": model_name,
              "device": device, "capacity_bytes": verdict.capacity_bytes, "capacity_source": verdict.capacity_source,
              "shared_host": verdict.shared_host, **plan.to_dict()}
    if args.json:
        json.dump(output, sys.stdout)
        sys.stdout.write("\n")
    else:
        _print_config_memory(plan, verdict, model_name, device)
    if not verdict.fits:
        print(f"raymoe plan memory: {verdict.problem}", file=sys.stderr)
    return 0 if verdict.fits else 1


def _print_config_memory(plan, verdict, model_name: str, device: str) -> None:
    where = "shared by all ranks" if verdict.shared_host else "per rank"
    print(f"{model_name} on {device}: {bytes_text(verdict.capacity_bytes)} {where} ({verdict.capacity_source})")
    print(f"{'rank':<10} {'peak':>9}  parts")
    seen = set()
    for rank in plan.ranks:
        kind = rank.rank.split()[0]
        same = (kind, rank.peak_bytes)
        if same in seen:  # every router (worker) of a config needs the same: print the first
            continue
        seen.add(same)
        count = sum(1 for other in plan.ranks if (other.rank.split()[0], other.peak_bytes) == same)
        label = f"{kind} x{count}" if count > 1 else rank.rank
        if kind == "router":
            capped = "; engine.kv_cache_bytes capped at max_num_seqs x max_model_len" if rank.kv_cache_capped else ""
            parts = (f"dense {bytes_text(rank.dense_bytes)}, KV cache {bytes_text(rank.kv_cache_bytes)} "
                     f"({rank.kv_cache_tokens:,} tokens{capped}), activations {bytes_text(rank.activation_bytes)}, "
                     f"score logits {bytes_text(rank.score_logits_bytes)}, reserve {bytes_text(rank.reserve_bytes)}")
        else:
            parts = (f"{rank.slots} slots + {rank.spare_rows} spare rows/layer: pool {bytes_text(rank.pool_bytes)}"
                     + (f", packed {bytes_text(rank.packed_bytes)}" if rank.packed_bytes else "")
                     + f", staging {bytes_text(rank.staging_bytes)}, activations {bytes_text(rank.activation_bytes)}, "
                     f"reserve {bytes_text(rank.reserve_bytes)}; serving {bytes_text(rank.serving_bytes)}, "
                     f"recovery reload peak {bytes_text(rank.reload_peak_bytes)}")
        print(f"{label:<10} {bytes_text(rank.peak_bytes):>9}  {parts}")
    if verdict.shared_host:
        print(f"{'all ranks':<10} {bytes_text(plan.total_bytes):>9}")
    print(f"fits: {'yes' if verdict.fits else 'no'}")


def count_text(count: float) -> str:
    """A parameter count in the largest unit it reaches: 46.7B, 1.3M, 24.6K, 512."""
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if count >= scale:
            return f"{count / scale:.3g}{unit}" if count < 100 * scale else f"{count / scale:.0f}{unit}"
    return f"{count:.0f}"


def _kv_cache_per_token(model: str, bytes_per_value: int) -> tuple[int | None, str]:
    """The engine's own KV-cache size per token (ModelConfig.kv_cache_values_per_token, which
    engine/kv_cache.py allocates) in bytes, and what it holds; None for a model raymoe does
    not serve (its weights can still be sized)."""
    from raymoe.moe.model_config import UnsupportedModelError
    from raymoe.engine.hf_config import parse_model_config
    from raymoe.moe.model_presets import model_presets

    presets = {name.lower(): config for name, config in model_presets().items()}
    if model.lower() in presets:
        raw = presets[model.lower()]
    else:
        path = Path(model)
        raw = json.loads((path / "config.json" if path.is_dir() else path).read_text())
    # Presets keep only the fields that size a model; the context length sizes nothing here.
    try:
        config = parse_model_config({"max_position_embeddings": 1, **raw})
    except UnsupportedModelError as error:
        return None, f"n/a: {error}"
    per_layer = config.kv_cache_values_per_token // config.num_layers
    if config.mla is not None:
        held = f"MLA latent: kv_lora_rank {config.mla.kv_lora_rank} + qk_rope_head_dim {config.mla.qk_rope_head_dim}"
    else:
        held = f"K and V of {config.num_kv_heads} kv heads x {config.head_dim}"
    layout = f"{config.num_layers} layers x {per_layer} values ({held}) x {bytes_per_value} B"
    return config.kv_cache_values_per_token * bytes_per_value, layout
