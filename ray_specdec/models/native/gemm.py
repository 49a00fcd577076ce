"""Matrix products on CPU, from one row to prefill chunks: per row count, the fastest of a few equivalent float32 GEMM
paths, measured.

A decode or verify forward of a small Transformer on CPU multiplies 1 to a few dozen rows by every weight matrix, so
it is bound by reading the weights. torch's `F.linear` leaves that to MKL, whose paths for few rows are far from the
memory bound on some CPUs. On the 2-core AMD EPYC (Zen 4) this project is developed on, over the default target's
Linear weights (49 MB in float32, more than the cache holds): a 1-row product (GEMV) reads them at ~11 GB/s, 2-16
rows cost 1.1-1.6x more than one row, while the same product with the weight as the left operand (W @ x^T) reads them
at ~23 GB/s, oneDNN's matmul beats both from ~8 rows, and the register-blocked C product of gemm_cpu.c (where a
compiler builds it) beats all three from 2 rows (`python -m benchmarks.cpu_gemm` prints the table). Prefill chunks
(hundreds of rows) are bound by arithmetic instead, and there too the winner is the CPU's: F.linear on that Zen 4,
the native GEMM on a Zen 5, where MKL's path took 2.4x its time. Which path wins depends on the CPU, the BLAS and the
shapes, so `calibrate` times them on the model's own weights for 1 to 512 rows (a few seconds for that target, once
per machine: plans are kept in `library.cache_dir()`) and `install` makes every `nn.Linear` of the model dispatch by row
count.

The paths compute the same product in float32 with different summation orders: results agree with `F.linear` to
float32 rounding (~1e-6 relative), as a batched and a one-row forward already do. Greedy output can differ only at
near-ties of the target's logits, as it can between any two GEMM kernels.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import platform
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from ray_specdec import env
from ray_specdec.models.native import library

LINEAR, WEIGHT_LEFT, ONEDNN, NATIVE = "linear", "weight_left", "onednn", "native"
# Row counts the calibration times; a product of m rows uses the plan of the smallest of these >= m, and products of
# more rows than the last that of the last. The largest are prefill chunks: which path wins there differs by CPU as
# much as for few rows (F.linear, i.e. MKL, led on the Zen 4 machine this was first measured on; on a Zen 5 one it
# took 2.4x the native GEMM's time for 512 rows, and oneDNN 1.1x).
CALIBRATED_ROWS = (*range(1, 9), 10, 12, 16, 24, 32, 48, 64, 128, 256, 512)
# Another path replaces F.linear only when it is at least this much faster (timings on a busy machine are noisy).
MIN_GAIN = 0.10


def _weight_left(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [m, k] @ weight^T as (weight @ x^T)^T. One row is padded to two: torch sends a 1-row product to GEMV."""
    m = x.shape[0]
    xt = (torch.cat((x, x)) if m == 1 else x).t()
    out = torch.mm(weight, xt) if bias is None else torch.addmm(bias[:, None], weight, xt)
    return out.t()[:m].contiguous()


def _onednn(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x, weight, bias)


