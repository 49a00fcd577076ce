"""A training-friendly forward for HF Mamba mixers on machines without the mamba-ssm kernels.

transformers' torch fallback runs the selective scan as a loop that indexes one time step of a [B, D, L, N] tensor
per iteration; autograd then materialises a full-size gradient per step (quadratic in L, gigabytes at L=256). This
forward computes the same function with `unbind` (whose backward is one stack), so training cost stays linear.
Only used while training; the exported model is a plain MambaForCausalLM.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from transformers import MambaForCausalLM


def selective_scan(u, delta, A, B, C, D):
    """Selective scan from a zero state. u, delta: [b, d, L]; A: [d, n]; B, C: [b, L, n]; D: [d] -> y [b, d, L].

    One fused multiply-add per time step inside the loop; the read-out by C is one einsum over all steps.
    """
    decay = torch.exp(delta.unsqueeze(-1) * A.unsqueeze(1))         # [b, d, L, n]
    drive = (delta * u).unsqueeze(-1) * B.unsqueeze(1)               # [b, d, L, n]
    state = torch.zeros_like(decay[:, :, 0])                         # [b, d, n]
    states = []
    for a_t, b_t in zip(decay.unbind(2), drive.unbind(2)):
        state = torch.addcmul(b_t, a_t, state)
        states.append(state)
    return torch.einsum("bdln,bln->bdl", torch.stack(states, dim=2), C) + u * D.unsqueeze(-1)


def mixer_forward(mixer, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """MambaMixer forward without cache (full sequence). hidden_states: [b, L, hidden] -> [b, L, hidden]."""
    seq_len = hidden_states.shape[1]
    x, gate = mixer.in_proj(hidden_states).transpose(1, 2).chunk(2, dim=1)   # [b, d, L] each
    x = mixer.conv1d(x)[..., :seq_len]                                      # causal: drop the right padding
    x = mixer.act(x)
    dt, B, C = torch.split(mixer.x_proj(x.transpose(1, 2)),
                           [mixer.time_step_rank, mixer.ssm_state_size, mixer.ssm_state_size], dim=-1)
    delta = F.softplus(mixer.dt_proj(dt)).transpose(1, 2)                   # [b, d, L]
    A = -torch.exp(mixer.A_log)
    y = selective_scan(x, delta, A, B, C, mixer.D) * mixer.act(gate)
    return mixer.out_proj(y.transpose(1, 2))


@contextlib.contextmanager
def fast_training_forward(model: MambaForCausalLM) -> Iterator[MambaForCausalLM]:
    """Within the block, every mixer of `model` uses `mixer_forward` (no cache support)."""
    mixers = [layer.mixer for layer in model.backbone.layers]
    for mixer in mixers:
        mixer.forward = types.MethodType(mixer_forward, mixer)
    try:
        yield model
    finally:
        for mixer in mixers:
            del mixer.forward
