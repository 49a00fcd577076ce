"""A step's prefill chunks between their QKV products and their attention, natively (native/prefill_cpu.c).

The batch-invariant lean forward runs every prefill chunk of a step in one forward (TargetModel._prefill_chunks),
each chunk attending on its own over its cache. In torch each layer then rotates all rows' queries and keys (a
dozen strided passes), copies every chunk's keys and values into its cache, and concatenates the chunks' attention
outputs. `PrefillWrites` does the first two in one native pass per layer, writing keys and values straight into the
caches' buffers, and gathers the outputs into one buffer: the same bits as the torch path (the rotary rounds each
product and sum as torch does), with fewer passes over memory. Where the model's attention is HF's sdpa function
(or the native attention's, on the rows it hands to sdpa), each chunk calls torch's sdpa with the arguments HF's
function would give it and its output [H, S, D] is transposed once, into the step's output buffer: HF's function would
copy it to [S, H, D] first (with the gather after it, ~13% of a step of four ~256-token prompts, py-spy).
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward

from ray_specdec.models.native import attention as native_attention, library

from ray_specdec import env

# Columns of prefill_writes' segment table (SEG_* in prefill_cpu.c): first row, rows, first cache row, the keys'
# address, head stride and row stride (floats), the values'.
FIELDS = 9
FIRST, ROWS, DEST, KEYS, VALUES = 0, 1, 2, 3, 6


def available(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the kernel runs here: float32 on CPU, with the native library built, unless
    RAY_SPECDEC_NATIVE_PREFILL=0 (the torch path, the same bits)."""
    return (dtype == torch.float32 and device.type == "cpu" and env.NATIVE_PREFILL.on()
            and library.load() is not None)  # fmt: skip


def write(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
          table: torch.Tensor, with_queries: bool = True) -> torch.Tensor | None:
    """query [1, H, R, D], key / value [1, Hkv, R, D] (any strides with the last dimension contiguous), cos / sin
    [R, rotary] contiguous, table int64 [segments, FIELDS] -> the rotated queries [1, H, R, D] (None without
    with_queries), after every segment's rotated keys and its values are written to its cache rows (the buffers must
    be live and hold them)."""
    lib = library.load()
    if lib is None:
        raise RuntimeError(f"native prefill writes unavailable: {library.why_unavailable()}")
    _, heads, rows, dim = query.shape
    kv_heads = key.shape[1]
    for name, t in (("query", query), ("key", key), ("value", value), ("cos", cos), ("sin", sin)):
        if t.dtype != torch.float32 or t.device.type != "cpu" or t.stride(-1) != 1:
            raise ValueError(f"{name} must be float32 on CPU with a contiguous last dimension")
    if key.shape != (1, kv_heads, rows, dim) or value.shape != key.shape or query.shape[0] != 1:
        raise ValueError(f"query {tuple(query.shape)}, key {tuple(key.shape)} and value {tuple(value.shape)} do "
                         "not agree")  # fmt: skip
    rotary = cos.shape[-1]
    if cos.shape != (rows, rotary) or sin.shape != cos.shape or not cos.is_contiguous() or not sin.is_contiguous():
        raise ValueError(f"cos / sin must be contiguous [{rows}, rotary], got {tuple(cos.shape)}")
    if rotary % 2 or rotary > dim:
        raise ValueError(f"a rotary of {rotary} dimensions does not fit heads of {dim}")
    if table.dtype != torch.int64 or table.dim() != 2 or table.shape[1] != FIELDS or not table.is_contiguous():
        raise ValueError(f"a segment table is a contiguous int64 [segments, {FIELDS}], got {tuple(table.shape)}")
    out = torch.empty(1, heads, rows, dim, dtype=torch.float32) if with_queries else None
    failed = lib.prefill_writes(
        rows, heads, kv_heads, dim, rotary, query.data_ptr(), query.stride(1), query.stride(2), key.data_ptr(),
        key.stride(1), key.stride(2), value.data_ptr(), value.stride(1), value.stride(2), cos.data_ptr(),
        sin.data_ptr(), None if out is None else out.data_ptr(), table.shape[0], table.data_ptr(),
        torch.get_num_threads(),
    )  # fmt: skip
    if failed:
        raise ValueError("a prefill segment's rows fall outside the step's rows (or scratch memory ran out)")
    return out


