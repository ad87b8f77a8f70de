"""Soak: mixed valid, invalid and cancelled requests at the admission limit, with RSS watched.

Starts `raymoe serve` (its own local Ray, loopback only) on the demo checkpoint with a small
admission limit, then for ``--minutes`` runs ``--clients`` closed-loop clients, each picking
per request: a completion (non-streamed), a streamed chat that it hangs up on after the first
event, an invalid body, a streamed completion read to the end, a body that never arrives
whole (the client leaves after 20 of 1,000 promised bytes), or a body sent as text/plain. Every minute it samples
the RSS of every process of the server's session (the CLI, Ray's daemons, every actor).

Prints, per outcome, how many requests ended that way; requests that ended any other way
(a 5xx, a lost connection on a request it did not cancel, a wrong body) are "lost"; and per
process its RSS after the first minute and at the end, with the growth. The issue's bar:
no request lost, every process within 5% of its first-minute RSS.

    python benchmarks/soak.py [--minutes 10] [--clients 24]
"""

from __future__ import annotations

import argparse
import collections
import http.client
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import threading
import time

from common import machine_description
from raymoe.cluster import procfs
from raymoe.cluster.serve_process import ServeProcess
from raymoe.kernels.comm.ports import free_port


def process_name(words: list[str]) -> str:
    """`ray::Router`, `gcs_server`, `raylet`, or a Python process by its script (`dashboard.py`),
    from its command line's non-empty arguments."""
    if not words:
        return "?"
    first = os.path.basename(words[0]) if words[0].startswith("/") else words[0]
    if first.startswith("python") and len(words) > 1:
        script = next((w for w in words[1:] if not w.startswith("-")), words[1])
        return f"python {os.path.basename(script)}"[:52]
    return first[:52]


def session_processes(session: int) -> dict[int, tuple[str, int]]:
    """pid -> (name, RSS bytes) for every process in ``session``."""
    found = {}
    for pid, process in procfs.processes().items():
        if process.session != session:
            continue
        try:
            found[pid] = (process_name(process.arguments), procfs.resident_bytes(pid))
        except (OSError, ValueError, IndexError):  # gone meanwhile
            continue
    return found


