"""The drafter side of serving, without Ray: one MambaDrafter and the per-request drafting state of many requests.

A request's state is a `DrafterSession` (root state and the open round's per-depth states) plus its draft random
generator. The router's commit of round k rides on its draft call of round k + 1, followed by the verdicts of any
rounds it ran without drafting (their bonus tokens go through the drafter in one pass, far cheaper than a rebuild). A worker that lacks the request's
state (a new or restarted replica, an evicted session) answers None; the router then calls again with every token so
far, and the state is rebuilt by prefill. States are bounded: least recently used sessions are evicted beyond
`max_sessions`, and sessions idle for `idle_timeout_s` are dropped (a client that vanished without a release).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from ray_specdec.acceptance import Verdict
from ray_specdec.config import SamplingParams, TreeConfig
from ray_specdec.drafting import Draft, DrafterSession
from ray_specdec.engine import make_generators
from ray_specdec.models.mamba_drafter import MambaDrafter


def _on_cpu(draft: Draft) -> Draft:
    """The draft as it crosses to the router: tensors on the CPU. Ray pickles a CUDA tensor with its device, and a
    router without that GPU (a CPU node, or a GPU node's process that was given none) could not unpickle it."""
    if draft.tokens.device.type == "cpu" and (draft.probs is None or draft.probs.device.type == "cpu"):
        return draft
    probs = None if draft.probs is None else draft.probs.cpu()
    return dataclasses.replace(draft, tokens=draft.tokens.cpu(), probs=probs)


@dataclass
class _Entry:
    session: DrafterSession
    generator: torch.Generator  # the request's draft random stream
    last_used: float
    drafted: bool = False  # a draft is open: the next call must carry its commit


class DrafterWorker:
    """Per-request drafting over one drafter. Thread-safe: calls for different requests may run concurrently."""

    def __init__(
        self,
        drafter: MambaDrafter,
        vocab_size: int,
        max_sessions: int = 1024,
        idle_timeout_s: float = 600.0,
        clock: Callable[[], float] = time.monotonic,
        min_path_prob: float = 0.0,
    ):
        if max_sessions < 1 or idle_timeout_s <= 0:
            raise ValueError("max_sessions must be >= 1 and idle_timeout_s > 0")
        self.drafter = drafter
        self.vocab_size = vocab_size  # the target's: draft distributions live in its vocabulary
        self.max_sessions = max_sessions
        self.idle_timeout_s = idle_timeout_s
        self.min_path_prob = min_path_prob  # see DrafterSession.draft
        self._clock = clock
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        self._lock = threading.Lock()
        self.rebuilds = 0  # sessions built from token ids (first calls and recoveries)
        self.evictions = 0

    @property
    def num_sessions(self) -> int:
        return len(self._entries)

    def draft(
        self,
        request_id: str,
        commits: Sequence[Verdict],
        config: TreeConfig,
        params: SamplingParams,
        seed: int | None,
        token_ids: Sequence[int] | None = None,
    ) -> Draft | None:
        """Apply the verdicts since the last draft, then draft a tree; None if this worker lacks the request's state.

        commits: the verdict of the open draft's round first, then those of rounds verified without a draft (no
        accepted rows). With token_ids (every token so far: prompt + generated) the state is rebuilt by prefill and
        commits are ignored: those tokens already include them.
        """
        if token_ids is not None:
            entry = self._build(request_id, token_ids, seed)
        else:
            if any(v.accepted_rows for v in commits[1:]):
                raise ValueError("only the first commit may accept draft rows: later rounds had no draft")
            entry = self._take(request_id, bool(commits))
            if entry is None:
                return None
            entry.session.commit_all(commits)
        draft = entry.session.draft(config, params, entry.generator, self.min_path_prob)
        entry.drafted = True
        return _on_cpu(draft)

    def release(self, request_id: str) -> None:
        with self._lock:
            self._entries.pop(request_id, None)

    def _build(self, request_id: str, token_ids: Sequence[int], seed: int | None) -> _Entry:
        if len(token_ids) == 0:
            raise ValueError("token_ids must hold at least one token")
        draft_gen, _ = make_generators(seed)
        entry = _Entry(DrafterSession(self.drafter, token_ids, self.vocab_size), draft_gen, self._clock())
        with self._lock:
            self._entries[request_id] = entry
            self._entries.move_to_end(request_id)
            self.rebuilds += 1
            self._evict()
        return entry

    def _take(self, request_id: str, has_commits: bool) -> _Entry | None:
        """The request's entry if it exists and can take these commits (some after an open draft, none otherwise)."""
        with self._lock:
            self._evict()
            entry = self._entries.get(request_id)
            if entry is None:
                return None
            if entry.drafted != has_commits:
                # out of step with the router (it cannot happen with a well-behaved router): rebuild instead
                del self._entries[request_id]
                return None
            entry.last_used = self._clock()
            self._entries.move_to_end(request_id)
            return entry

    def _evict(self) -> None:
        """Drop idle sessions, then the least recently used ones beyond max_sessions (caller holds the lock)."""
        now = self._clock()
        while self._entries:
            oldest_id, oldest = next(iter(self._entries.items()))
            if len(self._entries) <= self.max_sessions and now - oldest.last_used < self.idle_timeout_s:
                break
            del self._entries[oldest_id]
            self.evictions += 1
