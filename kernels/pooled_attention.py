"""Pooled tree attention: every row of a forward attends over its request's rows of the K/V pool in one launch.

On CUDA each request's cache is a contiguous range of one K/V pool per layer (ray_specdec/models/target/kv_pool.py). The
eager path gathers every request's rows into a padded batch and calls sdpa: per layer two writes, three gathers, a
reshape, sdpa and a pick, each a launch whose shapes change every step. This kernel reads the pool in place, so one
launch per layer does it all, with shapes fixed by the forward's (padded) row count: a CUDA graph can hold it, and
the whole forward becomes one graph per bucket (models/target/step_graphs.py).

Program (r, h) serves row r and query head h:
- meta[r] = (pool row of its request's key 0, keys cached before this forward, forward row of its request's first new
  row, new rows of its request; 0 new rows: a padding row, which does nothing);
- its keys are the request's cached pool rows, then the forward's new rows of the same request, read from
  `new_keys` / `new_values` (not the pool: the writes of this launch are not ordered before its reads);
- a new row c (from the request's first new row) is visible where `visible[r, c]` is nonzero (a tree's ancestors and
  itself, or a prefill chunk's rows up to r); cached rows always are;
- the program of a key head's first query head also writes row r's new key and value to its pool row.

Scores and the softmax accumulate in float32 (float64 inputs: in float64), one key block at a time (online softmax).
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the torch reference keeps everything working where triton is missing
    triton = None

META_FIELDS = 4  # per row: pool offset, cached keys, span start, span rows
BLOCK_N = 32  # keys per block


def pooled_attention_ref(query, new_keys, new_values, pool_keys, pool_values, meta, visible, scale: float, out) -> None:
    """Plain-torch reference: query [R, H, D], new_keys [R, Hkv, D], new_values [R, Hkv, Dv], pool_keys / pool_values
    [rows, Hkv, D / Dv], meta int32 [R, META_FIELDS], visible int8 [R, W], out [R, H, Dv] (written for real rows)."""
    heads, kv_heads = query.shape[1], new_keys.shape[1]
    groups = heads // kv_heads
    work = torch.float64 if query.dtype == torch.float64 else torch.float32
    for r, (offset, cached, start, rows) in enumerate(meta.tolist()):
        if rows == 0:
            continue
        keys = torch.cat([pool_keys[offset : offset + cached], new_keys[start : start + rows]]).to(work)
        values = torch.cat([pool_values[offset : offset + cached], new_values[start : start + rows]]).to(work)
        seen = torch.cat([torch.ones(cached, dtype=torch.bool), visible[r, :rows] != 0])  # [keys]
        q = query[r].to(work)  # [H, D]
        k = keys.repeat_interleave(groups, dim=1)  # [keys, H, D]
        v = values.repeat_interleave(groups, dim=1)
        scores = torch.einsum("hd,khd->hk", q, k) * scale
        scores = scores.masked_fill(~seen[None], float("-inf"))
        out[r] = torch.einsum("hk,khd->hd", scores.softmax(-1), v).to(out.dtype)
    for r, (offset, cached, start, rows) in enumerate(meta.tolist()):  # after every read, as the kernel's order allows
        if rows:
            pool_keys[offset + cached + r - start] = new_keys[r]
            pool_values[offset + cached + r - start] = new_values[r]


if triton is not None:

    @triton.jit
    def _pooled_attention_kernel(
        q_ptr, q_stride_r, q_stride_h,
        nk_ptr, nk_stride_r, nk_stride_h,
        nv_ptr, nv_stride_r, nv_stride_h,
        pk_ptr, pk_stride_r, pk_stride_h,
        pv_ptr, pv_stride_r, pv_stride_h,
        o_ptr, o_stride_r, o_stride_h,
        meta_ptr, vis_ptr, vis_stride,
        scale, groups,
        D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK: tl.constexpr,
        WORK: tl.constexpr,
    ):  # fmt: skip
        r = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1).to(tl.int64)
        offset = tl.load(meta_ptr + r * 4).to(tl.int64)
        cached = tl.load(meta_ptr + r * 4 + 1).to(tl.int64)
        start = tl.load(meta_ptr + r * 4 + 2).to(tl.int64)
        rows = tl.load(meta_ptr + r * 4 + 3).to(tl.int64)
        if rows > 0:
            hk = h // groups
            d = tl.arange(0, BLOCK_D)
            dv = tl.arange(0, BLOCK_DV)
            d_ok = d < D
            dv_ok = dv < DV
            q = tl.load(q_ptr + r * q_stride_r + h * q_stride_h + d, mask=d_ok, other=0.0).to(WORK)
            m = tl.full([1], float("-inf"), WORK)  # running max, sum of weights and weighted values
            total = tl.zeros([1], WORK)
            acc = tl.zeros([BLOCK_DV], WORK)
            keys = cached + rows
            for first in range(0, keys, BLOCK):
                j = first + tl.arange(0, BLOCK)  # [BLOCK] key positions of the request
                in_cache = j < cached
                is_new = (j >= cached) & (j < keys)
                c = tl.where(is_new, j - cached, 0)  # the new row, from the request's first
                pool_row = offset + tl.where(in_cache, j, 0)
                new_row = start + c
                k = tl.load(pk_ptr + pool_row[:, None] * pk_stride_r + hk * pk_stride_h + d[None, :],
                            mask=in_cache[:, None] & d_ok[None, :], other=0.0)
                k += tl.load(nk_ptr + new_row[:, None] * nk_stride_r + hk * nk_stride_h + d[None, :],
                             mask=is_new[:, None] & d_ok[None, :], other=0.0)
                seen = in_cache | (is_new & (tl.load(vis_ptr + r * vis_stride + c, mask=is_new, other=0) != 0))
                s = tl.sum(q[None, :] * k.to(WORK), axis=1) * scale  # [BLOCK]
                s = tl.where(seen, s, float("-inf"))
                m_new = tl.maximum(m, tl.max(s, axis=0))  # [1]
                alpha = tl.where(m == float("-inf"), 0.0, tl.exp(m - m_new))
                p = tl.where(seen, tl.exp(s - m_new), 0.0)  # [BLOCK]
                v = tl.load(pv_ptr + pool_row[:, None] * pv_stride_r + hk * pv_stride_h + dv[None, :],
                            mask=in_cache[:, None] & dv_ok[None, :], other=0.0)
                v += tl.load(nv_ptr + new_row[:, None] * nv_stride_r + hk * nv_stride_h + dv[None, :],
                             mask=is_new[:, None] & dv_ok[None, :], other=0.0)
                acc = acc * alpha + tl.sum(p[:, None] * v.to(WORK), axis=0)
                total = total * alpha + tl.sum(p, axis=0)
                m = m_new
            out = acc / total
            tl.store(o_ptr + r * o_stride_r + h * o_stride_h + dv, out.to(o_ptr.dtype.element_ty), mask=dv_ok)
            if h % groups == 0:  # this key head's row r goes to its pool row
                dest = offset + cached + (r - start)
                k_new = tl.load(nk_ptr + r * nk_stride_r + hk * nk_stride_h + d, mask=d_ok)
                tl.store(pk_ptr + dest * pk_stride_r + hk * pk_stride_h + d, k_new, mask=d_ok)
                v_new = tl.load(nv_ptr + r * nv_stride_r + hk * nv_stride_h + dv, mask=dv_ok)
                tl.store(pv_ptr + dest * pv_stride_r + hk * pv_stride_h + dv, v_new, mask=dv_ok)


def pooled_attention(query, new_keys, new_values, pool_keys, pool_values, meta, visible, scale: float, out) -> None:
    """The kernel (same arguments as `pooled_attention_ref`; last dimensions contiguous)."""
    if triton is None:
        raise RuntimeError("pooled_attention needs triton")
    rows, heads, dim = query.shape
    kv_heads, value_dim = new_keys.shape[1], new_values.shape[2]
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads do not group over {kv_heads} key heads")
    tensors = (query, new_keys, new_values, pool_keys, pool_values, out)
    if any(t.stride(-1) != 1 for t in tensors):
        raise ValueError("pooled_attention needs contiguous last dimensions")
    if meta.dtype != torch.int32 or not meta.is_contiguous() or meta.shape != (rows, META_FIELDS):
        raise ValueError(f"meta must be int32 [{rows}, {META_FIELDS}], contiguous")
    if visible.dtype != torch.int8 or visible.shape[0] != rows or visible.stride(-1) != 1:
        raise ValueError(f"visible must be int8 [{rows}, W] with a contiguous last dimension")
    _pooled_attention_kernel[(rows, heads)](
        query, query.stride(0), query.stride(1),
        new_keys, new_keys.stride(0), new_keys.stride(1),
        new_values, new_values.stride(0), new_values.stride(1),
        pool_keys, pool_keys.stride(0), pool_keys.stride(1),
        pool_values, pool_values.stride(0), pool_values.stride(1),
        out, out.stride(0), out.stride(1),
        meta, visible, visible.stride(0),
        scale, heads // kv_heads,
        D=dim, DV=value_dim, BLOCK_D=triton.next_power_of_2(dim), BLOCK_DV=triton.next_power_of_2(value_dim),
        BLOCK=BLOCK_N, WORK=tl.float64 if query.dtype == torch.float64 else tl.float32,
    )  # fmt: skip
