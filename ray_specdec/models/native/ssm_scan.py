"""An SSM target layer's tree conv and scan natively (native/ssm_scan_cpu.c): `tree_conv` (with the SiLU after it)
and `tree_scan` of models/target/ssm_scan.py over a forward's rows, one call each per layer, writing only the states
the forward keeps."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ray_specdec.models.native import library

if TYPE_CHECKING:
    from ray_specdec.models.target.ssm_scan import RowTrees


def available(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the kernel runs here: a float32 scan on CPU, with the native library built."""
    return dtype == torch.float32 and device.type == "cpu" and library.load() is not None


def tree_scan(
    dt: torch.Tensor,  # [R, d_inner] (after softplus); rows of any stride, channels contiguous (as x, B and C)
    x: torch.Tensor,  # [R, d_inner]
    B: torch.Tensor,  # [R, d_state], or [R, groups, d_state]: each of `groups` runs of channels has its own
    C: torch.Tensor,  # like B
    A: torch.Tensor,  # [d_inner, d_state], or [d_inner]: one value per channel for every state element (Mamba2)
    ssm_states: torch.Tensor,  # [S, d_inner, d_state] float32, each state contiguous: the segments' starting states
    layout: RowTrees,  # the rows' segments and parents (checked by RowTrees.build: the kernel trusts them)
    keep: torch.Tensor,  # [K] long: the rows whose states come back (distinct)
    out: torch.Tensor | None = None,  # [K, d_inner, d_state] contiguous float32: where they go (else a new tensor)
    *,
    start_rows: torch.Tensor | None = None,  # [segments] long: segment s starts from ssm_states[start_rows[s]]
    in_place: bool = False,  # each kept row's state replaces its segment's starting state in ssm_states
) -> tuple[torch.Tensor, torch.Tensor]:  # y [R, d_inner] (C . state, before the D skip and the gate); kept states
    """`tree_scan` (models/target/ssm_scan.py) with the states of the `keep` rows only.

    start_rows None: ssm_states holds one state per segment, in order. in_place (at most one kept row per segment, no
    `out`): a request's state advanced where it lies, e.g. in its slot of a pool of states (`start_rows` its slots);
    returns ssm_states as the kept states then."""
    lib = library.load()
    if lib is None:
        raise RuntimeError(f"native SSM scan unavailable: {library.why_unavailable()}")
    rows, d_inner = x.shape
    if B.dim() == 2:
        B, C = B.unsqueeze(1), C.unsqueeze(1)
    groups, n = B.shape[1], B.shape[2]
    segments = layout.segments
    if start_rows is None:
        if ssm_states.shape[0] != segments:
            raise ValueError(f"shapes do not agree: {ssm_states.shape[0]} starting states for {segments} segments")
    elif start_rows.shape != (segments,):
        raise ValueError(f"start_rows must be [{segments}], got {tuple(start_rows.shape)}")
    if ssm_states.shape[1:] != (d_inner, n) or dt.shape != x.shape or C.shape != B.shape or B.shape[0] != rows:
        raise ValueError(f"shapes do not agree: dt {tuple(dt.shape)}, x {tuple(x.shape)}, B {tuple(B.shape)}, "
                         f"C {tuple(C.shape)}, states {tuple(ssm_states.shape)} for {segments} segments")  # fmt: skip
    if d_inner % groups or layout.rows != rows:
        raise ValueError(f"{groups} groups of {d_inner} channels, {layout.rows} rows laid out for {rows}")
    per_channel = A.dim() == 1
    if A.shape != ((d_inner,) if per_channel else (d_inner, n)) or (not per_channel and A.stride(1) != 1):
        raise ValueError(f"A must be [d_inner] or [d_inner, d_state] with contiguous state elements, got "
                         f"{tuple(A.shape)}")  # fmt: skip
    for name, t in (("dt", dt), ("x", x), ("B", B), ("C", C), ("A", A), ("states", ssm_states)):
        if t.dtype != torch.float32 or t.device.type != "cpu":
            raise ValueError(f"{name} must be float32 on CPU, got {t.dtype} on {t.device}")
    dt, x = (t if t.stride(1) == 1 else t.contiguous() for t in (dt, x))
    B, C = (t if t.stride(2) == 1 and t.stride(1) == n else t.contiguous() for t in (B, C))
    if ssm_states.stride(2) != 1 or ssm_states.stride(1) != n:
        if in_place:
            raise ValueError("states advanced in place must each be contiguous")
        ssm_states = ssm_states.contiguous()
    keep = keep.to(torch.int64).contiguous()
    if keep.numel() and not (0 <= int(keep.min()) and int(keep.max()) < rows):
        raise IndexError(f"kept rows must be in [0, {rows})")
    if start_rows is not None:
        start_rows = start_rows.to(torch.int64).contiguous()
        if segments and not (0 <= int(start_rows.min()) and int(start_rows.max()) < ssm_states.shape[0]):
            raise IndexError(f"start rows must be in [0, {ssm_states.shape[0]})")
    kept_to = None
    if in_place:
        if out is not None:
            raise ValueError("in_place writes the kept states over the starting states: no `out`")
        segment_of = layout.segment_of[keep]
        if segment_of.unique().numel() != segment_of.numel():
            raise ValueError("in place, at most one row of a segment can be kept")
        kept_to = segment_of if start_rows is None else start_rows[segment_of]
        out = ssm_states
    y = torch.empty(rows, d_inner, dtype=torch.float32)
    if out is None:
        out = torch.empty(keep.numel(), d_inner, n, dtype=torch.float32)
    elif not in_place and (out.shape != (keep.numel(), d_inner, n) or out.dtype != torch.float32
                           or not out.is_contiguous()):  # fmt: skip
        raise ValueError(f"out must be contiguous float32 [{keep.numel()}, {d_inner}, {n}], got {tuple(out.shape)}")
    library.match_torch_threads(lib)
    starts, parents = layout.native_tables
    if lib.ssm_tree_scan(rows, segments, starts.data_ptr(), parents.data_ptr(), d_inner, n, groups, dt.data_ptr(),
                         dt.stride(0), x.data_ptr(), x.stride(0), B.data_ptr(), B.stride(0), C.data_ptr(), C.stride(0),
                         A.data_ptr(), A.stride(0), int(per_channel), ssm_states.data_ptr(), ssm_states.stride(0),
                         None if start_rows is None else start_rows.data_ptr(), keep.numel(), keep.data_ptr(),
                         out.data_ptr(), out.stride(0), None if kept_to is None else kept_to.data_ptr(),
                         y.data_ptr()) != 0:  # fmt: skip
        raise MemoryError("the native SSM scan could not allocate its buffers")
    return y, out


