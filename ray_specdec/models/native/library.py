"""Native CPU kernels, compiled on first use with the machine's C compiler and loaded with ctypes.

`load()` returns the library, or None with the reason in `why_unavailable()`: no compiler, a failed build, or
RAY_SPECDEC_NATIVE=0. Callers keep their torch path for that case; nothing here is required.

The shared object is built for this CPU (-march=native) and kept under `cache_dir()/native/`, keyed by
the source, the flags, the compiler and the CPU (its kind and instruction sets: `cpu_identity`), so a
process on the same machine loads it in milliseconds. RAY_SPECDEC_NATIVE_ISA builds for a lower instruction set than
the CPU's own (`ISA_FLAGS`: avx512, avx2 or scalar), so that one machine runs the code paths another CPU would take:
the kernels' tests run every path the machine can (`available_isas`). The build writes a temporary file and renames
it into place: processes that build at once (Serve replicas) do not see each other's half-written files.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from ray_specdec import env

# Compiled together into one shared object; HEADERS are included by them (and part of the build's key).
SOURCES = tuple(Path(__file__).with_name(name)
                for name in ("gemm_cpu.c", "mamba_cpu.c", "attention_cpu.c", "decoder_cpu.c", "prefill_cpu.c",
                             "shm_cpu.c", "threads_cpu.c", "philox_cpu.c", "ssm_scan_cpu.c", "ssm_rows_cpu.c",
                             "mamba2_cpu.c"))
HEADERS = tuple(Path(__file__).with_name(name) for name in ("gemm_cpu.h", "simd_cpu.h", "attention_simd_cpu.h"))
# Fast math reassociates the sums, so that they vectorise, and lets glibc's math.h offer vector expf (libmvec).
FLAGS = ("-O3", "-ffast-math", "-fPIC", "-shared")
# The instruction sets a build can target. The sources pick their SIMD path from the compiler's macros (__AVX512F__,
# __FMA__, neither), and libmvec its vector width, so each is a path some CPU takes: x86-64-v4 is AVX-512's, v3 AVX2
# with FMA's, and the scalar build is the x86-64 baseline with the vectoriser off.
ISA_FLAGS = {
    "native": ("-march=native",),
    "avx512": ("-march=x86-64-v4", "-mtune=native"),
    "avx2": ("-march=x86-64-v3", "-mtune=native"),
    "scalar": ("-march=x86-64", "-mtune=native", "-fno-tree-vectorize", "-fno-tree-slp-vectorize"),
}
# The CPU flags each x86-64 level needs beyond the one below it (their psABI definitions).
_ISA_CPU_FLAGS = {
    "avx2": {"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave"},
    "avx512": {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"},
}
# linear_panels splits a product's output blocks over torch's intra-op thread count; built without it if the
# compiler has no OpenMP.
OPENMP = ("-fopenmp",)
# Products smaller than this many multiply-adds run on one thread (waking another costs more than it saves).
PARALLEL_MIN_MACS = 1 << 19
_why: list[str] = []


def enabled_by_environment() -> bool:
    """RAY_SPECDEC_NATIVE=0 (or off / false / no) keeps the torch paths."""
    return env.NATIVE.on()


def why_unavailable() -> str | None:
    """Why `load()` returned None (None when it did not)."""
    return _why[-1] if _why else None


def available_isas(cpuinfo: str = "/proc/cpuinfo") -> tuple[str, ...]:
    """The ISA_FLAGS builds this CPU runs: "native" always; on x86-64 also each level its flags reach."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return ("native",)
    try:
        with open(cpuinfo) as f:
            flags = set(next((line for line in f if line.startswith("flags")), "").partition(":")[2].split())
    except OSError:
        return ("native",)
    isas = ["native", "scalar"]
    if _ISA_CPU_FLAGS["avx2"] <= flags:
        isas.append("avx2")
        if _ISA_CPU_FLAGS["avx512"] <= flags:
            isas.append("avx512")
    return tuple(isas)


