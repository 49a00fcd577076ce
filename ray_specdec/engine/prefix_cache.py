"""Prefix caching: the K/V of prompt chunks kept after their prefill, so that a later request whose prompt starts with
the same tokens copies them instead of computing them again (vLLM's automatic prefix caching, SGLang's radix cache).

Exact by construction. A prompt is prefilled in chunks cut at fixed positions (multiples of `prefill_chunk` from its
start; the last one ends before the prompt's last token, the first root), and each chunk runs its own forward
(`TargetModel._prefill_chunks`: alone, or beside other requests' chunks through batch-invariant operations): a
chunk's K/V are a function of the K/V before it, its tokens and its bounds, nothing
else. A cached chunk is therefore bit for bit what a new request would compute itself exactly when that request cuts
the same chunk after the same tokens. The index keys each chunk by its whole token prefix (a chain: parent chunk +
own tokens) and checks the tokens and the parent on every hit, so a hash collision is a miss, never a wrong hit. A
request's match is the longest run of cached chunks from its start; it prefills the rest as it would have anyway.
Greedy output with the cache is the output without it (tests/engine/test_prefix_cache.py compares logits bit for bit).

What hits: identical prompts (retries, `n` > 1 across requests, repeated benchmark prompts, the same question asked
again) and prompts that share whole chunks (a long document or system prompt followed by different questions). Two
prompts that share fewer than `prefill_chunk` tokens share nothing here: a finer grain needs prefill rows computed the
same whatever the chunk (the native attention over a causal chain), which the prefill path does not do yet.

Memory. A cached chunk is a copy (on every tensor-parallel rank: each keeps its shard), and its rows count against
the scheduler's KV budget beside the requests' grants (engine/kv_manager.py). Cached rows only take budget no request
holds: admission and a request's growth evict the least recently used chunks (a chunk and every chunk after it, which
nothing can reach without it) before a request would wait, and a new chunk is kept only where the budget has room for
it after evictions.

The scheduler owns this index and tells the target what to do through `StepWork` (`loads`, `drops`, `saves`); the
target holds the rows (`target_backend.PrefixStore`).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Iterator, Sequence

ROOT = 0  # the key of the empty prefix


@dataclass
class CachedChunk:
    block_id: int  # the target's name for its rows
    parent: int  # key of the chunk before it (ROOT for a prompt's first chunk)
    tokens: tuple[int, ...]  # its own tokens: rows [start, start + len(tokens)) of every request that hits it
    children: set[int] = field(default_factory=set)

    @property
    def rows(self) -> int:
        return len(self.tokens)


@dataclass
class Match:
    block_ids: list[int]  # chunks to copy into the request's cache, in order
    rows: int  # prompt rows they cover (the request prefills from there)
    key: int  # key of the last chunk matched (ROOT when none)


def chunk_key(parent: int, tokens: tuple[int, ...]) -> int:
    return hash((parent, tokens))


class PrefixIndex:
    """Which prompt chunks the target keeps, in least-recently-used order, and the budget rows they take."""

    def __init__(self, chunk: int):
        if chunk < 1:
            raise ValueError(f"chunk must be >= 1, got {chunk}")
        self.chunk = chunk
        self.entries: OrderedDict[int, CachedChunk] = OrderedDict()  # key -> chunk, least recently used first
        self.rows = 0  # budget rows the cached chunks take
        self.pending: set[int] = set()  # keys saved by the step being planned: not evictable until it is sent
        self.queried_rows = 0  # prompt rows looked up at admission (vLLM's prefix_cache_queries, in tokens)
        self.hit_rows = 0  # of which found cached (at admission, or later while the request prefills)
        self._next_id = 0

    def spans(self, start: int, stop: int) -> Iterator[tuple[int, int]]:
        """The chunks [a, b) that cut rows [start, stop) of a prompt (start on a chunk boundary)."""
        while start < stop:
            end = min((start // self.chunk + 1) * self.chunk, stop)
            yield start, end
            start = end

    def match(self, tokens: Sequence[int], stop: int, start: int = 0, parent: int = ROOT) -> Match:
        """The longest run of cached chunks that cut tokens[start:stop] after the prefix `parent` (the key of
        tokens[:start]; stop: the rows the request prefills). Touches them, last first, so that a prefix outlives
        what follows it."""
        key, found = parent, []
        for start, end in self.spans(start, stop):
            piece = tuple(tokens[start:end])
            entry = self.entries.get(chunk_key(key, piece))
            if entry is None or entry.tokens != piece or entry.parent != key or chunk_key(key, piece) in self.pending:
                break  # (a pending chunk's rows exist only after the forward of the step being planned)
            key = chunk_key(key, piece)
            found.append(key)
        for k in reversed(found):
            self.entries.move_to_end(k)
        rows = sum(self.entries[k].rows for k in found)
        self.hit_rows += rows
        return Match([self.entries[k].block_id for k in found], rows, key)

    def add(self, parent: int, tokens: Sequence[int]) -> tuple[int, int] | None:
        """Cache the chunk `tokens` after the prefix `parent` -> (its key, the target's block id to save it as), or
        None when it is cached already or its parent is not (nothing could reach it). The caller makes room first."""
        piece = tuple(tokens)
        key = chunk_key(parent, piece)
        if key in self.entries or (parent != ROOT and parent not in self.entries):
            return None
        self._next_id += 1
        self.entries[key] = CachedChunk(self._next_id, parent, piece)
        if parent != ROOT:
            self.entries[parent].children.add(key)
        self.rows += len(piece)
        self.pending.add(key)
        return key, self._next_id

    def evict(self) -> list[int] | None:
        """Drop the least recently used evictable chunk and every chunk after it -> their block ids (None when no
        chunk can go)."""
        victim = next((k for k in self.entries if not self._pinned(k)), None)
        if victim is None:
            return None
        parent = self.entries.get(self.entries[victim].parent)
        if parent is not None:
            parent.children.discard(victim)
        dropped, stack = [], [victim]
        while stack:
            entry = self.entries.pop(stack.pop())
            stack.extend(entry.children)
            self.rows -= entry.rows
            dropped.append(entry.block_id)
        return dropped

    def _pinned(self, key: int) -> bool:
        """A chunk saved in the step being planned, or with such a chunk after it, stays until that step is sent."""
        stack = [key]
        while stack:
            k = stack.pop()
            if k in self.pending:
                return True
            stack.extend(self.entries[k].children)
        return False

    def sent(self) -> None:
        """The planned step reached the target: its saves are done."""
        self.pending.clear()

    def unsent(self) -> None:
        """The planned step failed on the target: its saves never happened, so their chunks are not cached."""
        for key in self.pending:
            entry = self.entries.pop(key, None)
            if entry is not None:
                self.rows -= entry.rows
                parent = self.entries.get(entry.parent)
                if parent is not None:
                    parent.children.discard(key)
        self.pending.clear()

    def clear(self) -> None:
        """The target lost its rows (a restarted rank)."""
        self.entries.clear()
        self.pending.clear()
        self.rows = 0