def _native(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The register-blocked C GEMM (gemm_cpu.c) over a packed copy of the weight (float32, no autograd).

    The copy lives on the weight itself and is packed again whenever the weight has changed in place since; it is
    half precision where that holds every value of the weight exactly (`exact_panel_dtype`)."""
    if (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)) or not (
        x.dtype == weight.dtype == torch.float32 and x.device.type == weight.device.type == "cpu"
    ):
        return F.linear(x, weight, bias)
    return linear(x, native_panels(weight), None if bias is None else bias.detach(), weight.shape[0])


def native_panels(weight: torch.Tensor) -> torch.Tensor:
    """The weight's packed copy for the native GEMM (`pack_panels`), kept on the weight and packed again
    whenever the weight has changed in place since."""
    packed = getattr(weight, "_ray_specdec_panels", None)
    if packed is None or packed[0] != weight._version:
        w = weight.detach()
        packed = (weight._version, pack_panels(w, exact_panel_dtype(w)))
        weight._ray_specdec_panels = packed
    return packed[1]


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
    lib = library.load()
    if lib is not None and lib.half_panels_fast() and weight.dtype == torch.float32:
        for dtype in (torch.float16, torch.bfloat16):
            if torch.equal(weight.to(dtype).to(torch.float32), weight):
                return dtype
    return torch.float32


def linear(x: torch.Tensor, panels: torch.Tensor, bias: torch.Tensor | None, n_out: int) -> torch.Tensor:
    """x [rows, n_in] @ W^T (+ bias) -> [rows, n_out] for W [n_out, n_in] packed by `pack_panels` (x and bias
    float32, on CPU; panels in any of PANEL_FORMATS)."""
    rows, n_in = x.shape
    x = x.contiguous()
    out = torch.empty(rows, n_out, dtype=torch.float32)
    if rows:
        lib = library.load()
        if lib is None:
            raise RuntimeError(f"native kernels unavailable: {library.why_unavailable()}")
        library.match_torch_threads(lib)
        lib.linear_panels(PANEL_FORMATS[panels.dtype], rows, n_out, n_in, panels.data_ptr(),
                          None if bias is None else bias.data_ptr(), x.data_ptr(), out.data_ptr())  # fmt: skip
    return out


PATHS: dict[str, Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]] = {
    LINEAR: _linear,
    WEIGHT_LEFT: _weight_left,
    ONEDNN: _onednn,
    NATIVE: _native,
}


def enabled_by_environment() -> bool:
    """RAY_SPECDEC_PLANNED_GEMM=0 (or off/false/no) turns the automatic choice off, e.g. to compare."""
    return env.PLANNED_GEMM.on()


def available_paths() -> tuple[str, ...]:
    paths = [LINEAR, WEIGHT_LEFT]
    if torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        paths.append(ONEDNN)
    if library.load() is not None:
        paths.append(NATIVE)
    return tuple(paths)


@dataclass(frozen=True)
class GemmPlan:
    """The path for each calibrated row count (CALIBRATED_ROWS order); products of more rows take the last's."""

    rows: tuple[int, ...]
    paths: tuple[str, ...]

    def path_for(self, m: int) -> str:
        for rows, path in zip(self.rows, self.paths):
            if m <= rows:
                return path
        return self.paths[-1] if self.paths else LINEAR

    def describe(self) -> str:
        """e.g. 'rows 1-7: weight_left, 8-512: onednn, more: onednn'."""
        spans, start = [], 1
        for i, (rows, path) in enumerate(zip(self.rows, self.paths)):
            if i + 1 == len(self.paths) or self.paths[i + 1] != path:
                spans.append(f"{start}-{rows}: {path}" if start != rows else f"{rows}: {path}")
                start = rows + 1
        return "rows " + ", ".join(spans) + f", more: {self.path_for(self.rows[-1] + 1) if self.rows else LINEAR}"


def choose(timings: dict[tuple[str, int], float], rows: Sequence[int] = CALIBRATED_ROWS) -> GemmPlan:
    """The plan from measured seconds per (path, rows): F.linear unless another path is MIN_GAIN faster."""
    chosen = []
    for m in rows:
        base = timings[(LINEAR, m)]
        best, best_s = LINEAR, base
        for (path, rows_), seconds in timings.items():
            if rows_ == m and path != LINEAR and seconds < best_s and seconds <= base * (1 - MIN_GAIN):
                best, best_s = path, seconds
        chosen.append(best)
    return GemmPlan(tuple(rows), tuple(chosen))


# Every row count on the native GEMM (`native_copy`).
ALWAYS_NATIVE = GemmPlan((1,), (NATIVE,))

Product = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]


def calibrate(
    weights: Sequence[tuple[torch.Tensor, torch.Tensor | None]],
    rows: Sequence[int] = CALIBRATED_ROWS,
    repeats: int = 4,
    paths: Mapping[str, Product] | None = None,
    seed: int = 0,
) -> GemmPlan:
    """The plan of the fastest path per row count, as `measure` times them."""
    return choose(measure(weights, rows, repeats, paths, seed), rows)


@torch.inference_mode()
def measure(
    weights: Sequence[tuple[torch.Tensor, torch.Tensor | None]],
    rows: Sequence[int] = CALIBRATED_ROWS,
    repeats: int = 4,
    paths: Mapping[str, Product] | None = None,
    seed: int = 0,
) -> dict[tuple[str, int], float]:
    """Seconds per (path, rows) to multiply `rows` rows by all `weights` in turn (as a forward reads them: from
    memory, not from cache, when they are bigger than it).

    A busy machine only ever adds time, so each cell keeps its best of `repeats` sweeps, and the sweeps run in a
    fresh random order each time, so that a burst of other work spoils scattered measurements, not all of one
    path's. paths: name -> fn(x, weight, bias), F.linear's among them under LINEAR; default: `available_paths()`.
    """
    paths = dict(paths or {name: PATHS[name] for name in available_paths()})
    if LINEAR not in paths:
        raise ValueError(f"the paths to calibrate must include {LINEAR!r}, the reference")
    inputs = {m: [torch.randn(m, w.shape[1], dtype=w.dtype, device=w.device) for w, _ in weights] for m in rows}
    cells = [(name, m) for m in rows for name in paths]
    order = random.Random(seed)
    timings: dict[tuple[str, int], float] = {}
    for rep in range(repeats + 1):  # the first round warms every path up
        order.shuffle(cells)
        for name, m in cells:
            fn = paths[name]
            t0 = time.perf_counter()
            for x, (w, b) in zip(inputs[m], weights):
                fn(x, w, b)
            seconds = time.perf_counter() - t0
            if rep:
                timings[(name, m)] = min(timings.get((name, m), seconds), seconds)
    return timings


