"""Attention for a few query rows over a long KV cache on CPU: the C kernel of attention_cpu.c, where it applies.

A verify forward attends 1 + n tree rows over the whole cache; a decode step, one row. torch's CPU sdpa kernel runs
those as small GEMMs per query and key block, far from the memory bound: on the 2-core development machine, a 12-row
verify of the default target at 3k tokens of context spent ~2/3 of its time in attention (7.6 of ~12 ms), and every
extra tree row cost about as much as reading the cache once more. `tree_attention` in attention_cpu.c reads
each key/value head's keys and values once for all rows of the query heads that share it (`python -m
benchmarks.cpu_attention` prints both side by side).

`install(model)` registers the function under `NAME` with HF's attention interface (and HF's sdpa mask builder for
it, so masks are built exactly as for sdpa) and switches the model to it. The function takes the kernel for float32
CPU tensors without autograd, batch 1 and `MIN_ROWS` to `MAX_ROWS` query rows that carry a 4D mask (a verify's);
everything else (decode steps, prefill chunks, other dtypes and devices, training) goes to HF's sdpa function
unchanged. (A batch-invariant target's verify rows of any count, one row included, take `tree_attention_table`:
models/target/lean_forward.py.) Results agree with sdpa to float32 rounding (a different summation order, as between any
two attention kernels): greedy output can differ only at near-ties of the target's logits.
"""

from __future__ import annotations

from typing import Sequence

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

from ray_specdec.models.native import library

NAME = "ray_specdec_cpu"
# Query rows the kernel takes: from 3 (fewer rows, decode steps among them, ran as fast in sdpa on the development
# machine) to 64 (verify trees are smaller; longer inputs are prefill chunks, where sdpa's blocked GEMMs are efficient).
MIN_ROWS, MAX_ROWS = 3, 64
# Floats a mask may hold (-ffast-math in the kernel assumes finite values; HF's own masks use this as "masked").
_LOWEST = torch.finfo(torch.float32).min


def supported(model) -> bool:
    """A float32 model on CPU whose attention layers call HF's attention interface with sdpa semantics."""
    param = next(model.parameters())
    return (
        param.dtype == torch.float32
        and param.device.type == "cpu"
        and model.config._attn_implementation in ("sdpa", NAME)
        and model._can_set_attn_implementation()
    )


def install(model) -> None:
    """Switch `model` (see `supported`) to the native attention; raises where the kernels cannot be built."""
    if library.load() is None:
        raise RuntimeError(f"native attention unavailable: {library.why_unavailable()}")
    if not supported(model):
        raise ValueError("native attention needs a float32 CPU model running sdpa attention")
    AttentionInterface.register(NAME, attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, sdpa_mask)
    model.set_attn_implementation(NAME)


def attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling: float | None = None,
              **kwargs) -> tuple[torch.Tensor, None]:
    """HF attention-interface function: query [1, H, S, D], key / value [1, Hkv, L, D] -> ([1, S, H, D], None)."""
    mask = _kernel_mask(query, key, value, attention_mask, dropout, kwargs)
    if mask is False:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)  # fmt: skip
    return tree_attention(query, key, value, mask, query.shape[-1] ** -0.5 if scaling is None else scaling), None


def runs_natively(query, key, value, attention_mask) -> bool:
    """Whether `attention` (no dropout, no extra arguments) takes the native kernel for these operands, not sdpa."""
    return _kernel_mask(query, key, value, attention_mask, 0.0, {}) is not False


def _kernel_mask(query, key, value, attention_mask, dropout, kwargs) -> torch.Tensor | None | bool:
    """The additive float mask [1 or H, S, L] the kernel takes (None: no mask), or False where sdpa must run."""
    _, heads, rows, _ = query.shape
    kv_heads, length = key.shape[1], key.shape[2]
    if (
        query.device.type != "cpu"
        or not (query.dtype == key.dtype == value.dtype == torch.float32)
        or query.shape[0] != 1
        or not MIN_ROWS <= rows <= MAX_ROWS
        or length == 0
        or heads % kv_heads
        or dropout
        or torch.is_grad_enabled()
        or kwargs.get("s_aux") is not None
        or kwargs.get("softcap")
    ):
        return False
    if attention_mask is None:
        # sdpa runs causal when more than one row comes without a mask (the kernel takes no causal flag).
        return False
    if attention_mask.dim() != 4 or attention_mask.shape[0] != 1 or attention_mask.shape[1] not in (1, heads):
        return False
    mask = attention_mask[0, :, :, :length]  # HF slices the mask to the keys the same way
    if mask.shape[1:] != (rows, length):
        return False
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=torch.float32).masked_fill_(~mask, _LOWEST)
    if mask.dtype != torch.float32:
        return False
    return mask.clamp_min(_LOWEST)


