"""Native CPU kernels, compiled on first use with the machine's C compiler and loaded with ctypes.

`load()` returns the library, or None with the reason in `why_unavailable()`: no compiler, a failed build, or
RAY_SPECDEC_NATIVE=0. Callers keep their torch path for that case; nothing here is required.

The shared object is built for this CPU (-march=native) and kept under `cpu_gemm.cache_dir()/native/`, keyed by
the source, the flags, the compiler and the CPU (its kind and instruction sets: `cpu_gemm.cpu_identity`), so a
process on the same machine loads it in milliseconds. RAY_SPECDEC_NATIVE_ISA builds for a lower instruction set than
the CPU's own (`ISA_FLAGS`: avx512, avx2 or scalar), so that one machine runs the code paths another CPU would take:
the kernels' tests run every path the machine can (`available_isas`). The build writes a temporary file and renames
it into place: processes that build at once (Serve replicas) do not see each other's half-written files.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import itertools
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Sequence

import torch

from ray_specdec.models import cpu_gemm
from ray_specdec.models.loading import switched_on

# Compiled together into one shared object; HEADERS are included by them (and part of the build's key).
SOURCES = tuple(Path(__file__).with_name(name)
                for name in ("gemm_cpu.c", "mamba_cpu.c", "attention_cpu.c", "decoder_cpu.c", "prefill_cpu.c",
                             "shm_cpu.c", "threads_cpu.c"))
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
    return switched_on("RAY_SPECDEC_NATIVE")


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
    isa = os.environ.get("RAY_SPECDEC_NATIVE_ISA", "").strip().lower() or "native"
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
        b"\0".join([source, " ".join(flags).encode(), version.encode(), cpu_gemm.cpu_identity().encode(),
                    platform.machine().encode()])
    ).hexdigest()[:20]
    directory = cpu_gemm.cache_dir()
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


def _declare(lib: ctypes.CDLL) -> None:
    p, i = ctypes.c_void_p, ctypes.c_int
    lib.mamba_forward.argtypes = [ctypes.POINTER(Model), i, i, p, p, p, p]
    lib.mamba_forward.restype = i
    lib.mamba_forward_rows.argtypes = [ctypes.POINTER(Model), i, p, p, p, p, ctypes.c_int64, ctypes.c_int64, p]
    lib.mamba_forward_rows.restype = i
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


# Element formats of panels (PANEL_* of gemm_cpu.h).
PANEL_FORMATS = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


def pack_panels(weight: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """weight [n_out, n_in] -> the panels gemm_cpu.c reads: the columns of weight^T cut into blocks of 64 outputs,
    then of 16, then the rest padded with zero columns to 16, each block [n_in, 64 or 16] contiguous, one after the
    other (flat), in `dtype` (float32, or a half format that holds every value of the weight exactly: see
    `exact_panel_dtype`)."""
    n_out = weight.shape[0]
    wide, narrow = n_out // 64 * 64, n_out // 16 * 16
    bounds = [*range(0, wide, 64), *range(wide, narrow, 16), narrow, n_out]
    blocks = [weight[a:b].t().contiguous().reshape(-1) for a, b in zip(bounds, bounds[1:]) if b > a]
    if narrow < n_out:
        tail = weight.new_zeros(16, weight.shape[1])
        tail[: n_out - narrow] = weight[narrow:]
        blocks[-1] = tail.t().contiguous().reshape(-1)
    panels = torch.cat(blocks)
    if dtype != torch.float32:
        if dtype not in PANEL_FORMATS:
            raise ValueError(f"panels are float32, float16 or bfloat16, not {dtype}")
        narrowed = panels.to(dtype)
        if not torch.equal(narrowed.to(panels.dtype), panels):
            raise ValueError(f"the weight has values that {dtype} does not hold exactly")
        panels = narrowed
    return panels


def exact_panel_dtype(weight: torch.Tensor) -> torch.dtype:
    """The narrowest panel format that holds every value of a float32 weight exactly: float16 or bfloat16 for a
    weight loaded from a half-precision checkpoint (the products are then the float32 panels' bit for bit, from half
    the bytes), float32 otherwise, or where this build widens half values slowly."""
    lib = load()
    if lib is not None and lib.half_panels_fast() and weight.dtype == torch.float32:
        for dtype in (torch.float16, torch.bfloat16):
            if torch.equal(weight.to(dtype).to(torch.float32), weight):
                return dtype
    return torch.float32


_threads_set: dict[int, int] = {}  # loaded library handle -> the thread count it was last given


def _match_torch_threads(lib: ctypes.CDLL) -> None:
    """Products use as many threads as torch's intra-op pool (checked per call: a process may change it)."""
    threads = torch.get_num_threads()
    if _threads_set.get(lib._handle) != threads:
        lib.set_threads(threads, PARALLEL_MIN_MACS)
        _threads_set[lib._handle] = threads


