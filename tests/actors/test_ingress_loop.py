"""The ingress replica runs its routes on Serve's own event loop (actors/ingress.py, SAME_LOOP_ENV):
Ray reads RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD when the replica's process starts, so the
deployment's runtime_env must carry it; RAYMOE_INGRESS_SEPARATE_LOOP=1 keeps Serve's default.
What it buys is measured by benchmarks/bench_ingress_loop.py; the serve suite runs on it."""

import json
import os
import subprocess
import sys

PROBE = ("import json; from raymoe.actors.ingress import OpenAIIngress; "
         "print(json.dumps(OpenAIIngress.ray_actor_options.get('runtime_env', {}).get('env_vars', {})))")


def replica_env(**env: str) -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE], env={**os.environ, **env}, check=True,
                         capture_output=True, text=True, timeout=120)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_replica_runs_its_routes_on_serves_loop_unless_told_otherwise():
    assert replica_env(RAYMOE_INGRESS_SEPARATE_LOOP="0") == {"RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0"}
    assert replica_env(RAYMOE_INGRESS_SEPARATE_LOOP="1") == {}
