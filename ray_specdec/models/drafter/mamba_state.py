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


class StateSlots:
    """One-row drafter states preallocated for `slots` requests (mamba_ssm's `state_batch_indices` idea): a request's
    root state is a slot, a batched draft gathers every request's root rows at depth 1 by slot index in one copy, and
    a commit copies the accepted row into the slot and advances it there in place. Nothing is allocated per request
    or per round for the roots, and memory is bounded by the slot count.

    Slot-major (`conv` [slots, L, d_inner, d_conv], `ssm` [slots, L, d_inner, d_state]) so that a slot is a contiguous
    one-row state [L, 1, ...], as the native kernels and graphs take it; `rows()` is the whole pool as a state of
    `slots` rows (strided), which the state-copy path gathers from by index.
    """

    def __init__(self, drafter, slots: int):
        """drafter: the MambaDrafter whose states the slots hold (`new_state` gives their shapes, dtypes and device).
        The pool is allocated on the first `acquire`: a scheduler whose requests never draft never allocates it."""
        if slots < 1:
            raise ValueError(f"a slot pool needs at least one slot, got {slots}")
        self.drafter, self.slots = drafter, slots
        self.conv: torch.Tensor | None = None  # [slots, L, d_inner, d_conv]
        self.ssm: torch.Tensor | None = None  # [slots, L, d_inner, d_state]
        self._free = list(range(slots - 1, -1, -1))  # popped from the end: slot 0 first
        self._used: set[int] = set()

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def acquire(self) -> int | None:
        """A free slot (its state is whatever it last held), or None when every slot is taken."""
        new_state = getattr(self.drafter, "new_state", None)
        if not self._free or new_state is None:  # (a drafter that keeps no MambaState: a test's stand-in)
            return None
        if self.conv is None:
            template = new_state(1)  # [L, 1, ...]
            self.conv = template.conv.new_zeros(self.slots, template.conv.shape[0], *template.conv.shape[2:])
            self.ssm = template.ssm.new_zeros(self.slots, template.ssm.shape[0], *template.ssm.shape[2:])
        slot = self._free.pop()
        self._used.add(slot)
        return slot

    def release(self, slot: int) -> None:
        """The slot is free again (releasing a free slot does nothing)."""
        if slot in self._used:
            self._used.remove(slot)
            self._free.append(slot)

    def state(self, slot: int) -> MambaState:
        """The slot as a one-row state [L, 1, ...]: a contiguous view, written in place by whatever advances it."""
        return MambaState(self.conv[slot].unsqueeze(1), self.ssm[slot].unsqueeze(1))

    def rows(self) -> MambaState:
        """Every slot as one state of `slots` rows (row i is slot i): a strided view, to gather rows from."""
        return MambaState(self.conv.transpose(0, 1), self.ssm.transpose(0, 1))
