"""Selective-scan kernel for the Mamba drafter's prefill on a GPU without mamba-ssm: the whole scan in one launch.

The drafter's torch prefill scan is sequential over tokens: one fused op per token and layer. On a GPU that is one
kernel launch per token (~6 us of host time each), so without mamba-ssm's CUDA kernels a 2,048-token prefill of
the 4-layer default drafter took 128 ms on an H200 against 15 ms for the 14M target's whole prefill. Here each
program owns a block of channels and all their state entries and walks the tokens in a loop, so the state stays in
registers and the scan is one launch per layer:

    state[c, n] <- state[c, n] * exp(dt[t, c] A[c, n]) + dt[t, c] x[t, c] B[t, n]
    y[t, c]      = sum_n C[t, n] state[c, n]

(the D skip and the gate stay in torch, as on the other paths). float32 in, float32 out; the state is read at the
start and written back at the end, so a scan continues where the last one stopped. The sums are in a different order
than torch's: results agree to float32 rounding (they only make drafts; the target verifies every token).
"""

from __future__ import annotations

import torch

from kernels.state_copy import _interpreting, _triton_has_driver, triton

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _selective_scan_kernel(
        dt_ptr,
        x_ptr,
        B_ptr,
        C_ptr,
        A_ptr,
        state_ptr,
        y_ptr,
        tokens,
        d_inner,
        d_state,
        dt_stride,
        x_stride,
        B_stride,
        C_stride,
        y_stride,
        BLOCK_C: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):
        c = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
        n = tl.arange(0, BLOCK_N)
        c_ok, n_ok = c < d_inner, n < d_state
        both = c_ok[:, None] & n_ok[None, :]
        entries = c[:, None] * d_state + n[None, :]
        A = tl.load(A_ptr + entries, mask=both, other=0.0)
        state = tl.load(state_ptr + entries, mask=both, other=0.0)
        for _ in range(tokens):  # the row pointers advance (64-bit pointer arithmetic, no int32 row offsets)
            dt = tl.load(dt_ptr + c, mask=c_ok, other=0.0)
            x = tl.load(x_ptr + c, mask=c_ok, other=0.0)
            B = tl.load(B_ptr + n, mask=n_ok, other=0.0)
            C = tl.load(C_ptr + n, mask=n_ok, other=0.0)
            state = state * tl.exp(dt[:, None] * A) + (dt * x)[:, None] * B[None, :]
            tl.store(y_ptr + c, tl.sum(state * C[None, :], axis=1), mask=c_ok)
            dt_ptr += dt_stride
            x_ptr += x_stride
            B_ptr += B_stride
            C_ptr += C_stride
            y_ptr += y_stride
        tl.store(state_ptr + entries, state, mask=both)


def selective_scan_ref(dt, x, B, C, A, state) -> torch.Tensor:
    """Plain-torch reference, token by token (float64 in tests)."""
    y = torch.empty_like(x)
    for t in range(x.shape[0]):
        state.mul_(torch.exp(dt[t, :, None] * A)).add_((dt[t] * x[t])[:, None] * B[t][None, :])
        y[t] = state @ C[t]
    return y


def available(device: torch.device) -> bool:
    """Whether `selective_scan` runs on tensors of this device: a GPU with a Triton driver, or the interpreter."""
    return triton is not None and ((device.type == "cuda" and _triton_has_driver()) or _interpreting())


def selective_scan(
    dt: torch.Tensor,  # [S, d_inner] float32, after dt_proj, its bias and softplus
    x: torch.Tensor,  # [S, d_inner] float32
    B: torch.Tensor,  # [S, d_state] float32
    C: torch.Tensor,  # [S, d_state] float32
    A: torch.Tensor,  # [d_inner, d_state] float32 (-exp(A_log)), contiguous
    state: torch.Tensor,  # [d_inner, d_state] float32, contiguous; carried in and out
) -> torch.Tensor:  # [S, d_inner]: C . state after each token
    """The scan in one launch; rows of dt / x / B / C may be strided (slices of a projection), columns contiguous."""
    if triton is None:
        raise RuntimeError("triton is not installed; use selective_scan_ref")
    tokens, d_inner = x.shape
    d_state = A.shape[1]
    for name, t, shape in (("dt", dt, (tokens, d_inner)), ("B", B, (tokens, d_state)), ("C", C, (tokens, d_state)),
                           ("A", A, (d_inner, d_state)), ("state", state, (d_inner, d_state))):  # fmt: skip
        if tuple(t.shape) != shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {shape}")
    tensors = (dt, x, B, C, A, state)
    if any(t.dtype != torch.float32 for t in tensors) or len({t.device for t in tensors}) != 1:
        raise ValueError("selective_scan takes float32 tensors on one device")
    if any(t.stride(-1) != 1 for t in (dt, x, B, C)) or not (A.is_contiguous() and state.is_contiguous()):
        raise ValueError("dt, x, B and C need contiguous columns; A and state must be contiguous")
    y = torch.empty(tokens, d_inner, dtype=torch.float32, device=x.device)
    if tokens == 0 or d_inner == 0:
        return y
    block_n = triton.next_power_of_2(d_state)
    block_c = max(1, min(triton.next_power_of_2(d_inner), 4096 // block_n))  # ~4k state entries per program
    _selective_scan_kernel[(triton.cdiv(d_inner, block_c),)](
        dt, x, B, C, A, state, y, tokens, d_inner, d_state,
        dt.stride(0), x.stride(0), B.stride(0), C.stride(0), y.stride(0),
        BLOCK_C=block_c, BLOCK_N=block_n,
    )  # fmt: skip
    return y
