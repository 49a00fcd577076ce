"""A Mamba drafter's per-row recurrent state, and one layer's weights as MambaDrafter's hot path reads them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass
class MambaState:
    """Per-row recurrent state. Made by the drafter under inference mode: change it only through the drafter."""

    conv: torch.Tensor  # [n_layers, rows, d_inner, d_conv]: the last d_conv conv inputs, oldest first
    ssm: torch.Tensor  # [n_layers, rows, d_inner, d_state]

    @property
    def rows(self) -> int:
        return self.conv.shape[1]

    def row_slice(self, start: int, stop: int) -> "MambaState":
        """Rows start..stop-1 as a view, no copy: one request's rows of a state that several requests step in."""
        return MambaState(self.conv[:, start:stop], self.ssm[:, start:stop])

    @staticmethod
    def cat(states: Sequence["MambaState"]) -> "MambaState":
        """The rows of all states, in order, as one state: one copy per tensor, none for a single state (returned
        as it is, not a copy: change it only through the drafter)."""
        if len(states) == 1:
            return states[0]
        return MambaState(torch.cat([s.conv for s in states], dim=1), torch.cat([s.ssm for s in states], dim=1))


@dataclass(frozen=True)
class MixerWeights:
    """One layer's weights, detached from the HF module and laid out for the hot path."""

    norm: torch.Tensor  # [d_model]
    in_proj: torch.Tensor  # [2 * d_inner, d_model]
    in_proj_bias: torch.Tensor | None  # [2 * d_inner]
    conv: torch.Tensor  # [d_inner, d_conv]
    conv_bias: torch.Tensor | None  # [d_inner]
    x_proj: torch.Tensor  # [dt_rank + 2 * d_state, d_inner]
    dt_proj: torch.Tensor  # [d_inner, dt_rank]
    dt_bias: torch.Tensor  # [d_inner]
    A: torch.Tensor  # [d_inner, d_state], ssm dtype: -exp(A_log)
    D: torch.Tensor  # [d_inner], ssm dtype
    out_proj: torch.Tensor  # [d_model, d_inner]
    out_proj_bias: torch.Tensor | None  # [d_model]

    @classmethod
    def from_block(cls, block, ssm_dtype: torch.dtype) -> "MixerWeights":
        mixer = block.mixer

        def param(p):
            return None if p is None else p.detach().contiguous()

        return cls(
            norm=param(block.norm.weight),
            in_proj=param(mixer.in_proj.weight),
            in_proj_bias=param(mixer.in_proj.bias),
            conv=param(mixer.conv1d.weight[:, 0, :]),
            conv_bias=param(mixer.conv1d.bias),
            x_proj=param(mixer.x_proj.weight),
            dt_proj=param(mixer.dt_proj.weight),
            dt_bias=param(mixer.dt_proj.bias),
            A=-torch.exp(mixer.A_log.detach().to(ssm_dtype)),
            D=mixer.D.detach().to(ssm_dtype),
            out_proj=param(mixer.out_proj.weight),
            out_proj_bias=param(mixer.out_proj.bias),
        )
