"""The scheduler's drafting side: where a step's drafts come from (`drafters=local|remote`).

`Drafters` is what the scheduler asks: a drafter handle per admitted request (`open`: `request.drafter`, which takes
the request's verdicts and its end), the drafts of a step's drafting requests in one batch (`draft`), and what pricing
needs (`prefill_window`, `prefill_tokens`, `timings`).

- `LocalDrafters`: the drafter in the engine's own process. Each request holds a `LazyDrafter`; a step brings every
  drafting request's session up to date (`ready_many`: first prefills, then the waiting verdicts in one commit) and
  drafts them in one batch (`draft_many`).
- `RemoteDrafters`: drafter workers elsewhere (speculation/drafter_worker.py; the `drafter` Serve deployment). A
  request hashes into one of `shards`; its state lives on the worker its shard was last sent to. A step sends one
  `DraftCall` per worker, with every drafting request whose shard lives there (shards not placed yet go one call
  each, and the reply says which worker took them). Each request's item carries its verdicts since its last draft,
  or every token id where the worker may lack its state. A failed, timed-out or refused call, and a worker that
  lacks a request's state, cost that round its draft: it runs undrafted (with its prompt-lookup proposal where it
  may have one), never fails, and its tokens go with its next draft call, where the state is rebuilt.

Shards follow a growing pool: a shard's calls go by its route (the shard, plus `shards` times its epoch), and the
transport places a route not placed yet on the worker that holds the fewest (Serve's multiplexed routing does), so a
worker added later would draft only shards placed after it started. Where the transport counts its workers
(`DrafterTransport.replicas`), every `rebalance_s` the shards beyond an even share (ceil(placed / workers)) on each
worker take their next epoch: a route of their own, placed anew (less often while moves do not even them out). Their
requests' states go to the new worker with their tokens in the next call (a prefill there, no undrafted round), and
their sessions on the old worker are released with its next call.

With `overlap`, right after a step's drafts a second call per worker asks it to draft each request's next round
ahead, while the target verifies this one (speculation/drafter_worker.py: from the likeliest path of the draft just
sent, assumed accepted whole, and the drafter's own pick of the bonus token). Where a verdict brings exactly the
assumed tokens and the controller picks the same tree, the next round's draft is that one and costs no call; else it
is dropped and the round drafts as usual. Only what the target verifies is ever emitted either way.

Transports (`DrafterTransport`) carry the calls: deployments/drafter.py through Serve handles (each call routed by
its first shard's route with Serve's model multiplexing, so that a shard stays on one replica), tests in-process.
"""

from __future__ import annotations

import time
import zlib
from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence

from ray_specdec.config import TreeConfig
from ray_specdec.models.drafter.mamba_state import StateSlots
from ray_specdec.speculation.acceptance import Verdict
from ray_specdec.speculation.controller import drafter_timings
from ray_specdec.speculation.drafter_cache import DrafterStates
from ray_specdec.speculation.drafter_sessions import LazyDrafter, ready_many
from ray_specdec.speculation.drafter_worker import DraftCall, DraftItem, DraftReply
from ray_specdec.speculation.drafting import Draft, DraftRequest, draft_many, prefill_key

REBALANCE_S = 5.0  # RemoteDrafters: how often shards may move to even out the workers' shares, seconds


