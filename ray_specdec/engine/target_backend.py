"""The scheduler's target side: one call per step (`run(StepWork)`), in process or fanned out to tensor-parallel ranks.

A step's work for the target is everything it must do to its caches, in order: keep the accepted rows of the
previous step's verifies (commits ride on the next step's call), free the caches of requests that ended, allocate
caches of newly admitted ones (their KV budget, preallocated once), copy cached prompt chunks into the new caches
that hit them and drop the chunks the scheduler evicted (engine/prefix_cache.py), then one batched forward over every
segment of the step, and last keep the prefill chunks the scheduler chose to cache. `LocalTarget` does that on a
`TargetModel` in this process; a rank of a tensor-parallel group does exactly the same on its shard
(serving/target_worker.py), so a whole step crosses to the ranks in one call, never one per request.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, Sequence

import torch

from ray_specdec.models.target.kv_cache import TargetCache
from ray_specdec.models.target.model import Segment, TargetModel
from ray_specdec.speculation.drafting import tree_from_paths


@dataclass(frozen=True)
class SegmentSpec:
    """One request's rows in a step's forward (picklable: it may cross to rank processes)."""

    request_id: str
    tokens: torch.Tensor  # [S] a prefill chunk, or [root, *tree node tokens] (BFS)
    paths: tuple[tuple[int, ...], ...] | None = None  # verify: the tree's index paths (() for no tree); None: prefill
    # verify: the caller needs only each row's argmax (a greedy request without logit processing or logprobs): the
    # step returns the rows' argmaxes [S] instead of their logits [S, V]. With tensor-parallel ranks, that is what
    # crosses from rank 0 to the loop each step: 8 bytes a row instead of 4 V (200 KB a row for a 50k vocabulary).
    argmax_only: bool = False


@dataclass
class StepWork:
    releases: list[str] = field(default_factory=list)
    allocations: list[tuple[str, int]] = field(default_factory=list)  # (request id, KV rows to preallocate)
    resizes: list[tuple[str, int]] = field(default_factory=list)  # (request id, its cache's new capacity in rows)
    commits: list[tuple[str, tuple[int, ...]]] = field(default_factory=list)  # (request id, verify rows kept)
    segments: list[SegmentSpec] = field(default_factory=list)
    # prefix caching (engine/prefix_cache.py): cached chunks copied into a new cache, in order; chunks evicted; prefill
    # chunks of this step kept after the forward as (request id, first row, end row, block id)
    loads: list[tuple[str, tuple[int, ...]]] = field(default_factory=list)
    drops: list[int] = field(default_factory=list)
    saves: list[tuple[str, int, int, int]] = field(default_factory=list)


class TargetBackend(Protocol):
    vocab_size: int
    max_context: int
    eos_token_ids: frozenset[int]

    def run(self, work: StepWork) -> list[torch.Tensor | None]:
        """Apply the work; -> logits [S, V] per verify segment, or their row argmaxes [S] where the segment is
        `argmax_only` (None for prefill segments)."""
        ...

    def reset(self) -> None:
        """Forget every cache (a restarted target): requests are re-prefilled from their token ids."""
        ...


def row_argmaxes(segments: Sequence[SegmentSpec], logits: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
    """`logits` with each `argmax_only` segment's replaced by its rows' argmaxes. Off the CPU, one argmax over all
    those segments' rows and one copy of the result to the host: one kernel and one synchronising copy a step, where
    an argmax per segment, each read back by its request's acceptance, cost a kernel launch and a wait on the device
    per request. (An argmax of the same row is the same index in any batch: the first of equal maxima.)"""
    picks = [i for i, (s, x) in enumerate(zip(segments, logits)) if x is not None and s.argmax_only]
    out = list(logits)
    if not picks or logits[picks[0]].device.type == "cpu":
        for i in picks:
            out[i] = logits[i].argmax(dim=-1)
        return out
    rows = (logits[picks[0]] if len(picks) == 1 else torch.cat([logits[i] for i in picks])).argmax(dim=-1).cpu()
    for i, ids in zip(picks, rows.split([logits[i].shape[0] for i in picks])):
        out[i] = ids
    return out


def on_host(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """The tensors on the CPU: those on a device through one copy together (a copy each would wait on the device once
    per request)."""
    away = [i for i, t in enumerate(tensors) if t.device.type != "cpu"]
    if not away:
        return tensors
    out = list(tensors)
    flat = torch.cat([tensors[i].reshape(-1) for i in away]).cpu()
    for i, part in zip(away, flat.split([tensors[i].numel() for i in away])):
        out[i] = part.reshape(tensors[i].shape)
    return out


class TargetCaches:
    """A `TargetModel` (or `SSMTargetModel`: the same calls) and the caches of the requests it serves, driven by
    `StepWork` (one rank's side too)."""

    def __init__(self, target: TargetModel):
        self.target = target
        self.caches: dict[str, TargetCache] = {}
        self.chunks: dict[int, object] = {}  # cached prompt chunks by block: K/V rows, or an SSM's state after them

    def run(self, work: StepWork) -> list[torch.Tensor | None]:
        self.target.commit_many([(self._cache(request_id), keep) for request_id, keep in work.commits])
        for request_id in work.releases:
            cache = self.caches.pop(request_id, None)
            if cache is not None:
                self.target.release(cache)
        for request_id, capacity in work.allocations:
            if request_id in self.caches:
                raise ValueError(f"request {request_id!r} already has a cache")
            self.caches[request_id] = self.target.new_cache(capacity)
        for request_id, capacity in work.resizes:
            self.target.resize(self._cache(request_id), capacity)
        for request_id, blocks in work.loads:
            cache = self._cache(request_id)
            for block in blocks:
                self.target.load_chunk(cache, self._chunk(block))
        for block in work.drops:
            self.chunks.pop(block, None)
        logits = []
        if work.segments:
            segments = [
                Segment(self._cache(s.request_id), s.tokens, None if s.paths is None else tree_from_paths(s.paths))
                for s in work.segments
            ]
            logits = row_argmaxes(work.segments, self.target.forward_batch(segments))
        for request_id, start, end, block in work.saves:
            self.chunks[block] = self.target.save_chunk(self._cache(request_id), start, end)
        return logits

    def _chunk(self, block: int):
        rows = self.chunks.get(block)
        if rows is None:
            raise KeyError(f"the target holds no cached chunk {block}")
        return rows

    def _cache(self, request_id: str) -> TargetCache:
        cache = self.caches.get(request_id)
        if cache is None:
            raise KeyError(f"the target holds no cache for request {request_id!r}")
        return cache

    def reset(self) -> None:
        for cache in self.caches.values():
            self.target.release(cache)
        self.caches.clear()
        self.chunks.clear()


class LocalTarget(TargetCaches):
    """The target in this process (tp_size 1, or any model loaded here)."""

    @property
    def vocab_size(self) -> int:
        return self.target.vocab_size

    @property
    def max_context(self) -> int:
        return self.target.max_context

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self.target.eos_token_ids

    @property
    def state_rows(self) -> int:
        """KV rows each request's fixed state is charged (an SSM target's; 0 for attention targets)."""
        return getattr(self.target, "state_rows", 0)

    @property
    def kv_pool(self) -> dict[str, int] | None:
        """The target's KV pool's state (models/target/kv_pool.py), None where its caches are their own."""
        return getattr(self.target, "kv_pool_stats", None)

