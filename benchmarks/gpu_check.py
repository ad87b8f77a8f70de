"""One short GPU check of raymoe on one CUDA GPU: PASS/FAIL per check, a summary, a JSON file.

Sized for a first device: every check has its own time budget and the whole run stays under
6 minutes (TOTAL_BUDGET_S, process starts included). Each check runs in its own Python
process (this script, with ``--child``), so an exception, a crash or a hang in one (say, an
NCCL call that never returns) is caught by its budget and hides none of the others.

  a  versions: torch, its CUDA and NCCL, the GPU, cupy, cupy's CUDA runtime and NCCL, and
     whether the two CUDA majors pair (informational)
  b  ``pytest -m gpu`` over the test files that hold gpu tests (its tail printed)
  c  the engine on CUDA against the CPU engine (tiny random Mixtral): logits, float32 max
     |diff| < 1e-3; greedy tokens, float32 equal to the CPU's; bfloat16's first token equal to
     the CPU's wherever the CPU's top two logits are 0.1 or more apart
  d  grouped GEMM (``torch._grouped_mm``) vs the per-slot loop at expert-worker shapes,
     Mixtral 8x7B and DeepSeek-V3, bfloat16: outputs compared, both timed; on sm90+ the
     grouped path must run (its two calls counted), and a grouped GEMM error FAILs the check
  e  ``raymoe.engine.experts.combine_partials`` bitwise deterministic over 20 runs (bf16)
  f  host syncs in one decode step of the engine on CUDA, in all and inside the MoE layers
     (per layer), as CUDA's sync debug mode sees them; and one expert-parallel layer of each
     side (planner, router exchange, worker headers, worker rows: bf16, a relay for the
     communicator, tests/engine/test_ep_host_syncs.py::one_layer_each_side) (informational)
  g  NCCL for real: ``NcclCommunicator.loopback`` sends to this rank and receives from it in
     one group (groupStart / send / recv / groupEnd, each call counted), the bytes equal; a
     real abort within its bound; an abort that never returns given up at its bound (a
     stand-in handle, the hook recorded instead of ending the process); a new group works
  h  NCCL loopback latency for 1, 64 and 1024 rows of 7168 bf16 (through NCCL, not a copy)
  i  paged attention, FlashInfer vs the generic per-sequence SDPA path (GQA prompts with chunks
     after cached context, a decode batch, a sliding window; MLA's latent): bf16 max |diff| < 2e-2,
     both timed; SKIP naming the reason when FlashInfer cannot run (not installed, say)

Statuses: PASS, FAIL, SKIP (cannot run here: no CUDA, no cupy NCCL, API not yet present),
INFO (measured, nothing to pass). The exit status is 1 when any check FAILed, else 0.
Without CUDA nothing but ``a`` runs: the JSON says ``"skipped": true`` with the reason, and
the exit status is 0 (the script takes seconds on a CPU machine).

Run::

    python benchmarks/gpu_check.py --out $OUT/gpu_check.json   # all checks
    python benchmarks/gpu_check.py --only c,d      # some of them
    python benchmarks/gpu_check.py --cpu-smoke     # the CUDA checks' code on the CPU at small
                                                   # shapes (g: only its stand-in abort): tests
                                                   # this script, measures nothing about GPUs

The JSON summary goes to ``--out PATH`` (or ``--json PATH``), else ``$OUT/gpu_check.json`` when
OUT is set, else ``benchmarks/results/gpu_check.json``. benchmarks/gpu_check_2gpu.py is the
two-GPU check (one router and one worker over NCCL, end to end).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TOTAL_BUDGET_S = 345  # the whole run, all checks and their process starts: under 6 minutes
RESERVE_S = 5  # kept back for the summary and the JSON


@dataclass(frozen=True)
class Check:
    key: str
    title: str
    budget_s: int  # the check's own process, start to end
    needs_cuda: bool


CHECKS = [
    Check("a", "versions", 25, needs_cuda=False),
    Check("b", "pytest -m gpu", 85, needs_cuda=True),
    Check("c", "engine CUDA vs CPU: logits, tokens", 45, needs_cuda=True),
    Check("d", "grouped GEMM vs per-slot loop", 40, needs_cuda=True),
    Check("e", "bf16 combine bitwise determinism", 15, needs_cuda=True),
    Check("f", "host syncs per decode step and MoE layer", 30, needs_cuda=True),
    Check("g", "NCCL send/recv to self, bounded abort", 35, needs_cuda=True),
    Check("h", "NCCL loopback latency", 20, needs_cuda=True),
    Check("i", "attention: FlashInfer vs SDPA", 45, needs_cuda=True),
]
assert sum(c.budget_s for c in CHECKS) + RESERVE_S <= TOTAL_BUDGET_S <= 360


def log(*parts) -> None:
    print(*parts, flush=True)


def result(status: str, summary: str, **details) -> dict:
    return {"status": status, "summary": summary, "details": details}


# ---- setup shared by the checks (child processes) ----------------------------------------
def ensure_raymoe_importable() -> str:
    """raymoe's folders map onto ``raymoe.*`` through the (editable) install; without one,
    as on a bare GPU machine, extend ``raymoe.__path__`` with the source tree instead."""
    try:
        import raymoe.kernels.expert_mlp  # noqa: F401

        return "installed"
    except ImportError:
        pass
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    for name in [m for m in sys.modules if m == "raymoe" or m.startswith("raymoe.")]:
        del sys.modules[name]
    import raymoe

    if str(REPO) not in list(raymoe.__path__):
        raymoe.__path__.append(str(REPO))
    import raymoe.kernels.expert_mlp  # noqa: F401

    return "source tree (not installed; raymoe.__path__ extended)"


def tests_on_path() -> None:
    tests = str(REPO / "tests")
    if tests not in sys.path:
        sys.path.insert(0, tests)


def device_for(smoke: bool):
    import torch

    return torch.device("cpu") if smoke else torch.device("cuda", 0)


def synchronize(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_calls(fn, device, warmup: int = 3, iters: int = 20) -> list[float]:
    """Seconds per call: CUDA events on the GPU, perf_counter on the CPU."""
    import torch

    for _ in range(warmup):
        fn()
    synchronize(device)
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            started = time.perf_counter()
            fn()
            times.append(time.perf_counter() - started)
    return times


def max_rel(a, b) -> float:
    """max |a - b| / max |b| (relative to the reference's scale, robust near zeros)."""
    a, b = a.float(), b.float()
    scale = b.abs().max().item()
    return (a - b).abs().max().item() / (scale if scale > 0 else 1.0)


def cupy_nccl_missing() -> str | None:
    try:
        import cupy
        from cupy.cuda import nccl
    except Exception as error:
        return f"cannot import cupy.cuda.nccl ({type(error).__name__}: {error})"
    if not getattr(nccl, "available", False):
        return f"cupy {cupy.__version__} cannot load libnccl"
    return None


def nccl_version_text(code: int) -> str:
    return f"{code // 10000}.{code % 10000 // 100}.{code % 100}" if code >= 10000 else str(code)


def tiny_mixtral(tmp: str) -> str:
    tests_on_path()
    from tiny_models import build_reference_model, write_checkpoint

    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    except Exception:
        pass

    return write_checkpoint(build_reference_model("mixtral"), tmp)


def tiny_prompts() -> list[list[int]]:
    import torch

    tests_on_path()
    from tiny_models import VOCAB

    generator = torch.Generator().manual_seed(3)
    return [torch.randint(4, VOCAB, (n,), generator=generator).tolist() for n in (3, 21, 40)]


# ---- a: versions -------------------------------------------------------------------------
def check_versions(smoke: bool, budget_s: float) -> dict:
    import platform

    import torch

    info = {"python": platform.python_version(), "torch": torch.__version__, "torch_cuda": torch.version.cuda,
            "cuda_available": torch.cuda.is_available(), "raymoe": ensure_raymoe_importable()}
    log(f"python {info['python']}, torch {torch.__version__} (CUDA {torch.version.cuda}), raymoe: {info['raymoe']}")
    parts = [f"torch {torch.__version__} CUDA {torch.version.cuda}"]
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(gpu=props.name, gpu_count=torch.cuda.device_count(), capability=f"{props.major}.{props.minor}",
                    gpu_memory_gib=round(props.total_memory / 2**30, 1), multiprocessors=props.multi_processor_count)
        log(f"GPU: {props.name} x{info['gpu_count']}, sm_{props.major}{props.minor}, "
            f"{info['gpu_memory_gib']} GiB, {props.multi_processor_count} SMs")
        parts.append(f"{props.name} sm_{props.major}{props.minor}")
        try:
            version = torch.cuda.nccl.version()
            info["torch_nccl"] = ".".join(map(str, version)) if isinstance(version, tuple) else str(version)
        except Exception as error:
            info["torch_nccl"] = f"unavailable ({type(error).__name__}: {error})"
        log(f"NCCL as torch sees it: {info['torch_nccl']}")
        parts.append(f"torch NCCL {info['torch_nccl']}")
        info["tf32_matmul"] = torch.backends.cuda.matmul.allow_tf32
        log(f"torch.backends.cuda.matmul.allow_tf32 = {info['tf32_matmul']}")
    else:
        info["gpu"] = None
        log("GPU: none (torch sees no CUDA device)")
        parts.append("no GPU")
    try:
        import cupy

        info["cupy"] = cupy.__version__
        try:
            info["cupy_cuda_runtime"] = cupy.cuda.runtime.runtimeGetVersion()
        except Exception as error:
            info["cupy_cuda_runtime"] = f"unavailable ({type(error).__name__})"
        missing = cupy_nccl_missing()
        if missing is None:
            from cupy.cuda import nccl

            info["cupy_nccl"] = nccl_version_text(nccl.get_version())
        else:
            info["cupy_nccl"] = f"missing: {missing}"
        if isinstance(info["cupy_cuda_runtime"], int):
            from raymoe.kernels.comm.nccl import cuda_pairing_problem

            problem = cuda_pairing_problem(torch.version.cuda, info["cupy_cuda_runtime"], cupy.__version__)
            info["cuda_pairing"] = "ok" if problem is None else problem
            log(f"torch/cupy CUDA pairing: {info['cuda_pairing']}")
    except Exception as error:
        info["cupy"] = f"missing ({type(error).__name__}: {error})"
        info["cupy_nccl"] = "missing (no cupy)"
    if "cupy_cuda_runtime" in info:
        log(f"cupy: {info['cupy']} (CUDA runtime {info['cupy_cuda_runtime']}), cupy NCCL: {info['cupy_nccl']}")
        parts.append(f"cupy {info['cupy']} NCCL {str(info['cupy_nccl']).split(' (')[0]}")
    else:
        log(f"cupy: {info['cupy']}")
        parts.append("cupy missing")
    from importlib import metadata

    for name in ("transformers", "safetensors", "tokenizers", "ray", "msgspec", "flashinfer-python"):
        try:  # the installed version, without importing the package (seconds each)
            info[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            info[name] = "missing"
    log("packages: " + ", ".join(f"{n} {info[n]}" for n in ("transformers", "safetensors", "tokenizers", "ray",
                                                           "msgspec", "flashinfer-python")))
    return result("INFO", ", ".join(parts), **info)


# ---- b: pytest -m gpu --------------------------------------------------------------------
SHIM = """import os, raymoe
_root = os.environ["RAYMOE_SOURCE_ROOT"]
if _root not in list(raymoe.__path__):
    raymoe.__path__.append(_root)
"""


def parse_pytest(output: str) -> dict:
    counts = {}
    tail = [line for line in output.splitlines() if line.strip()]
    final = tail[-1] if tail else ""
    for number, word in re.findall(r"(\d+) (passed|failed|skipped|deselected|errors?|xfailed|xpassed)", final):
        counts["error" if word.startswith("error") else word] = int(number)
    collection_errors = sorted({m for m in re.findall(r"^ERROR (\S+?\.py)(?: - .*)?$", output, re.M)})
    test_errors = re.findall(r"^ERROR \S+::\S+", output, re.M)
    failed = re.findall(r"^FAILED (\S+)", output, re.M)
    return {"counts": counts, "final_line": final, "collection_errors": collection_errors,
            "test_errors": len(test_errors), "failed_tests": failed}


def check_pytest(smoke: bool, budget_s: float) -> dict:
    mode = ensure_raymoe_importable()
    # Only the files that hold gpu tests: collecting the whole suite would spend the budget.
    targets = ["tests/kernels/test_expert_mlp.py"] if smoke else gpu_test_files()
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu", *targets,
               "-rfEs", "--continue-on-collection-errors"]
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "PYTHONUNBUFFERED": "1"}
    with tempfile.TemporaryDirectory() as shim_dir:
        if mode != "installed":
            Path(shim_dir, "raymoe_source_shim.py").write_text(SHIM)
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [shim_dir, env.get("PYTHONPATH")]))
            env["RAYMOE_SOURCE_ROOT"] = str(REPO)
            command[3:3] = ["-p", "raymoe_source_shim"]
        timeout_s = max(10.0, budget_s - 15)
        log("$ " + " ".join(command[2:]) + f"   (timeout {timeout_s:.0f} s)")
        output, code = run_process(command, env, timeout_s)
    lines = output.splitlines()
    log("---- pytest tail ----")
    for line in lines[-40:]:
        log("  " + line)
    if code is None:
        return result("FAIL", f"pytest timed out after {timeout_s:.0f} s", tail=lines[-40:])
    parsed = parse_pytest(output)
    counts = parsed["counts"]
    gpu_files_not_collected = [
        path for path in parsed["collection_errors"]
        if (REPO / path).is_file() and "mark.gpu" in (REPO / path).read_text(errors="replace")
    ]
    notes = []
    if parsed["collection_errors"]:
        notes.append(f"{len(parsed['collection_errors'])} files without gpu tests did not import "
                     f"(missing packages here?): {', '.join(parsed['collection_errors'][:6])}")
    problems = []
    if counts.get("failed"):
        problems.append(f"{counts['failed']} failed")
    if parsed["test_errors"]:
        problems.append(f"{parsed['test_errors']} errors")
    if gpu_files_not_collected:
        problems.append(f"files with gpu tests did not import: {', '.join(gpu_files_not_collected)}")
    if not smoke and not counts.get("passed"):
        problems.append("no gpu test passed")
    if code not in (0, 1) and not parsed["collection_errors"]:
        problems.append(f"pytest exit status {code}")
    summary = parsed["final_line"].strip("= ") or f"exit status {code}"
    details = dict(parsed, exit_status=code, notes=notes, gpu_files_not_collected=gpu_files_not_collected)
    if notes:
        log("note: " + "; ".join(notes))
    if problems:
        return result("FAIL", f"{summary} ({'; '.join(problems)})", **details)
    return result("PASS", summary + (" (collection errors outside gpu tests, see notes)" if notes else ""), **details)


