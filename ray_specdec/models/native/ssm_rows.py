"""An SSM target layer's elementwise work natively (native/ssm_rows_cpu.c), fused and parallel over rows: RMSNorm,
dt's softplus (per head, repeated over its channels), and the gate (D skip, SiLU of z, Mamba2's gated RMSNorm). A row
is computed whole by one thread with the same instructions whatever the other rows or the thread count, so a
request's results do not depend on what shares its forward. models/target/ssm.py's torch path is the definition
(`rms_norm`, `Mamba2Weights.gated_norm`); the kernels' tests compare against it in float64."""

from __future__ import annotations

import torch

from ray_specdec.models.native import library

FLOAT32_MAX = float(torch.finfo(torch.float32).max)  # an unlimited clamp (the kernels assume finite values)


def _lib():
    lib = library.load()
    if lib is None:
        raise RuntimeError(f"native SSM row kernels unavailable: {library.why_unavailable()}")
    library.match_torch_threads(lib)
    return lib


def _rows(name: str, t: torch.Tensor, rows: int, width: int) -> torch.Tensor:
    """t as [rows, width] float32 on CPU with contiguous columns (rows of any stride)."""
    if t.dim() != 2 or t.shape != (rows, width):
        raise ValueError(f"{name} must be [{rows}, {width}], got {tuple(t.shape)}")
    if t.dtype != torch.float32 or t.device.type != "cpu":
        raise ValueError(f"{name} must be float32 on CPU, got {t.dtype} on {t.device}")
    return t if t.stride(1) == 1 or width <= 1 else t.contiguous()


def _vector(name: str, t: torch.Tensor, width: int) -> torch.Tensor:
    if t.shape != (width,) or t.dtype != torch.float32 or t.device.type != "cpu":
        raise ValueError(f"{name} must be float32 [{width}] on CPU, got {t.dtype} {tuple(t.shape)} on {t.device}")
    return t.contiguous()


def _limit(v: float) -> float:
    return max(-FLOAT32_MAX, min(FLOAT32_MAX, float(v)))


def rms_norm(
    x: torch.Tensor,  # [R, d] float32 (rows of any stride)
    weight: torch.Tensor,  # [d]
    eps: float,
) -> torch.Tensor:  # [R, d]: weight * (x / sqrt(mean(x^2) + eps)) per row
    """HF's MambaRMSNorm of float32 rows."""
    rows, d = x.shape if x.dim() == 2 else (-1, -1)
    x, weight = _rows("x", x, rows, d), _vector("weight", weight, d)
    out = torch.empty(rows, d, dtype=torch.float32)
    _lib().ssm_rms_norm_rows(rows, d, x.data_ptr(), x.stride(0), weight.data_ptr(), eps, out.data_ptr(), d)
    return out


def dt(
    raw: torch.Tensor,  # [R, heads] float32: dt before its bias (rows of any stride: a column slice of a projection)
    bias: torch.Tensor | None,  # [heads]
    repeat: int,  # channels per head
    limits: tuple[float, float] = (0.0, float("inf")),
) -> torch.Tensor:  # [R, heads * repeat]: clamp(softplus(raw + bias), *limits) of each head, over its channels
    """The scan's dt per channel: torch's softplus (threshold 20) of each head's raw dt plus its bias, clamped, each
    head's value repeated over its `repeat` channels (Mamba2; repeat 1 and no bias for Mamba, whose dt_proj adds it)."""
    rows, heads = raw.shape if raw.dim() == 2 else (-1, -1)
    raw = _rows("dt", raw, rows, heads)
    bias = None if bias is None else _vector("dt bias", bias, heads)
    if repeat < 1:
        raise ValueError(f"repeat must be at least 1, got {repeat}")
    out = torch.empty(rows, heads * repeat, dtype=torch.float32)
    _lib().ssm_dt_rows(rows, heads, repeat, raw.data_ptr(), raw.stride(0), None if bias is None else bias.data_ptr(),
                       _limit(limits[0]), _limit(limits[1]), out.data_ptr())  # fmt: skip
    return out


def gate(
    y: torch.Tensor,  # [R, d] float32: the scan's output
    x: torch.Tensor,  # [R, d]: the scan's input (the D skip)
    D: torch.Tensor,  # [d]
    z: torch.Tensor,  # [R, d]: the gate
    norm: torch.Tensor | None = None,  # [d]: Mamba2's gated RMSNorm weight
    group: int = 0,  # channels per group of the norm (d a multiple of it)
    eps: float = 0.0,
    out: torch.Tensor | None = None,  # [R, d] contiguous float32 (may be y); else a new tensor
) -> torch.Tensor:  # [R, d]
    """(y + x D) SiLU(z) per row, then, where `norm` is given, each group of `group` channels g -> norm * (g /
    sqrt(mean(g^2) + eps)) (HF's MambaRMSNormGated)."""
    rows, d = y.shape if y.dim() == 2 else (-1, -1)
    y, x, z = (_rows(name, t, rows, d) for name, t in (("y", y), ("x", x), ("z", z)))
    D = _vector("D", D, d)
    if norm is not None:
        norm = _vector("gate norm", norm, d)
        if group < 1 or d % group:
            raise ValueError(f"{d} channels do not split into groups of {group}")
    if out is None:
        out = torch.empty(rows, d, dtype=torch.float32)
    elif out.shape != (rows, d) or out.dtype != torch.float32 or not out.is_contiguous():
        raise ValueError(f"out must be contiguous float32 [{rows}, {d}], got {tuple(out.shape)}")
    _lib().ssm_gate_rows(rows, d, y.data_ptr(), y.stride(0), x.data_ptr(), x.stride(0), D.data_ptr(), z.data_ptr(),
                         z.stride(0), None if norm is None else norm.data_ptr(), group, eps, out.data_ptr(), d)
    return out
