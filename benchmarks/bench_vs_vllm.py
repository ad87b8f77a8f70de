"""`raymoe serve` against `vllm serve` (vLLM's CPU build), same checkpoint, same client.

Both servers get the same load from vLLM's own client, ``vllm bench serve`` (OpenAI
``/v1/completions``, streaming): the random dataset, 32 prompt tokens and 64 output tokens
per request (EOS ignored, temperature 0 sent explicitly: this client no longer does by
default), ``--num-prompts`` requests at each ``--max-concurrency`` C in ``--concurrency``
(default 1 and 32). The checkpoint is a random-weight Mixtral (hidden 256,
4 layers, 8 experts, top-2, intermediate 512, vocab 512, float32: benchmarks/common.py's,
the same model as the other end-to-end benchmarks), written once and reused.

- vLLM: ``VLLM_CPU_KVCACHE_SPACE=1 vllm serve CKPT --dtype float32 --max-model-len 512``
  from its own virtualenv (``--vllm-venv``, default /work/vllm-venv; build it with
  shared/tools/vllm-cpu-venv). vLLM is never a dependency of raymoe.
- raymoe: ``raymoe serve CONFIG`` for each ``--configs`` entry: ``RxW`` means R routers and
  W expert workers (a cluster config written to a temporary directory: the checkpoint,
  device cpu, dtype float32, every other field at its default), or a path to a cluster
  config YAML used as it is. Each gets a local Ray of its own (its own RAY_TMPDIR), and
  ``--raymoe-python`` picks the interpreter, e.g. a virtualenv holding another checkout.

Servers run one at a time, on 127.0.0.1 only, each started as its own process group and
stopped by its PID (SIGINT, then SIGTERM, then SIGKILL to that group); every wait is bounded.
Prints output tokens/s, ITL P50 and TTFT P50 per server and concurrency, and the ratios
the issue asks for (raymoe 1x1 / vLLM tok/s at C=32 >= 0.8, raymoe 1x1 / vLLM ITL P50 at
C=1 <= 1.5, raymoe 2x4 / raymoe 1x1 tok/s at C=32 >= 0.5); writes all figures as JSON
(``--out``) and a bar chart beside it (same name, .png). With vLLM skipped, its rows are
carried over from an existing ``--out`` file (marked ``reused``), so raymoe alone can be
re-measured against the last vLLM run.

    python benchmarks/bench_vs_vllm.py                       # vLLM, raymoe 1x1 and 2x4
    python benchmarks/bench_vs_vllm.py --num-prompts 16      # a quick check
    python benchmarks/bench_vs_vllm.py --raymoe-only 1x1     # raymoe 1x1 vs the last vLLM run
    python benchmarks/bench_vs_vllm.py --rounds 3            # every server 3 times, in turn

``--model`` picks a real model's per-layer shapes in bfloat16 instead (benchmarks/common.py's
REAL_SHAPES, built once into ``~/.cache/raymoe/real-NAME``, never committed; issue 29):
``qwen3-30b-a3b-4l`` or ``mixtral-8x7b-2l``. Then the defaults follow that issue: vLLM with
``--dtype bfloat16`` and ``VLLM_CPU_KVCACHE_SPACE=2``, raymoe 1 router x 2 workers, 128 prompt
tokens and 32 output tokens, C = 1 and 16, 16 prompts per run, and its ratios (tok/s at C=16 >= 1.2,
TPOT P50 at C=1 <= 1.0, TTFT P50 at C=16 <= 1.0, peak resident memory <= 1.0 of vLLM's). Every
server's peak memory is sampled twice a second over its whole process tree (Ray's daemons and
actors, vLLM's engine core): the sum of resident sizes (RSS, what the issue compares; shared file
pages count once per process) and of proportional sizes (PSS, shared pages split).

    python benchmarks/bench_vs_vllm.py --model qwen3-30b-a3b-4l

With ``--rounds N`` the servers take turns N times and every ratio is taken within a round,
then its median over the rounds is reported with the per-round values: on a shared machine
whose speed drifts (this one's did by 1.5x within minutes) that compares like with like.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from typing import Any, Iterator

from raymoe.cluster import procfs
from raymoe.cluster.serve_process import ServeProcess, serve_argv
from raymoe.kernels.comm.ports import free_port

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import REAL_SHAPES  # noqa: E402  (benchmarks/common.py, beside this file)

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_OUT = os.path.join(HERE, "results", "bench_vs_vllm.json")
DEFAULT_CKPT = os.path.join(os.environ.get("RAYMOE_CACHE") or os.path.expanduser("~/.cache/raymoe"),
                            "bench-mixtral-h256-l4-e8")
VLLM = "vllm"

# The targets: (name, numerator (server, C, metric), denominator, comparison, target).
RATIOS = [
    ("raymoe 1x1 / vLLM output tok/s at C=32", ("raymoe 1x1", 32, "output_tok_s"), (VLLM, 32, "output_tok_s"),
     ">=", 0.8),
    ("raymoe 1x1 / vLLM ITL P50 at C=1", ("raymoe 1x1", 1, "itl_p50_ms"), (VLLM, 1, "itl_p50_ms"), "<=", 1.5),
    ("raymoe 2x4 / raymoe 1x1 output tok/s at C=32", ("raymoe 2x4", 32, "output_tok_s"),
     ("raymoe 1x1", 32, "output_tok_s"), ">=", 0.5),
    # No target: the same comparison as the ITL ratio, but robust to a server (or a starved
    # client) delivering several tokens in one burst, which drives ITL P50 towards 0.
    ("raymoe 1x1 / vLLM E2E latency P50 at C=1", ("raymoe 1x1", 1, "e2el_p50_ms"), (VLLM, 1, "e2el_p50_ms"),
     None, None),
    # No target: a request's mean time per output token after its first (TPOT), the per-token
    # figure that bursts cannot drive towards 0.
    ("raymoe 1x1 / vLLM TPOT P50 at C=1", ("raymoe 1x1", 1, "tpot_p50_ms"), (VLLM, 1, "tpot_p50_ms"), None, None),
]
# The real shapes' targets (issue 29), raymoe 1 router x 2 workers against vLLM.
REAL = "raymoe 1x2"
REAL_RATIOS = [
    (f"{REAL} / vLLM output tok/s at C=16", (REAL, 16, "output_tok_s"), (VLLM, 16, "output_tok_s"), ">=", 1.2),
    (f"{REAL} / vLLM TPOT P50 at C=1", (REAL, 1, "tpot_p50_ms"), (VLLM, 1, "tpot_p50_ms"), "<=", 1.0),
    (f"{REAL} / vLLM TTFT P50 at C=16", (REAL, 16, "ttft_p50_ms"), (VLLM, 16, "ttft_p50_ms"), "<=", 1.0),
    (f"{REAL} / vLLM peak RSS", (REAL, 1, "peak_rss_gb"), (VLLM, 1, "peak_rss_gb"), "<=", 1.0),
    (f"{REAL} / vLLM peak PSS", (REAL, 1, "peak_pss_gb"), (VLLM, 1, "peak_pss_gb"), None, None),
    (f"{REAL} / vLLM ITL P50 at C=16", (REAL, 16, "itl_p50_ms"), (VLLM, 16, "itl_p50_ms"), None, None),
]
# An ITL P50 below this means tokens arrived in bursts (several per network read), not one per step.
BURST_ITL_MS = 0.1


def log(message: str) -> None:
    print(f"[bench_vs_vllm {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# --- the checkpoint -----------------------------------------------------------------------

def ensure_checkpoint(path: str, model: str = "toy") -> str:
    """The random checkpoint at ``path``, written with benchmarks/common.py's writers if missing:
    the toy Mixtral, or a real model's shapes in bfloat16 (``model`` a REAL_SHAPES name)."""
    path = os.path.abspath(os.path.expanduser(path))
    if os.path.isfile(os.path.join(path, "config.json")) and os.path.isfile(os.path.join(path, "tokenizer.json")):
        log(f"reusing the checkpoint at {path}")
        return path
    sys.path.insert(0, HERE)
    from common import build_mixtral, build_real_shape

    tmp = path + ".partial"
    shutil.rmtree(tmp, ignore_errors=True)
    if model == "toy":
        log(f"writing a random Mixtral (hidden 256, 4 layers, 8 experts, top-2, float32) to {path}")
        build_mixtral(tmp)
    else:
        log(f"writing a random {model} in bfloat16 to {path} (a minute or two)")
        build_real_shape(tmp, model)
    shutil.rmtree(path, ignore_errors=True)
    os.replace(tmp, path)
    return path


