"""An SSM target's per-request state: a slot of a preallocated pool, and the cache object the engine holds for it.

A request's state is, per SSM layer, the last `d_conv - 1` conv inputs and the SSM state after its committed tokens:
the same size at any context (a hybrid's attention layers keep K and V per token beside it, in the cache object). The
pool holds `slots` of them in two tensors (slot-major, so one slot is contiguous) and doubles when every slot is
taken; a slot is zeroed as a cache takes it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


class SSMStatePool:
    """Preallocated per-request states: `conv` [slots, L, d_conv - 1, conv channels], `ssm` [slots, L, d_inner,
    d_state]."""

    def __init__(self, conv_shape: tuple[int, ...], ssm_shape: tuple[int, ...], conv_dtype: torch.dtype,
                 ssm_dtype: torch.dtype, device: torch.device, slots: int = 8):
        self.conv = torch.zeros(slots, *conv_shape, dtype=conv_dtype, device=device)
        self.ssm = torch.zeros(slots, *ssm_shape, dtype=ssm_dtype, device=device)
        self._free = list(range(slots - 1, -1, -1))  # popped from the end: slot 0 first

    @property
    def slots(self) -> int:
        return self.conv.shape[0]

    @property
    def bytes_per_slot(self) -> int:
        return self.conv[0].numel() * self.conv.dtype.itemsize + self.ssm[0].numel() * self.ssm.dtype.itemsize

    def acquire(self) -> int:
        """A free slot, zeroed (the state before any token); the pool doubles where none is free."""
        if not self._free:
            grown = self.slots
            self.conv = torch.cat([self.conv, torch.zeros_like(self.conv)])
            self.ssm = torch.cat([self.ssm, torch.zeros_like(self.ssm)])
            self._free = list(range(2 * grown - 1, grown - 1, -1))
        slot = self._free.pop()
        self.conv[slot].zero_()
        self.ssm[slot].zero_()
        return slot

    def release(self, slot: int) -> None:
        if slot not in self._free:
            self._free.append(slot)

    @property
    def used(self) -> int:
        return self.slots - len(self._free)


@dataclass
class PendingStates:
    """What a verify left for its rows until `commit` keeps one path's: per layer each row's conv state after its
    token and the scan's inputs of each row (from which the commit replays the kept path's SSM state from the slot's);
    the rows' parents (to check that what is kept is a path)."""

    conv: torch.Tensor  # [L, rows, d_conv - 1, conv channels]
    # whether the slot's SSM states are the root's already (the forward wrote them), else the state before the root
    # (a prefill chunk's end, in the same forward: the commit replays the root too)
    root_in_slot: bool
    # per layer (dt, x, B, C) of every verify row of the forward, shared by its verifies: [V, d_inner] x 2, [V, (g,) N]
    # x 2; this verify's rows are [scan_first, scan_first + rows)
    scan: list[tuple[torch.Tensor, ...]]
    scan_first: int
    parents: torch.Tensor  # [rows] long, within the verify (-1 for its root)
    kv: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # a hybrid's attention layers' rows


@dataclass
class SSMCache:
    """A request's target state: its pool slot, the tokens it holds, and a verify's uncommitted rows."""

    slot: int
    capacity: int | None  # the rows the scheduler granted (None: unbounded); an SSM state holds any number
    committed: int = 0  # tokens whose effect the slot's state holds
    pending: PendingStates | None = None
    # a hybrid's attention layers: K and V buffers [rows, kv heads, head_dim] each, of which [:committed] hold its
    # tokens' (rows: the granted capacity, allocated on the first write)
    kv: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)

    @property
    def pending_rows(self) -> int:
        return 0 if self.pending is None else self.pending.parents.numel()

    @property
    def length(self) -> int:
        """Tokens held, uncommitted verify rows included (as a KV cache counts them)."""
        return self.committed + self.pending_rows


@dataclass(frozen=True)
class StateSnapshot:
    """A request's state after the prompt chunk [start, end), kept by the prefix cache: it holds tokens [0, end)."""

    conv: torch.Tensor  # [L, d_conv - 1, d_inner]
    ssm: torch.Tensor  # [L, d_inner, d_state]
    start: int
    end: int
    kv: tuple[tuple[torch.Tensor, torch.Tensor], ...] = ()  # a hybrid's attention rows [start, end) per layer