def selected_isa() -> str:
    """RAY_SPECDEC_NATIVE_ISA (one of ISA_FLAGS), "native" where unset."""
    isa = (env.NATIVE_ISA.value() or "").strip().lower() or "native"
    if isa not in ISA_FLAGS:
        raise ValueError(f"RAY_SPECDEC_NATIVE_ISA={isa!r}: expected one of {sorted(ISA_FLAGS)}")
    return isa


def load(isa: str | None = None) -> ctypes.CDLL | None:
    """The compiled kernels for this machine, for the instruction set `isa` (one of ISA_FLAGS; by default
    RAY_SPECDEC_NATIVE_ISA's), built if needed; None (see `why_unavailable`) where that fails."""
    return _load(isa or selected_isa())


@functools.cache
def _load(isa: str) -> ctypes.CDLL | None:
    _why.clear()
    if not enabled_by_environment():
        _why.append("RAY_SPECDEC_NATIVE=0")
        return None
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if compiler is None or shutil.which(compiler) is None:
        _why.append(f"no C compiler found ({compiler or 'cc, gcc, clang'})")
        return None
    if isa != "native" and isa not in available_isas():
        _why.append(f"RAY_SPECDEC_NATIVE_ISA={isa}: this CPU does not run it (it runs {', '.join(available_isas())})")
        return None
    flags = FLAGS + ISA_FLAGS[isa]
    try:
        try:
            library = _build(compiler, flags + OPENMP)
        except subprocess.SubprocessError:  # no OpenMP runtime for this compiler: one thread per product
            library = _build(compiler, flags)
        lib = ctypes.CDLL(str(library))
    except (OSError, subprocess.SubprocessError) as e:
        _why.append(f"native kernels could not be built with {compiler}: {str(e).strip().splitlines()[-1][:300]}")
        return None
    _declare(lib)
    return lib


load.cache_clear = _load.cache_clear  # a test's way to make the next load() build or load anew


def _build(compiler: str, flags: tuple[str, ...]) -> Path:
    source = b"\0".join(path.read_bytes() for path in SOURCES + HEADERS)
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=60).stdout
    key = hashlib.sha256(
        b"\0".join([source, " ".join(flags).encode(), version.encode(), cpu_identity().encode(),
                    platform.machine().encode()])
    ).hexdigest()[:20]
    directory = cache_dir()
    if directory is None:  # no cache: build into this process's own temp dir
        directory = Path(tempfile.mkdtemp(prefix="ray_specdec_native_"))
    target = directory / "native" / f"kernels-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f"{target.stem}.{os.getpid()}.tmp.so")
    done = subprocess.run(
        [compiler, *flags, "-o", str(tmp), *map(str, SOURCES), "-lm"], capture_output=True, text=True, timeout=300
    )
    if done.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise subprocess.SubprocessError(done.stderr or f"{compiler} exited with {done.returncode}")
    os.replace(tmp, target)
    return target


def cache_dir() -> Path | None:
    """Where measured plans are kept across processes: RAY_SPECDEC_CACHE_DIR, or ~/.cache/ray_specdec; an empty
    RAY_SPECDEC_CACHE_DIR keeps none (every process measures)."""
    configured = env.CACHE_DIR.value()
    if configured is not None:
        return Path(configured) if configured.strip() else None
    return Path.home() / ".cache" / "ray_specdec"


