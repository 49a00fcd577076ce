"""State-copy kernel: gather Mamba state rows by parent index, for every layer's conv and SSM state at once.

Tree drafting expands the drafter state from depth i to depth i+1 by copying each child's parent row. On a GPU the
per-layer `index_select` would be 2 * n_layers launches per depth; this kernel does the whole copy in one launch:
program ((layer * rows_out + i) * blocks_per_row + block) copies one block of the flattened row
`src[layer, index[i]]` into `dst[layer, i]`, for the conv state and the SSM state alike (the conv row is shorter; its
extra blocks are masked).

    dst_conv[l, i] = src_conv[l, index[i]]     # [L, R_out, d_inner, d_conv]  <- [L, R_src, d_inner, d_conv]
    dst_ssm[l, i]  = src_ssm[l, index[i]]      # [L, R_out, d_inner, d_state] <- [L, R_src, d_inner, d_state]

(A Mamba2 state's conv rows hold its conv_dim channels of x, B and C, more than d_inner: the rows need not agree.)

Rows (the last two dims) must be contiguous; layer and row strides are free, so dst may be a slice of a larger
preallocated buffer. dst and src must be separate buffers: the kernel reads and writes in the same launch, and the
check is by memory span, so two row slices of one [L, R, ...] buffer count as overlapping (their spans interleave).
No autotune: the kernel writes in place, and autotune would run it several times.
"""

from __future__ import annotations

import functools
import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the torch reference keeps everything working where triton is missing
    triton = None

_MAX_BLOCK = 1024
# Below this many bytes moved (read + write), copy_state_rows on a GPU takes two torch gathers instead: on an H200 a
# launch of this kernel costs ~50 us from Python and two index_select ~15 us, while above ~64 MiB the kernel's one
# pass wins (2-3x at 2.8b-model states and 12-64 rows; docs/BENCHMARKS.md).
KERNEL_MIN_BYTES = 64 << 20


def state_copy_ref(
    src_conv: torch.Tensor,  # [L, R_src, d_inner, d_conv]
    src_ssm: torch.Tensor,  # [L, R_src, d_inner, d_state]
    index: torch.Tensor,  # [R_out] long
    dst_conv: torch.Tensor,  # [L, R_out, d_inner, d_conv]
    dst_ssm: torch.Tensor,  # [L, R_out, d_inner, d_state]
) -> None:
    """Plain-torch reference (and CPU path): two gathers over the row dimension, straight into dst where it is
    contiguous (a gather then a copy moves every byte twice: 2-3x slower on CPU for tree states of 12-96 rows). A
    source whose layers are not one block (a slot-major pool's [L, slots, ...] view, mamba_state.StateSlots) is
    gathered layer by layer on CPU: one gather over such a view takes torch's element-wise path there, ~5x slower
    (a GPU's gather takes the strides in one launch)."""
    for src, dst in ((src_conv, dst_conv), (src_ssm, dst_ssm)):
        if not src.is_contiguous() and src.device.type == "cpu":
            for layer in range(src.shape[0]):
                if dst[layer].is_contiguous():
                    torch.index_select(src[layer], 0, index, out=dst[layer])
                else:
                    dst[layer].copy_(src[layer].index_select(0, index))
        elif dst.is_contiguous():
            torch.index_select(src, 1, index, out=dst)
        else:
            dst.copy_(src.index_select(1, index))


