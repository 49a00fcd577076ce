"""The requests' K/V in one pooled tensor per layer, and the verify rows of a whole step attending over it in one call
per layer (`PooledAttention`): the GPU path of continuous batching.

Why. With a cache of its own per request, a batched forward attends request by request: per layer and request a
write of the new K/V and one sdpa call. Profiled on an H200, a 7B-sized
Llama at 32 requests launched ~7,200 kernels a step, 1,024 of them sdpa calls, and the step took ~180 ms of host time
against ~37 ms of GPU time: bound by its launches, not its arithmetic. vLLM's answer is a paged KV pool read by a
varlen kernel. Here: every request's cache is a contiguous range of rows of one pool per layer, so a step's verify
rows write their K/V with one `index_copy_` per layer, gather every request's cached rows into a padded batch
`[B, Hkv, L, D]` with one indexing op, and attend in one sdpa call with a `[B, 1, Q, L]` mask built once per forward
(each request's cached columns and its own tree's ancestors). A few launches per layer, whatever the batch size.

Layout. Per layer, keys `[rows, Hkv, Dk]` and values `[rows, Hkv, Dv]`. A request's range is its KV grant (the
scheduler's allocation, engine/kv_manager.py), placed in the smallest free range that fits. When the grant grows
(`resize`) the range extends in place, or slides down over free rows just below it, where those around it suffice; else
it moves to a free range. Its `GrowableKVCache` sees it as `[1, Hkv, capacity, D]` views, so every other path (prefill
chunks through the model's attention, compaction after acceptance, prefix-cache copies, HF's forward) works on it
unchanged. When no free range fits, the pool either packs (caches' rows slid down over the free ranges below them, in
one gather and scatter per layer, until enough rows at the end are free; chosen where an eighth of the pool stays free
after it) or doubles (its rows copied a layer's keys or values at a time, every live cache's views rebound to each new
tensor before the next is made, between forwards: the device holds at most the grown pool and one old layer's tensor,
never the old pool and a new one, which would cap the pool at half the device). Where
the device has no memory to double, the pool grows by less, down to just the rows it lacks, and packs; so while the
caches' grants fit the device (the scheduler keeps them within its KV budget) none is refused for the pool's fragments
(`benchmarks/kv_pool_limit.py`; tests/models/target/test_kv_pool_packing.py). Where even that fails, the request gets a
cache of its own and attends on its own, as before. A range is freed when the request's cache is released (`free`), or
at the latest when the cache is garbage-collected.

Exactness. The gathered keys, values and queries are copies of the same numbers, and masked columns add the dtype's
minimum as the per-request masks do, so the result is sdpa's over the same inputs; only the batch shape differs,
which (as for cuBLAS's row count) can change the last bits on CUDA. tests/models/target/test_kv_pool.py checks it
against the per-request path in float64 on the CPU (logits to 1e-10, the same greedy tokens for a mixed batch).
"""

from __future__ import annotations

import itertools
import threading
import weakref
from typing import Sequence

import torch

from ray_specdec.models.target.kv_cache import GrowableKVCache, GrowableLayer, first_moved

# Rows of a pool's first allocation, and at least 8 times the first request's capacity (for a 7B-sized Llama in
# bfloat16, 8 requests of 600 rows are 2.3 GiB); the pool doubles when no free range fits, so it grows with the load in
# flight instead of taking the whole KV budget up front.
MIN_POOL_ROWS = 1024
# Verify spans a forward pools at least: one request alone attends over its own rows without gathering them (on an
# H200 with a 7B-sized Llama at one request, the gather made a step ~15% slower than the request's own sdpa call).
MIN_BATCH = 2
# The gathered key length is rounded up to this many columns: the mask's rows then start at sdpa's memory-efficient
# kernel's alignment (attention_masks.MASK_ALIGNMENT) with no padding copy per call.
KEY_ALIGNMENT = 16


