"""`raymoe plan memory --config`: every shipped GPU example fits an 80 GB H100 with
Mixtral-8x7B in bf16 (issue 34 item 1), a 10 GB GPU fits none, and the JSON says so."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from raymoe.cluster import plan_cli

EXAMPLES = Path(__file__).resolve().parents[2] / "configs" / "examples"
GPU_EXAMPLES = ["1node-8gpu", "2node-16gpu-strict-spread", "disaggregated-routers", "redundant-slots"]
EXPERT_ROW = 3 * 4096 * 14336 * 2  # one Mixtral expert of one layer, bf16
LAYERS = 32


def run(argv: list[str], capsys) -> tuple[int, dict, str]:
    import argparse

    parser = argparse.ArgumentParser(prog="raymoe")
    plan_cli.add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(argv)
    code = args.func(args)
    captured = capsys.readouterr()
    return code, json.loads(captured.out), captured.err


@pytest.mark.parametrize("name", GPU_EXAMPLES)
def test_every_gpu_example_fits_an_80gb_h100_and_no_10gb_gpu(name, capsys):
    argv = ["plan", "memory", "--config", str(EXAMPLES / f"{name}.yaml"), "--model", "Mixtral-8x7B", "--json"]
    code, plan, _ = run([*argv, "--gpu-memory-gb", "80"], capsys)
    assert (code, plan["fits"], plan["problem"]) == (0, True, None), plan["problem"]
    assert plan["capacity_bytes"] == 80 * 10**9 and plan["device"] == "cuda"
    for worker in plan["workers"]:
        # every worker holds all its slots and spare rows of every layer; a reload one row more
        rows = worker["slots"] + worker["spare_rows"]
        assert worker["pool_bytes"] == rows * LAYERS * EXPERT_ROW
        assert worker["reload_peak_bytes"] == worker["pool_bytes"] + EXPERT_ROW + worker["reserve_bytes"]
        assert worker["peak_bytes"] <= 80e9
    for router in plan["routers"]:
        assert router["kv_cache_bytes"] > 30 * 2**30 and router["peak_bytes"] <= 80e9
    code, plan, err = run([*argv, "--gpu-memory-gb", "10"], capsys)
    assert (code, plan["fits"]) == (1, False)
    assert "not enough memory" in plan["problem"] and "80 GB" not in plan["problem"]
    assert "10 GB" in err and "bytes" in err and ("worker" in err or "router" in err)


def test_the_shipped_2node_example_had_all_8_experts_per_worker(tmp_path, capsys):
    """The example as shipped before (the default max_copies_per_rebalance 8: 4 slots + min(4, 8)
    spare rows): 90 GB of rows per worker, named with its bytes, exit 1."""
    text = (EXAMPLES / "2node-16gpu-strict-spread.yaml").read_text()
    assert "  max_copies_per_rebalance: 1" in text
    old = text.replace("  max_copies_per_rebalance: 1", "  max_copies_per_rebalance: 8")
    path = tmp_path / "old.yaml"
    path.write_text(old)
    code, plan, err = run(["plan", "memory", "--config", str(path), "--model", "Mixtral-8x7B", "--gpu-memory-gb", "80",
                           "--json"], capsys)
    assert code == 1 and not plan["fits"]
    worker = plan["workers"][0]
    assert (worker["slots"], worker["spare_rows"]) == (4, 4)
    assert worker["pool_bytes"] == 8 * LAYERS * EXPERT_ROW  # 90.2 GB: all 8 experts' rows
    assert "worker 0 needs" in plan["problem"] and str(worker["peak_bytes"]) in plan["problem"]


def test_exit_codes_through_the_real_cli():
    base = [sys.executable, "-m", "raymoe.cluster.cli", "plan", "memory", "--config",
            str(EXAMPLES / "1node-8gpu.yaml"), "--model", "Mixtral-8x7B", "--json"]
    fits = subprocess.run([*base, "--gpu-memory-gb", "80"], capture_output=True, text=True, timeout=120)
    assert fits.returncode == 0 and json.loads(fits.stdout)["fits"] is True, fits.stderr
    small = subprocess.run([*base, "--gpu-memory-gb", "10"], capture_output=True, text=True, timeout=120)
    assert small.returncode == 1 and json.loads(small.stdout)["fits"] is False
    assert "not enough memory" in small.stderr


def test_text_output_and_a_cpu_config_against_this_host(capsys, tmp_path):
    import argparse

    from raymoe.engine.demo_model import write_demo_model

    model = write_demo_model(str(tmp_path / "demo"))
    parser = argparse.ArgumentParser(prog="raymoe")
    plan_cli.add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["plan", "memory", "--config", str(EXAMPLES / "cpu-2x3.yaml"), "--model", model])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert "shared by all ranks (this host's MemTotal)" in out and "fits: yes" in out
    assert "router x2" in out and "worker x3" in out and "recovery reload peak" in out
    assert "engine.kv_cache_bytes capped" in out  # the default 512 MiB: more than 256 x 1,024 tokens use


def test_serve_checks_gpus_per_rank_and_a_cpu_host_only_when_it_starts_ray(tmp_path, monkeypatch):
    from raymoe.cluster import memory_check, serve_cli
    from raymoe.cluster.config import parse_cluster_config
    from raymoe.engine.demo_model import write_demo_model

    model = write_demo_model(str(tmp_path / "demo"))

    def config(device: str, kv_bytes: int):
        return parse_cluster_config({"model": model, "device": device, "routers": 1, "expert_workers": 2,
                                     "engine": {"kv_cache_bytes": kv_bytes, "max_num_seqs": 10**8}}, "test.yaml")

    huge = 10**13
    assert serve_cli._memory_problem(config("cpu", huge), started_ray=False) is None  # ranks on unknown nodes
    assert "router 0 needs 10 TB" in serve_cli._memory_problem(config("cpu", huge), started_ray=True)
    assert serve_cli._memory_problem(config("cpu", 2**20), started_ray=True) is None
    monkeypatch.setattr(memory_check, "local_gpu_memory", lambda: None)
    assert serve_cli._memory_problem(config("cuda", huge), started_ray=True) is None  # no GPU here: not known
    monkeypatch.setattr(memory_check, "local_gpu_memory", lambda: 80 * 10**9)
    problem = serve_cli._memory_problem(config("cuda", 100 * 10**9), started_ray=False)
    assert "router 0 needs" in problem and "80000000000 bytes, this machine's GPU (nvidia-smi)" in problem
    assert "lower engine.kv_cache_bytes" in problem
    assert serve_cli._memory_problem(config("cuda", 10 * 10**9), started_ray=False) is None


def test_gpu_memory_comes_from_nvidia_smi_without_touching_cuda(tmp_path, monkeypatch):
    import os

    from raymoe.cluster import memory_check

    fake = tmp_path / "nvidia-smi"
    fake.write_text("#!/bin/sh\necho 81559\necho 81559\n")  # MiB, as an H100 80GB reports it
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    assert memory_check.local_gpu_memory() == 81559 * 2**20
