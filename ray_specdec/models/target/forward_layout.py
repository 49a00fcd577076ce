"""A batched target forward's layout: where each segment's rows sit in the forward, at which positions, and what
each attends over (`lean_forward.Span`).

`TargetModel.forward_batch` checks a step's segments into `Rows` and lays them out here; it runs the forwards. Three
layouts:
- `verify_spans`: a step's verify segments in one forward, each over its own cache with its tree's mask (or none for a
  root alone where the native attention sees every key; or its tree only, for pooled caches that attend together);
- `all_spans` (`TargetModel.one_forward`, CUDA): prefill chunks and verifies in one forward, a chunk causal over its
  cache, a verify after a chunk of its own cache attending once that chunk's K/V are written;
- `prefill_rounds` and `prefill_spans`: prefill segments cut into pieces, the pieces of many segments in rounds
  (a segment's second piece in the second round, ...), each piece causal over its cache.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Sequence

import torch

from ray_specdec.models.target import kv_pool
from ray_specdec.models.target.attention_masks import TreeMasks, prefill_mask
from ray_specdec.models.target.kv_cache import TargetCache
from ray_specdec.models.target.lean_forward import Span
from ray_specdec.speculation.tree import TreeTensors


@dataclass
class Segment:
    """One request's part of a batched forward: a prefill chunk (tree None: appended causally, no logits) or a
    verify (`tokens` = [root, *tree nodes], S == 1 + tree.num_nodes)."""

    cache: "TargetCache"
    tokens: torch.Tensor  # [S] long: a prefill chunk, or [root, *tree node tokens] (BFS order)
    tree: TreeTensors | None = None


@dataclass
class Rows:
    """A checked segment, ready for the forward: its tokens and its cache's length."""

    segment: Segment
    tokens: torch.Tensor  # [S] long, where the segment's were (the host's: one copy to the device for the forward)
    cache_len: int

    @property
    def verify(self) -> bool:
        return self.segment.tree is not None


def attending_together(verify: Sequence[Rows]) -> set[int]:
    """ids of the verify segments over pooled caches that attend together (kv_pool.attend_together): they go to the
    lean forward with their tree (`Span.tree_mask`) instead of a mask of their own."""
    if not kv_pool.attend_together([r.segment.cache.kv for r in verify]):
        return set()
    return {id(r) for r in verify if kv_pool.pool_of(r.segment.cache.kv) is not None}


def verify_positions(verify: Sequence[Rows]) -> torch.Tensor:
    """[R] position of every verify row (its tree depth past its cache's length), all segments at once."""
    lengths = torch.tensor([r.cache_len for r in verify])
    if all(r.segment.tree.num_nodes == 0 for r in verify):
        return lengths
    sizes = torch.tensor([r.tokens.numel() for r in verify])
    return torch.cat([r.segment.tree.depths for r in verify]) + lengths.repeat_interleave(sizes)


def verify_spans(verify: Sequence[Rows], masks: TreeMasks, maskless_roots: bool) -> list[Span]:
    """The spans of a forward over verify segments only, in order. maskless_roots: a root alone (no tree nodes) gets
    no mask (the batch-invariant native attention: adding 0.0 changes no score; other kernels keep theirs)."""
    spans, start = [], 0
    pooled = attending_together(verify)
    for r in verify:
        tree, end = r.segment.tree, start + r.tokens.numel()
        if id(r) in pooled:
            spans.append(Span(start, end, r.segment.cache.kv, None, tree=True, tree_mask=tree.attn_mask,
                              ancestors=tree.attn_mask))  # fmt: skip
        else:
            mask = None if maskless_roots and tree.num_nodes == 0 else masks(r.cache_len, tree)
            spans.append(Span(start, end, r.segment.cache.kv, mask, tree=True, ancestors=tree.attn_mask))
        start = end
    return spans


def all_spans(rows: Sequence[Rows], masks: TreeMasks, window: int | None,
              prefill_dtype: torch.dtype | None) -> tuple[list[Span], torch.Tensor, torch.Tensor | None]:  # fmt: skip
    """Every segment's rows in one forward, each attending over its own cache (a prefill segment causally, whole: its
    mask covers all its rows) -> (spans, positions [R], the verify segments' rows [V] or None when there is none).
    prefill_dtype: a chunk's mask additive in this dtype (None: boolean)."""
    spans, positions, logit_rows, start = [], [], [], 0
    # a verify after a chunk of its cache attends on its own, after the chunk's span has written its K/V (the pooled
    # verifies attend before every other span: lean_forward._attend)
    chunked = {id(r.segment.cache) for r in rows if not r.verify}
    pooled = attending_together([r for r in rows if r.verify and id(r.segment.cache) not in chunked])
    for r in rows:
        n = r.tokens.numel()
        tree_mask = None
        if r.verify:
            if id(r) in pooled:
                mask, tree_mask = None, r.segment.tree.attn_mask
            else:
                mask = masks(r.cache_len, r.segment.tree)
            positions.append(r.segment.tree.position_ids(r.cache_len))
            logit_rows.append(torch.arange(start, start + n))
        else:
            mask = prefill_mask(r.cache_len, n, window, prefill_dtype)
            mask = None if mask is None else masks.place(mask)
            positions.append(torch.arange(r.cache_len, r.cache_len + n))
        spans.append(Span(start, start + n, r.segment.cache.kv, mask, tree=r.verify, tree_mask=tree_mask,
                          ancestors=r.segment.tree.attn_mask if r.verify else None))  # fmt: skip
        start += n
    return spans, torch.cat(positions), torch.cat(logit_rows) if logit_rows else None


def prefill_rounds(chunks: Sequence[Rows], size: int,
                   together: bool) -> list[list[tuple["TargetCache", torch.Tensor]]]:  # fmt: skip
    """Every prefill segment's tokens cut into pieces of `size` from its start, as the forwards that append them:
    together, one forward per round of pieces (a segment's second piece in the second, ...); else one per piece."""
    pieces = [[(r.segment.cache, r.tokens[start : start + size]) for start in range(0, r.tokens.numel(), size)]
              for r in chunks]  # fmt: skip
    if together:
        return [[p for p in round_ if p is not None] for round_ in itertools.zip_longest(*pieces)]
    return [[p] for segment in pieces for p in segment]


def prefill_spans(pieces: Sequence[tuple["TargetCache", torch.Tensor]], masks: TreeMasks, window: int | None,
                  mask_dtype: torch.dtype | None) -> tuple[list[Span], torch.Tensor]:  # fmt: skip
    """One forward's pieces (distinct caches), each causal over its cache -> (spans, positions [R]). mask_dtype: a
    piece's mask additive in this dtype (None: boolean, or no mask where causal attention alone says it)."""
    spans, positions, start = [], [], 0
    for cache, tokens in pieces:
        cache_len, n = cache.length, tokens.numel()
        positions.append(torch.arange(cache_len, cache_len + n))
        mask = prefill_mask(cache_len, n, window, mask_dtype)
        spans.append(Span(start, start + n, cache.kv, None if mask is None else masks.place(mask), tree=False))
        start += n
    return spans, torch.cat(positions)
