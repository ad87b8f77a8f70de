"""raymoe's native CPU library: built, loaded and checked once per process.

The C sources (kernels/csrc/cpu_f32.c: the float32 compute kernels; cpu_bf16.c: the bfloat16 ones;
kernels/csrc/cpu_exchange.c: each side's MoE layer of the exchange over the sockets transport; the
headers they share, simd_math.h) are compiled on first use with the
machine's C compiler (``$CC``, else ``cc``) into ``$RAYMOE_NATIVE_DIR`` (default
``~/.cache/raymoe/native``), a fraction of a second, once per source, compiler and constants.

**One source for the constants C and Python share.** The C files include ``raymoe_constants.h``,
which exists nowhere in the tree: it is generated here (:func:`c_header`) from the Python
definitions (the exchange's wire facts, kernels/comm/wire.py, and :data:`CHUNK_ROWS`) and written
beside the build. The library reports back what it was built with (``raymoe_constants``: the
values as the C code sees them, the frame's and trailer's sizes measured with ``sizeof``), and
a library whose report differs from :func:`constants` is refused here (and
tests/kernels/test_native_cpu.py compares them one by one).

Where there is no compiler, the CPU lacks AVX-512F or ``RAYMOE_NATIVE_KERNELS=0`` is set, the
library is not loaded, :func:`unavailable_reason` says why (logged once), and torch's kernels run
as before. The bfloat16 kernels need AVX512_BF16 besides: :func:`bf16_unavailable_reason` says
whether they run (logged once where they do not). The compute wrappers are kernels/native_cpu.py
(float32) and kernels/native_bf16.py, the exchange's ctypes face kernels/native_exchange.py; all
read :data:`STATE`.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading

from raymoe.kernels.comm import wire

LOG = logging.getLogger("raymoe.kernels")

_CSRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc")
BF16_SOURCE = os.path.join(_CSRC, "cpu_bf16.c")  # the bfloat16 kernels (AVX512_BF16, AMX)
SOURCES = (os.path.join(_CSRC, "cpu_f32.c"),  # the float32 kernels
           BF16_SOURCE,
           os.path.join(_CSRC, "cpu_exchange.c"))  # each side's layer of the exchange over sockets
INCLUDED = (os.path.join(_CSRC, "simd_math.h"), os.path.join(_CSRC, "decode_attention.inc"))  # headers the sources include (part of the build's digest)
HEADER_NAME = "raymoe_constants.h"  # generated: c_header()
CFLAGS = ["-O3", "-ffp-contract=off", "-fPIC", "-shared"]  # no contraction: only the source's own FMAs
CHUNK_ROWS = 32  # expert rows per pass over an expert's weights: the swiglu scratch's height
MEASURED = ("FRAME_BYTES", "TRAILER_BYTES")  # reported by the C side with sizeof, not from the header

_P, _I64 = ctypes.c_void_p, ctypes.c_int64
_SIGNATURES = {
    "raymoe_swiglu_experts": [_P] * 5 + [_I64] * 3 + [_P],
    "raymoe_linear": [_P] * 4 + [_I64] * 3,
    "raymoe_decode_attention": [_P] * 7 + [_I64] * 6 + [ctypes.c_float],
    "raymoe_rms_norm": [_P] * 5 + [_I64] * 2 + [ctypes.c_float],
    "raymoe_rope": [_P, _I64, _P, _P, _P, _I64, _I64, _I64],
    "raymoe_attention_block": [_P] * 20,
    "raymoe_run_rows": [_P] + [_I64] * 5 + [_P, _P] + [_I64] * 2 + [_P, _P] + [_I64] * 2 + [_P],
    "raymoe_plan_pack": [_P] * 5 + [_I64] * 6 + [_P, _I64] + [_P] * 5,
    "raymoe_worker_layer": [_P, _I64, ctypes.c_int32] + [_P] * 3 + [_I64] * 4 + [_P, _I64] + [_P] * 3 + [_I64] * 5 + [_P],
    "raymoe_router_layer": [_P, _P, _I64, ctypes.c_int32] + [_P] * 4 + [_I64] * 5 + [_P, _I64, _P, _I64, _I64, _P],
    "raymoe_router_moe_layer": [_P] * 19,
    "raymoe_router_empty_layers": [_P, _I64, ctypes.c_int32, _P, _P, _I64, _P, _I64, _I64, _I64, _P, _I64, _P],
    "raymoe_constants": [_P, _P, _I64],
    "raymoe_bf16_linear": [_P, _I64, _P, _I64, ctypes.c_int32, _P, _P] + [_I64] * 4,
    "raymoe_bf16_swiglu_experts": [_P] * 5 + [_I64] * 3 + [_P],
    "raymoe_amx_linear": [_P, _I64, _P, _I64, ctypes.c_int32, _P, _P] + [_I64] * 4,
    "raymoe_amx_swiglu_experts": [_P] * 5 + [_I64] * 3 + [_P],
    "raymoe_bf16_decode_attention": [_P] * 7 + [_I64] * 6 + [ctypes.c_float],
}
_RETURNS = {name: ctypes.c_int64
            for name in ("raymoe_run_rows", "raymoe_plan_pack", "raymoe_worker_layer", "raymoe_router_layer",
                         "raymoe_router_moe_layer", "raymoe_router_empty_layers", "raymoe_constants")}
# (the others return an int status)


class _State:
    """The process's library: whether it may be used, and once tried, the library or why not."""

    __slots__ = ("bf16", "enabled", "library", "reason", "tried")

    def __init__(self) -> None:
        self.enabled = os.environ.get("RAYMOE_NATIVE_KERNELS", "1").lower() not in ("0", "false", "no", "off")
        self.library: ctypes.CDLL | None = None
        self.reason: str | None = None  # why the library is unavailable (None: not tried yet, or available)
        self.tried = False
        self.bf16: str | None | bool = False  # False: not asked yet; then None (runs) or why not