def linear(x: torch.Tensor, panels: torch.Tensor, bias: torch.Tensor | None, n_out: int) -> torch.Tensor:
    """x [rows, n_in] @ W^T (+ bias) -> [rows, n_out] for W [n_out, n_in] packed by `pack_panels` (x and bias
    float32, on CPU; panels in any of PANEL_FORMATS)."""
    rows, n_in = x.shape
    x = x.contiguous()
    out = torch.empty(rows, n_out, dtype=torch.float32)
    if rows:
        lib = load()
        if lib is None:
            raise RuntimeError(f"native kernels unavailable: {why_unavailable()}")
        _match_torch_threads(lib)
        lib.linear_panels(PANEL_FORMATS[panels.dtype], rows, n_out, n_in, panels.data_ptr(),
                          None if bias is None else bias.data_ptr(), x.data_ptr(), out.data_ptr())  # fmt: skip
    return out


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


class NativeMamba:
    """The fused step and scan of mamba_cpu.c bound to one drafter's float32 weights (which it keeps alive)."""

    def __init__(self, lib: ctypes.CDLL, drafter) -> None:
        self.lib = lib
        d = drafter
        self._keep = []  # every tensor whose pointer the C side holds

        formats: set[torch.dtype] = set()

        def ptr(t: torch.Tensor | None) -> int | None:
            if t is None:
                return None
            if t.dtype != torch.float32 or t.device.type != "cpu":
                raise ValueError(f"native kernels take float32 CPU tensors, got {t.dtype} on {t.device}")
            t = t.contiguous()
            self._keep.append(t)
            return t.data_ptr()

        def panels(weight: torch.Tensor) -> tuple[int, int]:
            """(pointer, format) of the weight's panels: half precision where it holds the weight exactly (the
            products are the float32 panels' bit for bit)."""
            ptr(weight)  # checks dtype and device
            packed = pack_panels(weight, exact_panel_dtype(weight))
            self._keep.append(packed)
            formats.add(packed.dtype)
            return packed.data_ptr(), PANEL_FORMATS[packed.dtype]

        layers = []
        for w in d._layers:
            (in_p, in_f), (x_p, x_f), (dt_p, dt_f), (out_p, out_f) = map(
                panels, (w.in_proj, w.x_proj, w.dt_proj, w.out_proj))
            layers.append(Layer(ptr(w.norm), in_p, ptr(w.in_proj_bias), ptr(w.conv), ptr(w.conv_bias), x_p, dt_p,
                                ptr(w.dt_bias), ptr(w.A), ptr(w.D), out_p, ptr(w.out_proj_bias),
                                in_f, x_f, dt_f, out_f))  # fmt: skip
        self._layers = (Layer * d.n_layers)(*layers)
        head, head_format = panels(d._lm_head)
        self._model = Model(
            d.n_layers, d.model.config.hidden_size, d.d_inner, d.d_conv, d.d_state, d.dt_rank, d.vocab_size,
            d.eps, ptr(d._embed), ptr(d._norm_f), head, self._layers, head_format,
        )
        self.panel_formats = sorted(str(dtype).removeprefix("torch.") for dtype in formats)  # for reports
        self.vocab_size = d.vocab_size

    def forward(self, conv: torch.Tensor, ssm: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [R, S] (int64): S tokens for each of the R state rows -> logits [R, V] after each row's last
        token; conv / ssm ([n_layers, R, ...], contiguous float32) advance by S tokens in place."""
        R, S = tokens.shape
        tokens = tokens.contiguous()
        logits = torch.empty(R, self.vocab_size, dtype=torch.float32)
        if R == 0 or S == 0:
            return logits
        if int(tokens.min()) < 0 or int(tokens.max()) >= self.vocab_size:  # the C side indexes the embedding
            raise IndexError(f"token ids must be in [0, {self.vocab_size}), got {tokens.flatten().tolist()}")
        _match_torch_threads(self.lib)
        if self.lib.mamba_forward(ctypes.byref(self._model), R, S, tokens.data_ptr(), conv.data_ptr(),
                                  ssm.data_ptr(), logits.data_ptr()) != 0:  # fmt: skip
            raise MemoryError("the native Mamba forward could not allocate its buffers")
        return logits

    def forward_rows(self, states: Sequence[tuple[torch.Tensor, torch.Tensor]],
                     tokens: Sequence[torch.Tensor]) -> torch.Tensor:  # fmt: skip
        """One-row states (conv [n_layers, 1, d_inner, d_conv], ssm [n_layers, 1, d_inner, d_state]; contiguous float32,
        anywhere: slots of a pool, states of their own), each advanced in place by its own tokens (int64 [S_r], S_r >=
        1) -> logits [R, V] after each one's last token. Row r gets the bits `forward` gives it alone."""
        R = len(states)
        if len(tokens) != R:
            raise ValueError(f"{len(tokens)} token sequences for {R} states")
        logits = torch.empty(R, self.vocab_size, dtype=torch.float32)
        if R == 0:
            return logits
        lengths = [int(t.numel()) for t in tokens]
        if min(lengths) < 1:
            raise ValueError("every state needs at least one token")
        flat = torch.cat([t.reshape(-1) for t in tokens]).to(torch.int64).contiguous()
        if int(flat.min()) < 0 or int(flat.max()) >= self.vocab_size:  # the C side indexes the embedding
            raise IndexError(f"token ids must be in [0, {self.vocab_size}), got {flat.tolist()}")
        offsets = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int64)
        conv0, ssm0 = states[0]
        for conv, ssm in states:
            if (conv.shape != conv0.shape or ssm.shape != ssm0.shape or conv.shape[1] != 1
                    or not (conv.is_contiguous() and ssm.is_contiguous())
                    or conv.dtype != torch.float32 or ssm.dtype != torch.float32):  # fmt: skip
                raise ValueError("forward_rows takes contiguous one-row float32 states of one shape")
        pointers = (ctypes.c_void_p * (2 * R))(*[c.data_ptr() for c, _ in states], *[s.data_ptr() for _, s in states])
        row = ctypes.sizeof(ctypes.c_void_p) * R
        _match_torch_threads(self.lib)
        if self.lib.mamba_forward_rows(ctypes.byref(self._model), R, offsets.data_ptr(), flat.data_ptr(),
                                       ctypes.addressof(pointers), ctypes.addressof(pointers) + row,
                                       conv0[0].numel(), ssm0[0].numel(), logits.data_ptr()) != 0:  # fmt: skip
            raise MemoryError("the native Mamba forward could not allocate its buffers")
        return logits

    def scan(self, dt, x, B, C, A, state: torch.Tensor) -> torch.Tensor:
        """The selective scan of `mamba_ops.scan_block` (C . state per token, before the D skip and the gate) over
        all of dt / x [S, d_inner] and B / C [S, N]; state [d_inner, N] carried in and out."""
        S, d_inner = x.shape
        N = B.shape[1]
        dt, x, B, C, A = (t.contiguous() for t in (dt, x, B, C, A))
        carried = state if state.is_contiguous() else state.contiguous()
        y = torch.empty(S, d_inner, dtype=torch.float32)
        _match_torch_threads(self.lib)
        self.lib.mamba_scan(S, d_inner, N, dt.data_ptr(), x.data_ptr(), B.data_ptr(), C.data_ptr(),
                            A.data_ptr(), carried.data_ptr(), y.data_ptr())  # fmt: skip
        if carried is not state:
            state.copy_(carried)
        return y