class KVPool:
    """Per-layer K/V pools; `new_cache(capacity)` places a request's cache in them (None when the device is full)."""

    def __init__(self, layers: int, kv_heads: int, key_dim: int, value_dim: int, dtype: torch.dtype,
                 device: torch.device | str, rows: int = 0):
        self.layers, self.kv_heads, self.key_dim, self.value_dim = layers, kv_heads, key_dim, value_dim
        self.dtype, self.device = dtype, torch.device(device)
        self.rows = 0
        self.keys: list[torch.Tensor] = []  # per layer [rows, Hkv, Dk]
        self.values: list[torch.Tensor] = []  # per layer [rows, Hkv, Dv]
        self._free: list[tuple[int, int]] = []  # free ranges [start, end), ascending, never adjacent
        # Per cache (by a key of its own): its range (offset, capacity), and the cache while it lives. A cache
        # collected gives its range back through its key (`_drop`), wherever the range has moved since.
        self._ranges: dict[int, tuple[int, int]] = {}
        self._caches: weakref.WeakValueDictionary[int, GrowableKVCache] = weakref.WeakValueDictionary()
        self._keys = itertools.count()
        # A collected cache's rows come back from whichever thread the garbage collector runs on.
        self._lock = threading.RLock()
        self.packs = 0  # times caches' rows were slid down over free ranges to free rows at the end (`_pack`)
        self.moved_rows = 0  # rows copied by packs and by grants moved to larger ranges
        if rows:
            self._grow(rows)

    @property
    def free_rows(self) -> int:
        return sum(end - start for start, end in self._free)

    def stats(self) -> dict[str, int]:
        """Rows, free rows, packs and rows moved so far (the engine's /v1/stats)."""
        with self._lock:
            return {"rows": self.rows, "free_rows": self.free_rows, "packs": self.packs, "moved_rows": self.moved_rows}

    def new_cache(self, capacity: int) -> GrowableKVCache | None:
        """A cache of `capacity` rows in the pool (packing or growing it if no free range fits), or None where the
        device has no memory for that."""
        if capacity < 1:
            raise ValueError(f"a cache needs a capacity of at least one row, got {capacity}")
        with self._lock:
            offset = self._place(capacity)
            if offset is None and not (self.free_rows >= capacity and self._worth_packing(capacity)):
                try:
                    self._grow_for(capacity, max(2 * self.rows, MIN_POOL_ROWS, 8 * capacity))
                    offset = self._place(capacity)
                except torch.OutOfMemoryError:
                    pass
            if offset is None:  # packed, the last rows are free (grown by what they lack)
                self._pack(capacity)
                if self.free_rows < capacity:
                    try:
                        self._grow(self.rows + capacity - self.free_rows)
                    except torch.OutOfMemoryError:
                        return None
                offset = self._place(capacity)
            cache = GrowableKVCache(max_capacity=capacity, preallocate=True)
            cache.layers = [_pooled_layer(capacity) for _ in range(self.layers)]
            cache.pool, cache.pool_key = self, next(self._keys)
            self._caches[cache.pool_key] = cache
            cache.pool_release = weakref.finalize(cache, self._drop, cache.pool_key)
            self._rebind(cache, offset, capacity)
            return cache

    def free(self, cache: GrowableKVCache) -> None:
        """Give the cache's rows back now (the cache must not be used after this: its views are dropped, so that a
        growth lets the old pool go); a cache not of this pool: no-op."""
        if getattr(cache, "pool", None) is self:
            cache.pool_release()
            with self._lock:
                self._caches.pop(cache.pool_key, None)
            for layer in cache.layers:
                layer._keys = layer._values = None

    def resize(self, cache: GrowableKVCache, capacity: int) -> None:
        """Give one of this pool's caches a range of `capacity` rows (at least the rows it holds), its rows kept (a
        request's KV granted as it decodes): extended in place, or slid down, where the free rows around its range
        suffice, else moved to the best-fitting free range, else packed with it last or the pool grown; the pool
        raises OutOfMemoryError where not even packing and the device's memory make room (the cache keeps its rows)."""
        if getattr(cache, "pool", None) is not self:
            raise ValueError("a cache of another pool (or none) resized by this pool")
        length = cache.get_seq_length()
        if capacity < max(length, 1):
            raise ValueError(f"a capacity of {capacity} rows is below the {length} rows the cache holds")
        with self._lock:
            old, held = self._ranges[cache.pool_key]
            if capacity <= held:
                if capacity < held:
                    self._release(old + capacity, held - capacity)
                self._rebind(cache, old, capacity)
                return
            # Its own range and the free rows around it, if they hold the grant: it extends in place, or slides down
            # over the free rows below it (a copy of its own rows only). Else the best-fitting free range, if any.
            self._release(old, held)
            start, end = next((s, e) for s, e in self._free if s <= old < e)
            offset = start if end - start >= capacity else self._place(capacity)
            if offset == start:
                self._take(start, capacity)
            elif offset is None:
                self._take(old, held, within=True)  # its range again, until it is packed or the pool grows
                if not (self.free_rows + held >= capacity and self._worth_packing(capacity - held)):
                    try:  # a growth keeps every cache's offset and rebinds it to the new pools
                        self._grow_for(capacity, max(2 * self.rows, MIN_POOL_ROWS))
                        offset = self._place(capacity)
                    except torch.OutOfMemoryError:
                        pass
                if offset is None:  # packed with this cache's rows last, it extends into the free rows after them
                    self._pack(capacity - held, last=cache)
                    old = cache.pool_offset
                    if not self._take(old + held, capacity - held):
                        self._grow(old + capacity)  # OutOfMemoryError: the cache keeps its rows and range, packed
                        self._take(old + held, capacity - held)
                    self._rebind(cache, old, capacity)
                    return
                self._release(old, held)
            if offset != old and length:
                overlap = offset < old + length and old < offset + length
                for pool in self.keys + self.values:
                    rows = pool[old:old + length]
                    pool[offset:offset + length] = rows.clone() if overlap else rows
                self.moved_rows += length
            self._rebind(cache, offset, capacity)

    def compact(self, moves: Sequence[tuple[GrowableKVCache, int, Sequence[int]]]) -> None:
        """`cache.compact(base, keep)` for every (cache, base, keep) of this pool's caches, together: the rows that
        move, over all of them, in one gather and one scatter per layer's keys and values (a step's commits; a
        compaction per request cost a host-to-device copy and four kernels per layer each). Every row is gathered
        before any is written, so a kept row whose source is another kept row's destination moves as alone."""
        source, target = [], []
        for cache, base, keep in moves:
            if getattr(cache, "pool", None) is not self:
                raise ValueError("a cache of another pool (or none) in the pool's compaction")
            first, start = first_moved(keep), cache.pool_offset + base
            source += [start + row for row in keep[first:]]
            target += range(start + first, start + len(keep))
            for layer in cache.layers:
                layer.length = base + len(keep)
        if source:
            index = torch.tensor([source, target]).to(self.device)
            for pool in self.keys + self.values:
                pool.index_copy_(0, index[1], pool.index_select(0, index[0]))

    def _place(self, capacity: int) -> int | None:
        """Best fit: the start of the smallest free range of at least `capacity` rows, taken out of the free list
        (None: none fits)."""
        fits = [(e - s, s) for s, e in self._free if e - s >= capacity]
        if not fits:
            return None
        start = min(fits)[1]
        self._take(start, capacity)
        return start

    def _take(self, start: int, rows: int, within: bool = False) -> bool:
        """Take rows [start, start + rows) out of the free list if they are free: at the start of a free range (a
        range extended in place), or (`within`) anywhere in one."""
        for i, (s, e) in enumerate(self._free):
            if (s == start or within and s <= start) and start + rows <= e:
                self._free[i:i + 1] = [r for r in ((s, start), (start + rows, e)) if r[0] < r[1]]
                return True
        return False

    def _worth_packing(self, rows: int) -> bool:
        """Whether to pack (a copy of the rows the caches hold) rather than grow (a copy of the whole pool, into
        twice its rows) to make room for `rows` more: where, once they are placed, an eighth of the pool stays free
        (else the next request would pack again)."""
        return self.free_rows - rows >= self.rows // 8

    def _pack(self, need: int, last: GrowableKVCache | None = None) -> None:
        """Slide caches' rows down over the free ranges, so that the last `need` rows of the pool (those after `last`,
        when given) are free: the caches above the highest point from which that frees enough (all of them where
        nothing does), one range after another in their order and `last` after them, in one gather and one scatter
        per layer's keys and values. Free ranges below that point stay as they are."""
        self.packs += 1
        live = []  # (range, cache) of every cache but `last`, held here while they move
        for key, placed in list(self._ranges.items()):
            cache = self._caches.get(key)
            if cache is None:  # gone (its `_drop` may be waiting for the lock): its rows are free
                self._release(*self._ranges.pop(key))
            elif cache is not last:
                live.append((placed, cache))
        live.sort(key=lambda rc: rc[0])
        held = self._ranges[last.pool_key][1] if last is not None else 0
        # From a point `start`: the caches at or above it slide down to it, `last` after them.
        bottom = 0
        for start in sorted({0, *(s for s, _ in self._free), *([last.pool_offset] if last is not None else [])}):
            above = sum(capacity for (offset, capacity), _ in live if offset >= start)
            if self.rows - start - above - held >= need:
                bottom = start
        moving = [(offset, capacity, cache) for (offset, capacity), cache in live if offset >= bottom]
        if last is not None:
            moving.append((*self._ranges[last.pool_key], last))
        source, target, place = [], [], bottom
        for offset, capacity, cache in moving:
            length = cache.get_seq_length()
            if offset != place and length:
                source += range(offset, offset + length)
                target += range(place, place + length)
            place += capacity
        if source:
            index = torch.tensor([source, target]).to(self.device)
            for pool in self.keys + self.values:
                pool.index_copy_(0, index[1], pool.index_select(0, index[0]))
            self.moved_rows += len(source)
        self._free = [(s, e) for s, e in self._free if e <= bottom]
        if last is not None and last.pool_offset < bottom:
            self._release(last.pool_offset, held)
        if place < self.rows:
            self._release(place, self.rows - place)
        place = bottom
        for _, capacity, cache in moving:
            self._rebind(cache, place, capacity)
            place += capacity

    def _drop(self, key: int) -> None:
        """A cache freed or collected: its range (wherever it is now) is free again."""
        with self._lock:
            placed = self._ranges.pop(key, None)
            if placed is not None:
                self._release(*placed)

    def _release(self, offset: int, capacity: int) -> None:
        """Rows [offset, offset + capacity) are free again (merged with free neighbours)."""
        with self._lock:
            start, end = offset, offset + capacity
            kept = []
            for s, e in self._free:
                if e == start:
                    start = s
                elif s == end:
                    end = e
                else:
                    kept.append((s, e))
            kept.append((start, end))
            self._free = sorted(kept)

    def _grow_for(self, capacity: int, rows: int) -> None:
        """Grow the pool to `rows` rows or, where the device has no memory for that, to as many as it has, halving the
        growth down to the fewest rows that fit a range of `capacity` after the last (OutOfMemoryError where not even
        those fit)."""
        tail = self._free[-1][1] - self._free[-1][0] if self._free and self._free[-1][1] == self.rows else 0
        fewest = self.rows + capacity - tail
        extra = max(rows, fewest) - self.rows
        while True:
            try:
                self._grow(max(self.rows + extra, fewest))
                return
            except torch.OutOfMemoryError:
                if self.rows + extra <= fewest:
                    raise
                extra //= 2

    def _grow(self, rows: int) -> None:
        """Pools of `rows` rows holding the old ones, every live cache's views rebound to them. A layer's keys, then
        its values, at a time, each old tensor let go once the caches' views point at its successor: the device holds
        the pool and one layer's growth, not the old pool and a new one (which would cap the pool at half the device).
        An OutOfMemoryError part way leaves the layers grown so far larger (their extra rows unused until a growth
        completes) and every cache whole and bound."""
        old = self.rows
        caches = list(self._caches.values())
        for layer in range(self.layers):
            for tensors, dim in ((self.keys, self.key_dim), (self.values, self.value_dim)):
                if layer < len(tensors) and tensors[layer].shape[0] >= rows:
                    continue  # grown by an earlier attempt that ran out of memory further on
                new = _allocate(rows, self.kv_heads, dim, self.dtype, self.device)
                if layer < len(tensors):
                    new[:old] = tensors[layer][:old]
                    tensors[layer] = new
                else:
                    tensors.append(new)
                for cache in caches:
                    self._bind(cache, layer)
        self.rows = rows
        self._release(old, rows - old)

    def _rebind(self, cache: GrowableKVCache, offset: int, capacity: int) -> None:
        """The cache holds rows [offset, offset + capacity) from now on (the free list already says so)."""
        self._ranges[cache.pool_key] = (offset, capacity)
        cache.pool_offset, cache.fixed_capacity = offset, capacity
        for layer in cache.layers:
            layer.max_capacity = capacity
        self._bind(cache)

    def _bind(self, cache: GrowableKVCache, layer: int | None = None) -> None:
        """Point the cache's layers (or one) at its rows: views [1, Hkv, capacity, D] of the pools (lengths kept)."""
        rows = slice(cache.pool_offset, cache.pool_offset + cache.fixed_capacity)
        for i in range(self.layers) if layer is None else (layer,):
            if getattr(cache, "pool_key", None) not in self._ranges:
                break  # freed: bound to nothing (`free`)
            cache.layers[i]._keys = self.keys[i][rows].transpose(0, 1)[None]
            cache.layers[i]._values = self.values[i][rows].transpose(0, 1)[None]
            cache.layers[i].dtype, cache.layers[i].device = self.dtype, self.device
        cache._buffers = None  # addresses handed out earlier are stale