STATE = _State()
_lock = threading.Lock()


def constants() -> dict[str, int]:
    """Every constant C and Python share, by its C name: the generated header's, as the library
    must report them."""
    return {**wire.C_CONSTANTS, "CHUNK_ROWS": CHUNK_ROWS}


def c_header() -> str:
    """``raymoe_constants.h``: every shared constant as a C macro, and ``RAYMOE_CONSTANTS(X)``
    listing those the library reports from the header (the measured ones it reports by sizeof)."""
    values = constants()
    lines = ["/* Generated by kernels/native_library.py from kernels/comm/wire.py: do not edit, not in the tree. */",
             "#ifndef RAYMOE_CONSTANTS_H", "#define RAYMOE_CONSTANTS_H"]
    lines += [f"#define {name} ({value})" for name, value in values.items()]
    lines += ["/* A dispatched row of D float32 activations and k positions (kernels/comm/wire.py::RowFormat):",
              " * its bytes, and where its k slots start (its k weights follow them). */",
              "#define ROW_BYTES(D, k) (4 * (D) + (SLOT_BYTES + WEIGHT_BYTES) * (k))",
              "/* the same row with A-byte activations (2: bfloat16) */",
              "#define ROW_BYTES_OF(A, D, k) ((A) * (D) + (SLOT_BYTES + WEIGHT_BYTES) * (k))",
              "#define ROW_SLOTS_AT(D) (4 * (D))",
              "#define RAYMOE_CONSTANTS(X) " + " ".join(f"X({name})" for name in values if name not in MEASURED),
              "#endif", ""]
    return "\n".join(lines)


def set_enabled(enabled: bool) -> None:
    """Take the native kernels where they apply (the default), or torch's always."""
    STATE.enabled = bool(enabled)


def unavailable_reason() -> str | None:
    """None when the library is built, loaded, checked and runs on this CPU; else why not (built
    on the first call)."""
    if not STATE.enabled:
        return "turned off (RAYMOE_NATIVE_KERNELS=0 or set_enabled(False))"
    if STATE.tried:
        return STATE.reason
    with _lock:
        if not STATE.tried:
            try:
                library = ctypes.CDLL(_build())
                if not library.raymoe_native_supported():
                    raise OSError("this CPU has no AVX-512F")
                for name, argtypes in _SIGNATURES.items():
                    function = getattr(library, name, None)
                    if function is None and STATE.bf16 and name.startswith(("raymoe_bf16", "raymoe_amx")):
                        continue  # built without the bfloat16 kernels (_build says why)
                    if function is None:
                        raise OSError(f"the library has no {name}")
                    function.restype, function.argtypes = _RETURNS.get(name, ctypes.c_int), argtypes
                disagree = constant_differences(reported_constants(library), constants())
                if disagree:
                    raise OSError(f"the library's constants disagree with the Python side's: {disagree}")
                STATE.library = library
            except (OSError, subprocess.SubprocessError) as error:
                STATE.reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
                LOG.warning("native CPU kernels unavailable (%s): torch's kernels run instead", STATE.reason)
            STATE.tried = True
    return STATE.reason


