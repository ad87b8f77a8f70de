"""The two-GPU check: one router and one expert worker over NCCL, end to end, on one machine.

What benchmarks/gpu_check.py cannot do on one GPU (NCCL refuses two ranks on one device): a
real group of two ranks on two GPUs, built the way ``raymoe serve`` builds it. A tiny random
Mixtral is written to a temporary directory; a local Ray (this machine's GPUs) runs
``cluster.deploy.deploy`` with one router and one worker on CUDA in float32 over
``comm.backend: nccl``; greedy tokens for a few prompts come back through the group and must
equal the CPU engine's (the in-process engine, float32) token for token. The router's warm-up
report and both actors' info are kept.

Every step runs in a child process with a time limit (``--timeout``, 300 s by default; the
whole script stays under 6 minutes), so a hang in NCCL ends as a FAIL with the output so far.
Without two GPUs, cupy with NCCL, or Ray, nothing starts: the JSON says ``"skipped": true``
with the reason, and the exit status is 0. The exit status is 1 when the check FAILed.

Run::

    python benchmarks/gpu_check_2gpu.py --out $OUT/gpu_check_2gpu.json
    python benchmarks/gpu_check_2gpu.py --cpu-smoke   # the same run on CPU actors over the
                                                      # sockets transport: tests this script,
                                                      # nothing about GPUs or NCCL

The JSON goes to ``--out PATH``, else ``$OUT/gpu_check_2gpu.json`` when OUT is set, else
``benchmarks/results/gpu_check_2gpu.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))

import gpu_check as single  # noqa: E402  (benchmarks/gpu_check.py: shared helpers)

DEFAULT_TIMEOUT_S = 300
TOKENS_PER_PROMPT = 8
COMM_TIMEOUT_S = 60.0


def missing_requirement() -> str | None:
    """Why this machine cannot run the check, or None."""
    import torch

    has_cuda, reason = single.cuda_state()
    if not has_cuda:
        return f"no GPU here: {reason}"
    count = torch.cuda.device_count()
    if count < 2:
        return f"needs 2 GPUs, this machine has {count} ({torch.cuda.get_device_name(0)})"
    missing = single.cupy_nccl_missing()
    if missing is not None:
        return f"cupy with NCCL missing: {missing}"
    try:
        import ray  # noqa: F401
    except ImportError as error:
        return f"ray is not installed ({error}); pip install 'ray[serve]>=2.40' (a raymoe dependency)"
    return None


def run_end_to_end(log, smoke: bool = False) -> dict:
    """One router and one worker on two GPUs over NCCL; tokens against the CPU engine's
    (``smoke``: on CPU actors over sockets, to test this script where there is no GPU)."""
    single.ensure_raymoe_importable()
    import ray

    from raymoe.cluster.config import parse_cluster_config
    from raymoe.cluster.deploy import deploy
    from raymoe.engine.engine import EngineConfig, LLMEngine
    from raymoe.engine.sampling_params import SamplingParams

    timings: dict[str, float] = {}
    prompts = single.tiny_prompts()
    params = SamplingParams(max_tokens=TOKENS_PER_PROMPT, temperature=0.0, ignore_eos=True)
    with tempfile.TemporaryDirectory() as tmp:
        model = single.tiny_mixtral(tmp)
        started = time.perf_counter()
        reference = LLMEngine.from_pretrained(model, EngineConfig(dtype="float32", device="cpu"))
        expected = [output.output_token_ids for output in reference.generate(prompts, params)]
        timings["cpu_reference_s"] = time.perf_counter() - started
        log(f"CPU engine (float32): {expected}")
        config = parse_cluster_config({
            "model": model, "device": "cpu" if smoke else "cuda", "dtype": "float32", "routers": 1,
            "expert_workers": 1, "comm": {"backend": "sockets" if smoke else "nccl", "timeout_s": COMM_TIMEOUT_S},
            "balancer": {"enabled": False},
        })
        started = time.perf_counter()
        # The actors import raymoe from this checkout whether or not it is installed.
        ray.init(address="local", include_dashboard=False,
                 runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join(filter(None, [
                     str(REPO), os.environ.get("PYTHONPATH")]))}})
        timings["ray_start_s"] = time.perf_counter() - started
        deployment = None
        try:
            started = time.perf_counter()
            deployment = deploy(config, name="gpu-check-2gpu", ready_timeout_s=60, load_timeout_s=120)
            timings["deploy_s"] = time.perf_counter() - started
            started = time.perf_counter()
            outputs = deployment.generate(prompts, params)
            timings["generate_s"] = time.perf_counter() - started
            got = [output.output_token_ids for output in outputs]
            log(f"1 router x 1 worker over {config.comm.backend.value} ({config.device.value}): {got}")
            router_info = ray.get(deployment.routers[0].info.remote(), timeout=30)
            worker_info = ray.get(deployment.workers[0].info.remote(), timeout=30)
            started = time.perf_counter()
            again = [output.output_token_ids for output in deployment.generate(prompts, params)]
            timings["generate_again_s"] = time.perf_counter() - started
            ping_pong = micro_batches_on_and_off(deployment, prompts, params, expected, log)
        finally:
            if deployment is not None:
                deployment.shutdown()
            ray.shutdown()
    equal = got == expected and again == expected and ping_pong["tokens_equal"]
    details = dict(expected=expected, tokens=got, tokens_again=again, ping_pong=ping_pong, router=router_info,
                   worker={key: worker_info.get(key) for key in ("pid", "node_id", "expert_kernel", "pool_bytes")},
                   **timings)
    summary = (f"tokens {'equal to' if equal else 'DIFFER from'} the CPU engine's ({len(prompts)} prompts x "
               f"{TOKENS_PER_PROMPT}); deploy {timings['deploy_s']:.1f} s, first generate "
               f"{timings['generate_s']:.2f} s, again {timings['generate_again_s']:.2f} s; ping-pong micro-batches: "
               f"tokens {'equal' if ping_pong['tokens_equal'] else 'DIFFER'}, on/off {ping_pong['on_over_off']:.2f}x "
               f"tok/s over {ping_pong['requests']} requests")
    return single.result("PASS" if equal else "FAIL", summary, **details)


def micro_batches_on_and_off(deployment, prompts, params, expected, log, rounds: int = 3) -> dict:
    """The router's steps in two ping-ponged micro-batches (``engine.micro_batch_min_seqs``; one
    half's attention on the router's stream while the worker runs the other half's experts and
    NCCL moves the rows on its own stream) and not, alternating on the same deployment: the
    tokens must equal the CPU engine's; the time ratio is reported (issue 29 item 2)."""
    import ray

    router = deployment.routers[0]
    many = prompts * max(1, 16 // len(prompts))  # enough sequences to split each step
    walls: dict[int, list[float]] = {0: [], 2: []}
    tokens_on = None
    for _ in range(rounds):
        for least in (0, 2):
            ray.get(router.set_micro_batch_min_seqs.remote(least), timeout=30)
            started = time.perf_counter()
            outputs = deployment.generate(many, params)
            walls[least].append(time.perf_counter() - started)
            if least:
                tokens_on = [output.output_token_ids for output in outputs]
    ray.get(router.set_micro_batch_min_seqs.remote(0), timeout=30)
    info = ray.get(router.info.remote(), timeout=30)
    off, on = (min(walls[least]) for least in (0, 2))
    equal = tokens_on == expected * (len(many) // len(prompts))
    log(f"ping-pong micro-batches over {len(many)} requests: off {off:.3f} s, on {on:.3f} s (best of {rounds}); "
        f"tokens {'equal' if equal else 'DIFFER'}; {info['ping_pong_steps']} ping-pong steps")
    return {"tokens_equal": equal, "requests": len(many), "off_s": walls[0], "on_s": walls[2], "on_over_off": off / on,
            "ping_pong_steps": info["ping_pong_steps"]}


def run_child(result_file: str, smoke: bool) -> int:
    try:
        outcome = run_end_to_end(single.log, smoke)
    except Exception as error:
        traceback.print_exc()
        outcome = single.result("FAIL", f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"[:400])
    Path(result_file).write_text(json.dumps(outcome, default=str))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="where to write the JSON summary")
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S,
                        help=f"seconds the end-to-end run may take (default {DEFAULT_TIMEOUT_S})")
    parser.add_argument("--cpu-smoke", action="store_true",
                        help="the same run on CPU actors over sockets (tests this script; no GPU, no NCCL)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return run_child(args.child, args.cpu_smoke)
    started = time.perf_counter()
    reason = None if args.cpu_smoke else missing_requirement()
    if reason is not None:
        single.log(f"raymoe gpu_check_2gpu: skipped: {reason}")
        outcome = single.result("SKIP", reason)
    else:
        over = "sockets on CPU actors (--cpu-smoke)" if args.cpu_smoke else "NCCL on 2 GPUs"
        single.log(f"raymoe gpu_check_2gpu: 1 router x 1 worker over {over}, timeout {args.timeout:.0f} s")
        with tempfile.TemporaryDirectory() as tmp:
            result_file = os.path.join(tmp, "result.json")
            env = {**os.environ, "PYTHONUNBUFFERED": "1", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
                   "TOKENIZERS_PARALLELISM": "false"}
            command = [sys.executable, str(Path(__file__).resolve()), "--child", result_file]
            output, code = single.run_process(command + (["--cpu-smoke"] if args.cpu_smoke else []), env, args.timeout)
            for line in output.rstrip().splitlines():
                print("    " + line)
            if code is None:
                outcome = single.result("FAIL", f"over its time limit of {args.timeout:.0f} s (killed)",
                                        output_tail=output[-4000:])
            else:
                try:
                    outcome = json.loads(Path(result_file).read_text())
                except (OSError, ValueError):
                    outcome = single.result("FAIL", f"its process ended with status {code} and no result",
                                            output_tail=output[-4000:])
    failed = outcome["status"] == "FAIL"
    skipped = outcome["status"] == "SKIP"
    summary = {"check": "1 router x 1 worker over NCCL on 2 GPUs, tokens against the CPU engine",
               "cpu_smoke": args.cpu_smoke, "skipped": skipped, "reason": reason, "status": outcome["status"], "summary": outcome["summary"],
               "details": outcome.get("details", {}), "seconds": round(time.perf_counter() - started, 2),
               "exit_status": 1 if failed else 0}
    single.log(f"{outcome['status']}: {outcome['summary']}")
    out_path = Path(args.out) if args.out else (
        Path(os.environ["OUT"]) / "gpu_check_2gpu.json" if os.environ.get("OUT")
        else REPO / "benchmarks" / "results" / "gpu_check_2gpu.json")
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(summary, indent=2, default=str) + "\n")
    single.log(f"JSON summary: {out_path}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