@functools.cache
def cpu_identity(cpuinfo: str = "/proc/cpuinfo") -> str:
    """What tells this CPU's kind apart for kept plans and builds: its model name, family, model and instruction-set
    flags. The name alone is not enough: a cloud VM may call a Zen 3 and a Zen 4 both "AMD EPYC", and a home
    directory shared between them (an NFS home on a cluster) must not hand one the other's AVX-512 build or plan."""
    try:
        with open(cpuinfo) as f:
            fields: dict[str, str] = {}
            for line in f:
                if not line.strip():
                    break  # the first processor's block
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        return platform.processor()
    flags = fields.get("flags") or fields.get("Features", "")  # x86 / ARM
    described = [fields.get(k, "") for k in ("model name", "cpu family", "model", "CPU implementer", "CPU part")]
    return " | ".join([*described, hashlib.sha256(" ".join(sorted(flags.split())).encode()).hexdigest()[:16]])


class Layer(ctypes.Structure):
    """layer_t of mamba_cpu.c: one layer's weight pointers and its matrices' panel formats, in its field order."""

    _fields_ = [*[(name, ctypes.c_void_p) for name in (
        "norm", "in_proj", "in_proj_bias", "conv", "conv_bias", "x_proj", "dt_proj", "dt_bias", "A", "D",
        "out_proj", "out_proj_bias")],
        *[(name, ctypes.c_int32) for name in (
            "in_proj_format", "x_proj_format", "dt_proj_format", "out_proj_format")]]  # fmt: skip


class Model(ctypes.Structure):
    """model_t of mamba_cpu.c."""

    _fields_ = [
        *[(name, ctypes.c_int32) for name in ("n_layers", "d_model", "d_inner", "d_conv", "d_state", "dt_rank",
                                              "vocab")],
        ("eps", ctypes.c_float),
        ("embed", ctypes.c_void_p),
        ("norm_f", ctypes.c_void_p),
        ("lm_head", ctypes.c_void_p),
        ("layers", ctypes.POINTER(Layer)),
        ("lm_head_format", ctypes.c_int32),
    ]  # fmt: skip


class Mamba2Layer(ctypes.Structure):
    """mamba2_layer_t of mamba2_cpu.c."""

    _fields_ = [*[(name, ctypes.c_void_p) for name in (
        "norm", "in_proj", "in_proj_bias", "conv", "conv_bias", "dt_bias", "A", "D", "gate_norm", "out_proj",
        "out_proj_bias")],
        *[(name, ctypes.c_int32) for name in ("in_proj_format", "out_proj_format")]]  # fmt: skip


class Mamba2Model(ctypes.Structure):
    """mamba2_model_t of mamba2_cpu.c."""

    _fields_ = [
        *[(name, ctypes.c_int32) for name in ("n_layers", "d_model", "d_inner", "d_conv", "d_state", "heads", "groups",
                                              "vocab")],
        *[(name, ctypes.c_float) for name in ("eps", "gate_eps", "dt_min", "dt_max")],
        ("embed", ctypes.c_void_p),
        ("norm_f", ctypes.c_void_p),
        ("lm_head", ctypes.c_void_p),
        ("layers", ctypes.POINTER(Mamba2Layer)),
        ("lm_head_format", ctypes.c_int32),
    ]  # fmt: skip


