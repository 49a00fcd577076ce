"""A KV cache for the target that grows in place: per-layer K/V buffers with spare capacity.

transformers' `DynamicCache` appends with `torch.cat`, so every forward copies the whole K/V of every layer: a verify
round at 8k context moves O(context) bytes per layer just to add a few rows. `GrowableKVCache` keeps one buffer per
layer for keys and one for values, `[B, H, capacity, D]`, writes new rows into the spare capacity and hands attention
views of the valid prefix `[B, H, length, D]` (strided: attention reads them without a copy). A full buffer is replaced
by one twice as large (amortised O(1) per row), so a request's buffers are reallocated O(log context) times. A cache
made with `preallocate=True` (a request's share of a KV budget) allocates `max_capacity` rows on its first write and
never more: a write past them raises `CacheFull` instead of growing.

A later `update` never changes a view an earlier one returned: it writes only at or after the current length, and
growth copies into a new buffer while old views keep the old one alive. `compact` does rewrite rows such views cover
(and frees rows that later writes reuse), so views are for the forward that took them (as HF uses them).

The layer implements what HF's attention layers and mask builders call (`update`, `get_seq_length`,
`get_mask_sizes`, `get_max_length`, `lazy_initialization`, `reset`), plus `compact` for tree verification. For a
kernel that writes every layer's new rows in place (the batched verify's ragged attention), the cache reserves rows in
all layers at once and hands out its buffers' addresses (`reserve`, kept until a buffer is replaced), then `advance`s
every layer's length. The shapes
come from the first update, so on a tensor-parallel rank the buffers hold that rank's head shard. Beam search and
offloading, which reassign `keys` / `values`, are not supported.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Sequence

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

# First allocation, in rows: small enough for short requests, large enough that decoding does not regrow at once.
MIN_CAPACITY = 256


class CacheFull(ValueError):
    """A write needs more rows than a preallocated cache holds."""


class GrowableLayer(CacheLayerMixin):
    """One attention layer's K/V in buffers `[B, H, capacity, D]`; rows `[0, length)` are valid.

    Every position is kept (a full-attention layer): sliding windows are applied by the mask, not by dropping rows.
    """

    def __init__(self, max_capacity: int | None = None, preallocate: bool = False):
        # CacheLayerMixin.__init__ is not called: it assigns `keys` / `values`, which are views of the buffers here.
        if preallocate and not max_capacity:
            raise ValueError("a preallocated cache needs a max_capacity of at least one row")
        self.max_capacity = max_capacity
        self.preallocate = preallocate
        self.length = 0
        self.is_initialized = False
        self._keys: torch.Tensor | None = None  # [B, H, capacity, Dk]
        self._values: torch.Tensor | None = None  # [B, H, capacity, Dv]

    @property
    def keys(self) -> torch.Tensor | None:
        """[B, H, length, Dk] view of the valid rows."""
        return None if self._keys is None else self._keys[:, :, : self.length]

    @property
    def values(self) -> torch.Tensor | None:
        """[B, H, length, Dv] view of the valid rows."""
        return None if self._values is None else self._values[:, :, : self.length]

    @property
    def buffers(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole K and V buffers [B, H, capacity, D] (rows past `length` unspecified): for kernels that write new
        rows in place (then advance `length` themselves)."""
        return self._keys, self._values

    @property
    def capacity(self) -> int:
        return 0 if self._keys is None else self._keys.shape[-2]

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Empty buffers with the batch, head count, head size, dtype and device of the first states."""
        self.dtype, self.device = key_states.dtype, key_states.device
        self._keys = key_states.new_empty((*key_states.shape[:2], 0, key_states.shape[-1]))
        self._values = value_states.new_empty((*value_states.shape[:2], 0, value_states.shape[-1]))
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append key_states [B, H, S, Dk] and value_states [B, H, S, Dv]; return views of all valid rows."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        end = self.length + key_states.shape[-2]
        self.reserve(end)
        self._keys[:, :, self.length : end] = key_states
        self._values[:, :, self.length : end] = value_states
        self.length = end
        return self.keys, self.values

    def reserve(self, rows: int) -> None:
        """Make room for `rows` rows in total: double the capacity (at least), capped at `max_capacity`; a
        preallocated layer takes all `max_capacity` rows at once and raises `CacheFull` beyond them."""
        if rows <= self.capacity:
            return
        if self.preallocate:
            if rows > self.max_capacity:
                raise CacheFull(f"{rows} KV rows do not fit the cache's fixed capacity of {self.max_capacity} rows")
            capacity = self.max_capacity
        else:
            capacity = max(2 * self.capacity, MIN_CAPACITY)
            if self.max_capacity is not None:
                capacity = min(capacity, self.max_capacity)
            capacity = max(capacity, rows)
        self._keys = _regrow(self._keys, capacity, self.length)
        self._values = _regrow(self._values, capacity, self.length)

    def compact(self, base: int, keep: Sequence[int]) -> None:
        """Move rows `base + keep[i]` to `base + i` (keep ascending) and drop every row after them."""
        first = first_moved(keep)
        if first < len(keep):
            self._move(base, first, torch.tensor(keep[first:], device=self._keys.device) + base)
        self.length = base + len(keep)

    def _move(self, base: int, first: int, index: torch.Tensor) -> None:
        """Rows `index` [k] move to `base + first` onwards."""
        rows = slice(base + first, base + first + index.numel())
        # Gather (a copy) before writing: a kept row's source can be another kept row's destination.
        self._keys[:, :, rows] = self._keys.index_select(2, index)
        self._values[:, :, rows] = self._values.index_select(2, index)

    def reset(self) -> None:
        """Empty the layer; the buffers are kept for reuse."""
        self.length = 0

    def get_seq_length(self) -> int:
        return self.length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """(kv_length, kv_offset) of the next forward's mask: every cached row plus the queries, from position 0."""
        return self.length + query_length, 0

    def get_max_length(self) -> int:
        return -1  # no maximum: the buffers grow