if triton is not None:

    @triton.jit
    def _state_copy_kernel(
        src_conv_ptr,
        src_ssm_ptr,
        index_ptr,
        dst_conv_ptr,
        dst_ssm_ptr,
        rows_out,
        conv_numel,  # elements per conv row: d_inner * d_conv
        ssm_numel,  # elements per ssm row: d_inner * d_state
        src_conv_stride_l,
        src_conv_stride_r,
        src_ssm_stride_l,
        src_ssm_stride_r,
        dst_conv_stride_l,
        dst_conv_stride_r,
        dst_ssm_stride_l,
        dst_ssm_stride_r,
        blocks_per_row,
        BLOCK: tl.constexpr,
    ):
        # one flat grid axis (axis 0 allows 2**31 - 1 programs; axes 1 and 2 only 65535)
        pid = tl.program_id(0).to(tl.int64)  # int64: layer * stride can pass 2**31 on big buffers
        block = pid % blocks_per_row
        layer_row = pid // blocks_per_row
        layer = layer_row // rows_out
        row = layer_row % rows_out
        src_row = tl.load(index_ptr + row).to(tl.int64)
        offs = block * BLOCK + tl.arange(0, BLOCK)

        conv_mask = offs < conv_numel
        conv = tl.load(
            src_conv_ptr + layer * src_conv_stride_l + src_row * src_conv_stride_r + offs, mask=conv_mask
        )
        tl.store(dst_conv_ptr + layer * dst_conv_stride_l + row * dst_conv_stride_r + offs, conv, mask=conv_mask)

        ssm_mask = offs < ssm_numel
        ssm = tl.load(src_ssm_ptr + layer * src_ssm_stride_l + src_row * src_ssm_stride_r + offs, mask=ssm_mask)
        tl.store(dst_ssm_ptr + layer * dst_ssm_stride_l + row * dst_ssm_stride_r + offs, ssm, mask=ssm_mask)


def _check_rows_contiguous(name: str, t: torch.Tensor) -> None:
    if t.stride(-1) != 1 or t.stride(-2) != t.shape[-1]:
        raise ValueError(f"{name}: rows (last two dims) must be contiguous, got strides {t.stride()}")


def _memory_span(t: torch.Tensor) -> tuple[int, int]:
    extent = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride())) + 1
    return t.data_ptr(), t.data_ptr() + extent * t.element_size()


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.numel() == 0 or b.numel() == 0:
        return False
    (a0, a1), (b0, b1) = _memory_span(a), _memory_span(b)
    return a0 < b1 and b0 < a1


def check_state_copy_args(src_conv, src_ssm, index, dst_conv, dst_ssm, index_checked: bool = False) -> None:
    """Raise ValueError unless the arguments describe a valid copy (shapes, dtypes, devices, index range).

    index_checked: the caller has checked the index range already (on the host, say): skip the device sync.
    """
    for name, t in (("src_conv", src_conv), ("src_ssm", src_ssm), ("dst_conv", dst_conv), ("dst_ssm", dst_ssm)):
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D [layers, rows, d_inner, d], got shape {tuple(t.shape)}")
    if index.dim() != 1 or index.dtype != torch.long:
        raise ValueError(f"index must be a 1-D torch.long tensor, got {index.dtype} shape {tuple(index.shape)}")
    n_layers, rows_src = src_conv.shape[:2]
    rows_out = index.shape[0]
    expected = {  # the conv state's channels may outnumber the SSM state's (Mamba2 convolves x, B and C)
        "src_ssm": (n_layers, rows_src, *src_ssm.shape[2:]),
        "dst_conv": (n_layers, rows_out, *src_conv.shape[2:]),
        "dst_ssm": (n_layers, rows_out, *src_ssm.shape[2:]),
    }
    for name, t in (("src_ssm", src_ssm), ("dst_conv", dst_conv), ("dst_ssm", dst_ssm)):
        if tuple(t.shape) != expected[name]:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {expected[name]}")
    if dst_conv.dtype != src_conv.dtype or dst_ssm.dtype != src_ssm.dtype:
        raise ValueError("dst dtypes must match src dtypes")
    devices = {t.device for t in (src_conv, src_ssm, index, dst_conv, dst_ssm)}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devices))}")
    if any(_overlap(d, s) for d in (dst_conv, dst_ssm) for s in (src_conv, src_ssm)):
        raise ValueError("dst must not overlap src")
    # One host sync; the index must be valid before the kernel reads memory with it.
    if rows_out and not index_checked and bool(((index < 0) | (index >= rows_src)).any()):
        raise ValueError(f"index out of range for {rows_src} source rows")