def gpu_test_files() -> list[str]:
    """The test files that hold `gpu` or `nccl` tests, relative to the repository."""
    found = []
    for path in sorted((REPO / "tests").rglob("test_*.py")):
        text = path.read_text(errors="replace")
        if "mark.gpu" in text or "mark.nccl" in text:
            found.append(str(path.relative_to(REPO)))
    return found or ["tests/"]


def run_process(command: list[str], env: dict, timeout_s: float, cwd: Path = REPO) -> tuple[str, int | None]:
    """(stdout+stderr, exit status); None for the status when it ran out of time (its process
    group is killed, grandchildren included)."""
    process = subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, start_new_session=True)
    try:
        output, _ = process.communicate(timeout=timeout_s)
        return output, process.returncode
    except subprocess.TimeoutExpired:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        output, _ = process.communicate()
        return output or "", None


# ---- c: the engine on CUDA against the CPU engine: logits and tokens ------------------------
TOKENS_PER_PROMPT = 8
FIRST_TOKEN_MARGIN = 0.1  # CPU fp32 logits: top two this far apart must give bf16's same first token


def check_engine_logits(smoke: bool, budget_s: float) -> dict:
    import torch

    ensure_raymoe_importable()
    from raymoe.engine.engine import EngineConfig, LLMEngine
    from raymoe.engine.sampling_params import SamplingParams

    device = "cpu" if smoke else "cuda"
    prompts = tiny_prompts()
    params = SamplingParams(max_tokens=TOKENS_PER_PROMPT, temperature=0.0, ignore_eos=True)
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        path = tiny_mixtral(tmp)

        def run(dtype: str, on: str) -> tuple[list, list[list[int]]]:
            engine = LLMEngine.from_pretrained(path, EngineConfig(dtype=dtype, device=on))
            logits = engine.score(prompts)  # per prompt [L, V] float32 on the CPU
            tokens = [output.output_token_ids for output in engine.generate(prompts, params)]
            return logits, tokens

        for key, dtype, on in [("cpu32", "float32", "cpu"), ("cuda32", "float32", device),
                               ("cuda16", "bfloat16", device), ("cpu16", "bfloat16", "cpu")]:
            runs[key] = run(dtype, on)
    (cpu32_rows, cpu_tokens), (cuda32_rows, cuda32_tokens) = runs["cpu32"], runs["cuda32"]
    cuda16_tokens = runs["cuda16"][1]
    cpu32, cuda32 = torch.cat(cpu32_rows), torch.cat(cuda32_rows)
    cuda16, cpu16 = torch.cat(runs["cuda16"][0]), torch.cat(runs["cpu16"][0])
    # bf16 rounds: its first token must match the CPU's wherever the CPU's choice is clear.
    clear, first_agree = 0, 0
    for rows, expected, got in zip(cpu32_rows, cpu_tokens, cuda16_tokens):
        top2 = rows[-1].topk(2).values
        if float(top2[0] - top2[1]) >= FIRST_TOKEN_MARGIN:
            clear += 1
            first_agree += int(got[:1] == expected[:1])
    tokens32_equal = cuda32_tokens == cpu_tokens
    bf16_matching = sum(next((i for i, (a, b) in enumerate(zip(got, exp)) if a != b), len(exp))
                        for got, exp in zip(cuda16_tokens, cpu_tokens))
    log(f"greedy tokens ({TOKENS_PER_PROMPT} per prompt): {device} float32 "
        f"{'equal to' if tokens32_equal else 'DIFFER from'} the CPU's; {device} bfloat16 first token equal on "
        f"{first_agree}/{clear} prompts with a clear CPU choice, {bf16_matching}/{len(prompts) * TOKENS_PER_PROMPT} "
        f"tokens before the first difference")
    diff32 = (cuda32 - cpu32).abs().max().item()
    diff16 = (cuda16 - cpu32).abs().max().item()
    agree16 = (cuda16.argmax(-1) == cpu32.argmax(-1)).float().mean().item()
    cpu_diff16 = (cpu16 - cpu32).abs().max().item()
    cpu_agree16 = (cpu16.argmax(-1) == cpu32.argmax(-1)).float().mean().item()
    log(f"{cpu32.shape[0]} positions x {cpu32.shape[1]} vocab, logits std {cpu32.std().item():.3f}")
    log(f"{device} float32  vs cpu float32: max |diff| {diff32:.2e} (limit 1e-3)")
    log(f"{device} bfloat16 vs cpu float32: max |diff| {diff16:.3f}, argmax agreement {agree16:.1%}")
    log(f"(baseline) cpu bfloat16 vs cpu float32: max |diff| {cpu_diff16:.3f}, argmax agreement {cpu_agree16:.1%}")
    details = dict(positions=cpu32.shape[0], float32_max_diff=diff32, bfloat16_max_diff=diff16,
                   bfloat16_argmax_agreement=agree16, cpu_bfloat16_max_diff=cpu_diff16,
                   cpu_bfloat16_argmax_agreement=cpu_agree16, cpu_tokens=cpu_tokens, float32_tokens=cuda32_tokens,
                   bfloat16_tokens=cuda16_tokens, float32_tokens_equal=tokens32_equal,
                   bfloat16_first_token_agreement=[first_agree, clear],
                   bfloat16_tokens_before_first_difference=bf16_matching)
    summary = (f"fp32 max|diff| {diff32:.1e}, tokens {'equal' if tokens32_equal else 'DIFFER'}; bf16 max|diff| "
               f"{diff16:.3f}, argmax agree {agree16:.0%}, first token {first_agree}/{clear}")
    if not torch.isfinite(cuda32).all() or not torch.isfinite(cuda16).all():
        return result("FAIL", "non-finite logits on " + device + "; " + summary, **details)
    if diff32 >= 1e-3:
        return result("FAIL", summary + " (fp32 limit 1e-3)", **details)
    if not tokens32_equal or first_agree < clear:
        return result("FAIL", summary, **details)
    return result("PASS", summary, **details)


