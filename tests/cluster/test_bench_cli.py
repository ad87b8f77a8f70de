"""`raymoe bench` end to end against `raymoe serve` on a tiny checkpoint (CPU)."""

from __future__ import annotations

import json
import re

import pytest

from raymoe.cluster.cli import main
from raymoe.cluster.loadgen import LengthDistribution, synthetic_workload
from raymoe.kernels.comm.ports import free_port
from serve.server_process import served

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def server(tiny_mixtral_dir, tmp_path_factory):
    yield from served(tmp_path_factory.mktemp("bench-serve"), tiny_mixtral_dir,
                      "routers: 1\nexpert_workers: 2\nplacement:\n  strategy: round_robin\ncomm:\n  backend: gloo\n"
                      "serve:\n  served_model_name: tiny\n")


def test_closed_loop_prints_percentiles_and_writes_json_and_png(server, tmp_path, capsys):
    out = tmp_path / "run.json"
    code = main(["bench", "--url", f"{server.url}/v1", "--num-requests", "12", "--concurrency", "4",
                 "--prompt-len", "4:16", "--output-len", "4:8", "--seed", "1", "--output", str(out)])
    printed = capsys.readouterr()
    assert code == 0, printed
    number = r"\s+(\d+\.\d)"
    for name in ("TTFT", "ITL", "TPOT", "E2E"):
        assert re.search(rf"^{name} \(ms\){number * 4}$", printed.out, re.M), printed.out
    assert "requests: 12 ok, 0 failed" in printed.out
    assert re.search(r"output tokens/s: \d+\.\d", printed.out) and "goodput: " in printed.out
    assert "12/12" in printed.err  # the progress bar

    body = json.loads(out.read_text())
    for key in ("ttft_ms", "itl_ms"):
        stats = body[key]
        assert 0 < stats["p50"] <= stats["p95"] <= stats["p99"]
    assert body["requests_ok"] == 12 and body["requests_failed"] == 0 and body["output_tokens_per_s"] > 0
    drawn = synthetic_workload(12, LengthDistribution.parse("4:16"), LengthDistribution.parse("4:8"), 256, 1)
    assert body["output_tokens"] == sum(r.max_tokens for r in drawn)  # ignore_eos: every drawn length
    printed_ttft = re.search(rf"^TTFT \(ms\){number}", printed.out, re.M).group(1)
    assert printed_ttft == f"{body['ttft_ms']['p50']:.1f}"

    png = tmp_path / "run.png"
    assert png.read_bytes()[:8] == PNG_MAGIC
    import matplotlib.image

    height, width, _ = matplotlib.image.imread(str(png)).shape
    assert width > 2 * height > 200  # three panels side by side


def test_open_loop_from_a_jsonl_dataset(server, tmp_path, capsys):
    dataset = tmp_path / "prompts.jsonl"
    dataset.write_text('{"prompt": "Hello world", "max_tokens": 3}\n{"prompt": [10, 11, 12], "max_tokens": 5}\n' * 2)
    out = tmp_path / "open.json"
    code = main(["bench", "--url", server.url, "--dataset", str(dataset), "--num-requests", "4",
                 "--request-rate", "8", "--no-progress", "--output", str(out)])
    printed = capsys.readouterr()
    assert code == 0, printed
    body = json.loads(out.read_text())
    assert body["requests_ok"] == 4 and body["output_tokens"] == 16
    assert body["workload"]["request_rate"] == 8 and "open loop, 8 req/s" in printed.out


def test_unreachable_url_and_bad_lengths_are_reported(capsys):
    assert main(["bench", "--url", f"http://127.0.0.1:{free_port(below_ephemeral=True)}", "--num-requests", "2"]) == 1
    assert "cannot reach" in capsys.readouterr().err
    assert main(["bench", "--url", "http://127.0.0.1:1", "--output-len", "0"]) == 2
    assert "length '0'" in capsys.readouterr().err
