"""Recovery measured (issue 30 item 5): streams under steady load while one component is killed
or frozen; what the clients saw, per case.

Starts `raymoe serve` (its own local Ray, loopback only; cluster/serve_process.py) on a tiny
random-weight Mixtral written offline (benchmarks/common.py), 2 routers x 3 expert workers,
CPU, float32, comm over ``--backend`` (sockets, the CPU default; or gloo) with ``--timeout-s`` (3 s, as
tests/serve/test_router_failure.py).
Per case it starts ``--streams`` streamed completions of ``--tokens`` tokens each (half greedy,
half seeded at temperature 0.9; one after the other, each once its first event arrived, so
that with one ingress replica stream i runs on router i % 2), waits until every stream has
``--warm-tokens`` tokens, then fires the fault and records every stream's token arrival times:

  none  no fault: the reference outputs and the baseline pauses
  a     SIGKILL of expert worker 1, every expert having 2 copies (redundant slots)
  b     SIGKILL of expert worker 1, no replicas (recovery waits for Ray's restart)
  c     SIGKILL of router 0 (its requests migrate to router 1 and continue)
  d     SIGSTOP of router 0 for ``--stop-s`` s, then SIGCONT
  e     SIGKILL of the controller
  f     SIGKILL of one of 2 ingress replicas (serve.replicas: 2): its streams are lost

Cases a, c, d, e run one after the other on one server (redundant slots so every expert has
2 copies, 1 ingress replica); b and f on a second one (no replicas, 2 ingress replicas). Each
server first runs the reference ("none"); before each case the cluster is back at full size.

Per case: streams lost (an error, a dropped connection, or fewer tokens than asked), streams
whose token ids differ from the reference, the longest pause between two consecutive token
events of the surviving streams (those not on the killed component: for c and d the odd
streams, on router 1; for f those that completed) and of all streams, the p99 inter-token
latency over the tokens that arrived in the ``--after-s`` s after the fault, and the seconds
from the fault until the cluster is back at full size (GET /admin/placement with the admin
token answers, every router alive, no degraded placement, a recovery recorded where one is
due, and every actor process of the killed kind alive again under a new pid).

    python benchmarks/bench_recovery.py [--cases a,b,c,d,e,f] [--streams 16] [--tokens 200]
        [--out recovery.json] [--plot docs/figures/recovery_timeline.png]

Timings depend on the machine's load: on a shared machine they are noisy.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import signal
import sys
import tempfile
import threading
import time
import urllib.request
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from raymoe.cluster import procfs  # noqa: E402
from raymoe.cluster.serve_process import ServeProcess  # noqa: E402

ADMIN_TOKEN = "bench-recovery-token"
CASES = {
    "a": "worker SIGKILL, replicas",
    "b": "worker SIGKILL, no replicas",
    "c": "router SIGKILL",
    "d": "router SIGSTOP",
    "e": "controller SIGKILL",
    "f": "ingress replica SIGKILL",
}
SERVER_A, SERVER_B = ("a", "c", "d", "e"), ("b", "f")
FULL_SIZE_TIMEOUT_S = 180
START_ATTEMPTS = 2
STREAM_TIMEOUT_S = 300


# ---- pure parts: a timeline is {"events": [(t, [token ids]), ...], "error": str|None, ...} ----

def token_ids(stream: dict) -> list[int]:
    return [t for _, ids in stream["events"] for t in ids]


def gaps(stream: dict) -> list[tuple[float, float, int]]:
    """(start, end, tokens arriving at end) between consecutive token events."""
    times = [(t, len(ids)) for t, ids in stream["events"] if ids]
    return [(a, b, n) for (a, _), (b, n) in zip(times, times[1:])]


def longest_pause(streams: list[dict]) -> float:
    """The longest gap between two consecutive token events over ``streams`` (0 without any)."""
    return max((end - start for s in streams for start, end, _ in gaps(s)), default=0.0)


def pause_within(streams: list[dict], start: float, end: float) -> float:
    """The longest gap between two consecutive token events over ``streams`` that overlaps
    ``[start, end]`` (0 without any): the pause a phase caused (a recovery, a re-include)."""
    return max((b - a for s in streams for a, b, _ in gaps(s) if b >= start and a <= end), default=0.0)


def phase_windows(recoveries: list[dict], wall_minus_mono: float, fault_t: float) -> dict[str, tuple[float, float]]:
    """From the controller's recovery records after the fault (each ends at ``time``, wall clock,
    and took ``seconds``): the window of the fault (from the fault to the end of the first
    recovery) and of the re-include (the record with ``reincluded_workers``), in monotonic time."""
    windows: dict[str, tuple[float, float]] = {}
    for record in recoveries:
        end = record["time"] - wall_minus_mono
        if "reincluded_workers" in record and "reinclude" not in windows:
            windows["reinclude"] = (end - record.get("seconds", 0.0), end)
        elif "lost_workers" in record and "fault" not in windows:
            windows["fault"] = (fault_t, end)
    return windows


def itl_after(streams: list[dict], fault_t: float, window_s: float) -> list[float]:
    """Inter-token latencies of the tokens that arrived in [fault_t, fault_t + window_s]: an event
    carrying n tokens after a gap g counts n times g / n."""
    found = []
    for s in streams:
        for start, end, n in gaps(s):
            if fault_t <= end <= fault_t + window_s:
                found.extend([(end - start) / max(n, 1)] * max(n, 1))
    return found


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    k = (len(ordered) - 1) * q / 100
    low = int(k)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (k - low)


def is_lost(stream: dict, max_tokens: int) -> bool:
    return stream.get("error") is not None or len(token_ids(stream)) != max_tokens


def rate_series(streams: list[dict], origin: float, bin_s: float = 0.5) -> tuple[list[float], list[float]]:
    """Tokens/s over all streams in bins of ``bin_s``, times relative to ``origin``."""
    stamps = [(t - origin, len(ids)) for s in streams for t, ids in s["events"] if ids]
    if not stamps:
        return [], []
    first = min(t for t, _ in stamps)
    last = max(t for t, _ in stamps)
    start = bin_s * (first // bin_s)
    count = int((last - start) // bin_s) + 1
    bins = [0] * count
    for t, n in stamps:
        bins[min(int((t - start) // bin_s), count - 1)] += n
    return [start + (i + 0.5) * bin_s for i in range(count)], [b / bin_s for b in bins]


def summarize(case: str, streams: list[dict], reference: list[list[int]] | None, max_tokens: int,
              fault_t: float | None, surviving: list[int] | None, after_s: float,
              full_size_s: float | None) -> dict[str, Any]:
    """One case's row: lost, differing, the longest pauses (surviving / all), p99 ITL after the
    fault (ms), seconds back at full size."""
    lost = [i for i, s in enumerate(streams) if is_lost(s, max_tokens)]
    differing = [i for i, s in enumerate(streams)
                 if reference is not None and i not in lost and token_ids(s) != reference[i]]
    if surviving is None:
        surviving = [i for i in range(len(streams)) if i not in lost]
    origin = fault_t if fault_t is not None else min((t for s in streams for t, ids in s["events"] if ids), default=0)
    itl = itl_after(streams, origin, after_s)
    return {
        "case": case, "what": CASES.get(case, "no fault (reference)"), "streams": len(streams),
        "lost": len(lost), "lost_streams": lost, "differing": len(differing), "differing_streams": differing,
        "longest_pause_surviving_s": round(longest_pause([streams[i] for i in surviving]), 3),
        "longest_pause_all_s": round(longest_pause(streams), 3),
        "p99_itl_after_ms": round(1000 * percentile(itl, 99), 1), "itl_tokens_after": len(itl),
        "full_size_s": None if full_size_s is None else round(full_size_s, 2),
    }


def split_pauses(row: dict, streams: list[dict], surviving: list[int] | None, windows: dict) -> None:
    """Add to ``row`` the longest pause of the surviving streams at the fault (a gap overlapping
    the fault's recovery) and at the re-include (a gap overlapping it), where the records say when."""
    alive = streams if surviving is None else [streams[i] for i in surviving]
    for name, (start, end) in windows.items():
        row[f"pause_at_{name}_s"] = round(pause_within(alive, start, end), 3)
        row[f"{name}_window_s"] = [round(start, 3), round(end, 3)]


def table(rows: list[dict]) -> str:
    def seconds(value):
        return "n/a" if value is None else f"{value:.2f}"

    lines = [f"{'case':4} {'what':30} {'lost':>6} {'differ':>6} {'pause surv/all s':>17} "
             f"{'p99 ITL after ms':>16} {'full size s':>11} {'at fault/re-include s':>21}"]
    for r in rows:
        lines.append(f"{r['case']:4} {r['what']:30} {r['lost']:>3}/{r['streams']:<2} {r['differing']:>6} "
                     f"{r['longest_pause_surviving_s']:>8.2f}/{r['longest_pause_all_s']:<8.2f} "
                     f"{r['p99_itl_after_ms']:>16.1f} {seconds(r['full_size_s']):>11} "
                     f"{seconds(r.get('pause_at_fault_s')):>10}/{seconds(r.get('pause_at_reinclude_s')):<10}")
    return "\n".join(lines)


def plot(results: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(results), 1, figsize=(7, 1.5 * len(results) + 0.6), sharex=True, squeeze=False)
    for ax, result in zip(axes[:, 0], results):
        times, rates = result["rate_t"], result["rate"]
        ax.plot(times, rates, lw=1)
        for mark, style in ((0.0, "r-"), (result.get("resume_t"), "g--")):
            if mark is not None and result["row"]["case"] != "none":
                ax.axvline(mark, color=style[0], ls=style[1:], lw=1)
        if result["row"].get("full_size_s") is not None:
            ax.axvline(result["row"]["full_size_s"], color="k", ls=":", lw=1)
        ax.set_ylabel("tok/s", fontsize=7)
        ax.set_title(f"({result['row']['case']}) {result['row']['what']}", fontsize=8, loc="left")
        ax.tick_params(labelsize=7)
    axes[-1, 0].set_xlabel("seconds after the fault (red: fault, green dashed: SIGCONT, black dotted: full size)",
                           fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=70)
    plt.close(fig)


# ---- the run ----------------------------------------------------------------------------

def request_body(i: int, tokens: int) -> dict:
    body = {"prompt": [50 + i, 60 + i, 70 + i, 80 + i], "max_tokens": tokens, "ignore_eos": True,
            "stream": True, "return_token_ids": True, "temperature": 0.0}
    if i % 2:
        body.update(temperature=0.9, seed=1000 + i)
    return body


def run_stream(port: int, body: dict, record: dict, first: threading.Event) -> None:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=STREAM_TIMEOUT_S)
    try:
        connection.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        response = connection.getresponse()
        if response.status != 200:
            record["error"] = f"HTTP {response.status}: {response.read()[:200]!r}"
            return
        done = False
        for raw in response:
            line = raw.decode(errors="replace").strip()
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                done = True
                break
            payload = json.loads(data)
            if "error" in payload:
                record["error"] = payload["error"].get("code") or "error event"
                break
            ids = [t for c in payload.get("choices", []) for t in c.get("token_ids") or []]
            record["events"].append((time.monotonic(), ids))
            first.set()
        if not done and record["error"] is None:
            record["error"] = "stream ended without [DONE]"
    except (OSError, http.client.HTTPException, ValueError) as error:
        record["error"] = f"{type(error).__name__}: {error}"
    finally:
        record["end"] = time.monotonic()
        first.set()
        connection.close()


