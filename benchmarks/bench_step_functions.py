"""A decode step function by function: the served router against the in-process engine.

Both run the same random Mixtral (benchmarks/common.py, float32) on the same workload:
``--requests`` sequences of 16 prompt tokens decoding 64 tokens, ``--rounds`` times after one
warm-up round. benchmarks/step_functions_hook.py wraps the step's functions with thread-CPU
timers (inclusive: a function's figure holds what it calls):

1. in-process: the engine in this process, on one pinned core, torch on one thread;
2. served: a 1 router x 1 worker deployment (CPU defaults) on a local Ray whose actor processes
   install the same hook; the router's figures are read from its process, and the expert
   worker's serving thread's (lines ``worker: ...``, per step it served: its headers, each
   layer's ``serve_layer`` and the native call inside it) from its own.

Prints CPU ms per decode step for each function on both sides, and the difference. The
in-process engine runs the experts itself (``LocalExperts.forward``); the router sends them
(``RemoteExperts._send``, ``_receive``): the rest of ``MoEModel.forward`` (attention, the gate,
norms) is the dense part both sides share, and the lines below it show what serving adds.

    python benchmarks/bench_step_functions.py [--requests 1 32] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import ray
import torch

import step_functions_hook as hook
from bench_served_phases import read_phases
from common import build_mixtral, machine_description
from raymoe.cluster.config import parse_cluster_config
from raymoe.cluster.deploy import deploy
from raymoe.engine.engine import EngineConfig, LLMEngine
from raymoe.engine.sampling_params import SamplingParams

HERE = os.path.dirname(os.path.abspath(__file__))
PARAMS = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)


def prompts_for(count: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(count)
    return [torch.randint(4, 512, (16,), generator=generator).tolist() for _ in range(count)]


def per_step(steps: int, seconds: dict[str, float]) -> dict[str, float]:
    return {name: 1e3 * value / steps for name, value in seconds.items()} if steps else {}


def in_process(path: str, counts: list[int], rounds: int) -> dict[int, dict[str, float]]:
    affinity, threads = os.sched_getaffinity(0), torch.get_num_threads()
    os.sched_setaffinity(0, {min(affinity)})
    torch.set_num_threads(1)
    try:
        engine = LLMEngine.from_pretrained(path, EngineConfig(dtype="float32"))
        results = {}
        for count in counts:
            for round_ in range(rounds + 1):
                if round_ == 1:  # the first round warms up
                    hook.reset()
                for index, prompt in enumerate(prompts_for(count)):
                    engine.add_request(f"{count}-{round_}-{index}", prompt, PARAMS)
                while engine.has_unfinished():
                    engine.step()
            results[count] = per_step(hook.steps[0], hook.totals)
        return results
    finally:
        torch.set_num_threads(threads)
        os.sched_setaffinity(0, affinity)


def served(path: str, counts: list[int], rounds: int, one_call: bool = True) -> dict[int, dict[str, float]]:
    with tempfile.TemporaryDirectory() as directory:
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
        python_path = os.pathsep.join(p for p in (HERE, os.environ.get("PYTHONPATH", "")) if p)
        ray.init(address="local", include_dashboard=False, log_to_driver=False, runtime_env={
            "worker_process_setup_hook": "step_functions_hook.install",
            "env_vars": {"RAYMOE_STEP_FUNCTIONS_DIR": directory, "PYTHONPATH": python_path,
                         "RAYMOE_STEP_FUNCTIONS_PYTHON_LAYERS": "0" if one_call else "1"}})
        deployment = deploy(parse_cluster_config({"model": path, "device": "cpu", "dtype": "float32",
                                                  "routers": 1, "expert_workers": 1}), name="step-functions")
        try:
            router_pid = ray.get(deployment.routers[0].info.remote())["pid"]
            worker_pid = ray.get(deployment.workers[0].info.remote())["pid"]
            results = {}
            for count in counts:
                deployment.generate(prompts_for(count), PARAMS)  # warm-up
                time.sleep(0.5)  # its last dump lands
                before = read_phases(directory)
                for _ in range(rounds):
                    deployment.generate(prompts_for(count), PARAMS)
                time.sleep(0.5)
                after = read_phases(directory)
                results[count] = {}
                for pid, prefix in ((router_pid, ""), (worker_pid, "worker: ")):
                    then, now = before.get(pid, {"steps": 0, "seconds": {}}), after.get(pid)
                    if now is None or now["steps"] <= then["steps"]:
                        continue
                    results[count].update({prefix + name: value for name, value in per_step(
                        now["steps"] - then["steps"], {name: value - then["seconds"].get(name, 0.0)
                                                       for name, value in now["seconds"].items()}).items()})
            return results
        finally:
            deployment.shutdown()
            ray.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, nargs="+", default=[1, 32], help="sequences decoding together")
    parser.add_argument("--rounds", type=int, default=3, help="measured rounds of 64 tokens after a warm-up")
    parser.add_argument("--python-layers-too", action="store_true",
                        help="also serve with each MoE layer planned in Python around the exchange (the path "
                             "before one native call per layer), a column of its own")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as path:
        build_mixtral(path)
        print(f"machine: {machine_description()}")
        hook.install()  # this process: the in-process engine (the actors install it themselves)
        local = in_process(path, args.requests, args.rounds)
        remote = served(path, args.requests, args.rounds)
        python_layers = served(path, args.requests, args.rounds, one_call=False) if args.python_layers_too else None
    for count in args.requests:
        mine, theirs = local[count], remote[count]
        other = python_layers[count] if python_layers else {}
        print(f"\n{count} sequence(s): CPU ms per decode step (inclusive), in-process engine vs served router (1x1)")
        extra = f" {'served, Python layers':>22}" if python_layers else ""
        print(f"{'function':<42} {'in-process':>10} {'served':>8} {'served - in-process':>20}{extra}")
        names = set(mine) | set(theirs) | set(other)
        for name in sorted(names, key=lambda n: -max(mine.get(n, 0.0), theirs.get(n, 0.0), other.get(n, 0.0))):
            a, b, c = mine.get(name), theirs.get(name), other.get(name)
            difference = f"{b - a:20.3f}" if a is not None and b is not None else f"{'':>20}"
            column = (f" {'' if c is None else f'{c:22.3f}':>22}") if python_layers else ""
            print(f"{name:<42} {'' if a is None else f'{a:10.3f}':>10} {'' if b is None else f'{b:8.3f}':>8} "
                  f"{difference}{column}")


if __name__ == "__main__":
    main()
