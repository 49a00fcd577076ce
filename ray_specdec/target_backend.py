"""The scheduler's target side: one call per step (`run(StepWork)`), in process or fanned out to tensor-parallel ranks.

A step's work for the target is everything it must do to its caches, in order: keep the accepted rows of the
previous step's verifies (commits ride on the next step's call), free the caches of requests that ended, allocate
caches of newly admitted ones (their KV budget, preallocated once), then one batched forward over every segment of
the step. `LocalTarget` does that on a `TargetModel` in this process; a rank of a tensor-parallel group does exactly the
same on its shard (serving/target_worker.py), so a whole step crosses to the ranks in one call, never one per request.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from ray_specdec.models.target import Segment, TargetCache, TargetModel
from ray_specdec.drafting import tree_from_paths


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
    commits: list[tuple[str, tuple[int, ...]]] = field(default_factory=list)  # (request id, verify rows kept)
    segments: list[SegmentSpec] = field(default_factory=list)

    def clear(self) -> None:
        self.releases, self.allocations, self.commits, self.segments = [], [], [], []


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


class TargetCaches:
    """A `TargetModel` and the KV caches of the requests it serves, driven by `StepWork` (one rank's side too)."""

    def __init__(self, target: TargetModel):
        self.target = target
        self.caches: dict[str, TargetCache] = {}

    def run(self, work: StepWork) -> list[torch.Tensor | None]:
        for request_id, keep in work.commits:
            self.target.commit(self._cache(request_id), keep)
        for request_id in work.releases:
            self.caches.pop(request_id, None)
        for request_id, capacity in work.allocations:
            if request_id in self.caches:
                raise ValueError(f"request {request_id!r} already has a cache")
            self.caches[request_id] = self.target.new_cache(capacity)
        if not work.segments:
            return []
        segments = [
            Segment(self._cache(s.request_id), s.tokens, None if s.paths is None else tree_from_paths(s.paths))
            for s in work.segments
        ]
        logits = self.target.forward_batch(segments)
        return [x.argmax(dim=-1) if x is not None and s.argmax_only else x for s, x in zip(work.segments, logits)]

    def _cache(self, request_id: str) -> TargetCache:
        cache = self.caches.get(request_id)
        if cache is None:
            raise KeyError(f"the target holds no cache for request {request_id!r}")
        return cache

    def reset(self) -> None:
        self.caches.clear()


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