# ---- d: grouped GEMM vs the per-slot loop --------------------------------------------------
# (name, hidden D, intermediate I, local experts S, rows A): one expert worker's share.
WORKER_SHAPES = [
    ("Mixtral-8x7B", 4096, 14336, 4, 256),
    ("DeepSeek-V3", 7168, 2048, 32, 512),
]
SMOKE_SHAPES = [("Mixtral-like (smoke)", 256, 512, 4, 64), ("DeepSeek-like (smoke)", 448, 128, 8, 128)]


class GroupedMmCalls:
    """Counts calls of ``torch._grouped_mm`` while active: proof of which path ran (the kernel
    module looks the function up on ``torch`` at every call, so the wrapper sees each one)."""

    def __init__(self):
        self.count = 0

    def __enter__(self):
        import torch

        self._original = getattr(torch, "_grouped_mm", None)
        if self._original is not None:
            def counted(*args, **kwargs):
                self.count += 1
                return self._original(*args, **kwargs)

            torch._grouped_mm = counted
        return self

    def __exit__(self, *exc):
        import torch

        if self._original is not None:
            torch._grouped_mm = self._original


def check_grouped_gemm(smoke: bool, budget_s: float) -> dict:
    import torch

    ensure_raymoe_importable()
    from raymoe.kernels.expert_mlp import _can_grouped_mm, _grouped_swiglu_loop, _use_grouped_mm, grouped_swiglu

    device = device_for(smoke)
    rows_out, failures = [], []
    for name, hidden, inter, slots, rows in SMOKE_SHAPES if smoke else WORKER_SHAPES:
        generator = torch.Generator(device=device).manual_seed(0)
        bf16 = torch.bfloat16
        x = torch.randn(rows, hidden, device=device, dtype=bf16, generator=generator)
        w13 = torch.randn(slots, 2 * inter, hidden, device=device, dtype=bf16, generator=generator).mul_(hidden**-0.5)
        w2 = torch.randn(slots, hidden, inter, device=device, dtype=bf16, generator=generator).mul_(inter**-0.5)
        counts = torch.bincount(torch.randint(0, slots, (rows,), generator=torch.Generator().manual_seed(1)),
                                minlength=slots).tolist()
        # This GPU, torch and dtype can run torch._grouped_mm, and these shapes all have the
        # layout it takes: grouped_swiglu must take it (a failure there raises, it never falls
        # back to the loop), and exactly two calls (gate/up, down) prove it did.
        expected_grouped = x.is_cuda and _can_grouped_mm(x, w13)
        chosen_grouped = x.is_cuda and _use_grouped_mm(x, w13, w2)
        try:
            with GroupedMmCalls() as calls:
                grouped = grouped_swiglu(x, counts, w13, w2)
        except Exception as error:  # the grouped GEMM failed loudly, as it should: this check fails
            failures.append(f"{name}: grouped_swiglu raised {type(error).__name__}: {str(error)[:300]}")
            log(f"{name}: grouped_swiglu raised {type(error).__name__}: {str(error)[:300]}")
            del x, w13, w2
            continue
        path = "torch._grouped_mm" if calls.count else "loop"
        if expected_grouped and not chosen_grouped:
            failures.append(f"{name}: the layout check sent a shape torch._grouped_mm takes to the loop")
        if chosen_grouped and calls.count != 2:
            failures.append(f"{name}: grouped_swiglu chose torch._grouped_mm but called it {calls.count} times, not 2")
        if not chosen_grouped and calls.count:
            failures.append(f"{name}: torch._grouped_mm ran although the layout check chose the loop")
        loop = _grouped_swiglu_loop(x, counts, w13, w2, list(range(slots)))
        reference = _grouped_swiglu_loop(x.float(), counts, w13.float(), w2.float(), list(range(slots)))
        rel_grouped_loop = max_rel(grouped, loop)
        rel_grouped_ref, rel_loop_ref = max_rel(grouped, reference), max_rel(loop, reference)
        del reference
        t_grouped = statistics.median(time_calls(lambda: grouped_swiglu(x, counts, w13, w2), device))
        t_loop = statistics.median(time_calls(lambda: _grouped_swiglu_loop(x, counts, w13, w2, list(range(slots))),
                                              device))
        used = sum(1 for c in counts if c)
        weight_bytes = used * 3 * inter * hidden * 2  # bf16 weights of the non-empty slots
        flops = 2 * rows * hidden * 3 * inter
        row = dict(shape=name, hidden=hidden, intermediate=inter, slots=slots, rows=rows, nonempty_slots=used,
                   path=path, grouped_mm_calls=calls.count, rel_grouped_vs_loop=rel_grouped_loop,
                   rel_grouped_vs_fp32=rel_grouped_ref, rel_loop_vs_fp32=rel_loop_ref,
                   grouped_ms=t_grouped * 1e3, loop_ms=t_loop * 1e3, speedup=t_loop / t_grouped,
                   grouped_weight_tb_s=weight_bytes / t_grouped / 1e12, grouped_tflop_s=flops / t_grouped / 1e12,
                   loop_weight_tb_s=weight_bytes / t_loop / 1e12)
        rows_out.append(row)
        log(f"{name}: D={hidden} I={inter} S={slots} A={rows} ({used} slots used), path {path}")
        log(f"  max rel diff: grouped vs loop {rel_grouped_loop:.2e}; vs fp32 loop: grouped {rel_grouped_ref:.2e}, "
            f"loop {rel_loop_ref:.2e}")
        log(f"  median of 20: grouped {t_grouped * 1e3:.3f} ms ({row['grouped_weight_tb_s']:.2f} TB/s of weights, "
            f"{row['grouped_tflop_s']:.0f} TFLOP/s), loop {t_loop * 1e3:.3f} ms "
            f"({row['loop_weight_tb_s']:.2f} TB/s); loop/grouped {row['speedup']:.2f}x")
        if not (torch.isfinite(grouped).all() and torch.isfinite(loop).all()):
            failures.append(f"{name}: non-finite output")
        for label, value in [("grouped vs loop", rel_grouped_loop), ("grouped vs fp32", rel_grouped_ref),
                             ("loop vs fp32", rel_loop_ref)]:
            if not value < 2e-2:
                failures.append(f"{name}: {label} rel diff {value:.2e} >= 2e-2")
        del x, w13, w2, grouped, loop
        if device.type == "cuda":
            torch.cuda.empty_cache()
    summary = "; ".join(f"{r['shape']}: grouped_swiglu [{r['path']}] {r['grouped_ms']:.3f} ms, "
                        f"per-slot loop {r['loop_ms']:.3f} ms ({r['speedup']:.2f}x), "
                        f"rel {r['rel_grouped_vs_loop']:.1e}" for r in rows_out)
    if failures:
        return result("FAIL", "; ".join(failures), shapes=rows_out)
    return result("PASS", summary, shapes=rows_out)


