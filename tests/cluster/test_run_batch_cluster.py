"""`raymoe run-batch CONFIG.yaml`: the batch runs on the cluster the config describes."""

from __future__ import annotations

import json
import subprocess
import sys


def test_run_batch_on_a_cluster_config_equals_the_in_process_run(tiny_mixtral_dir, tmp_path):
    items = [
        {"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
         "body": {"prompt": list(range(10 + i, 20 + 2 * i)), "max_tokens": 6, "temperature": 0,
                  "ignore_eos": True, "return_token_ids": True}}
        for i in range(5)
    ] + [{"custom_id": "bad", "method": "POST", "url": "/v1/completions", "body": {"prompt": [1], "top_p": 7}}]
    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps(i) + "\n" for i in items))
    config = tmp_path / "cluster.yaml"
    config.write_text(
        f"model: {tiny_mixtral_dir}\ndevice: cpu\ndtype: float32\nrouters: 2\nexpert_workers: 3\n"
        "placement:\n  strategy: round_robin\n  redundant_slots_per_worker: 1\n"
        "serve:\n  host: 127.0.0.1\n  port: 8000\n"
    )
    command = [sys.executable, "-m", "raymoe.cluster.cli", "run-batch"]
    on_cluster = tmp_path / "cluster.jsonl"
    done = subprocess.run(command + [str(config), "-i", str(source), "-o", str(on_cluster)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    in_process = tmp_path / "local.jsonl"
    done = subprocess.run(command + ["--model", tiny_mixtral_dir, "-i", str(source), "-o", str(in_process)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]

    def token_ids(path):
        return [
            (line["custom_id"], line["response"]["status_code"],
             line["response"]["body"]["choices"][0]["token_ids"] if line["response"]["status_code"] == 200 else None)
            for line in map(json.loads, path.read_text().splitlines())
        ]

    cluster_result = token_ids(on_cluster)
    assert cluster_result == token_ids(in_process)
    assert [status for _, status, _ in cluster_result] == [200] * 5 + [400]