def checkpoint_summary(path: str) -> dict[str, Any]:
    with open(os.path.join(path, "config.json")) as handle:
        config = json.load(handle)
    keys = ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "num_local_experts", "num_experts_per_tok", "vocab_size")
    return {"path": path} | {key: config.get(key) for key in keys}


# --- server processes ---------------------------------------------------------------------

def first_model(url: str) -> str | None:
    """The first model id that GET /v1/models lists (None while it lists none)."""
    with urllib.request.urlopen(f"{url}/v1/models", timeout=5) as response:
        models = json.loads(response.read()).get("data") or []
        return models[0]["id"] if response.status == 200 and models else None


class Server(ServeProcess):
    """A server (vLLM's or raymoe's) started as its own process group (cluster/serve_process.py);
    output appended to ``log_path``; ready once GET /v1/models lists a model; stopped by its PID,
    then its group."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], port: int, log_path: str):
        # Run from the log's folder, not the caller's: `python -m` puts the working directory
        # first on sys.path, and a checkout's raymoe/ there would shadow the installed package.
        super().__init__(argv, port, log_path=log_path, env=env, cwd=os.path.dirname(log_path), name=name)

    def start(self) -> None:
        log(f"{self.name}: {' '.join(self.argv)}  (log: {self.log_path})")
        super().start()

    def wait_ready(self, timeout_s: float) -> str:
        """Poll GET /v1/models until it lists a model; returns the first model id."""
        started = time.monotonic()
        model = super().wait_ready(timeout_s, probe=first_model, interval_s=1.0)
        log(f"{self.name}: ready after {time.monotonic() - started:.1f} s, model {model!r}")
        return model

    def stop(self, grace_s: float = 90.0) -> None:
        """SIGINT to the PID, then SIGTERM and SIGKILL to its process group, each wait bounded."""
        process = self.process
        if process is None:
            return
        if process.poll() is None:
            for signum, target, wait_s in ((signal.SIGINT, "pid", grace_s), (signal.SIGTERM, "group", 30.0),
                                           (signal.SIGKILL, "group", 15.0)):
                try:
                    if target == "pid":
                        os.kill(process.pid, signum)
                    else:
                        os.killpg(process.pid, signum)
                except ProcessLookupError:
                    break
                try:
                    process.wait(wait_s)
                    break
                except subprocess.TimeoutExpired:
                    log(f"{self.name}: still running {wait_s:.0f} s after {signal.Signals(signum).name}")
        # Whatever the server left behind in its own group (engine processes, Ray daemons) gets
        # a few seconds to exit on its own, then SIGKILL.
        deadline = time.monotonic() + 15.0
        while group_alive(process.pid) and time.monotonic() < deadline:
            time.sleep(0.5)
        if group_alive(process.pid):
            log(f"{self.name}: processes left in group {process.pid} after it exited; SIGKILL to the group")
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(process.pid, signal.SIGKILL)
        log(f"{self.name}: stopped (exit code {process.returncode})")
        self.process = None


class PeakMemory(threading.Thread):
    """Samples the summed RSS of a process and all its descendants every ``interval_s``, their
    PSS and the process tree every ``EVERY``-th time; keeps the peaks (bytes).

    Cheap on purpose: it shares the cores with the server it measures. Reading every process's
    ``smaps_rollup`` (a walk of its page tables: seconds of CPU over a 6 GB server) and the whole
    process table twice a second took 0.22 of the 2 cores during a C=1 run (cpu_by_process.py),
    as much as half a worker."""

    EVERY = 4

    def __init__(self, pid: int, interval_s: float = 0.5):
        super().__init__(daemon=True, name=f"peak-memory-{pid}")
        self.pid, self.interval_s = pid, interval_s
        self.peak_rss = self.peak_pss = 0
        self.halt = threading.Event()

    def run(self) -> None:
        tree: set[int] = set()
        turn = 0
        while not self.halt.wait(self.interval_s):
            full = turn % self.EVERY == 0
            turn += 1
            if full:
                tree = procfs.descendants({self.pid}, procfs.processes())
            rss = pss = 0
            for pid in tree:
                with contextlib.suppress(OSError, ValueError, KeyError, IndexError):
                    rss += procfs.memory_kib(pid, ("VmRSS",)).get("VmRSS", 0) * 1024
                    if full:
                        pss += int(procfs.status(pid, "smaps_rollup")["Pss"].split()[0]) * 1024
            self.peak_rss = max(self.peak_rss, rss)
            if full:
                self.peak_pss = max(self.peak_pss, pss)

    def stop(self) -> dict[str, float]:
        self.halt.set()
        self.join(10)
        return {"peak_rss_gb": self.peak_rss / 1e9, "peak_pss_gb": self.peak_pss / 1e9}


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def tail(path: str, lines: int = 30) -> str:
    try:
        with open(path, errors="replace") as handle:
            return "".join(handle.readlines()[-lines:])
    except OSError:
        return ""


@contextlib.contextmanager
def running(server: Server, ready_timeout_s: float, memory: dict[str, float] | None = None) -> Iterator[str]:
    """The server, started and ready; with ``memory``, its tree's peak RSS and PSS over its whole
    life (start-up included) are written into that dict once it stops."""
    sampler = None
    try:
        server.start()
        if memory is not None:
            sampler = PeakMemory(server.process.pid)
            sampler.start()
        yield server.wait_ready(ready_timeout_s)
    finally:
        try:
            server.stop()
        finally:
            if sampler is not None:
                memory.update(sampler.stop())


# --- the load: vllm bench serve ----------------------------------------------------------

def bench_serve(vllm_bin: str, url: str, model: str, checkpoint: str, concurrency: int, args: argparse.Namespace,
                result_dir: str, label: str) -> dict[str, Any]:
    """One ``vllm bench serve`` run; returns its result JSON (per-request lists dropped)."""
    filename = f"{re.sub(r'[^A-Za-z0-9]+', '_', label)}_c{concurrency}.json"
    argv = [vllm_bin, "bench", "serve", "--backend", "openai", "--base-url", url, "--endpoint", "/v1/completions",
            "--model", model, "--tokenizer", checkpoint, "--dataset-name", "random",
            "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len),
            "--num-prompts", str(args.num_prompts), "--ignore-eos", "--temperature", str(args.temperature), "--max-concurrency", str(concurrency),
            "--seed", str(args.seed), "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
            "--disable-tqdm", "--save-result", "--result-dir", result_dir, "--result-filename", filename]
    log(f"{label} C={concurrency}: {' '.join(argv)}")
    env = dict(os.environ, VLLM_LOGGING_LEVEL=os.environ.get("VLLM_LOGGING_LEVEL", "WARNING"))
    started = time.monotonic()
    # The client is its own process group too, so that a timeout ends it and whatever it spawned.
    with open(os.path.join(result_dir, filename + ".log"), "wb") as output:
        client = subprocess.Popen(argv, env=env, stdout=output, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                  start_new_session=True, cwd=result_dir)
        try:
            client.wait(args.timeout)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"{label} C={concurrency}: vllm bench serve ran past --timeout {args.timeout} s")
        finally:
            if client.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(client.pid, signal.SIGKILL)
                client.wait(15)
    if client.returncode != 0:
        raise RuntimeError(f"{label} C={concurrency}: vllm bench serve exited with {client.returncode}:\n"
                           f"{tail(os.path.join(result_dir, filename + '.log'))}")
    with open(os.path.join(result_dir, filename)) as handle:
        raw = json.load(handle)
    raw = {key: value for key, value in raw.items() if not isinstance(value, list)}
    row = {
        "server": label, "concurrency": concurrency, "wall_s": time.monotonic() - started,
        "completed": raw.get("completed"), "failed": raw.get("failed", 0),
        "output_tok_s": raw.get("output_throughput"), "itl_p50_ms": raw.get("median_itl_ms"),
        "itl_p99_ms": raw.get("p99_itl_ms"), "ttft_p50_ms": raw.get("median_ttft_ms"),
        "ttft_p99_ms": raw.get("p99_ttft_ms"), "tpot_p50_ms": raw.get("median_tpot_ms"),
        "e2el_p50_ms": raw.get("median_e2el_ms"), "raw": raw,
    }
    log(f"{label} C={concurrency}: {row['completed']} done, {row['failed']} failed, {row['output_tok_s']:.1f} tok/s, "
        f"ITL P50 {row['itl_p50_ms']:.1f} ms, TTFT P50 {row['ttft_p50_ms']:.1f} ms ({row['wall_s']:.0f} s)")
    if row["failed"]:
        log(f"{label} C={concurrency}: {row['failed']} requests failed, see {filename}.log")
    return row


# --- the two servers ----------------------------------------------------------------------

def run_vllm(args: argparse.Namespace, checkpoint: str, work: str) -> list[dict[str, Any]]:
    vllm_bin = os.path.join(args.vllm_venv, "bin", "vllm")
    port = free_port()
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=str(args.kv_cache_gib))
    server = Server(VLLM, [vllm_bin, "serve", checkpoint, "--dtype", args.dtype, "--max-model-len", "512",
                           "--host", "127.0.0.1", "--port", str(port)], env, port, os.path.join(work, "vllm-serve.log"))
    rows, memory = [], {}
    with running(server, args.startup_timeout, memory) as model:
        for concurrency in args.concurrency:
            rows.append(bench_serve(vllm_bin, server.url, model, checkpoint, concurrency, args, work, VLLM))
    return [dict(row, **memory) for row in rows]


CLUSTER_YAML = """\
model: {model}
device: cpu
dtype: {dtype}
routers: {routers}
expert_workers: {workers}
serve:
  host: 127.0.0.1
  port: {port}