# ---- e: combine determinism ----------------------------------------------------------------
def check_combine_determinism(smoke: bool, budget_s: float) -> dict:
    import torch

    ensure_raymoe_importable()
    try:
        from raymoe.engine.experts import combine_partials
    except ImportError as error:
        return result("SKIP", f"not yet present: raymoe.engine.experts.combine_partials ({error})")
    try:
        from raymoe.engine.experts import scatter_rows_add
    except ImportError:
        scatter_rows_add = None

    device = device_for(smoke)
    tokens, received, hidden, runs = 512, 1500, (512 if smoke else 7168), 20
    generator = torch.Generator(device=device).manual_seed(0)
    send_token = torch.randint(0, tokens, (received,), device=device, generator=generator)
    partial = torch.randn(received, hidden, device=device, dtype=torch.bfloat16, generator=generator)

    def bits(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.detach().contiguous().view(-1).view(torch.uint8)

    import inspect

    extra = {}
    if "max_rows_per_token" in inspect.signature(combine_partials).parameters:  # the bound on a token's rows
        extra["max_rows_per_token"] = int(torch.bincount(send_token, minlength=tokens).max().item())
    results = [combine_partials(tokens, send_token, partial, **extra) for _ in range(runs)]
    synchronize(device)
    first = results[0]
    differing = sum(1 for r in results[1:] if r.shape != first.shape or not torch.equal(bits(r), bits(first)))
    reference = torch.zeros(tokens, hidden, dtype=torch.float64).index_add_(0, send_token.cpu(),
                                                                             partial.double().cpu())
    rel = max_rel(first.cpu(), reference)
    scatter_differing = None  # the atomics-based add, for contrast, while it exists
    if scatter_rows_add is not None:
        scatter = [scatter_rows_add(tokens, send_token, partial) for _ in range(runs)]
        scatter_differing = sum(1 for r in scatter[1:] if not torch.equal(bits(r), bits(scatter[0])))
    log(f"T={tokens} N={received} D={hidden} bf16 on {device}{''.join(f', {k}={v}' for k, v in extra.items())}: "
        f"result {tuple(first.shape)} {first.dtype}")
    log(f"combine_partials: {runs - 1 - differing}/{runs - 1} repeats bitwise equal to the first; "
        f"max rel diff vs float64 {rel:.2e}")
    if scatter_differing is not None:
        log(f"(contrast) scatter_rows_add: {runs - 1 - scatter_differing}/{runs - 1} repeats bitwise equal")
    details = dict(tokens=tokens, rows=received, hidden=hidden, runs=runs, differing_runs=differing, **extra,
                   rel_vs_float64=rel, dtype=str(first.dtype), scatter_rows_add_differing_runs=scatter_differing)
    if tuple(first.shape) != (tokens, hidden):
        return result("FAIL", f"shape {tuple(first.shape)}, expected {(tokens, hidden)}", **details)
    if differing:
        return result("FAIL", f"{differing}/{runs - 1} repeats differ bitwise", **details)
    if not rel < 1e-2:
        return result("FAIL", f"bitwise stable but max rel diff vs float64 {rel:.2e} >= 1e-2", **details)
    contrast = "" if scatter_differing is None else f" (scatter_rows_add: {scatter_differing} of {runs - 1} differ)"
    return result("PASS", f"{runs} runs bitwise equal, rel diff vs fp64 {rel:.1e}{contrast}", **details)


# ---- f: host syncs per decode step and per MoE layer ---------------------------------------
def check_host_syncs(smoke: bool, budget_s: float) -> dict:
    import torch

    ensure_raymoe_importable()
    from raymoe.engine.engine import EngineConfig, LLMEngine
    from raymoe.engine.sampling_params import SamplingParams

    device = "cpu" if smoke else "cuda"
    with tempfile.TemporaryDirectory() as tmp:
        engine = LLMEngine.from_pretrained(tiny_mixtral(tmp), EngineConfig(dtype="bfloat16", device=device))
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(tiny_prompts() + [list(range(5, 17))]):
        engine.add_request(f"r{i}", prompt, params)
    num_moe_layers = len(engine.model.config.moe_layers)
    experts = engine.model.experts
    original_forward = experts.forward
    state = {"caught": None, "in_layers": 0}

    def is_sync(w) -> bool:
        return "synchroniz" in str(w.message).lower()

    def counted_forward(*args, **kwargs):  # the syncs one MoE layer's experts cause
        caught = state["caught"]
        before = sum(map(is_sync, caught)) if caught is not None else 0
        try:
            return original_forward(*args, **kwargs)
        finally:
            if caught is not None:
                state["in_layers"] += sum(map(is_sync, caught)) - before

    experts.forward = counted_forward

    def counted_step() -> tuple[int, int, int, dict]:
        state["in_layers"] = 0
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            state["caught"] = caught
            if not smoke:
                torch.cuda.set_sync_debug_mode("warn")
            try:
                outputs = engine.step()
            finally:
                if not smoke:
                    torch.cuda.set_sync_debug_mode("default")
                state["caught"] = None
        syncs = [w for w in caught if is_sync(w)]
        places: dict[str, int] = {}
        for w in syncs:
            where = f"{Path(w.filename).name}:{w.lineno}"
            places[where] = places.get(where, 0) + 1
        return len(outputs), len(syncs), state["in_layers"], places

    prefill_seqs, prefill_syncs, prefill_in_layers, prefill_places = counted_step()
    engine.step()  # a first decode step, outside the count (lazy initialisation)
    decode_seqs, decode_syncs, decode_in_layers, decode_places = counted_step()
    per_layer = decode_in_layers / max(num_moe_layers, 1)
    top = sorted(decode_places.items(), key=lambda kv: -kv[1])[:10]
    log(f"prefill step ({prefill_seqs} sequences): {prefill_syncs} synchronizing CUDA calls, "
        f"{prefill_in_layers} in the {num_moe_layers} MoE layers")
    log(f"decode step ({decode_seqs} running sequences): {decode_syncs} synchronizing CUDA calls, "
        f"{decode_in_layers} in the {num_moe_layers} MoE layers ({per_layer:.1f} per layer, in-process experts)")
    for where, count in top:
        log(f"  {count:4d}  {where}")
    if smoke:
        log("(cpu smoke: set_sync_debug_mode needs CUDA, so nothing is counted)")
    ep_layer: dict | str = {}
    try:  # one expert-parallel layer per side, counted the same way (CPU smoke: the CPU counter)
        import pytest

        sys.path.insert(0, str(REPO))
        from tests.engine.test_ep_host_syncs import one_layer_each_side

        with pytest.MonkeyPatch.context() as patch:
            ep_layer = one_layer_each_side(torch.device(device), patch)
        log(f"expert-parallel layer (sync-debug warnings + waited transfers): {ep_layer}")
    except Exception as error:  # informational: report, do not fail the check
        ep_layer = f"{type(error).__name__}: {error}"
        log(f"expert-parallel layer not counted: {ep_layer}")
    return result("INFO", f"{decode_syncs} host syncs in one decode step of {decode_seqs} sequences, "
                          f"{per_layer:.1f} per MoE layer (prefill: {prefill_syncs}); EP layer: {ep_layer}",
                  ep_layer_syncs=ep_layer,
                  decode_sequences=decode_seqs, decode_syncs=decode_syncs, decode_syncs_in_moe_layers=decode_in_layers,
                  moe_layers=num_moe_layers, decode_syncs_per_moe_layer=per_layer, decode_sync_places=dict(top),
                  prefill_sequences=prefill_seqs, prefill_syncs=prefill_syncs,
                  prefill_syncs_in_moe_layers=prefill_in_layers)


# ---- g, h: NCCL for real, one rank sending to itself ---------------------------------------
ABORT_TEST_BOUND_S = 0.5  # the stand-in abort's bound: the check waits this long, not ABORT_BOUND_S


def one_rank_nccl():
    import torch

    from raymoe.kernels.comm import CommBackend, make_communicator, new_rendezvous

    return make_communicator(CommBackend.NCCL, new_rendezvous(CommBackend.NCCL), rank=0, world_size=1,
                             timeout_s=10, device=torch.device("cuda", 0))


def nccl_skip(smoke: bool) -> dict | None:
    if smoke:
        return None
    missing = cupy_nccl_missing()
    return None if missing is None else result("SKIP", f"cupy with NCCL missing: {missing}")


class CountingHandle:
    """Forwards to cupy's NcclCommunicator, counting send and recv: proof of the NCCL path."""

    def __init__(self, handle):
        self.handle = handle
        self.calls: list[str] = []

    def send(self, *args):
        self.calls.append("send")
        return self.handle.send(*args)

    def recv(self, *args):
        self.calls.append("recv")
        return self.handle.recv(*args)

    def __getattr__(self, name):
        return getattr(self.handle, name)


def stand_in_abort_is_bounded() -> tuple[bool, float, str]:
    """An abort that never returns (a stand-in NCCL handle) must be given up at its bound, with
    the hook called; the hook is recorded here instead of ending this process."""
    import threading

    import torch

    from raymoe.kernels.comm import nccl as nccl_module

    release = threading.Event()

    class Stuck:
        def abort(self):
            release.wait()

        def destroy(self):
            pass

    hung, original = [], nccl_module.on_abort_hung
    nccl_module.on_abort_hung = hung.append
    try:
        comm = nccl_module.NcclCommunicator(rank=0, world_size=2, timeout_s=5.0, device=torch.device("cuda", 0),
                                            nccl_comm=Stuck(), stream=None)
        comm.abort_bound_s = ABORT_TEST_BOUND_S
        started = time.perf_counter()
        comm.abort()
        elapsed = time.perf_counter() - started
        lock_free = comm._issue_lock.acquire(timeout=1.0)
        if lock_free:
            comm._issue_lock.release()
    finally:
        nccl_module.on_abort_hung = original
        release.set()
    ok = len(hung) == 1 and lock_free and elapsed < ABORT_TEST_BOUND_S + 2.0
    return ok, elapsed, str(hung[0]) if hung else "the hook was not called"


def check_comm_abort(smoke: bool, budget_s: float) -> dict:
    import torch

    ensure_raymoe_importable()
    skip = nccl_skip(smoke)
    if skip:
        return skip
    steps, timings, problems = [], {}, []
    bounded, stand_in_s, hung_message = stand_in_abort_is_bounded()
    timings["stand_in_abort_s"] = stand_in_s
    steps.append(f"an abort that never returns: given up after {stand_in_s * 1e3:.0f} ms "
                 f"(bound {ABORT_TEST_BOUND_S * 1e3:.0f} ms), issue lock free: {hung_message[:120]}")
    if not bounded:
        problems.append("the stand-in abort was not given up at its bound")
    if smoke:  # no NCCL on the CPU: the bound is all this check can run
        for step in steps:
            log(step)
        details = dict(steps=steps, **timings)
        return result("PASS" if bounded else "FAIL", "; ".join(problems) or "stand-in abort bounded (cpu smoke)",
                      **details)
    from cupy.cuda import nccl

    from raymoe.kernels.comm import CommClosedError

    group_calls = []
    originals = {name: getattr(nccl, name) for name in ("groupStart", "groupEnd")}
    for name, original in originals.items():
        setattr(nccl, name, lambda _original=original, _name=name: (group_calls.append(_name), _original())[1])
    try:
        rows, hidden = 37, 7168

        def timed(label, fn):
            started = time.perf_counter()
            value = fn()
            timings[label] = time.perf_counter() - started
            return value

        comm = timed("create_s", one_rank_nccl)
        comm._nccl_comm = handle = CountingHandle(comm._nccl_comm)
        group_calls.clear()  # the factory's warm-up barrier is a local copy; count from here
        send = torch.randn(rows, hidden, device="cuda:0").to(torch.bfloat16)
        received = torch.full_like(send, -7)  # poisoned: every element must be written
        timed("loopback_s", lambda: comm.loopback(send, received, tag="loopback"))
        through_nccl = handle.calls == ["send", "recv"] and group_calls == ["groupStart", "groupEnd"]
        equal = torch.equal(received, send)
        steps.append(f"loopback: {handle.calls} inside {group_calls}, bytes {'equal' if equal else 'DIFFER'}")
        if not (through_nccl and equal):
            problems.append("the loopback did not go through one NCCL group of send and recv, or its bytes differ")
        timed("abort_s", comm.abort)
        steps.append(f"real abort: {timings['abort_s'] * 1e3:.1f} ms (bound {comm.abort_bound_s:.0f} s), "
                     f"hung aborts {comm.aborts_hung}")
        if comm.aborts_hung or timings["abort_s"] >= comm.abort_bound_s:
            problems.append("the real abort reached its bound")
        try:
            comm.loopback(send, received, tag="after abort")
            after_abort = "no error"
        except CommClosedError:
            after_abort = "CommClosedError"
        except Exception as error:
            after_abort = f"{type(error).__name__}: {error}"
        steps.append(f"loopback after abort: {after_abort}")
        if after_abort != "CommClosedError":
            problems.append(f"a loopback after abort gave {after_abort}")
        comm2 = timed("recreate_s", one_rank_nccl)
        send2 = torch.randn(rows, hidden, device="cuda:0").to(torch.bfloat16)
        received2 = torch.empty_like(send2)
        timed("loopback2_s", lambda: comm2.loopback(send2, received2, tag="new group"))
        second_ok = torch.equal(received2, send2)
        steps.append(f"loopback on a new group: {'equal' if second_ok else 'DIFFERS'}")
        if not second_ok:
            problems.append("the new group's loopback differs")
        comm2.close()
    finally:
        for name, original in originals.items():
            setattr(nccl, name, original)
    for step in steps:
        log(step)
    log("timings: " + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in timings.items()))
    details = dict(steps=steps, group_calls=group_calls, **timings)
    if problems:
        return result("FAIL", "; ".join(problems), **details)
    return result("PASS", f"send/recv to self through one NCCL group, equal; abort {timings['abort_s'] * 1e3:.0f} ms; "
                          f"a stuck abort given up at {stand_in_s * 1e3:.0f} ms; new group equal", **details)


