"""engine/host_memory.py: a CPU engine's decode steps reuse freed buffers instead of faulting
pages in anew.

Each case runs the in-process engine in its own interpreter (malloc's thresholds are process-wide
and set once), on a model just big enough that a step's buffers (the attention gather: 32
sequences x ~60 keys x 512 bytes, ~1 MB a layer) pass glibc's default mmap threshold. The
probes run torch's kernels (``RAYMOE_NATIVE_KERNELS=0``): the native ones (kernels/native_cpu.py)
allocate no such buffers, so with them there is little for the tuning to save.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

from raymoe.engine import host_memory
from tiny_models import build_reference_model, write_checkpoint

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt's parameters are glibc's")

PROBE = """
import json, random, resource, sys, torch
from raymoe.engine import host_memory
from raymoe.engine.engine import EngineConfig, LLMEngine
from raymoe.engine.sampling_params import SamplingParams
torch.set_num_threads(1)
engine = LLMEngine.from_pretrained(sys.argv[1], EngineConfig(dtype="float32"))
rng = random.Random(0)
params = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
for i in range(32):
    engine.add_request(f"r{i}", [rng.randrange(4, 100) for _ in range(32)], params)
for _ in range(25):  # prefill, then warm decode steps
    engine.step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):
    engine.step()
faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 20
print(json.dumps({"tuned": bool(host_memory._applied), "faults_per_step": faults,
                  "allocator": host_memory.allocator_in_use()}))
"""


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    model = build_reference_model("mixtral", hidden_size=256, num_attention_heads=8, num_key_value_heads=4,
                                  num_hidden_layers=2)
    return write_checkpoint(model, str(tmp_path_factory.mktemp("host-memory")))


def _probe(checkpoint: str, **env: str) -> dict:
    result = subprocess.run([sys.executable, "-c", PROBE, checkpoint], capture_output=True, text=True,
                            timeout=300, env={**os.environ, "RAYMOE_NATIVE_KERNELS": "0", **env})
    assert result.returncode == 0, result.stderr[-2000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_cpu_engine_decode_steps_reuse_freed_memory(checkpoint):
    tuned = _probe(checkpoint)  # the engine tunes malloc itself on the CPU
    untuned = _probe(checkpoint, RAYMOE_KEEP_FREED_MEMORY="0")  # the switch that turns it off
    assert tuned["tuned"] is True and untuned["tuned"] is False
    # Untuned, every step maps ~2.5 MB of buffers afresh (measured ~1,290 faults a step here);
    # tuned, a warm step faults almost never (~23, from the sequences' growing state).
    assert untuned["faults_per_step"] > 400, untuned
    assert tuned["faults_per_step"] < 100, tuned


@pytest.mark.skipif(host_memory.jemalloc_path() is None, reason="no jemalloc library on this machine")
def test_jemalloc_preloaded_as_a_cpu_deployment_starts_its_actors(checkpoint):
    # What deploy gives a CPU router or worker process by default (cpu.allocator: jemalloc).
    env = host_memory.allocator_env("jemalloc")
    assert env == {"LD_PRELOAD": host_memory.jemalloc_path()}
    assert host_memory.allocator_env("system") == {}
    preloaded = _probe(checkpoint, **env)
    assert preloaded["allocator"] == "jemalloc"
    assert preloaded["tuned"] is False  # glibc's malloc is not in use: its thresholds are left alone
    assert preloaded["faults_per_step"] < 100, preloaded  # jemalloc keeps freed pages for reuse as well
    assert _probe(checkpoint)["allocator"] == "system"
