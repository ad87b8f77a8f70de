"""`raymoe plan` end to end through its own argparse registration."""

from __future__ import annotations

import argparse
import json

import numpy as np
import pytest

from raymoe.cluster import plan_cli
from raymoe.moe.balance_metrics import count_copies
from raymoe.moe.placement import PlacementTable


def run(argv, capsys):
    parser = argparse.ArgumentParser(prog="raymoe")
    plan_cli.add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(argv)
    code = args.func(args)
    return code, capsys.readouterr().out


def test_payload_json_reproduces_seed_numbers(capsys):
    code, out = run(
        "plan payload --tokens 1024 --top-k 2 --hidden 4096 --bytes-per-value 2 --ranks 8 --json".split(), capsys
    )
    data = json.loads(out)
    assert code == 0
    assert data["dispatch_bytes"] == 16 << 20
    assert data["combine_bytes"] == 16 << 20
    assert data["remote_fraction"] == 0.875
    assert data["remote_bytes"] == 28 << 20


def test_payload_table(capsys):
    code, out = run("plan payload --tokens 1024 --top-k 2 --hidden 4096 --ranks 8".split(), capsys)
    assert code == 0 and "16 MiB" in out and "28 MiB" in out


def test_balance_then_rebalance_with_current(tmp_path, capsys):
    rng = np.random.default_rng(0)
    weights = np.arange(1, 17) ** -1.2
    first = [rng.multinomial(4000, weights / weights.sum()).tolist() for _ in range(2)]
    second = [rng.multinomial(4000, weights / weights.sum()).tolist() for _ in range(2)]
    (tmp_path / "load.json").write_text(json.dumps({"load": first}))
    code, out = run(
        f"plan balance --load {tmp_path / 'load.json'} --workers 4 --slots-per-worker 5 --nodes 2 --json".split(),
        capsys,
    )
    planned = json.loads(out)
    assert code == 0 and planned["copies"] is None
    placement = np.array(planned["placement"])
    assert placement.shape == (2, 20)
    assert all(set(row) == set(range(16)) for row in placement.tolist())
    assert 0.9 < planned["balancedness"] <= 1.0
    (tmp_path / "current.json").write_text(json.dumps({"placement": planned["placement"]}))
    (tmp_path / "load2.json").write_text(json.dumps({"load": second}))
    code, out = run(
        (
            f"plan balance --load {tmp_path / 'load2.json'} --workers 4 --slots-per-worker 5 --nodes 2 "
            f"--current {tmp_path / 'current.json'} --json"
        ).split(),
        capsys,
    )
    rebalanced = json.loads(out)
    assert rebalanced["algorithm"] == "migration"
    old = PlacementTable.from_phy2log(planned["placement"], 5, 16, [0, 0, 1, 1])
    new = PlacementTable.from_phy2log(rebalanced["placement"], 5, 16, [0, 0, 1, 1])
    assert rebalanced["copies"] == count_copies(old, new) == len(rebalanced["migration"])


@pytest.mark.parametrize("algorithm", ["global", "eplb", "hierarchical"])
def test_balance_algorithms_table_output(tmp_path, capsys, algorithm):
    (tmp_path / "load.json").write_text(json.dumps({"load": [[9, 1, 1, 1, 5, 1, 1, 1]]}))
    code, out = run(
        f"plan balance --load {tmp_path / 'load.json'} --workers 2 --slots-per-worker 5 --nodes 2 --groups 2 "
        f"--algorithm {algorithm}".split(),
        capsys,
    )
    assert code == 0 and "balancedness" in out and "layer 0" in out


def test_simulate_writes_a_plot(tmp_path, capsys):
    plot = tmp_path / "loads.png"
    code, out = run(
        f"plan simulate --experts 16 --layers 2 --workers 4 --slots-per-worker 5 --tokens 512 --plot {plot} --json".split(),
        capsys,
    )
    data = json.loads(out)
    assert code == 0
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and plot.stat().st_size > 5000
    assert data["after"]["max_over_mean"] < data["before"]["max_over_mean"]


def test_simulate_replays_recorded_load(tmp_path, capsys):
    (tmp_path / "load.json").write_text(json.dumps({"load": [[100, 100, 10, 10]]}))
    code, out = run(
        f"plan simulate --load {tmp_path / 'load.json'} --workers 2 --slots-per-worker 2 --json".split(), capsys
    )
    data = json.loads(out)
    assert data["before"]["max_over_mean"] == pytest.approx(200 / 110)
    assert data["after"]["max_over_mean"] == 1.0


def test_memory_json(capsys):
    code, out = run("plan memory --model DeepSeek-V3 --gpus 8 --redundant 32 --json".split(), capsys)
    data = json.loads(out)
    assert code == 0
    assert data["fits"]["expert_parallel"] and not data["fits"]["replicated"]
    assert data["slots_per_rank"] == 36