def check_comm_latency(smoke: bool, budget_s: float) -> dict:
    import torch

    ensure_raymoe_importable()
    if smoke:
        return result("SKIP", "NCCL only (loopback needs a GPU)")
    skip = nccl_skip(smoke)
    if skip:
        return skip
    hidden, iters = 7168, 50
    comm = one_rank_nccl()
    medians, problems = {}, []
    try:
        for rows in (1, 64, 1024):
            send = torch.randn(rows, hidden, device="cuda:0").to(torch.bfloat16)
            received = torch.empty_like(send)
            comm.loopback(send, received, tag="check")
            if not torch.equal(received, send):
                problems.append(f"{rows} rows: round trip differs")
            times = []
            for i in range(iters + 5):  # loopback returns once the group is complete
                started = time.perf_counter()
                comm.loopback(send, received, tag=f"latency {rows}")
                if i >= 5:
                    times.append(time.perf_counter() - started)
            medians[rows] = statistics.median(times) * 1e6
            megabytes = rows * hidden * 2 / 1e6
            log(f"loopback {rows:5d} rows ({megabytes:.2f} MB): median {medians[rows]:.0f} us, "
                f"p90 {sorted(times)[int(0.9 * len(times))] * 1e6:.0f} us, {megabytes / medians[rows]:.2f} GB/s")
    finally:
        comm.close()
    details = {"median_us": {str(k): v for k, v in medians.items()}, "iters": iters, "hidden": hidden}
    summary = ", ".join(f"{k} rows {v:.0f} us" for k, v in medians.items())
    if problems:
        return result("FAIL", "; ".join(problems), **details)
    return result("PASS", f"NCCL loopback median {summary}", **details)