def state_copy(
    src_conv: torch.Tensor,  # [L, R_src, d_inner, d_conv]
    src_ssm: torch.Tensor,  # [L, R_src, d_inner, d_state]
    index: torch.Tensor,  # [R_out] long
    dst_conv: torch.Tensor,  # [L, R_out, d_inner, d_conv]
    dst_ssm: torch.Tensor,  # [L, R_out, d_inner, d_state]
    index_checked: bool = False,
) -> None:
    """Triton launcher: checks the arguments, then one launch copies every layer's conv and SSM rows."""
    if triton is None:
        raise RuntimeError("triton is not installed; use copy_state_rows or state_copy_ref")
    check_state_copy_args(src_conv, src_ssm, index, dst_conv, dst_ssm, index_checked)
    for name, t in (("src_conv", src_conv), ("src_ssm", src_ssm), ("dst_conv", dst_conv), ("dst_ssm", dst_ssm)):
        _check_rows_contiguous(name, t)
    _launch(src_conv, src_ssm, index, dst_conv, dst_ssm)


def _launch(src_conv, src_ssm, index, dst_conv, dst_ssm) -> None:
    """The launch alone, on checked arguments."""
    n_layers, rows_out = dst_conv.shape[:2]
    conv_numel = dst_conv.shape[2] * dst_conv.shape[3]
    ssm_numel = dst_ssm.shape[2] * dst_ssm.shape[3]
    longest = max(conv_numel, ssm_numel)
    if n_layers * rows_out * longest == 0:
        return
    block = min(_MAX_BLOCK, triton.next_power_of_2(longest))
    blocks_per_row = triton.cdiv(longest, block)
    grid = (n_layers * rows_out * blocks_per_row,)
    _state_copy_kernel[grid](
        src_conv,
        src_ssm,
        index,
        dst_conv,
        dst_ssm,
        rows_out,
        conv_numel,
        ssm_numel,
        src_conv.stride(0),
        src_conv.stride(1),
        src_ssm.stride(0),
        src_ssm.stride(1),
        dst_conv.stride(0),
        dst_conv.stride(1),
        dst_ssm.stride(0),
        dst_ssm.stride(1),
        blocks_per_row,
        BLOCK=block,
    )


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@functools.cache
def _triton_has_driver() -> bool:
    if triton is None:
        return False
    try:
        triton.runtime.driver.active.get_current_device()
    except RuntimeError:  # "0 active drivers" on machines without a GPU
        return False
    return True


def copy_state_rows(
    src_conv: torch.Tensor,  # [L, R_src, d_inner, d_conv]
    src_ssm: torch.Tensor,  # [L, R_src, d_inner, d_state]
    index: torch.Tensor,  # [R_out] long
    dst_conv: torch.Tensor,  # [L, R_out, d_inner, d_conv]
    dst_ssm: torch.Tensor,  # [L, R_out, d_inner, d_state]
    index_checked: bool = False,
) -> None:
    """Dispatch: the Triton kernel on a GPU with a Triton driver for copies of KERNEL_MIN_BYTES or more (and always
    under TRITON_INTERPRET=1), else the reference.

    index_checked: the caller checked 0 <= index < R_src on the host; without it a CUDA index costs a device sync.
    """
    moved = 2 * (dst_conv.numel() * dst_conv.element_size() + dst_ssm.numel() * dst_ssm.element_size())
    on_gpu = src_conv.is_cuda and _triton_has_driver() and moved >= KERNEL_MIN_BYTES
    if triton is not None and (on_gpu or _interpreting()):
        state_copy(src_conv, src_ssm, index, dst_conv, dst_ssm, index_checked)
    else:
        check_state_copy_args(src_conv, src_ssm, index, dst_conv, dst_ssm, index_checked)
        state_copy_ref(src_conv, src_ssm, index, dst_conv, dst_ssm)
