"""The scheduler's KV budget and its prompts' prefill: grants, the prefix cache's room, each step's chunks.

Every request has a reservation, the KV rows it can ever need (`Scheduler.check`: prompt + max_new_tokens + its
largest verify), and a grant, the rows its cache holds now. With `SchedulerConfig.kv_grow` off, the grant is the
reservation from admission on. With it on (the default), a request is granted twice what its prompt and first round
need at admission (or just that, where twice does not fit), and more as it decodes (`grow`: doubling, as a growing
buffer does, or just what its next round needs). A chat request without max_tokens reserves the rest of the
context, yet most stop long before: counting reservations would cap the requests in flight at budget / context,
counting grants caps them at what they hold.

What keeps that safe without preempting anybody (vLLM preempts and recomputes; a recomputed cache is not the same
bits as the decoded one, so greedy tokens could change): a grant is made only where the banker's check still passes
(`safe`): in some order every request can grow to its reservation and finish, each freeing its rows for the next. One
that cannot grow this step skips its round and keeps its cache (`Scheduler.step`: nothing is admitted while one
waits), and a request that can always exists, so every admitted request finishes, and the granted rows never exceed
the budget. Cached prompt chunks (engine/prefix_cache.py) live in what no request was granted, and are evicted, least
recently used first, whenever a grant needs their room (`make_room`).

Each step, `plan` picks the prefill chunks that run beside the rounds: oldest request first, within the rows the
rounds leave (always at least one chunk), each cut at a fixed multiple of
`prefill_chunk` from its prompt's start, so that its K/V never depend on what else shares the step (batch
invariance, and a cached chunk is the same bits as a computed one). A request whose last chunk runs has its first
round in the same step (`Scheduler.step`): its `chunk_end` is then its last prompt token, the round's root.

Requests are the scheduler's (`request.Request`): this module reads their tokens and moves their `prefilled`,
`prefix_key`, `chunk_end` and `chunk_rows`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable

import torch

from ray_specdec.engine.prefix_cache import ROOT, PrefixIndex, chunk_key
from ray_specdec.engine.target_backend import SegmentSpec, StepWork

if TYPE_CHECKING:
    from ray_specdec.engine.request import Request


class PrefillPlan:
    """KV rows granted to running requests, the prefix cache beside them, and the prefill chunks of each step."""

    def __init__(self, budget: int, chunk: int, prefix_cache: bool, grow: bool = True):
        self.budget = budget  # KV rows in all (SchedulerConfig.kv_budget_tokens)
        self.grow_kv = grow  # grants grow as requests decode (SchedulerConfig.kv_grow), else reservations whole
        self.chunk = chunk  # prompts are cut at multiples of this (SchedulerConfig.prefill_chunk)
        self.reserved = 0  # KV rows granted to running requests (their caches' capacities)
        self.prefix = PrefixIndex(chunk) if prefix_cache else None  # cached prompt chunks

    def fits_now(self, rows: int) -> bool:
        """Whether `rows` more can be granted now (cached prompt chunks make way: `make_room`)."""
        return self.reserved + rows <= self.budget

    def safe(self, running: Iterable[Request], joining: Request | None = None) -> bool:
        """The banker's check over the running requests (and `joining`, with its first grant): whether, in some
        order, each can grow from its grant to its reservation while the ones before it have finished and freed
        theirs. Cached prompt chunks count as free: they make way for grants."""
        free = self.budget - self.reserved - (joining.granted if joining is not None else 0)
        requests = [*running, joining] if joining is not None else running
        for need, held in sorted((r.reserved - r.granted, r.granted) for r in requests):
            if need > free:
                return False
            free += held
        return True

    @staticmethod
    def needed(r: Request) -> int:
        """KV rows r's cache needs for its next round: its context and its largest verify (at most its reservation)."""
        verify = r.reserved - r.prompt_len - r.params.max_new_tokens
        return min(r.reserved, len(r.tokens) - 1 + verify)

    def first_grants(self, r: Request) -> tuple[int, ...]:
        """The KV rows r may be granted at admission, most first: its whole reservation (kv_grow off), else twice what
        its prompt and first round need (its first rounds grow into it without a copy), else just that."""
        if not self.grow_kv:
            return (r.reserved,)
        needed = self.needed(r)
        return tuple(dict.fromkeys((min(r.reserved, 2 * needed), needed)))

    def room(self, r: Request, running: Iterable[Request], work: StepWork) -> bool:
        """Whether r's cache holds its next round, grown where it must (doubled, else just enough, if granted)."""
        needed = self.needed(r)
        if needed <= r.granted:
            return True
        return self.grow(r, dict.fromkeys((min(r.reserved, max(needed, 2 * r.granted)), needed)), running, work)

    def can_admit(self, r: Request, running: Iterable[Request], work: StepWork) -> bool:
        """Whether one of r's first grants (most first) fits now (cached chunks evicted for it) and leaves every
        request able to finish; r.granted is then that one."""
        for grant in self.first_grants(r):
            r.granted = grant  # (not counted in `reserved` before `admit`)
            if self.safe(running, r) and self.make_room(grant, work):
                return True
        return False

    def grow(self, r: Request, capacities: Iterable[int], running: Iterable[Request], work: StepWork) -> bool:
        """Grant r the first of `capacities` (rows, above its grant) that fits now and keeps every request able to
        finish; its cache grows with `work` -> whether one was granted."""
        held = r.granted
        for capacity in capacities:
            r.granted, self.reserved = capacity, self.reserved + capacity - held
            if self.safe(running) and self.make_room(0, work):
                work.resizes.append((r.request_id, capacity))
                return True
            r.granted, self.reserved = held, self.reserved - capacity + held
        return False

    def make_room(self, rows: int, work: StepWork) -> bool:
        """Evict cached prompt chunks (least recently used first) until `rows` more fit the budget beside them ->
        whether they fit."""
        if not self.fits_now(rows):
            return False
        while self.prefix is not None and self.reserved + self.prefix.rows + rows > self.budget:
            dropped = self.prefix.evict()
            if dropped is None:
                return False
            work.drops += dropped
        return True

    def admit(self, r: Request, work: StepWork) -> None:
        """r's first grant is taken (`can_admit` said it fits); with the prefix cache, the cached chunks its prompt
        starts with are copied into its cache."""
        self.reserved += r.granted
        work.allocations.append((r.request_id, r.granted))
        if self.prefix is not None and r.prefilled == 0:
            self.prefix.queried_rows += len(r.tokens) - 1
            self.load_cached(r, work)

    def release(self, r: Request) -> None:
        self.reserved -= r.granted

    def reset(self, running) -> StepWork:
        """The target lost every cache: the cached chunks are gone and every running request prefills again from
        its first token -> the work that allocates their caches anew."""
        if self.prefix is not None:
            self.prefix.clear()
        work = StepWork()
        for r in running:
            r.prefilled, r.prefix_key = 0, ROOT
            work.allocations.append((r.request_id, r.granted))
        return work

    def load_cached(self, r: Request, work: StepWork) -> None:
        """Copy the cached chunks that continue r's prefill into its cache (with `work`), and skip their rows."""
        hit = self.prefix.match(r.tokens, len(r.tokens) - 1, r.prefilled, r.prefix_key)
        if hit.block_ids:
            work.loads.append((r.request_id, tuple(hit.block_ids)))
            r.prefilled, r.prefix_key = r.prefilled + hit.rows, hit.key
            r.stats.cached_tokens += hit.rows

    def plan(self, prefilling: list[Request], work: StepWork, budget: int) -> int:
        """Prefill chunks for this step, oldest request first, within `budget` rows (at least one chunk) -> the
        rows planned. With the prefix cache: chunks cached since a request's last step are copied instead, and a
        chunk that another request computes in this step is left to it (the same prompt admitted twice: `n`
        choices, retries), to be copied in the next one."""
        rows, size = 0, self.chunk
        for r in prefilling:
            if self.prefix is not None:
                self.load_cached(r, work)
            end = min((r.prefilled // size + 1) * size, len(r.tokens) - 1)
            n = end - r.prefilled
            computed_by_another = self.prefix is not None and n and self._pending(r, end)
            if (rows and rows + n > budget) or computed_by_another or n == 0:
                r.chunk_end, r.chunk_rows = r.prefilled, 0
                continue
            work.segments.append(SegmentSpec(r.request_id, torch.tensor(r.tokens[r.prefilled:end])))
            if self.prefix is not None:
                self._cache_chunk(r, work, r.prefilled, end)
            r.chunk_end, r.chunk_rows = end, n
            rows += n
        return rows

    def _pending(self, r: Request, end: int) -> bool:
        """Whether r's next chunk (up to `end`) is being computed by another request in this step."""
        return chunk_key(r.prefix_key, tuple(r.tokens[r.prefilled:end])) in self.prefix.pending

    def _cache_chunk(self, r: Request, work: StepWork, start: int, end: int) -> None:
        """Keep the prefill chunk [start, end) of r after this step's forward, where the budget has room for it."""
        tokens = tuple(r.tokens[start:end])
        parent, r.prefix_key = r.prefix_key, chunk_key(r.prefix_key, tokens)
        cachable = r.prefix_key not in self.prefix.entries and (parent == ROOT or parent in self.prefix.entries)
        if cachable and self.make_room(end - start, work):
            added = self.prefix.add(parent, tokens)  # None if making room evicted its parent
            if added is not None:
                work.saves.append((r.request_id, start, end, added[1]))