def one_request(port: int, kind: str) -> str:
    if kind == "half_body":  # headers promise 1,000 bytes, 20 arrive, the client leaves
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=30) as raw:
                raw.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json"
                            b"\r\nContent-Length: 1000\r\n\r\n" + b'{"prompt": "x", "max_')
                time.sleep(0.05)
            return "left mid-body"
        except OSError as error:
            return f"lost: {type(error).__name__}"
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    headers = {"Content-Type": "text/plain" if kind == "not_json" else "application/json"}
    try:
        if kind in ("completion", "not_json"):
            body = {"model": "demo-mixtral", "prompt": "Hello world", "max_tokens": 16, "temperature": 0.7}
        elif kind == "cancelled_stream":
            body = {"model": "demo-mixtral", "messages": [{"role": "user", "content": "Hi!"}], "max_tokens": 64,
                    "stream": True}
        elif kind == "invalid":
            body = random.choice([{"prompt": 12}, {"prompt": "x", "temperature": -3}, {"prompt": "x", "seed": 2**70},
                                  {"prompt": "x", "stop": ["s"] * 100}])
        else:
            body = {"model": "demo-mixtral", "prompt": "Once upon a time", "max_tokens": 24, "stream": True}
        connection.request("POST", "/v1/chat/completions" if kind == "cancelled_stream" else "/v1/completions",
                           json.dumps(body), headers)
        response = connection.getresponse()
        if response.status == 503:
            response.read()
            return "503 overloaded (refused at the admission limit)"
        if kind == "cancelled_stream":
            if response.status != 200 or not response.read(5).startswith(b"data:"):
                return f"lost: {response.status}"
            connection.sock.close()
            return "cancelled after the first event"
        text = response.read().decode()
        if kind == "not_json":
            return "415 refused" if response.status == 415 else f"lost: {response.status}"
        if kind == "invalid":
            return "400 refused" if response.status == 400 and '"error"' in text else f"lost: {response.status}"
        if response.status != 200:
            return f"lost: {response.status}"
        if kind == "stream":
            return "streamed to the end" if text.rstrip().endswith("data: [DONE]") and '"error"' not in text \
                else "lost: broken stream"
        return "completed" if json.loads(text)["choices"][0]["finish_reason"] in ("length", "stop") \
            else "lost: no finish"
    except (OSError, http.client.HTTPException, ValueError) as error:
        return f"lost: {type(error).__name__}"
    finally:
        connection.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--clients", type=int, default=24)
    args = parser.parse_args()
    port = free_port()
    folder = tempfile.mkdtemp(prefix="raymoe-soak-")
    model = os.path.join(folder, "demo")
    subprocess.run([sys.executable, "-m", "raymoe.cluster.cli", "demo-model", model], check=True,
                   stdout=subprocess.DEVNULL)
    config = os.path.join(folder, "soak.yaml")
    with open(config, "w") as handle:
        handle.write(f"model: {model}\ndevice: cpu\ndtype: float32\nrouters: 1\nexpert_workers: 2\n"
                     "engine:\n  max_num_seqs: 8\nserve:\n  max_queued_per_router: 8\n  served_model_name: demo-mixtral\n")
    env = dict(os.environ, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0")
    server = ServeProcess.raymoe(config, port=port, log_path=os.path.join(folder, "serve.log"), env=env)
    server.start()
    outcomes: collections.Counter = collections.Counter()
    samples: list[dict[int, tuple[str, int]]] = []
    try:
        server.wait_ready(300, interval_s=1)
        print(f"machine: {machine_description()}; server ready; {args.clients} clients for {args.minutes} min")
        stop_at = time.monotonic() + 60 * args.minutes
        lock = threading.Lock()

        def client(seed: int) -> None:
            rng = random.Random(seed)
            while time.monotonic() < stop_at:
                kind = rng.choices(["completion", "cancelled_stream", "invalid", "stream", "half_body", "not_json"],
                                   [4, 2, 2, 2, 1, 1])[0]
                outcome = one_request(port, kind)
                with lock:
                    outcomes[outcome] += 1

        threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(args.clients)]
        for thread in threads:
            thread.start()
        minute = 0
        while time.monotonic() < stop_at:
            time.sleep(min(60, max(0.0, stop_at - time.monotonic())))
            minute += 1
            samples.append(session_processes(server.process.pid))
            with lock:
                done = sum(outcomes.values())
            print(f"minute {minute}: {done} requests so far, {len(samples[-1])} server processes, "
                  f"RSS {sum(r for _, r in samples[-1].values()) / 2**20:.0f} MiB in all", flush=True)
        for thread in threads:
            thread.join(timeout=180)
    finally:
        server.stop(90)
    print("\noutcome                                            requests")
    for outcome, count in sorted(outcomes.items()):
        print(f"{outcome:50} {count:8d}")
    lost = sum(count for outcome, count in outcomes.items() if outcome.startswith("lost"))
    print(f"lost: {lost} of {sum(outcomes.values())}")
    if len(samples) >= 2:
        first, last = samples[0], samples[-1]
        print("\nprocess                                                      RSS after min 1   at the end   growth")
        worst = 0.0
        for pid, (name, rss) in sorted(first.items(), key=lambda item: -item[1][1]):
            if pid in last:
                growth = last[pid][1] / rss - 1
                worst = max(worst, growth)
                print(f"{pid:>7} {name:52} {rss / 2**20:10.1f} MiB {last[pid][1] / 2**20:10.1f} MiB {growth:+7.1%}")
        print(f"largest growth after the first minute: {worst:+.1%} (bar: +5%)")


if __name__ == "__main__":
    main()