def tree_conv(
    x: torch.Tensor,  # [R, d]: every row's conv input (rows of any stride, channels contiguous)
    conv_states: torch.Tensor,  # [segments, d_conv - 1, d]: each segment's inputs before its root, oldest first
    layout: RowTrees,
    weight: torch.Tensor,  # [d, d_conv]
    bias: torch.Tensor | None,  # [d]
    keep: torch.Tensor,  # [K] long: the rows whose conv states come back
    history: torch.Tensor,  # [K, d_conv - 1, d] contiguous float32: where they go (each kept row's last inputs)
    *,
    silu: bool = False,  # the outputs through SiLU (the layer's activation)
) -> torch.Tensor:  # [R, d] conv outputs
    """`tree_conv` (models/target/ssm_scan.py), with the kept rows' conv states (`inputs[layout.windows[keep, 1:]]`
    there) written to `history`."""
    lib = library.load()
    if lib is None:
        raise RuntimeError(f"native SSM conv unavailable: {library.why_unavailable()}")
    rows, d = x.shape
    d_conv = weight.shape[1]
    if (weight.shape != (d, d_conv) or conv_states.shape != (layout.segments, d_conv - 1, d) or layout.rows != rows
            or layout.windows.shape != (rows, d_conv) or (bias is not None and bias.shape != (d,))
            or history.shape != (keep.numel(), d_conv - 1, d) or not history.is_contiguous()):  # fmt: skip
        raise ValueError(f"shapes do not agree: x {tuple(x.shape)}, conv states {tuple(conv_states.shape)}, weight "
                         f"{tuple(weight.shape)}, history {tuple(history.shape)} for {layout.rows} rows")  # fmt: skip
    for name, t in (("x", x), ("conv states", conv_states), ("weight", weight), ("bias", bias), ("history", history)):
        if t is not None and (t.dtype != torch.float32 or t.device.type != "cpu"):
            raise ValueError(f"{name} must be float32 on CPU, got {t.dtype} on {t.device}")
    x = x if x.stride(1) == 1 else x.contiguous()
    conv_states, windows = conv_states.contiguous(), layout.windows.contiguous()
    weight_t = weight.t().contiguous()  # [d_conv, d]: a tap's weights over contiguous channels
    bias = None if bias is None else bias.contiguous()
    keep = keep.to(torch.int64).contiguous()
    if keep.numel() and not (0 <= int(keep.min()) and int(keep.max()) < rows):
        raise IndexError(f"kept rows must be in [0, {rows})")
    out = torch.empty(rows, d, dtype=torch.float32)
    library.match_torch_threads(lib)
    lib.ssm_tree_conv(rows, d, d_conv, x.data_ptr(), x.stride(0), conv_states.data_ptr(), windows.data_ptr(),
                      weight_t.data_ptr(), None if bias is None else bias.data_ptr(), int(silu), out.data_ptr(),
                      keep.numel(), keep.data_ptr(), history.data_ptr())  # fmt: skip
    return out
