"""`raymoe serve` refuses a config that cannot fit this machine's memory before anything
starts (issue 34 item 1): non-zero within seconds, naming memory, the rank and its bytes,
and never healthy."""

from __future__ import annotations

import time
import urllib.request

from server_process import ServerProcess

# 10 TB of KV cache for one router; max_num_seqs high enough that the engine would really
# allocate it (the KV cache is capped at max_num_seqs sequences of max_model_len tokens).
SETTINGS = "routers: 1\nexpert_workers: 2\nengine:\n  max_num_seqs: 100000000\n  kv_cache_bytes: 10000000000000\n"


def test_serve_refuses_a_kv_cache_this_host_cannot_hold(tmp_path):
    from raymoe.engine.demo_model import write_demo_model

    model = write_demo_model(str(tmp_path / "demo"))
    config = tmp_path / "too-big.yaml"
    config.write_text(f"model: {model}\ndevice: cpu\ndtype: float32\n{SETTINGS}")
    started = time.monotonic()
    server = ServerProcess(str(config), str(tmp_path / "serve.log"))
    healthy = False
    try:
        while server.process.poll() is None and time.monotonic() - started < 60:
            try:
                with urllib.request.urlopen(f"{server.url}/health", timeout=1) as response:
                    healthy = healthy or response.status == 200
            except OSError:
                pass
            time.sleep(0.2)
        elapsed = time.monotonic() - started
    finally:
        code = server.stop()
    log = server.tail(10**6)
    assert code not in (0, None), log
    assert elapsed < 30, f"took {elapsed:.1f} s:\n{log}"
    assert not healthy and "ready at" not in log
    assert "not enough memory" in log and "router 0 needs 10 TB" in log and "engine.kv_cache_bytes" in log, log
    assert "MemTotal" in log and "Ray cluster" not in log  # refused before any Ray started