def _allocate(rows: int, heads: int, dim: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """One layer's keys or values of a pool (uninitialised)."""
    return torch.empty(rows, heads, dim, dtype=dtype, device=device)


def _pooled_layer(capacity: int) -> GrowableLayer:
    """A layer whose buffers are views of a pool (bound by `KVPool._bind`): never reallocated."""
    layer = GrowableLayer(max_capacity=capacity, preallocate=True)
    layer.is_initialized = True
    return layer


def pool_of(cache) -> KVPool | None:
    """The pool a cache lives in (None: a cache of its own)."""
    return getattr(cache, "pool", None)


class PooledAttention:
    """One forward's verify spans over pooled caches: per layer, one write of their new K/V into the pool, one gather
    of each request's rows into a padded batch, one sdpa call. Built before the first layer (the caches' lengths are
    those before this forward); `finish` advances every span's cache by its rows."""

    def __init__(self, spans: Sequence):
        """spans: lean_forward.Span of verify rows whose caches share one pool (`pooled_spans` picks them)."""
        self.spans = list(spans)
        self.members = {id(s) for s in self.spans}
        pool = pool_of(self.spans[0].cache)
        if any(pool_of(s.cache) is not pool for s in self.spans):
            raise ValueError("pooled spans of one forward must share one pool")
        self.pool = pool
        device = pool.device
        sizes = [s.end - s.start for s in self.spans]
        lengths = [s.cache.get_seq_length() for s in self.spans]
        offsets = [s.cache.pool_offset for s in self.spans]
        batch, width = len(self.spans), max(sizes)
        keys = -(-max(c + q for c, q in zip(lengths, sizes)) // KEY_ALIGNMENT) * KEY_ALIGNMENT
        source = torch.cat([torch.arange(s.start, s.end) for s in self.spans])  # rows of the forward, [Rp]
        # whether the spans are rows [0, Rp) in order (then, where the forward has no other rows, K/V need no pick)
        self.leading = bool(torch.equal(source, torch.arange(len(source))))
        dest = torch.cat([torch.arange(o + c, o + c + q) for o, c, q in zip(offsets, lengths, sizes)])
        # Per request, its pool rows [offset, offset + L) (past its last row: its last row again, masked).
        columns = torch.arange(keys)
        ends = torch.tensor([o + c + q - 1 for o, c, q in zip(offsets, lengths, sizes)])
        gather = torch.minimum(torch.tensor(offsets)[:, None] + columns[None], ends[:, None])
        # Queries [B, Q]: padding rows repeat a request's last row (its mask too: finite, and dropped after).
        slot = torch.arange(width)
        query = torch.stack([s.start + torch.clamp(slot, max=q - 1) for s, q in zip(self.spans, sizes)])
        out = torch.cat([b * width + torch.arange(q) for b, q in enumerate(sizes)])  # [Rp] rows of [B * Q]
        # The mask: a row sees its request's cached columns and, past them, its tree's ancestors (itself included).
        ancestors = torch.zeros(batch, width, width, dtype=torch.bool)
        for b, (span, q) in enumerate(zip(self.spans, sizes)):
            tree = span.tree_mask
            ancestors[b, :q, :q] = tree
            ancestors[b, q:, :q] = tree[q - 1]
        cached = torch.tensor(lengths)
        offset = columns[None] - cached[:, None]  # [B, L] column - cache length: the tree row it holds, if >= 0
        in_tree = (offset >= 0) & (offset < torch.tensor(sizes)[:, None])
        seen = ancestors.gather(2, offset.clamp(0, width - 1)[:, None].expand(batch, width, keys))
        visible = (columns[None, None] < cached[:, None, None]) | (seen & in_tree[:, None])
        mask = torch.zeros(batch, 1, width, keys, dtype=pool.dtype)
        self.mask = mask.masked_fill_(~visible[:, None], torch.finfo(pool.dtype).min).to(device)
        self.source, self.dest, self.gather, self.query, self.out = (
            t.to(device) for t in (source, dest, gather, query, out))
        self.shape = (batch, width)
        self._grouped: torch.Tensor | None = None  # the mask for grouped-query attention (`_mask`)

    def __call__(self, module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """query [1, H, R, D], key / value [1, Hkv, R, D] of the forward's rows -> [Rp, H * Dv] of the spans' rows."""
        layer = module.layer_idx
        pool_k, pool_v = self.pool.keys[layer], self.pool.values[layer]
        new_k, new_v = key[0].transpose(0, 1), value[0].transpose(0, 1)  # [R, Hkv, D]
        if not self.leading or new_k.shape[0] != len(self.source):
            new_k, new_v = new_k[self.source], new_v[self.source]
        pool_k.index_copy_(0, self.dest, new_k)
        pool_v.index_copy_(0, self.dest, new_v)
        k = pool_k[self.gather].transpose(1, 2)  # [B, Hkv, L, D]
        v = pool_v[self.gather].transpose(1, 2)
        batch, width = self.shape
        heads, kv_heads = query.shape[1], k.shape[1]
        groups = heads // kv_heads
        q = query[0].transpose(0, 1)[self.query]  # [B, Q, H, D]
        # Grouped-query attention: query head h reads key head h // groups (HF's repeat_kv). Rather than copying
        # every key and value `groups` times, each key head takes its query heads' rows one after another: queries
        # [B, Hkv, groups * Q, D] (row g * Q + i: head kv * groups + g, row i) under the mask repeated `groups` times.
        q = q.reshape(batch, width, kv_heads, groups, -1).permute(0, 2, 3, 1, 4).reshape(batch, kv_heads,
                                                                                         groups * width, -1)
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=self._mask(groups),
                                                               scale=module.scaling)  # fmt: skip
        out = out.reshape(batch, heads, width, -1).transpose(1, 2)  # [B, Q, H, D]
        return out.reshape(batch * width, -1).index_select(0, self.out)

    def _mask(self, groups: int) -> torch.Tensor:
        """The mask [B, 1, groups * Q, L] of grouped queries (made once a forward)."""
        if groups == 1:
            return self.mask
        if self._grouped is None:
            self._grouped = self.mask.repeat(1, 1, groups, 1)
        return self._grouped

    def finish(self) -> None:
        """Every span's cache holds its rows (each layer wrote them)."""
        for span in self.spans:
            span.cache.advance(span.end - span.start)


def pooled_spans(spans: Sequence) -> list:
    """The verify spans PooledAttention serves: those given their tree (`Span.tree_mask`) over a pooled cache."""
    return [s for s in spans if s.tree and s.tree_mask is not None and pool_of(s.cache) is not None]


def attend_together(caches: Sequence) -> bool:
    """Whether verify segments over these caches attend together: at least MIN_BATCH of them pooled (else each
    attends over its cache's views of the pool, with its own mask)."""
    return sum(pool_of(c) is not None for c in caches) >= MIN_BATCH