def bf16_unavailable_reason() -> str | None:
    """None when the bfloat16 kernels (kernels/csrc/cpu_bf16.c) run here: the library is available
    and the CPU has AVX512_BF16; else why not (logged once: torch's kernels run instead)."""
    reason = unavailable_reason()
    if reason is not None:
        return reason
    if STATE.bf16 is False:
        STATE.bf16 = None if STATE.library.raymoe_bf16_supported() else "this CPU has no AVX512_BF16"
        if STATE.bf16:
            LOG.warning("bfloat16 native kernels unavailable (%s): torch's kernels run instead", STATE.bf16)
    return STATE.bf16


def reported_constants(library: ctypes.CDLL | None = None) -> dict[str, int]:
    """What the library reports it was built with (``raymoe_constants``), by C name."""
    library = library or STATE.library
    count = library.raymoe_constants(None, None, 0)
    names, values = (ctypes.c_char_p * count)(), (ctypes.c_int64 * count)()
    library.raymoe_constants(names, values, count)
    return {name.decode(): int(value) for name, value in zip(names, values)}


def constant_differences(reported: dict[str, int], expected: dict[str, int]) -> list[str]:
    """Each constant the library reports otherwise than ``expected`` (or not at all, or extra)."""
    return [f"{name}: library {reported.get(name, 'missing')}, Python {expected.get(name, 'missing')}"
            for name in sorted(set(reported) | set(expected)) if reported.get(name) != expected.get(name)]


def check(status: int, name: str) -> None:
    """A status of 0, else the bug it is: the Python side took arguments the C side refused."""
    if status != 0:
        raise ValueError(f"{name} refused its arguments (status {status}) after the Python side took them: a bug")


def _build() -> str:
    """Path of the shared library, compiled if not there yet. A compiler that cannot build the
    bfloat16 kernels (one without AMX's intrinsics: GCC before 11) still gets the float32 ones:
    the library is built without kernels/csrc/cpu_bf16.c, and :func:`bf16_unavailable_reason` says why."""
    try:
        return _build_from(SOURCES)
    except BuildError as error:
        path = _build_from(tuple(name for name in SOURCES if name != BF16_SOURCE))
        STATE.bf16 = f"the C compiler could not build kernels/csrc/cpu_bf16.c ({_first_error(error.stderr)})"
        LOG.warning("bfloat16 native kernels unavailable (%s): torch's kernels run instead", STATE.bf16)
        return path


class BuildError(OSError):
    """The compiler refused the sources; ``stderr`` is what it said."""

    def __init__(self, message: str, stderr: str):
        super().__init__(message)
        self.stderr = stderr


def _first_error(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if "error" in line] or stderr.splitlines() or [""]
    return lines[0].strip()[:200]


def _build_from(sources: tuple[str, ...]) -> str:
    """Path of the shared library for these sources, constants and compiler, compiled if not there yet."""
    compiler = os.environ.get("CC") or "cc"
    if shutil.which(compiler) is None:
        raise OSError(f"no C compiler ({compiler!r} not found; set CC)")
    header = c_header().encode()
    source = header
    for name in sources + INCLUDED:
        with open(name, "rb") as handle:
            source += handle.read()
    version = subprocess.run([compiler, "--version"], capture_output=True, timeout=30).stdout
    digest = hashlib.sha256(source + version + " ".join(CFLAGS).encode()).hexdigest()[:16]
    directory = os.environ.get("RAYMOE_NATIVE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "raymoe", "native")
    path = os.path.join(directory, f"cpu_f32-{digest}.so")
    if os.path.exists(path):
        return path
    os.makedirs(directory, exist_ok=True)
    handle, partial = tempfile.mkstemp(prefix=".cpu_f32-", suffix=".so", dir=directory)
    os.close(handle)
    include = tempfile.mkdtemp(prefix=".cpu_f32-include-", dir=directory)  # the generated header, for this build
    try:  # built under a name of its own, then renamed: processes building at once never see half a file
        with open(os.path.join(include, HEADER_NAME), "wb") as handle:
            handle.write(header)
        result = subprocess.run([compiler, *CFLAGS, "-I", include, "-o", partial, *sources], capture_output=True,
                                timeout=120)
        if result.returncode != 0:
            stderr = result.stderr.decode(errors="replace").strip()
            raise BuildError(f"{compiler} failed on {', '.join(sources)}: {stderr[:500]}", stderr)
        os.replace(partial, path)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)
        shutil.rmtree(include, ignore_errors=True)
    return path