class Drafters:
    """The drafting side of a scheduler (see the module docstring); requests are engine/request.py `Request`s."""

    prefill_window: int | None  # a request's drafter state starts from its last this many tokens (None: all)

    def open(self, request) -> Any:
        """The drafter handle of an admitted request (`request.drafter`): `commit(verdict)`, `close()`, `started`."""
        raise NotImplementedError

    def draft(self, requests: Sequence, configs: Sequence[TreeConfig],
              min_path_prob: float) -> list[tuple[Draft | None, float]]:
        """One step's drafts of `requests` (each drafts `configs[i]`) -> per request (its draft, or None where it
        runs undrafted this step; seconds of a drafter prefill it paid)."""
        raise NotImplementedError

    def prefill_tokens(self, tokens: Sequence[int]) -> int:
        """Tokens a first prefill over `tokens` runs (0 where the state is kept)."""
        return min(len(tokens), self.prefill_window) if self.prefill_window else len(tokens)

    def timings(self) -> tuple[float, float, float, float]:
        """Seconds of a drafter step at 1 and 16 rows, a catch-up over two tokens, a prefill over 64."""
        raise NotImplementedError

    def ahead(self, requests: Sequence, configs: Sequence[TreeConfig]) -> None:
        """The step's drafts are out and the target verifies them now: draft each request's next round (`configs`)
        ahead where that can overlap. Nothing here: in one process the target's forward takes the cores."""


class LocalDrafters(Drafters):
    """The drafter in this process: every request's `LazyDrafter`, one `ready_many` and one `draft_many` a step."""

    def __init__(self, drafter, vocab_size: int, states: DrafterStates | None, slots: StateSlots | None):
        """states: the drafter's prefix cache; slots: the pool the drafting requests' root states live in."""
        self.drafter, self.vocab_size, self.states, self.slots = drafter, vocab_size, states, slots

    @property
    def prefill_window(self) -> int | None:
        return self.drafter.prefill_window

    def open(self, request) -> LazyDrafter:
        return LazyDrafter(self.drafter, self.vocab_size, self.states, self.slots)

    def draft(self, requests, configs, min_path_prob):
        # every drafting request's waiting verdicts through the drafter together, first prefills one by one
        seconds = ready_many([(r.drafter, r.tokens) for r in requests])
        batch = [DraftRequest(r.drafter.session, c, r.params, r.draft_gen, r.noise) for r, c in zip(requests, configs)]
        return list(zip(draft_many(batch, min_path_prob), seconds))

    def prefill_tokens(self, tokens):
        if self.states is not None and self.states.holds(self.drafter, prefill_key(self.drafter, tokens)):
            return 0
        return super().prefill_tokens(tokens)

    def timings(self):
        return drafter_timings(self.drafter)


class DrafterTransport(Protocol):
    """How `RemoteDrafters` reaches its workers."""

    def submit(self, route: int, call: DraftCall) -> Any:
        """Start `call` on the worker that holds `route` (a shard's, `RemoteDrafters._submit`), or on the worker that
        holds the fewest routes where none does -> a pending reply."""

    def collect(self, pending: Sequence[Any], timeout_s: float) -> list[tuple[str, list[DraftReply]] | BaseException]:
        """Wait for the pending replies, all within `timeout_s` -> per call (the worker's id, its replies), or the
        exception that ended it (a timeout included)."""

    def timings(self, timeout_s: float) -> tuple[float, float, float, float]:
        """A worker's `DrafterWorker.timings()`."""

    # optional: `replicas() -> int | None`, the workers running now (None: not known); without it shards never move;
    # `loads() -> {worker: {metric: value}}`, the workers' recent load, shown in `RemoteDrafters.summary`


@dataclass
class RemoteDrafter:
    """A request's drafter on a worker, as its engine knows it (`request.drafter` under `RemoteDrafters`)."""

    request_id: str
    shard: int
    owner: RemoteDrafters
    synced: bool = False  # its worker holds its state, as of `verdicts` (else: send every token next time)
    open_round: bool = False  # verdicts[0] judges the worker's last draft for it
    verdicts: list[Verdict] = field(default_factory=list)  # rounds judged since its last draft
    adopt: bool = False  # its last round used the worker's draft ahead: say so with the next item
    early: tuple[Draft, tuple[int, ...], TreeConfig] | None = None  # a draft ahead: it, its assumed tokens, its tree
    worker: str | None = None  # the worker that holds its state (while synced)

    @property
    def started(self) -> bool:
        """Whether a state is held for it (else its next draft pays a prefill)."""
        return self.synced

    def commit(self, verdict: Verdict) -> None:
        if self.synced:
            self.verdicts.append(verdict)

    def close(self) -> None:
        """The request ended: its session goes with the next call to its worker."""
        if self.synced:
            self.owner.releases.setdefault(self.worker, []).append(self.request_id)

    def drafted(self, worker: str, adopted: bool = False) -> None:
        self.synced, self.open_round, self.verdicts, self.adopt = True, True, [], adopted
        self.worker = worker

    def lost(self) -> None:
        self.synced, self.open_round, self.verdicts, self.adopt = False, False, [], False