class PlannedLinear(nn.Linear):
    """nn.Linear whose product takes the path its plan names for the input's row count (set by `install`)."""

    gemm_plan: GemmPlan

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        path = self.gemm_plan.path_for(rows) if rows else LINEAR
        if path == LINEAR:
            return F.linear(x, self.weight, self.bias)
        out = PATHS[path](x.reshape(rows, x.shape[-1]), self.weight, self.bias)
        return out.reshape(*x.shape[:-1], out.shape[-1])


def native_copy(module: nn.Module) -> nn.Module:
    """A copy of `module` whose nn.Linear layers take the native GEMM at every row count, sharing its parameters
    (no weight is copied); the module itself is left as it is."""
    clone = copy.copy(module)
    clone._modules = {name: None if child is None else native_copy(child) for name, child in module._modules.items()}
    if type(module) is nn.Linear:
        clone.__class__ = PlannedLinear
        clone.gemm_plan = ALWAYS_NATIVE
    return clone


def linear_layers(model: nn.Module) -> list[nn.Linear]:
    """Every module that is exactly nn.Linear (or already planned): sharded layers of other classes are left alone."""
    return [m for m in model.modules() if type(m) in (nn.Linear, PlannedLinear)]


def supported(model: nn.Module) -> bool:
    """float32 weights on CPU: the paths are float32 GEMMs (float64 models keep F.linear, exactly)."""
    layers = linear_layers(model)
    return bool(layers) and all(m.weight.device.type == "cpu" and m.weight.dtype == torch.float32 for m in layers)


_PLANS: dict[str, GemmPlan] = {}  # this process's plans, by `_plan_key`


def _plan_key(weights, rows: Sequence[int], paths: Mapping[str, Product], tag: str) -> str:
    """What a plan depends on: the CPU, torch and its thread count, the shapes (and, for the native path, the panel
    format each weight packs into), the row counts and the paths."""
    formats = []
    if NATIVE in paths:
            formats = [str(exact_panel_dtype(w)) for w, _ in weights]
    described = {
        "cpu": library.cpu_identity(), "machine": platform.machine(), "torch": torch.__version__,
        "threads": torch.get_num_threads(), "tag": tag, "rows": list(rows), "paths": sorted(paths),
        "weights": [[*w.shape, str(w.dtype), b is not None] for w, b in weights],
        "panels": formats,
    }
    return hashlib.sha256(json.dumps(described, sort_keys=True).encode()).hexdigest()[:20]


def plan_for(
    weights: Sequence[tuple[torch.Tensor, torch.Tensor | None]],
    rows: Sequence[int] = CALIBRATED_ROWS,
    paths: Mapping[str, Product] | None = None,
    tag: str = "",
) -> GemmPlan:
    """The plan for these weights: measured once per machine and kept (this process, then `library.cache_dir()`).

    tag: tells apart path sets whose names alone do not (the drafter's low-precision copies)."""
    paths = dict(paths or {name: PATHS[name] for name in available_paths()})
    key = _plan_key(weights, rows, paths, tag)
    if key in _PLANS:
        return _PLANS[key]
    directory = library.cache_dir()
    file = directory / f"gemm-plan-{key}.json" if directory is not None else None
    plan = _load_plan(file, rows, paths) if file is not None else None
    if plan is None:
        plan = calibrate(weights, rows, paths=paths)
        if file is not None:
            _save_plan(file, plan)
    _PLANS[key] = plan
    return plan


def _load_plan(file: Path, rows: Sequence[int], paths: Mapping[str, Product]) -> GemmPlan | None:
    """A kept plan, or None when there is none or it does not fit (a damaged file is measured again)."""
    try:
        saved = json.loads(file.read_text())
        plan = GemmPlan(tuple(int(r) for r in saved["rows"]), tuple(str(p) for p in saved["paths"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if plan.rows != tuple(rows) or len(plan.paths) != len(plan.rows) or not set(plan.paths) <= set(paths):
        return None
    return plan


def _save_plan(file: Path, plan: GemmPlan) -> None:
    """Write atomically; a cache that cannot be written is no error (the next process measures again)."""
    try:
        file.parent.mkdir(parents=True, exist_ok=True)
        tmp = file.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"rows": list(plan.rows), "paths": list(plan.paths), "plan": plan.describe()}))
        os.replace(tmp, file)
    except OSError:
        pass


def install(model: nn.Module, plan: GemmPlan | None = None) -> GemmPlan:
    """Make the model's nn.Linear layers follow `plan`, by default the one measured on its own weights
    (`plan_for`). Parameters, state dict and module names stay as they were; `uninstall` undoes it.
    """
    if not supported(model):
        raise ValueError("the planned GEMM paths are for float32 models on CPU")
    layers = linear_layers(model)
    if plan is None:
        plan = plan_for([(m.weight.detach(), None if m.bias is None else m.bias.detach()) for m in layers])
    for m in layers:
        m.__class__ = PlannedLinear
        m.gemm_plan = plan
    return plan


def uninstall(model: nn.Module) -> None:
    for m in model.modules():
        if type(m) is PlannedLinear:
            m.__class__ = nn.Linear
            del m.gemm_plan