"""


def raymoe_config(spec: str, checkpoint: str, work: str, port: int, dtype: str = "float32") -> tuple[str, str]:
    """(label, YAML path) for ``RxW`` (written here) or a cluster config path (used as it is)."""
    match = re.fullmatch(r"(\d+)x(\d+)", spec)
    if not match:
        if not os.path.isfile(spec):
            raise SystemExit(f"--configs: {spec!r} is neither RxW (routers x expert workers) nor a YAML file")
        return f"raymoe {os.path.splitext(os.path.basename(spec))[0]}", os.path.abspath(spec)
    path = os.path.join(work, f"raymoe-{spec}.yaml")
    with open(path, "w") as handle:
        handle.write(CLUSTER_YAML.format(model=checkpoint, routers=match[1], workers=match[2], port=port, dtype=dtype))
    return f"raymoe {spec}", path


def run_raymoe(spec: str, args: argparse.Namespace, checkpoint: str, work: str) -> list[dict[str, Any]]:
    vllm_bin = os.path.join(args.vllm_venv, "bin", "vllm")
    port = free_port()
    label, config = raymoe_config(spec, checkpoint, work, port, args.dtype)
    # A local Ray of its own, stopped with the server: no RAY_ADDRESS, and a Ray temp dir of
    # its own, or ray.init() joins whatever cluster `ray start` last recorded in
    # /tmp/ray/ray_current_cluster on this machine (short path: Ray's socket paths must fit 107 bytes).
    ray_tmp = tempfile.mkdtemp(prefix="bvv-ray-", dir="/tmp")
    env = dict(os.environ, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", RAY_TMPDIR=ray_tmp)
    env.pop("RAY_ADDRESS", None)
    argv = serve_argv(config, port, host="127.0.0.1", python=args.raymoe_python)
    server = Server(label, argv, env, port, os.path.join(work, f"{label.replace(' ', '-')}-serve.log"))
    rows, memory = [], {}
    try:
        with running(server, args.startup_timeout, memory) as model:
            for concurrency in args.concurrency:
                rows.append(bench_serve(vllm_bin, server.url, model, checkpoint, concurrency, args, work, label))
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    return [dict(row, **memory) for row in rows]


# --- report -------------------------------------------------------------------------------

def find(rows: list[dict[str, Any]], server: str, concurrency: int, metric: str,
         round_: int | None = None) -> float | None:
    """The metric of ``server`` at ``concurrency`` in round ``round_`` (a reused row matches every
    round); without a round, the median over the rounds. A run in which requests failed is left
    out (its tokens/s and latencies describe another workload)."""
    values = [float(row[metric]) for row in rows
              if row["server"] == server and row["concurrency"] == concurrency and row.get(metric) is not None
              and not row.get("failed") and (round_ is None or row.get("round") in (round_, None))]
    return statistics.median(values) if values else None


def ratios(rows: list[dict[str, Any]], table: list | None = None) -> list[dict[str, Any]]:
    """Each target ratio (of ``table``, default :data:`RATIOS`) per round (both sides measured in the same round, minutes apart, so a
    machine whose speed drifts weighs on both alike), then the median over the rounds."""
    rounds = sorted({row["round"] for row in rows if row.get("round") is not None}) or [None]
    out = []
    for name, num, den, op, target in table or RATIOS:
        per_round, bursts = [], False
        for round_ in rounds:
            a, b = find(rows, *num, round_), find(rows, *den, round_)
            if a is not None and b:
                per_round.append(a / b)
            bursts |= num[2] == "itl_p50_ms" and any(x is not None and x < BURST_ITL_MS for x in (a, b))
        value = statistics.median(per_round) if per_round else None
        met = None if value is None or op is None else (value >= target if op == ">=" else value <= target)
        note = None
        if bursts:
            note = (f"an ITL P50 < {BURST_ITL_MS} ms: that server's tokens arrived in bursts, so this ratio "
                    "is not meaningful; see the E2E latency ratio")
        out.append({"name": name, "value": value, "per_round": per_round,
                    "target": None if op is None else f"{op} {target}", "met": met, "note": note})
    return out


def print_table(rows: list[dict[str, Any]], ratio_rows: list[dict[str, Any]]) -> None:
    print(f"{'server':<14} {'round':>5} {'C':>3} {'done':>5} {'output tok/s':>13} {'ITL P50 ms':>11} {'TTFT P50 ms':>12}"
          f" {'ITL P99 ms':>11} {'TTFT P99 ms':>12} {'E2EL P50 ms':>12} {'TPOT P50 ms':>12} {'peak RSS GB':>12}")
    for row in rows:
        note = "  (reused)" if row.get("reused") else ""
        if row.get("failed"):
            note += f"  ({row['failed']} failed: left out of the ratios)"
        print(f"{row['server']:<14} {row.get('round', '-'):>5} {row['concurrency']:>3} {row['completed']:>5} {row['output_tok_s']:>13.1f} "
              f"{row['itl_p50_ms']:>11.2f} {row['ttft_p50_ms']:>12.1f} {row['itl_p99_ms']:>11.1f} "
              f"{row['ttft_p99_ms']:>12.1f} {row.get('e2el_p50_ms') or float('nan'):>12.1f} "
              f"{row.get('tpot_p50_ms') or float('nan'):>12.1f} {row.get('peak_rss_gb') or float('nan'):>12.2f}{note}")
    print()
    for ratio in ratio_rows:
        value = "n/a (not measured)" if ratio["value"] is None else f"{ratio['value']:.2f}"
        verdict = "" if ratio["met"] is None else ("  met" if ratio["met"] else "  NOT met")
        target = f"  (target {ratio['target']})" if ratio["target"] else "  (no target)"
        spread = ""
        if len(ratio.get("per_round") or []) > 1:
            spread = f"  (median of {len(ratio['per_round'])} rounds: {', '.join(f'{v:.2f}' for v in ratio['per_round'])})"
        print(f"{ratio['name']:<46} {value:>8}{target}{verdict}{spread}")
        if ratio["note"]:
            print(f"    note: {ratio['note']}")


def write_plot(rows: list[dict[str, Any]], path: str,
               title: str = "raymoe serve vs vllm serve (CPU), vllm bench serve, random 32 in / 64 out") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    servers = list(dict.fromkeys(row["server"] for row in rows))
    concurrencies = sorted({row["concurrency"] for row in rows})
    metrics = [("output_tok_s", "output tokens/s (higher is better)"), ("itl_p50_ms", "ITL P50, ms (lower is better)"),
               ("ttft_p50_ms", "TTFT P50, ms (lower is better)")]
    if any(row.get("peak_rss_gb") for row in rows):  # the real shapes' figures
        metrics += [("tpot_p50_ms", "TPOT P50, ms (lower is better)"), ("peak_rss_gb", "peak RSS, GB (lower is better)")]
    figure, panels = plt.subplots(1, len(metrics), figsize=(5 * len(metrics), 4.2))
    width = 0.8 / max(1, len(servers))
    for axes, (metric, panel_title) in zip(panels, metrics):
        for index, server in enumerate(servers):
            xs = [c_index + (index - (len(servers) - 1) / 2) * width for c_index in range(len(concurrencies))]
            values = [find(rows, server, c, metric) or 0.0 for c in concurrencies]
            bars = axes.bar(xs, values, width, label=server)
            axes.bar_label(bars, labels=[f"{v:.0f}" if v >= 10 else f"{v:.1f}" for v in values], fontsize=7)
        axes.set_xticks(range(len(concurrencies)), [f"C={c}" for c in concurrencies])
        axes.set_title(panel_title)
        axes.grid(axis="y", alpha=0.3)
        axes.legend(fontsize=8)
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=90)
    plt.close(figure)


def machine_description() -> str:
    cpu = ""
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        for line in subprocess.run(["lscpu"], capture_output=True, text=True, timeout=5).stdout.splitlines():
            if line.startswith("Model name"):
                cpu = line.split(":", 1)[1].strip()
    return f"{cpu or 'unknown CPU'}, {os.cpu_count()} cores, Python {sys.version.split()[0]}"


def tool_version(argv: list[str]) -> str | None:
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        result = subprocess.run(argv, capture_output=True, text=True, timeout=120)
        lines = [line for line in result.stdout.splitlines() if line.strip()]
        return lines[-1].strip() if lines else None
    return None


def previous_vllm_rows(path: str) -> list[dict[str, Any]]:
    try:
        with open(path) as handle:
            previous = json.load(handle)
    except (OSError, ValueError):
        return []
    rows = [row for row in previous.get("rows", []) if row.get("server") == VLLM]
    for row in rows:
        row["reused"] = True
        row.pop("round", None)  # a reused row stands in every round of this run
        row.setdefault("measured_at", previous.get("finished_at"))
    return rows


def _interrupt(*_: Any) -> None:
    raise KeyboardInterrupt


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="toy", choices=["toy", *REAL_SHAPES],
                        help="the toy float32 Mixtral (default), or a real model's shapes in bfloat16")
    parser.add_argument("--num-prompts", type=int, help="requests per run (default 96; real shapes 16)")
    parser.add_argument("--concurrency", type=int, nargs="+", help="max concurrency values (default 1 32; real 1 16)")
    parser.add_argument("--configs", nargs="+",
                        help="raymoe configs: RxW (routers x expert workers) or cluster config YAML paths "
                             "(default 1x1 2x4; real shapes 1x2)")
    parser.add_argument("--skip-vllm", action="store_true",
                        help="do not run vLLM (its rows are reused from an existing --out file, if any)")
    parser.add_argument("--raymoe-only", metavar="CONFIG",
                        help="run only this raymoe config (RxW or a YAML path); implies --skip-vllm")
    parser.add_argument("--timeout", type=float, default=1200.0, help="limit of one vllm bench serve run, s")
    parser.add_argument("--startup-timeout", type=float, default=900.0, help="limit of one server start, s")
    parser.add_argument("--vllm-venv", default="/work/vllm-venv", help="virtualenv with vLLM's CPU build")
    parser.add_argument("--checkpoint", help="checkpoint directory (written if missing; default by --model)")
    parser.add_argument("--input-len", type=int, help="prompt tokens (default 32; real shapes 128)")
    parser.add_argument("--output-len", type=int, help="output tokens (default 64; real shapes 32)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="sent in every request (vllm bench serve sends none by default; 0 = greedy on both)")
    parser.add_argument("--raymoe-python", default=sys.executable,
                        help="interpreter that runs `raymoe serve` (e.g. a virtualenv with another raymoe checkout)")
    parser.add_argument("--out", help="results JSON, the chart beside it (.png); default "
                                      "benchmarks/results/bench_vs_vllm.json, or bench_vs_vllm_MODEL.json")
    parser.add_argument("--keep-logs", action="store_true", help="keep the servers' and clients' logs")
    parser.add_argument("--rounds", type=int, default=1,
                        help="run every server this many times, in turn; ratios are taken within a round and "
                             "their median reported (this machine's speed drifts by tens of percent)")
    args = parser.parse_args()
    real = args.model != "toy"
    defaults = dict(num_prompts=16, concurrency=[1, 16], configs=["1x2"], input_len=128, output_len=32) if real else \
        dict(num_prompts=96, concurrency=[1, 32], configs=["1x1", "2x4"], input_len=32, output_len=64)
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    args.dtype, args.kv_cache_gib = ("bfloat16", 2) if real else ("float32", 1)
    args.checkpoint = args.checkpoint or (os.path.join(os.path.dirname(DEFAULT_CKPT), f"real-{args.model}") if real
                                          else DEFAULT_CKPT)
    args.out = args.out or (os.path.join(HERE, "results", f"bench_vs_vllm_{args.model}.json") if real else DEFAULT_OUT)
    ratio_table = REAL_RATIOS if real else RATIOS
    # SIGTERM unwinds like Ctrl-C, so that the finally blocks stop every server started here.
    signal.signal(signal.SIGTERM, _interrupt)
    if args.raymoe_only:
        args.skip_vllm, args.configs = True, [args.raymoe_only]
    vllm_bin = os.path.join(args.vllm_venv, "bin", "vllm")
    if not os.access(vllm_bin, os.X_OK):
        raise SystemExit(f"{vllm_bin} not found: build it with `bash shared/tools/vllm-cpu-venv {args.vllm_venv}` "
                         "(vllm bench serve is the load generator for both servers)")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    started = time.monotonic()
    load_before = os.getloadavg()
    checkpoint = ensure_checkpoint(args.checkpoint, args.model)
    work = tempfile.mkdtemp(prefix="bench_vs_vllm-")
    rows: list[dict[str, Any]] = []
    errors: list[str] = []
    try:
        runs = ([] if args.skip_vllm else [(VLLM, lambda: run_vllm(args, checkpoint, work))]) + [
            (spec, lambda spec=spec: run_raymoe(spec, args, checkpoint, work)) for spec in args.configs]
        for round_ in range(args.rounds):
            for name, run in runs:
                try:
                    rows.extend(dict(row, round=round_) for row in run())
                except (RuntimeError, OSError, ValueError) as error:  # one failing does not lose the others' rows
                    log(f"{name} (round {round_}): FAILED: {error}")
                    errors.append(f"{name} (round {round_}): {error}")
    finally:
        if args.keep_logs or errors:
            log(f"logs kept in {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    if args.skip_vllm:
        rows = previous_vllm_rows(args.out) + rows
    if not rows:
        raise SystemExit("no results: " + "; ".join(errors))
    ratio_rows = ratios(rows, ratio_table)
    print(f"machine: {machine_description()}; {args.num_prompts} prompts per run, "
          f"{args.input_len} in / {args.output_len} out, wall {time.monotonic() - started:.0f} s, "
          f"load average {load_before[0]:.1f} before, {os.getloadavg()[0]:.1f} after")
    print_table(rows, ratio_rows)
    result = {
        "machine": machine_description(), "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "wall_s": time.monotonic() - started, "loadavg_before": load_before, "loadavg_after": os.getloadavg(),
        "checkpoint": checkpoint_summary(checkpoint),
        "vllm_version": tool_version([vllm_bin, "--version"]),
        "model": args.model, "dtype": args.dtype,
        "workload": {"num_prompts": args.num_prompts, "input_len": args.input_len, "output_len": args.output_len,
                     "concurrency": args.concurrency, "rounds": args.rounds, "seed": args.seed, "temperature": args.temperature, "client": "vllm bench serve --backend openai"},
        "configs": args.configs, "raymoe_python": args.raymoe_python, "rows": rows, "ratios": ratio_rows, "errors": errors,
    }
    with open(args.out, "w") as handle:
        json.dump(result, handle, indent=2)
    write_plot(rows, os.path.splitext(args.out)[0] + ".png",
               f"raymoe serve vs vllm serve (CPU), {args.model} {args.dtype}, vllm bench serve, "
               f"random {args.input_len} in / {args.output_len} out")
    log(f"wrote {args.out} and {os.path.splitext(args.out)[0]}.png")
    if errors:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