class RemoteDrafters(Drafters):
    """Drafts from drafter workers over a transport: one call per worker per step (see the module docstring)."""

    def __init__(self, transport: DrafterTransport, vocab_size: int, prefill_window: int | None,
                 shards: int = 16, timeout_s: float = 5.0, overlap: bool = False, rebalance_s: float = REBALANCE_S):
        """prefill_window: the workers' drafter's (resolved: drafter_prefill_window); shards: requests hash into
        this many; timeout_s: a step's calls not answered by then leave their rounds undrafted; overlap: draft the
        next rounds ahead while the target verifies; rebalance_s: how often shards may move to even out the
        workers' shares (the module docstring)."""
        self.transport, self.vocab_size, self.prefill_window = transport, vocab_size, prefill_window
        self.shards, self.timeout_s, self.rebalance_s = shards, timeout_s, rebalance_s
        self.homes: dict[int, str] = {}  # shard -> the worker its states were last sent to
        self.epochs: dict[int, int] = {}  # shard -> how often it moved (its route: shard + shards * epoch)
        self.releases: dict[str, list[str]] = {}  # worker -> ended or moved requests whose sessions it still holds
        self.overlap = overlap
        self.calls = self.failed_calls = self.missing = self.drafts = self.moved_shards = 0
        self._rebalanced = time.monotonic()
        self._backoff, self._most = 1, None  # rebalance_s's multiple now; the most shards on a worker at the last move
        self.ahead_hits = self.ahead_misses = 0  # rounds that used a draft ahead, and drafts ahead dropped
        self._pending_ahead: list[tuple[list[RemoteDrafter], list[TreeConfig], Any]] = []
        self._min_path_prob = 0.0

    def open(self, request) -> RemoteDrafter:
        return RemoteDrafter(request.request_id, zlib.crc32(request.request_id.encode()) % self.shards, self)

    def draft(self, requests, configs, min_path_prob):
        self._min_path_prob = min_path_prob
        self._rebalance()
        early = self._collect_ahead()
        out: list[tuple[Draft | None, float]] = [(None, 0.0)] * len(requests)
        groups: dict[Any, list[int]] = {}  # a worker (or a shard not placed yet) -> its requests, in order
        for i, r in enumerate(requests):
            drafter = r.drafter
            if drafter.synced and drafter.worker != self.homes.get(drafter.shard):  # its shard moved
                self.releases.setdefault(drafter.worker, []).append(drafter.request_id)
                drafter.lost()
            draft = _early_draft(drafter, configs[i]) if drafter.early is not None else None
            if draft is not None:
                out[i] = (draft, 0.0)
                drafter.drafted(drafter.worker, adopted=True)
                self.ahead_hits += 1
                continue
            groups.setdefault(self._home(drafter.shard), []).append(i)
        calls = []
        for key, members in groups.items():
            shards = sorted({requests[i].drafter.shard for i in members})
            releases = tuple(self.releases.pop(key, ())) if isinstance(key, str) else ()
            items = tuple(_item(requests[i], configs[i]) for i in members)
            calls.append((members, shards, self._submit(shards[0], DraftCall(items, self.vocab_size, min_path_prob,
                                                                             releases))))
        self.calls += len(calls)
        for drafter in early:
            self.ahead_misses += drafter.early is not None and not drafter.adopt
            drafter.early = None
        for (members, shards, _), result in zip(calls, self._collect(calls)):
            if isinstance(result, BaseException):  # the worker died, hung or refused: its states count as gone
                self.failed_calls += 1
                for s in shards:
                    self.homes.pop(s, None)
                for i in members:
                    requests[i].drafter.lost()
                continue
            worker, replies = result
            for s in shards:
                self.homes[s] = worker
            for i, reply in zip(members, replies):
                drafter = requests[i].drafter
                if reply.draft is None:
                    self.missing += 1
                    drafter.lost()
                else:
                    self.drafts += 1
                    drafter.drafted(worker)
                out[i] = (reply.draft, reply.prefill_s)
        homing = set(self.homes.values())
        for worker in [w for w in self.releases if w not in homing]:  # no call goes there: its LRU drops them
            del self.releases[worker]
        return out

    def _rebalance(self) -> None:
        """Every `rebalance_s` (doubled, up to 16 times, while a move did not even the shards out): where a worker
        holds more than ceil(placed / workers) of these shards, those beyond take their next epoch (a route of their
        own, placed anew: the module docstring). Their requests move with their next call."""
        now = time.monotonic()
        count = getattr(self.transport, "replicas", None)
        if count is None or now - self._rebalanced < self.rebalance_s * self._backoff:
            return
        self._rebalanced = now
        workers = count()
        by_worker: dict[str, list[int]] = {}
        for shard, worker in sorted(self.homes.items()):
            by_worker.setdefault(worker, []).append(shard)
        share = -(-len(self.homes) // workers) if workers and workers >= 2 else 0
        most = max(map(len, by_worker.values()), default=0)
        if not share or most <= share:
            self._backoff, self._most = 1, None
            return
        if self._most is not None and most >= self._most:  # the last move did not help (routes placed back)
            self._backoff = min(16, 2 * self._backoff)
        self._most = most
        for shards in by_worker.values():
            for shard in shards[share:]:
                del self.homes[shard]
                self.epochs[shard] = self.epochs.get(shard, 0) + 1
                self.moved_shards += 1

    def _home(self, shard: int) -> Any:
        """Where a call for `shard` goes: the worker its states were last sent to, or the shard itself (not placed
        yet: a call of its own, and the reply says which worker took it)."""
        return self.homes.get(shard, ("shard", shard))

    def _submit(self, shard: int, call: DraftCall) -> Any:
        """`call` sent toward `shard`'s worker (by its route) -> a pending reply, or `_Failed` where it could not
        leave (no replica, a handle gone): collected as a failed call."""
        try:
            return self.transport.submit(shard + self.shards * self.epochs.get(shard, 0), call)
        except Exception as exc:
            return _Failed(exc)

    def _collect(self, calls) -> list:
        """Each call's (worker, replies) or exception (a call that could not be sent: its exception)."""
        sent = [(i, pending) for i, (*_, pending) in enumerate(calls) if not isinstance(pending, _Failed)]
        results: list = [pending.exc if isinstance(pending, _Failed) else None for *_, pending in calls]
        for (i, _), result in zip(sent, self.transport.collect([p for _, p in sent], self.timeout_s) if sent else []):
            results[i] = result
        return results

    def ahead(self, requests, configs):
        if not self.overlap:
            return
        groups: dict[Any, list[int]] = {}
        for i, r in enumerate(requests):
            if r.drafter.synced and r.drafter.open_round:
                groups.setdefault(self._home(r.drafter.shard), []).append(i)
        for members in groups.values():
            drafters = [requests[i].drafter for i in members]
            items = tuple(_item(requests[i], configs[i]) for i in members)
            pending = self._submit(drafters[0].shard, DraftCall(items, self.vocab_size, self._min_path_prob,
                                                                 ahead=True))
            for drafter in drafters:
                drafter.adopt = False  # said with this call
            self._pending_ahead.append((drafters, [configs[i] for i in members], pending))

    def _collect_ahead(self) -> list[RemoteDrafter]:
        """The drafts ahead sent last step, into their requests' `early` -> those requests. A failed call leaves
        its requests' states unknown: rebuilt with their next call."""
        calls, self._pending_ahead = self._pending_ahead, []
        touched = []
        for (drafters, configs, _), result in zip(calls, self._collect(calls)):
            touched += drafters
            if isinstance(result, BaseException):
                self.failed_calls += 1
                for drafter in drafters:
                    drafter.lost()
                continue
            for drafter, config, reply in zip(drafters, configs, result[1]):
                if reply.draft is not None:
                    drafter.early = (reply.draft, reply.assumed, config)
        return touched

    def timings(self):
        """The workers' drafter's timings, each with a call's round trip added to the catch-up (a drafting step's
        fixed cost); zeros where no worker answers (the step cost model then learns drafting's cost from steps)."""
        try:
            step_1, step_16, catch_up, prefill_64 = self.transport.timings(self.timeout_s)
            t0 = time.perf_counter()
            reply = self.transport.collect([self.transport.submit(0, DraftCall((), self.vocab_size))], self.timeout_s)
            round_trip = 0.0 if isinstance(reply[0], BaseException) else time.perf_counter() - t0
        except Exception:
            return 0.0, 0.0, 0.0, 0.0
        return step_1, step_16, catch_up + round_trip, prefill_64

    def summary(self) -> dict:
        out = {"drafter_calls": self.calls, "drafts": self.drafts, "drafter_failed_calls": self.failed_calls,
               "drafter_missing_states": self.missing, "drafter_workers": sorted(set(self.homes.values())),
               "drafter_moved_shards": self.moved_shards, "ahead_hits": self.ahead_hits,
               "ahead_misses": self.ahead_misses}
        loads = getattr(self.transport, "loads", None)  # the workers' own (deployments/drafter.py), where it says
        return out if loads is None else out | {"drafter_loads": loads()}


def _early_draft(drafter: RemoteDrafter, config: TreeConfig) -> Draft | None:
    """Its draft ahead as this round's draft of `config`, where it is one: the one verdict since brought exactly the
    assumed tokens, and `config` is the tree drafted ahead or its first depths (a request near its end: its rows are
    the first rows of the tree drafted, in BFS order, so the worker's commit reads them alike); else None."""
    draft, assumed, drafted = drafter.early
    if not (drafter.synced and len(drafter.verdicts) == 1 and tuple(drafter.verdicts[0].new_tokens) == assumed):
        return None
    if config == drafted:
        return draft
    plain = draft.paths is None and draft.q_rows is None and draft.requested is None and not draft.config.lookup
    if not (plain and config.depth and not config.lookup and config.branching == draft.config.branching[:config.depth]):
        return None
    parents = 1 + TreeConfig(config.branching[:-1]).num_nodes  # rows with children: the root and all but the leaves
    probs = None if draft.probs is None else draft.probs[:parents]
    return Draft(config, draft.tokens[: config.num_nodes], probs)


@dataclass
class _Failed:
    """A call that could not be sent."""

    exc: Exception


def _item(r, config: TreeConfig) -> DraftItem:
    """Request r's part of a call: its verdicts since its last draft, or every token where its worker may lack it."""
    drafter: RemoteDrafter = r.drafter
    noise = (r.noise.seed, r.noise.choice) if r.noise is not None else None
    if drafter.synced:
        return DraftItem(r.request_id, len(r.tokens), config, r.params, tuple(drafter.verdicts), drafter.open_round,
                         noise=noise, adopt=drafter.adopt)  # fmt: skip
    return DraftItem(r.request_id, len(r.tokens), config, r.params, tokens=tuple(r.tokens), noise=noise,
                     draft_seed=r.draft_gen.initial_seed())  # fmt: skip