def _declare(lib: ctypes.CDLL) -> None:
    p, i = ctypes.c_void_p, ctypes.c_int
    lib.mamba_forward.argtypes = [ctypes.POINTER(Model), i, i, p, p, p, p]
    lib.mamba_forward.restype = i
    lib.mamba_forward_rows.argtypes = [ctypes.POINTER(Model), i, p, p, p, p, ctypes.c_int64, ctypes.c_int64, p]
    lib.mamba_forward_rows.restype = i
    lib.mamba2_forward.argtypes = [ctypes.POINTER(Mamba2Model), i, i, p, p, p, p]
    lib.mamba2_forward.restype = i
    lib.mamba2_forward_rows.argtypes = [ctypes.POINTER(Mamba2Model), i, p, p, p, p, ctypes.c_int64, ctypes.c_int64,
                                        p]  # fmt: skip
    lib.mamba2_forward_rows.restype = i
    lib.mamba_scan.argtypes = [i, i, i, p, p, p, p, p, p, p]
    lib.mamba_scan.restype = None
    lib.linear_panels.argtypes = [i, i, i, i, p, p, p, p]
    lib.linear_panels.restype = None
    lib.half_panels_fast.argtypes = []
    lib.half_panels_fast.restype = i
    lib.set_threads.argtypes = [i, i]
    lib.set_threads.restype = None
    i64, f = ctypes.c_int64, ctypes.c_float
    lib.tree_attention.argtypes = [i, i, i, i, i, f, p, i64, i64, p, i64, i64, p, i64, i64, p, i64, i64, p, i]
    lib.tree_attention.restype = i
    lib.tree_attention_ragged.argtypes = [i, p, i, i, i, f, p, i64, i64, p, i64, i64, p, i64, i64, p, i]
    lib.tree_attention_ragged.restype = i
    lib.decoder_layers.argtypes = [p, i, p, p, p, i, p, i]
    lib.decoder_layers.restype = i
    lib.gelu_rows.argtypes = [i, i, p, p, i]
    lib.prefill_writes.argtypes = [i, i, i, i, i, p, i64, i64, p, i64, i64, p, i64, i64, p, p, p, i, p, i]
    lib.prefill_writes.restype = i
    lib.gelu_rows.restype = None
    lib.shm_sum_f32.argtypes = [p, i, i, i64, i64, p, p, i64, ctypes.c_double]
    lib.shm_sum_f32.restype = i
    lib.omp_team_thread_ids.argtypes = [i, p]
    lib.omp_team_thread_ids.restype = i
    lib.keyed_uniforms.argtypes = [p, i64, i64, p]
    lib.keyed_uniforms.restype = None
    lib.ssm_tree_scan.argtypes = [i, i, p, p, i, i, i, p, i64, p, i64, p, i64, p, i64, p, i64, i, p, i64, p, i, p, p,
                                   i64, p, p]
    lib.ssm_tree_scan.restype = i
    lib.ssm_tree_conv.argtypes = [i, i, i, p, i64, p, p, p, p, i, p, i, p, p]
    lib.ssm_tree_conv.restype = None
    lib.ssm_rms_norm_rows.argtypes = [i, i, p, i64, p, f, p, i64]
    lib.ssm_rms_norm_rows.restype = None
    lib.ssm_dt_rows.argtypes = [i, i, i, p, i64, p, f, f, p]
    lib.ssm_dt_rows.restype = None
    lib.ssm_gate_rows.argtypes = [i, i, p, i64, p, i64, p, p, i64, p, i, f, p, i64]
    lib.ssm_gate_rows.restype = None


_threads_set: dict[int, int] = {}  # loaded library handle -> the thread count it was last given


def match_torch_threads(lib: ctypes.CDLL) -> None:
    """Products use as many threads as torch's intra-op pool (checked per call: a process may change it)."""
    threads = torch.get_num_threads()
    if _threads_set.get(lib._handle) != threads:
        lib.set_threads(threads, PARALLEL_MIN_MACS)
        _threads_set[lib._handle] = threads


def openmp_thread_ids() -> list[int] | None:
    """The OS thread ids of the calling thread's OpenMP team at torch's thread count (its own first): the threads that
    run torch's parallel work for it. None where that cannot be known: no native kernels, not Linux, or more than one
    OpenMP runtime in the process (then the team asked here need not be torch's)."""
    lib = load()
    if lib is None or platform.system() != "Linux":
        return None
    try:
        with open("/proc/self/maps") as maps:
            runtimes = {line.split()[-1] for line in maps if "libgomp" in line or "libiomp" in line}
    except OSError:
        return None
    if len(runtimes) != 1:
        return None
    threads = torch.get_num_threads()
    ids = (ctypes.c_int64 * threads)()
    size = lib.omp_team_thread_ids(threads, ids)
    found = [int(x) for x in ids[:size]]
    return found if all(x > 0 for x in found) else None