def admin(url: str, path: str = "/admin/placement", timeout: float = 10) -> dict:
    request = urllib.request.Request(url + path, headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


def actor_pids(server, prefix: str) -> list[int]:
    """Live (not zombie) processes of the server's session whose title starts with ``prefix``
    (Ray titles an actor's process ``ray::ClassName``)."""
    session = server.process.pid
    return sorted(pid for pid, p in procfs.processes().items()
                  if p.session == session and p.state != "Z" and p.command.startswith(prefix))


KINDS = {"a": ("ray::ExpertWorker", 3), "b": ("ray::ExpertWorker", 3), "c": ("ray::Router", 2),
         "d": ("ray::Router", 2), "e": ("ray::Controller", 1), "f": ("ray::ServeReplica", 2)}


def full_size(server, case: str | None, victim: int | None, recoveries_before: int,
              replicas: int) -> bool:
    """The cluster is whole again after ``case``'s fault on ``victim``."""
    try:
        status = admin(server.url)
    except (OSError, ValueError):
        return False
    if not all(r.get("alive") for r in status["routers"]) or status.get("degraded") is not None:
        return False
    if len(actor_pids(server, "ray::ExpertWorker")) < 3 or len(actor_pids(server, "ray::Router")) < 2:
        return False
    if len(actor_pids(server, "ray::ServeReplica")) < replicas:
        return False
    if case is None:
        return True
    prefix, _ = KINDS[case]
    if case in ("a", "b", "c") and len(status.get("recoveries", [])) <= recoveries_before:
        return False
    if case == "d":  # thawed (or killed and restarted by recovery)
        try:
            return procfs.stat(victim)[0] != "T"
        except (OSError, ValueError, IndexError):
            return True
    if case == "e":
        return status.get("pid") != victim
    return victim not in actor_pids(server, prefix)


def wait_full_size(server, case, victim, recoveries_before, replicas, since: float, timeout_s: float) -> float | None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if full_size(server, case, victim, recoveries_before, replicas):
            return time.monotonic() - since
        time.sleep(0.5)
    return None


def pick_victim(server, case: str) -> int:
    if case in ("a", "b"):
        workers = actor_pids(server, "ray::ExpertWorker")
        return workers[min(1, len(workers) - 1)]
    if case in ("c", "d"):
        return admin(server.url)["routers"][0]["pid"]
    if case == "e":
        return admin(server.url)["pid"]
    return actor_pids(server, "ray::ServeReplica")[0]


def run_case(server, case: str, args, reference: list[list[int]] | None, replicas: int) -> dict:
    """One load with (or, for "none", without) a fault; returns the row and the series."""
    records = [{"events": [], "error": None, "end": None} for _ in range(args.streams)]
    threads = []
    start_deadline = time.monotonic() + 120
    for i in range(args.streams):  # one after the other: stream i on router i % 2 (1 ingress replica)
        first = threading.Event()
        thread = threading.Thread(target=run_stream, daemon=True,
                                  args=(server.port, request_body(i, args.tokens), records[i], first))
        thread.start()
        threads.append(thread)
        first.wait(max(1.0, start_deadline - time.monotonic()))
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not all(
            len(token_ids(r)) >= args.warm_tokens or r["end"] is not None for r in records):
        time.sleep(0.05)
    fault_t, resume_t, victim, full_s = None, None, None, None
    if case != "none":
        recoveries_before = len(admin(server.url).get("recoveries", []))
        victim = pick_victim(server, case)
        fault_t = time.monotonic()
        os.kill(victim, signal.SIGSTOP if case == "d" else signal.SIGKILL)
        print(f"  case {case}: fault on pid {victim} at t0", flush=True)
        if case == "d":
            try:
                time.sleep(args.stop_s)
            finally:
                try:
                    os.kill(victim, signal.SIGCONT)
                except ProcessLookupError:  # recovery killed it meanwhile
                    pass
            resume_t = time.monotonic() - fault_t
        full_s = wait_full_size(server, case, victim, recoveries_before, replicas, fault_t, FULL_SIZE_TIMEOUT_S)
    for thread in threads:
        thread.join(max(1.0, STREAM_TIMEOUT_S))
    surviving = None
    if case in ("c", "d"):  # router 0's streams are the even ones
        surviving = [i for i in range(args.streams) if i % 2 == 1]
    row = summarize(case, records, reference, args.tokens, fault_t, surviving, args.after_s, full_s)
    row["victim_pid"] = victim
    if case != "none":
        try:
            recoveries = admin(server.url).get("recoveries", [])[recoveries_before:]
        except (OSError, ValueError):
            recoveries = []
        row["recoveries"] = recoveries
        split_pauses(row, records, surviving, phase_windows(recoveries, time.time() - time.monotonic(), fault_t))
    origin = fault_t if fault_t is not None else min(
        (t for r in records for t, ids in r["events"] if ids), default=time.monotonic())
    rate_t, rate = rate_series(records, origin)
    stamps = [[round(t - origin, 3) for t, ids in r["events"] if ids] for r in records]  # token events, s after the fault
    return {"row": row, "rate_t": [round(t, 2) for t in rate_t], "rate": rate, "resume_t": resume_t, "stamps": stamps,
            "tokens": [token_ids(r) for r in records], "errors": [r["error"] for r in records],
            "pause_per_stream": [round(longest_pause([r]), 3) for r in records]}


def cluster_yaml(model: str, redundant: int, replicas: int, timeout_s: float, backend: str = "sockets") -> str:
    return (f"model: {model}\ndevice: cpu\ndtype: float32\nrouters: 2\nexpert_workers: 3\n"
            f"placement:\n  strategy: round_robin\n  redundant_slots_per_worker: {redundant}\n"
            f"comm:\n  backend: {backend}\n  timeout_s: {timeout_s}\n"
            "balancer:\n  enabled: false\n  poll_interval_s: 0.2\n"
            f"serve:\n  replicas: {replicas}\n")


def copies_per_expert(status: dict) -> int:
    """The fewest workers any expert of any layer lives on."""
    per_worker = status["slots_per_worker"]
    fewest = None
    for layer in status["placement"]:
        holders: dict[int, set[int]] = {}
        for slot, expert in enumerate(layer):
            if expert >= 0:
                holders.setdefault(expert, set()).add(slot // per_worker)
        least = min(len(h) for h in holders.values())
        fewest = least if fewest is None else min(fewest, least)
    return fewest or 0


def serve_and_run(cases: list[str], args, model: str, folder: str, name: str, redundant: int, replicas: int,
                  reference: list[list[int]] | None) -> tuple[list[dict], list[list[int]]]:
    config = os.path.join(folder, f"{name}.yaml")
    with open(config, "w") as handle:
        handle.write(cluster_yaml(model, redundant, replicas, args.timeout_s, args.backend))
    env = dict(os.environ, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", RAYMOE_ADMIN_TOKEN=ADMIN_TOKEN)
    results = []
    for attempt in range(START_ATTEMPTS):  # on a loaded machine Ray's start can time out
        server = ServeProcess.raymoe(config, log_path=os.path.join(folder, f"{name}.log"), env=env)
        server.start()
        started = time.monotonic()
        try:
            server.wait_ready(300, interval_s=1)
            break
        except RuntimeError as error:
            server.stop(90)
            if attempt + 1 == START_ATTEMPTS:
                raise
            print(f"server {name} did not start ({str(error).splitlines()[0]}); again", flush=True)
    try:
        wait_full_size(server, None, None, 0, replicas, started, FULL_SIZE_TIMEOUT_S)
        status = admin(server.url)
        print(f"server {name}: ready in {time.monotonic() - started:.0f} s; every expert on >= "
              f"{copies_per_expert(status)} workers; {replicas} ingress replica(s)", flush=True)
        base = run_case(server, "none", args, reference, replicas)
        base["row"]["what"] = f"no fault ({name} server)"
        if reference is None:
            reference = base["tokens"]
        results.append(base)
        print(f"  reference: {base['row']}", flush=True)
        for case in cases:
            if not full_size(server, None, None, 0, replicas):
                waited = wait_full_size(server, None, None, 0, replicas, time.monotonic(), FULL_SIZE_TIMEOUT_S)
                print(f"  before {case}: back at full size after {waited} s", flush=True)
            try:
                result = run_case(server, case, args, reference, replicas)
            except (OSError, ValueError, KeyError, IndexError) as error:
                print(f"  case {case} failed, not measured: {type(error).__name__}: {error}", flush=True)
                continue
            print(f"  {result['row']}", flush=True)
            results.append(result)
    finally:
        server.stop(90)
    return results, reference


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default="a,b,c,d,e,f", help="comma-separated, of a b c d e f")
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=200, help="tokens per stream (ignore_eos)")
    parser.add_argument("--warm-tokens", type=int, default=20, help="tokens every stream has before the fault")
    parser.add_argument("--stop-s", type=float, default=20.0, help="case d: seconds between SIGSTOP and SIGCONT")
    parser.add_argument("--after-s", type=float, default=30.0, help="window after the fault for the p99 ITL")
    parser.add_argument("--timeout-s", type=float, default=3.0, help="comm.timeout_s of the deployment")
    parser.add_argument("--backend", default="sockets", choices=["sockets", "gloo"],
                        help="comm.backend (sockets: what a CPU deployment gets by default; gloo does not see a "
                             "dead peer before its deadline)")
    parser.add_argument("--out", help="write the rows (and tokens/s series) as JSON here")
    parser.add_argument("--plot", help="write the timeline plot (PNG) here")
    args = parser.parse_args(argv)
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = sorted(set(cases) - set(CASES))
    if unknown:
        parser.error(f"unknown cases {unknown}; choose from {sorted(CASES)}")
    from common import build_mixtral, machine_description

    folder = tempfile.mkdtemp(prefix="raymoe-recovery-")
    model = os.path.join(folder, "tiny-mixtral")
    build_mixtral(model, hidden=64, layers=3, experts=8, top_k=2, intermediate=96, vocab=320)
    print(f"machine: {machine_description()}; comm {args.backend}, timeout_s {args.timeout_s:g}; load average {os.getloadavg()[0]:.1f}; "
          f"{args.streams} streams x {args.tokens} tokens; logs in {folder}", flush=True)
    began = time.monotonic()
    results, reference = [], None
    first = [c for c in SERVER_A if c in cases]
    second = [c for c in SERVER_B if c in cases]
    for cases_here, name, redundant, replicas in ((first, "replicated", 3, 1), (second, "unreplicated", 0, 2)):
        if not cases_here:
            continue
        try:
            part, reference = serve_and_run(cases_here, args, model, folder, name, redundant, replicas, reference)
            results += part
        except (RuntimeError, OSError, ValueError) as error:  # report what was measured
            print(f"server {name} failed, cases {cases_here} not measured: {str(error).splitlines()[0]}", flush=True)
    rows = [r["row"] for r in results]
    print()
    print(table(rows))
    print(f"\nwhole run {time.monotonic() - began:.0f} s; load average {os.getloadavg()[0]:.1f}")
    if args.out:
        with open(args.out, "w") as handle:
            json.dump({"machine": machine_description(), "args": vars(args), "rows": rows,
                       "series": [{"case": r["row"]["case"], "t": r["rate_t"], "tok_s": r["rate"],
                                   "resume_t": r["resume_t"]} for r in results],
                       "pause_per_stream": [[r["row"]["case"], r["pause_per_stream"]] for r in results],
                       "token_event_times": [[r["row"]["case"], r["stamps"]] for r in results],
                       "errors": [[r["row"]["case"], r["errors"]] for r in results]}, handle, indent=1)
    if args.plot:
        plot([r for r in results if r["row"]["case"] != "none"] or results, args.plot)


if __name__ == "__main__":
    main()