# ---- i: attention, FlashInfer vs the generic SDPA path ---------------------------------------
# (name, heads, kv heads, head size, window, [(new tokens, all tokens) per sequence]): prompts
# with chunks after cached context, a decode batch, a sliding window; MLA at DeepSeek-V3's
# latent (R 512 + P 64, 16 heads: one tensor-parallel shard's worth).
ATTENTION_CASES = [
    ("prefill+chunks", 32, 8, 128, None, [(2048, 2048), (512, 3000), (1, 700), (300, 300)]),
    ("decode x32", 32, 8, 128, None, [(1, 2048)] * 32),
    ("window 1024", 32, 8, 128, 1024, [(1500, 1500), (256, 2500), (1, 3000)]),
    ("mla prefill+decode", 16, 1, None, None, [(1024, 1024), (64, 900), (1, 2000), (1, 300)]),
]
SMOKE_ATTENTION_CASES = [("prefill+chunks (smoke)", 4, 2, 64, None, [(40, 40), (9, 30), (1, 17)]),
                         ("mla (smoke)", 4, 1, None, None, [(20, 20), (1, 30)])]


def check_attention_backends(smoke: bool, budget_s: float) -> dict:
    import torch

    ensure_raymoe_importable()
    from raymoe.kernels.attention import AttentionMetadata, AttentionSpec, SdpaAttention
    from raymoe.kernels.attention_flashinfer import FlashInferAttention, flashinfer_unsupported
    from raymoe.moe.model_config import AttentionKind

    device, dtype, block = device_for(smoke), torch.bfloat16, 16
    rows, failures, reason = [], [], None
    for name, heads, kv_heads, dim, window, lengths in SMOKE_ATTENTION_CASES if smoke else ATTENTION_CASES:
        generator = torch.Generator().manual_seed(0)
        num_blocks = sum(-(-total // block) for _, total in lengths) + 1
        ids, tables = torch.randperm(num_blocks, generator=generator).tolist(), []
        for _, total in lengths:  # scattered blocks, as after some churn
            tables.append(ids[:-(-total // block)])
            ids = ids[len(tables[-1]):]
        metadata = AttentionMetadata.build([n for n, _ in lengths], [t for _, t in lengths], tables, block)
        metadata = AttentionMetadata(**{k: v.to(device) for k, v in vars(metadata).items()})
        tokens = sum(n for n, _ in lengths)
        if dim is None:  # MLA: one latent row per token, query absorbed
            spec = AttentionSpec(AttentionKind.MLA, heads, 1, 576, 512, 192 ** -0.5, None)
            cache = (torch.randn(num_blocks, block, 576, generator=generator).mul_(0.5).to(dtype).to(device),)
            q = torch.randn(tokens, heads, 576, generator=generator).mul_(0.5).to(dtype).to(device)
        else:
            spec = AttentionSpec(AttentionKind.GQA, heads, kv_heads, dim, dim, dim ** -0.5, window)
            cache = tuple(torch.randn(num_blocks, block, kv_heads, dim, generator=generator).to(dtype).to(device)
                          for _ in range(2))
            q = torch.randn(tokens, heads, dim, generator=generator).to(dtype).to(device)
        generic = SdpaAttention(spec)
        expected = generic.plan(metadata, block).attend(q, cache)
        t_generic = statistics.median(time_calls(lambda: generic.plan(metadata, block).attend(q, cache), device,
                                                 warmup=1, iters=5))
        row = dict(case=name, tokens=tokens, sequences=len(lengths), generic_ms=t_generic * 1e3)
        reason = flashinfer_unsupported(spec, dtype, device)
        if reason is None:
            fused = FlashInferAttention(spec, dtype, device)
            out = fused.plan(metadata, block).attend(q, cache)
            diff = (out.float() - expected.float()).abs().max().item()
            t_fused = statistics.median(time_calls(lambda: fused.plan(metadata, block).attend(q, cache), device,
                                                   warmup=1, iters=5))
            row.update(flashinfer_ms=t_fused * 1e3, max_abs_diff=diff)
            if not (torch.isfinite(out).all() and diff < 2e-2):
                failures.append(f"{name}: FlashInfer vs generic max |diff| {diff:.2e} (limit 2e-2)")
        rows.append(row)
        log(f"{name}: {tokens} tokens in {len(lengths)} sequences; generic {t_generic * 1e3:.2f} ms"
            + (f", FlashInfer {row['flashinfer_ms']:.2f} ms, max |diff| {row['max_abs_diff']:.1e}"
               if "flashinfer_ms" in row else f"; FlashInfer not run: {reason}"))
    summary = "; ".join(f"{r['case']}: generic {r['generic_ms']:.2f} ms"
                        + (f", FlashInfer {r['flashinfer_ms']:.2f} ms (diff {r['max_abs_diff']:.1e})"
                           if "flashinfer_ms" in r else "") for r in rows)
    if failures:
        return result("FAIL", "; ".join(failures), cases=rows)
    if any("flashinfer_ms" not in r for r in rows):
        return result("SKIP", f"FlashInfer not run ({reason}); {summary}", cases=rows)
    return result("PASS", summary, cases=rows)


CHECK_FUNCTIONS = {
    "a": check_versions, "b": check_pytest, "c": check_engine_logits, "d": check_grouped_gemm,
    "e": check_combine_determinism, "f": check_host_syncs, "g": check_comm_abort, "h": check_comm_latency,
    "i": check_attention_backends,
}


# ---- the parent: one process per check, budgets, summary, JSON ------------------------------
def run_child(key: str, smoke: bool, result_file: str, budget_s: float) -> int:
    started = time.perf_counter()
    try:
        outcome = CHECK_FUNCTIONS[key](smoke, budget_s)
    except Exception as error:
        traceback.print_exc()
        outcome = result("FAIL", f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"[:300])
    outcome["seconds_in_check"] = time.perf_counter() - started
    Path(result_file).write_text(json.dumps(outcome, default=str))
    return 0


def cuda_state() -> tuple[bool, str]:
    import torch

    if torch.cuda.is_available():
        return True, ""
    if torch.version.cuda is None:
        return False, f"no CUDA: torch {torch.__version__} is a CPU-only build"
    return False, f"no CUDA device: torch {torch.__version__} (CUDA {torch.version.cuda}) sees none"


def run_check(check: Check, smoke: bool, budget_s: float) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        result_file = os.path.join(tmp, "result.json")
        command = [sys.executable, str(Path(__file__).resolve()), "--child", check.key, "--result-file", result_file,
                   "--budget", str(budget_s)] + (["--cpu-smoke"] if smoke else [])
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
               "TOKENIZERS_PARALLELISM": "false"}
        output, code = run_process(command, env, budget_s)
        for line in output.rstrip().splitlines():
            print("    " + line)
        if code is None:
            return result("FAIL", f"over its budget of {budget_s:.0f} s (killed)", output_tail=output[-2000:])
        try:
            return json.loads(Path(result_file).read_text())
        except (OSError, ValueError):
            return result("FAIL", f"its process ended with status {code} and no result", output_tail=output[-2000:])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="comma-separated check letters (default: all)")
    parser.add_argument("--cpu-smoke", action="store_true",
                        help="run the CUDA checks' code on the CPU at small shapes (tests this script)")
    parser.add_argument("--out", "--json", dest="out", help="where to write the JSON summary")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--result-file", help=argparse.SUPPRESS)
    parser.add_argument("--budget", type=float, default=60.0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return run_child(args.child, args.cpu_smoke, args.result_file, args.budget)

    selected = [c for c in CHECKS if not args.only or c.key in args.only.replace(" ", "").split(",")]
    has_cuda, no_cuda_reason = cuda_state()
    if not has_cuda and not args.cpu_smoke:
        log(f"no GPU here: {no_cuda_reason}; every CUDA check is skipped")
    started = time.perf_counter()
    deadline = started + TOTAL_BUDGET_S
    log(f"raymoe gpu_check: {len(selected)} checks, budget {TOTAL_BUDGET_S} s in all"
        + (" (--cpu-smoke: CUDA checks on the CPU, nothing about GPUs is measured)" if args.cpu_smoke else ""))
    records = []
    for check in selected:
        check_started = time.perf_counter()
        left = deadline - check_started - RESERVE_S
        log(f"\n[{check.key}] {check.title}  (budget {min(check.budget_s, max(left, 0)):.0f} s)")
        if check.needs_cuda and not has_cuda and not args.cpu_smoke:
            outcome = result("SKIP", no_cuda_reason)
        elif left < 5:
            outcome = result("FAIL", "not run: the run's total budget is spent")
        else:
            outcome = run_check(check, args.cpu_smoke, min(check.budget_s, left))
        outcome.update(key=check.key, title=check.title, seconds=round(time.perf_counter() - check_started, 2),
                       budget_s=check.budget_s)
        records.append(outcome)
        log(f"{outcome['status']:<4}  {check.key} {check.title}: {outcome['summary']}  ({outcome['seconds']:.1f} s)")

    failed = [r for r in records if r["status"] == "FAIL"]
    width = max(len(r["title"]) for r in records) if records else 10
    log("\n==== summary " + "=" * 70)
    log(f"{'check':<{width + 4}} {'status':<6} {'s':>6}  summary")
    for r in records:
        text = r["summary"] if len(r["summary"]) <= 110 else r["summary"][:107] + "..."
        log(f"{r['key']} {r['title']:<{width + 2}} {r['status']:<6} {r['seconds']:>6.1f}  {text}")
    total = time.perf_counter() - started
    verdict = f"{len(failed)} FAILED" if failed else "no failures"
    log(f"{verdict}; " + ", ".join(f"{sum(r['status'] == s for r in records)} {s}" for s in
                                   ("PASS", "FAIL", "SKIP", "INFO")) + f"; {total:.1f} s")

    out_path = Path(args.out) if args.out else (
        Path(os.environ["OUT"]) / "gpu_check.json" if os.environ.get("OUT")
        else REPO / "benchmarks" / "results" / "gpu_check.json")
    out_path.parent.mkdir(parents=True, exist_ok=True)
    skipped = not has_cuda and not args.cpu_smoke
    summary = {"cpu_smoke": args.cpu_smoke, "has_cuda": has_cuda,
               "skipped": skipped, "reason": f"no GPU here: {no_cuda_reason}" if skipped else None,
               "seconds": round(total, 2), "budget_s": TOTAL_BUDGET_S,
               "exit_status": 1 if failed else 0, "checks": records}
    out_path.write_text(json.dumps(summary, indent=2, default=str) + "\n")
    log(f"JSON summary: {out_path}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