def sdpa_heads_first(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
                     scaling: float | None) -> torch.Tensor | None:
    """torch's sdpa as HF's `sdpa_attention_forward(module, query, key, value, mask, dropout=0.0, scaling=scaling)`
    calls it (grouped KV heads, the causal flag, the keys it keeps), for float32 CPU operands -> its output
    [1, H, S, D] before HF's transpose; None where HF would take a path not repeated here (one grouped query row
    under a mask: its packed heads)."""
    rows = query.shape[2]
    extra = {}
    if getattr(module, "num_key_value_groups", 1) > 1:
        if mask is None and key.shape[-1] == value.shape[-1] <= 256:  # HF's use_gqa_in_sdpa on CPU
            extra["enable_gqa"] = True
        elif rows == 1:
            return None
        else:
            key, value = repeat_kv(key, module.num_key_value_groups), repeat_kv(value, module.num_key_value_groups)
    causal = rows > 1 and mask is None and getattr(module, "is_causal", True)
    if causal and key.shape[2] > rows:
        key, value = key[:, :, :rows], value[:, :, :rows]
    return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, dropout_p=0.0, scale=scaling,
                                          is_causal=causal, **extra)  # fmt: skip


class PrefillWrites:
    """One forward's prefill spans (lean_forward.Span: rows [start, end) of the step, a GrowableKVCache, a mask):
    per layer, their K/V written to their caches and each span attending over its cache through the model's
    attention function; `finish` then advances every cache by its span's rows. Every layer's table is built once per
    forward, at the first layer (a new cache creates its layers from that layer's K/V shapes), as
    lean_forward._RaggedAttention builds its own."""

    def __init__(self, spans: Sequence, layers: int, cos: torch.Tensor, sin: torch.Tensor):
        """cos / sin [R, rotary] of the step's rows."""
        self._spans, self._layers = spans, layers
        self._cos, self._sin = cos.contiguous(), sin.contiguous()
        self._tables: torch.Tensor | None = None  # [layers, spans, FIELDS]
        self._ends: list[int] = []  # each span's cache rows once its rows are in

    def keys(self, module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        """The layer's K/V into the caches, without queries or attention (a last layer whose output nothing reads)."""
        write(query, key, value, self._cos, self._sin, self._table(module.layer_idx, key), with_queries=False)

    def attend(self, module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention: Callable) -> torch.Tensor:
        """query [1, H, R, D], key / value [1, Hkv, R, D] before the rotary -> the attention's output [1, R, H * D]:
        `attention(module, query rows, keys, values, mask, dropout=0.0, scaling=)` per span ([1, S, H, D]), the
        arguments the torch path gives it."""
        layer_idx = module.layer_idx
        rotated = write(query, key, value, self._cos, self._sin, self._table(layer_idx, key))
        heads, rows, dim = rotated.shape[1:]
        out = rotated.new_empty(rows, heads, dim)
        for span, end in zip(self._spans, self._ends):
            keys, values = span.cache.layers[layer_idx].buffers
            q, k, v = rotated[:, :, span.start : span.end], keys[:, :, :end], values[:, :, :end]
            heads_first = None
            if attention is sdpa_attention_forward or (
                    attention is native_attention.attention and not native_attention.runs_natively(q, k, v, span.mask)):
                heads_first = sdpa_heads_first(module, q, k, v, span.mask, module.scaling)
            if heads_first is not None:
                out[span.start : span.end] = heads_first[0].transpose(0, 1)
            else:
                attended, _ = attention(module, q, k, v, span.mask, dropout=0.0, scaling=module.scaling)
                out[span.start : span.end] = attended[0]
        return out.view(1, rows, heads * dim)

    def finish(self) -> None:
        """Every span's cache holds its rows (each layer wrote them)."""
        if self._tables is not None:
            for span in self._spans:
                span.cache.advance(span.end - span.start)

    def _table(self, layer_idx: int, key: torch.Tensor) -> torch.Tensor:
        if self._tables is None:
            self._tables = self._build(key)
        return self._tables[layer_idx]

    def _build(self, key: torch.Tensor) -> torch.Tensor:
        empty = key.new_empty(1, key.shape[1], 0, key.shape[-1])
        buffers, columns = [], []
        for span in self._spans:
            cache, rows = span.cache, span.end - span.start
            for index in range(len(cache.layers), self._layers):  # a cache's first write: create its layers
                cache.update(empty, empty, index)
            first = cache.get_seq_length()
            buffers.append(cache.reserve(first + rows))  # [layers, 6]: keys' address and strides, the values'
            columns.append((span.start, rows, first))
            self._ends.append(first + rows)
        tables = torch.empty(self._layers, len(self._spans), FIELDS, dtype=torch.int64)
        tables[:, :, KEYS:] = torch.stack(buffers, dim=1)
        tables[:, :, :KEYS] = torch.tensor(columns, dtype=torch.int64)
        return tables
