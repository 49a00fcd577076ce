"""Training-friendly forwards for HF Mamba, Mamba2 and Bamba mixers on machines without the mamba-ssm kernels.

Mamba: transformers' torch fallback runs the selective scan as a loop that indexes one time step of a [B, D, L, N]
tensor per iteration; autograd then materialises a full-size gradient per step (quadratic in L, gigabytes at L=256).
`mixer_forward` computes the same function with `unbind` (whose backward is one stack), so training cost stays linear.

Mamba2 (the mixer of Mamba2ForCausalLM and of Bamba): the torch fallback of the chunked scan builds [b, chunk, L, L,
heads, d_state] and [b, chunk, L, L, heads, head_dim] products (~800 MB each for a 256-token window of
target-hybrid's layers).
`mamba2_mixer_forward` takes the scan's quadratic (attention-like) form over the whole window instead: scores
C_t . B_s per head, times the decay exp(sum of dt A over (s, t]) and dt_s, applied to x: [b, L, L, heads] tensors.

Only used while training (full windows, no cache, no padding mask); the exported model is the plain HF class.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from transformers import Mamba2ForCausalLM, MambaForCausalLM


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


def ssd_quadratic(x, dt, A, B, C, D):
    """Mamba2's scan from a zero state in its quadratic form. x: [b, L, h, p]; dt: [b, L, h] (after softplus); A, D:
    [h]; B, C: [b, L, g, n] (g groups of h / g heads) -> y [b, L, h, p]."""
    heads_per_group = x.shape[2] // B.shape[2]
    B, C = B.repeat_interleave(heads_per_group, dim=2), C.repeat_interleave(heads_per_group, dim=2)
    cum = torch.cumsum(dt * A, dim=1)                                   # [b, L, h]
    length = x.shape[1]
    causal = torch.ones(length, length, dtype=torch.bool, device=x.device).tril()[None, :, :, None]
    decay = torch.exp((cum[:, :, None] - cum[:, None]).masked_fill(~causal, float("-inf")))  # [b, t, s, h]
    scores = torch.einsum("bthn,bshn->btsh", C, B) * decay * dt[:, None]
    return torch.einsum("btsh,bshp->bthp", scores, x) + x * D[:, None]


def mamba2_mixer_forward(mixer, hidden_states: torch.Tensor, cache=None, attention_mask=None, **kwargs):
    """Mamba2Mixer or BambaMixer forward over full windows (ssd_quadratic). hidden_states: [b, L, hidden] -> [b, L,
    hidden]. With a cache or a padding mask it is HF's own forward."""
    if cache is not None or attention_mask is not None:
        return type(mixer).forward(mixer, hidden_states, cache=cache, attention_mask=attention_mask, **kwargs)
    batch, length, _ = hidden_states.shape
    groups_state = mixer.n_groups * mixer.ssm_state_size
    gate, xbc, dt = mixer.in_proj(hidden_states).split(
        [mixer.intermediate_size, mixer.conv_dim, mixer.num_heads], dim=-1)
    xbc = mixer.act(mixer.conv1d(xbc.transpose(1, 2))[..., :length]).transpose(1, 2)   # causal: drop right padding
    x, B, C = xbc.split([mixer.intermediate_size, groups_state, groups_state], dim=-1)
    dt = F.softplus(dt + mixer.dt_bias)
    low, high = mixer.time_step_limit
    if (low, high) != (0.0, float("inf")):
        dt = dt.clamp(low, high)
    y = ssd_quadratic(x.view(batch, length, mixer.num_heads, mixer.head_dim), dt, -torch.exp(mixer.A_log.float()),
                      B.view(batch, length, mixer.n_groups, -1), C.view(batch, length, mixer.n_groups, -1), mixer.D)
    return mixer.out_proj(mixer.norm(y.reshape(batch, length, -1), gate))


@contextlib.contextmanager
def fast_training_forward(model) -> Iterator:
    """Within the block, every mixer of `model` (a MambaForCausalLM, Mamba2ForCausalLM or BambaForCausalLM) uses
    `mixer_forward` or `mamba2_mixer_forward` (full windows, no cache); the model makes no cache."""
    if isinstance(model, MambaForCausalLM):
        mixers, forward = [layer.mixer for layer in model.backbone.layers], mixer_forward
    elif isinstance(model, Mamba2ForCausalLM):
        mixers, forward = [layer.mixer for layer in model.backbone.layers], mamba2_mixer_forward
    else:
        mixers = [layer.mamba for layer in model.model.layers if hasattr(layer, "mamba")]
        forward = mamba2_mixer_forward
    use_cache, model.config.use_cache = model.config.use_cache, False
    for mixer in mixers:
        mixer.forward = types.MethodType(forward, mixer)
    try:
        yield model
    finally:
        model.config.use_cache = use_cache
        for mixer in mixers:
            del mixer.forward
