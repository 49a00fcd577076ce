"""The torch ops of MambaDrafter's mixer that are not methods: norm, depthwise causal conv, state contraction, and
the sequential selective scan over a block of tokens (the CPU and plain-CUDA reference paths)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(x.to(weight.dtype), weight.shape, weight, eps)


def causal_conv(
    x: torch.Tensor,  # [S, d_inner]
    weight: torch.Tensor,  # [d_inner, d_conv]
    bias: torch.Tensor | None,  # [d_inner]
    history: torch.Tensor | None = None,  # [d_conv - 1, d_inner] inputs before x; zeros when None
) -> torch.Tensor:  # [S, d_inner]
    # Depthwise causal conv as d_conv shifted multiply-adds: F.conv1d with groups=d_inner falls back to a slow
    # per-group loop on CPU for float64 (seconds for a short prompt on a busy machine).
    seq_len, width = x.shape[0], weight.shape[1]
    if history is None:
        padded = F.pad(x, (0, 0, width - 1, 0))  # [S + d_conv - 1, d_inner]
    else:
        padded = torch.cat((history.to(x.dtype), x))
    out = padded[:seq_len] * weight[:, 0]
    for k in range(1, width):
        out = torch.addcmul(out, padded[k : k + seq_len], weight[:, k])
    return out if bias is None else out + bias


def contract_state(
    state: torch.Tensor,  # [n, d_inner, d_state]
    C: torch.Tensor,  # [n, d_state]
) -> torch.Tensor:  # [n, d_inner]
    # C @ state^T as a batched (1 x d_state) @ (d_state x d_inner) product: several times faster on CPU than
    # state @ C (a batch of d_inner x 16 matrix-vector products) or a reduction over the short last dimension.
    return torch.bmm(C.unsqueeze(1), state.mT).squeeze(1)


def scan_block(
    dt: torch.Tensor,  # [T, d_inner]
    x: torch.Tensor,  # [T, d_inner]
    B: torch.Tensor,  # [T, d_state]
    C: torch.Tensor,  # [T, d_state]
    A: torch.Tensor,  # [d_inner, d_state]
    ssm_state: torch.Tensor,  # [d_inner, d_state], carried in and out
) -> torch.Tensor:  # [T, d_inner]: C . state, before the D skip and the gate
    # Sequential over tokens, vectorised over channels: one fused op per token. The decays and injections of
    # the whole block come from batched ops, and the decay buffer is overwritten with the states as we go.
    states = torch.exp(dt.unsqueeze(-1) * A)  # [T, d_inner, d_state]: decays, then states
    inject = (dt * x).unsqueeze(-1) * B.unsqueeze(1)  # [T, d_inner, d_state]
    prev = ssm_state
    for decay, add in zip(states.unbind(0), inject.unbind(0)):
        prev = torch.addcmul(add, decay, prev, out=decay)
    ssm_state.copy_(prev)
    return contract_state(states, C)