class GrowableKVCache(Cache):
    """An HF `Cache` of `GrowableLayer`s, created lazily (one per attention layer) on the first forward."""

    def __init__(self, max_capacity: int | None = None, preallocate: bool = False):
        """max_capacity: rows a buffer never grows beyond unless a single write needs more (the model's context).
        preallocate: every layer allocates max_capacity rows on its first write and never grows (a KV budget)."""
        super().__init__(layer_class_to_replicate=partial(GrowableLayer, max_capacity=max_capacity,
                                                          preallocate=preallocate))
        self.fixed_capacity: int | None = max_capacity if preallocate else None
        self._buffers: torch.Tensor | None = None  # what `reserve` returns, while no buffer has been replaced since
        self._reserved = 0  # rows every layer's buffers hold (while _buffers is set)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """HF's update (a layer appends the rows); a write may create or replace buffers, so `reserve` reads them
        again."""
        self._buffers = None
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def reserve(self, rows: int) -> torch.Tensor:
        """Room for `rows` rows in every layer (created by a first `update`) -> each layer's buffers as int64
        [layers, 6]: keys' address, head stride, row stride, then the values' (in elements), for a kernel that writes
        new rows in place and then calls `advance`."""
        if self._buffers is None or rows > self._reserved:
            for layer in self.layers:
                layer.reserve(rows)
            self._buffers = torch.tensor([
                (k.data_ptr(), k.stride(1), k.stride(2), v.data_ptr(), v.stride(1), v.stride(2))
                for k, v in (layer.buffers for layer in self.layers)
            ], dtype=torch.int64).reshape(-1, 6)  # fmt: skip
            self._reserved = min(layer.capacity for layer in self.layers)
        return self._buffers

    def resize(self, capacity: int) -> None:
        """A preallocated cache holds `capacity` rows from now on (at least the rows it holds): every layer's
        buffers, where allocated, are replaced by ones of that size holding the same rows; layers made later take
        it too. Addresses `reserve` handed out before are stale."""
        if self.fixed_capacity is None:
            raise ValueError("only a preallocated cache is resized (the others grow by themselves)")
        if capacity < self.get_seq_length():
            raise ValueError(f"a capacity of {capacity} rows is below the {self.get_seq_length()} rows the cache holds")
        self.fixed_capacity = capacity
        self.layer_class_to_replicate = partial(GrowableLayer, max_capacity=capacity, preallocate=True)
        for layer in self.layers:
            layer.max_capacity = capacity
            if layer._keys is not None and layer.capacity > 0 and layer.capacity != capacity:
                layer._keys = _regrow(layer._keys, capacity, layer.length)
                layer._values = _regrow(layer._values, capacity, layer.length)
        self._buffers = None

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Rows the layer holds (0 before its first write); every layer is one of ours."""
        return self.layers[layer_idx].length if layer_idx < len(self.layers) else 0

    def advance(self, rows: int) -> None:
        """Every layer holds `rows` more rows (written into its buffers after `reserve`)."""
        for layer in self.layers:
            layer.length += rows

    def copy_rows(self, start: int, end: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """A copy of rows [start, end) of every layer: (keys [B, H, end - start, Dk], values [..., Dv]) per layer."""
        if not 0 <= start <= end <= self.get_seq_length():
            raise ValueError(f"rows [{start}, {end}) are not in a cache of {self.get_seq_length()} rows")
        return [(layer.keys[:, :, start:end].clone(), layer.values[:, :, start:end].clone()) for layer in self.layers]

    def append_rows(self, rows: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Append rows that `copy_rows` copied (one (keys, values) per layer) after the rows every layer holds."""
        if self.layers and len(rows) != len(self.layers):
            raise ValueError(f"rows of {len(rows)} layers for a cache of {len(self.layers)} layers")
        for i, (keys, values) in enumerate(rows):
            self.update(keys, values, i)

    def compact(self, base: int, keep: Sequence[int]) -> None:
        """Every layer: rows `base + keep[i]` move to `base + i`; the cache then holds `base + len(keep)` rows."""
        first = first_moved(keep)
        index = None
        if first < len(keep) and self.layers:
            index = torch.tensor(keep[first:], device=self.layers[0]._keys.device) + base
        for layer in self.layers:
            if index is not None:
                layer._move(base, first, index)
            layer.length = base + len(keep)


@dataclass
class TargetCache:
    """Per-request KV cache. `pending_rows` counts rows of the last verify that are not committed yet."""

    kv: GrowableKVCache
    pending_rows: int = 0

    @property
    def length(self) -> int:
        """Tokens held, uncommitted verify rows included."""
        return self.kv.get_seq_length()

    @property
    def capacity(self) -> int | None:
        """Rows the cache was preallocated with and never grows past (None: it grows up to the context)."""
        return self.kv.fixed_capacity


def first_moved(keep: Sequence[int]) -> int:
    """The first i with keep[i] != i (len(keep) when every kept row stays where it is)."""
    return next((i for i, row in enumerate(keep) if row != i), len(keep))


def _regrow(buffer: torch.Tensor, capacity: int, rows: int) -> torch.Tensor:
    """buffer [B, H, old, D] -> a new [B, H, capacity, D] holding its first `rows` rows; the rest is uninitialised."""
    grown = buffer.new_empty((*buffer.shape[:2], capacity, buffer.shape[-1]))
    grown[:, :, :rows] = buffer[:, :, :rows]
    return grown
