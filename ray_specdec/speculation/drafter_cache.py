"""The drafter's prefix cache: its state after a prompt, kept so that the same prompt again skips the drafter's prefill.

A Mamba drafter's state after a context is a fixed size (per layer a conv and an SSM state, whatever the context's
length), so keeping it costs a few hundred KB where the target's KV of the same prompt costs megabytes, and a hit
replaces a prefill over the whole drafter window (~17 ms for 300 tokens of the shipped drafter on 2 CPU cores) by a
copy. With the target's prefix cache (engine/prefix_cache.py) a repeated prompt's target prefill is a copy too, so the
drafter's prefill was what a drafted request still paid for its prompt.

A hit is the state the drafter's own prefill gives for the same tokens (it is that state, copied), and drafts only
change speed anyway: acceptance keeps output exact whatever the drafter proposes. The cache holds whole windows only
(the exact drafter input of a session's prefill), least recently used first out, within `max_bytes`.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from ray_specdec.models.drafter.mamba import MambaDrafter, MambaState

# The shipped drafter's entry is ~180 KB (4 layers x 512 channels x (4 + 16) floats, and its logits): ~360 entries.
DEFAULT_MAX_BYTES = 64 << 20


class DrafterStates:
    """Root states after drafter prefills, by their exact input ids, within a byte budget (LRU)."""

    def __init__(self, max_bytes: int = DEFAULT_MAX_BYTES):
        self.max_bytes = max_bytes
        self.entries: OrderedDict[tuple[int, ...], tuple[MambaState, torch.Tensor]] = OrderedDict()
        self.bytes = 0
        self.hits = self.misses = 0
        self._drafter: MambaDrafter | None = None  # whose states these are

    def holds(self, drafter: MambaDrafter, key: tuple[int, ...]) -> bool:
        """Whether `prefill(drafter, ids)` would be a copy, for ids whose values are `key` (drafting.prefill_key)."""
        return drafter is self._drafter and key in self.entries

    @torch.inference_mode()
    def prefill(self, drafter: MambaDrafter, ids: torch.Tensor) -> tuple[MambaState, torch.Tensor]:
        """drafter.prefill(ids) for ids [S]: a copy of the kept state where these ids were prefilled before (by this
        drafter: another one, swapped in, starts the cache afresh)."""
        if drafter is not self._drafter:
            self.clear()
            self._drafter = drafter
        key = tuple(ids.tolist())
        kept = self.entries.get(key)
        if kept is not None:
            self.entries.move_to_end(key)
            self.hits += 1
            state, logits = kept
            return _copy(drafter, state), logits.clone()
        self.misses += 1
        state, logits = drafter.prefill(ids)
        size = _bytes(state, logits)
        if size <= self.max_bytes:  # the session advances its state in place: keep a copy
            self.entries[key] = (_copy(drafter, state), logits.clone())
            self.bytes += size
            while self.bytes > self.max_bytes:
                _, (old_state, old_logits) = self.entries.popitem(last=False)
                self.bytes -= _bytes(old_state, old_logits)
        return state, logits

    def clear(self) -> None:
        self.entries.clear()
        self.bytes = 0


def _copy(drafter: MambaDrafter, state: MambaState) -> MambaState:
    """A copy of a one-row state, through the drafter (its state-copy path)."""
    return drafter.copy_rows(state, torch.zeros(1, dtype=torch.long))


def _bytes(state: MambaState, logits: torch.Tensor) -> int:
    tensors = [t for t in vars(state).values() if isinstance(t, torch.Tensor)] + [logits]
    return sum(t.numel() * t.element_size() for t in tensors)