def tree_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
                   scale: float) -> torch.Tensor:
    """softmax(query key^T * scale + mask) value for float32 CPU tensors: query [1, H, S, D], key / value
    [1, Hkv, L, D] (H a multiple of Hkv; any strides with the last dimension contiguous), mask additive and finite,
    [1 or H, S, L] or None -> [1, S, H, D] contiguous."""
    lib = library.load()
    if lib is None:
        raise RuntimeError(f"native attention unavailable: {library.why_unavailable()}")
    _, heads, rows, dim = query.shape
    kv_heads, length = key.shape[1], key.shape[2]
    q, k, v = (t[0] if t.stride(-1) == 1 else t[0].contiguous() for t in (query, key, value))
    if mask is not None and mask.stride(-1) != 1:
        mask = mask.contiguous()
    out = torch.empty(1, rows, heads, dim, dtype=torch.float32)
    m_ptr, m_sh, m_ss = (None, 0, 0) if mask is None else (
        mask.data_ptr(), mask.stride(0) if mask.shape[0] > 1 else 0, mask.stride(1))
    failed = lib.tree_attention(
        rows, heads, kv_heads, length, dim, scale,
        q.data_ptr(), q.stride(0), q.stride(1), k.data_ptr(), k.stride(0), k.stride(1),
        v.data_ptr(), v.stride(0), v.stride(1), m_ptr, m_sh, m_ss, out.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    if failed:
        raise MemoryError("native attention could not allocate its scratch memory")
    return out


# Columns of tree_attention_ragged's segment table (SEG_* in native/attention_cpu.c): rows S, mask width L, first row,
# keys' address, head stride and row stride, the values' three, the mask's address (0: none) and row stride.
SEGMENT_FIELDS = 11
SEG_S, SEG_L, SEG_ROW, SEG_K, SEG_V, SEG_M, SEG_M_SS = 0, 1, 2, 3, 6, 9, 10


def tree_attention_ragged(
    query: torch.Tensor,  # [1, H, R, D]: the verify rows of every segment, in order
    key: torch.Tensor,  # [1, Hkv, R, D]: their new keys
    value: torch.Tensor,  # [1, Hkv, R, D]
    segments: Sequence[tuple[int, int, torch.Tensor, torch.Tensor, torch.Tensor]],
    scale: float,
) -> torch.Tensor:
    """Every segment's rows written to its cache and attending over it, in one native call -> [1, R, H, D].

    segments: (first row, rows S, keys, values, mask) per segment; keys / values [1, Hkv, capacity, D] are the
    cache's buffers whose rows [L - S, L) receive the new K/V (L = the mask's width), mask additive [S, L] (finite).
    Each row gets the bits `tree_attention` gives its segment alone (the same per-head routine, same operands)."""
    table = torch.tensor([
        (size, mask.shape[-1], row, keys.data_ptr(), keys.stride(1), keys.stride(2), values.data_ptr(),
         values.stride(1), values.stride(2), mask.data_ptr(), mask.stride(-2))
        for row, size, keys, values, mask in segments
    ], dtype=torch.int64).reshape(-1, SEGMENT_FIELDS)  # fmt: skip
    return tree_attention_table(query, key, value, table, scale)


def tree_attention_table(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, table: torch.Tensor,
                         scale: float) -> torch.Tensor:
    """`tree_attention_ragged` over a segment table already built: int64 [segments, SEGMENT_FIELDS], contiguous
    (for a caller that builds every layer's table at once), where a mask address of 0 means no mask (the segment's
    rows see all L keys: the bits of an all-zero mask, since adding 0.0 changes no score). query [1, H, R, D],
    key / value [1, Hkv, R, D] -> [1, R, H, D]. The addresses must be live buffers that hold every segment's rows."""
    lib = library.load()
    if lib is None:
        raise RuntimeError(f"native attention unavailable: {library.why_unavailable()}")
    if table.dtype != torch.int64 or table.dim() != 2 or table.shape[1] != SEGMENT_FIELDS or not table.is_contiguous():
        raise ValueError(f"a segment table is a contiguous int64 [segments, {SEGMENT_FIELDS}], got {table.shape}")
    _, heads, rows, dim = query.shape
    kv_heads = key.shape[1]
    q, kn, vn = (t[0] if t.stride(-1) == 1 else t[0].contiguous() for t in (query, key, value))
    out = torch.empty(1, rows, heads, dim, dtype=torch.float32)
    failed = lib.tree_attention_ragged(
        table.shape[0], table.data_ptr(), heads, kv_heads, dim, scale, q.data_ptr(), q.stride(0), q.stride(1),
        kn.data_ptr(), kn.stride(0), kn.stride(1), vn.data_ptr(), vn.stride(0), vn.stride(1), out.data_ptr(),
        torch.get_num_threads(),
    )  # fmt: skip
    if failed:
        raise MemoryError("native attention could not allocate its scratch memory")
    return out
