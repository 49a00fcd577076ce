"""A drafter worker: the drafting side of a step for the requests of other processes (`drafters=remote`).

It holds a `MambaDrafter`, a slot pool of root states and one `DrafterSession` per request, keyed by request id. An
engine sends it one `DraftCall` per step with every request it drafts there: per request, the verdicts of the rounds
since its last draft on this worker (the session catches up on them in one batched commit, as `LazyDrafter` does in
an engine's own process), the tree, the sampling parameters and the keyed noise's seed; or, where the worker may lack
the state, every token id, from which the session is rebuilt. The reply is one `Draft` per request, q included for
rejection-sampled requests, or None where the worker holds no state for a request and was not sent its tokens: the
engine runs that round undrafted and sends the tokens next time.

A session is trusted only where it is exactly what the engine expects: after its verdicts it must hold as many tokens
as the request (`DraftItem.context_len`), and the first verdict may move the root into the last draft's states only if
it judges that draft (`DraftItem.open_round`: a draft whose reply was lost is never the engine's). Anything else drops
the session. An item that would leave its session with fewer tokens than it holds already is a stale call's (one the
engine stopped waiting for, run after a later one): it gets no draft and leaves the session as it is. The engine's
verification keeps output exact whatever a worker proposes; these checks keep drafts good.

Drafting ahead (`DraftCall.ahead`, sent while the target verifies): the worker assumes its last draft's likeliest path
(the first child at every depth) is accepted whole and that the bonus token is its own pick after the leaf, forks the
session there (the kept state of the path's deepest stepped node, advanced over the rest: no prefill) and drafts the
next round from the fork. The reply carries the assumed tokens; where the verdict brings exactly them the engine uses
that draft and says so with the request's next item (`DraftItem.adopt`: the fork becomes the session), else the fork
is dropped.

No Ray here: deployments/drafter.py wraps the class as the `drafter` Serve deployment, and tests call it directly.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, replace
from typing import Sequence
import torch

from ray_specdec.config import SamplingParams, TreeConfig
from ray_specdec.models.device_clock import now
from ray_specdec.models.drafter.mamba import MambaDrafter
from ray_specdec.models.drafter.mamba_state import StateSlots
from ray_specdec.speculation.acceptance import Verdict
from ray_specdec.speculation.coupled import KeyedGumbel, prefetch
from ray_specdec.speculation.drafter_cache import DrafterStates
from ray_specdec.speculation.drafting import (Draft, DrafterSession, DraftRequest, align_vocab, commit_many,
                                              draft_many, drafter_ids, pick_children)


@dataclass(frozen=True)
class DraftItem:
    """One request's part of a `DraftCall`."""

    request_id: str
    context_len: int  # the request's tokens: what its session holds once `verdicts` are in
    config: TreeConfig  # the tree to draft (with its lookup branch)
    params: SamplingParams
    verdicts: tuple[Verdict, ...] = ()  # rounds judged since this worker's last draft for it, oldest first
    open_round: bool = False  # verdicts[0] judges this worker's last draft for it (its states take the root there)
    tokens: tuple[int, ...] | None = None  # every token of the request: the session is (re)built from them
    noise: tuple[int, int] | None = None  # a coupled request's keyed noise, (seed, choice)
    draft_seed: int = 0  # a rejection-sampled request's draft stream starts from this seed when its session is built
    adopt: bool = False  # the engine used this worker's draft ahead for the request: its fork is the session now


@dataclass(frozen=True)
class DraftCall:
    """One engine's call to one worker in a step: every request it drafts there."""

    items: tuple[DraftItem, ...]
    vocab_size: int  # the target's: drafts live in its vocabulary
    min_path_prob: float = 0.0
    releases: tuple[str, ...] = ()  # requests that ended: their sessions go
    ahead: bool = False  # draft each item's next round ahead, from a fork at its last draft's likeliest path


@dataclass(frozen=True)
class DraftReply:
    draft: Draft | None  # None: no state here and no tokens sent (the round goes undrafted; send the tokens)
    prefill_s: float = 0.0  # seconds of a session built in this call (0: none, or a kept state copied)
    assumed: tuple[int, ...] = ()  # a draft ahead's: the tokens the round before must bring for it to hold


@dataclass
class _Held:
    session: DrafterSession
    generator: torch.Generator  # the draft stream of a rejection-sampled request
    noise: KeyedGumbel | None
    fork: tuple[tuple[int, ...], DrafterSession] | None = None  # a draft ahead's assumed tokens and session


class DrafterWorker:
    """Sessions of many requests on one drafter; `draft` is a step's call."""

    def __init__(self, drafter: MambaDrafter, max_sessions: int = 256, prefix_cache: bool = True):
        """max_sessions: slots of the pool, and sessions kept (least recently drafted first out beyond it: a request
        whose engine stopped calling, or whose release was lost); prefix_cache: keep states after prompts
        (speculation/drafter_cache.py)."""
        self.drafter = drafter
        self.max_sessions = max_sessions
        self.slots = StateSlots(drafter, max_sessions)
        self.states = DrafterStates() if prefix_cache else None
        self.sessions: OrderedDict[str, _Held] = OrderedDict()

    def draft(self, call: DraftCall) -> list[DraftReply]:
        """One step's drafts of `call.items` -> one reply each, in order. Sessions first catch up on their verdicts
        (one batched commit), then every tree is drafted in one batch (drafting.draft_many)."""
        for request_id in call.releases:
            self._drop(request_id)
        if call.ahead:
            return self._ahead(call)
        held: list[_Held | None] = []
        prefill_s: list[float] = []
        commits = []
        for item in call.items:
            if self._stale(item):
                held.append(None)
                prefill_s.append(0.0)
                continue
            h, seconds = self._session(item, call.vocab_size)
            if h is not None and item.verdicts and item.tokens is None:
                verdicts = item.verdicts
                if not (item.open_round and h.session._draft is not None):  # its states are not that round's
                    verdicts = (_plain(verdicts[0]), *verdicts[1:])
                commits.append((h.session, verdicts))
            held.append(h)
            prefill_s.append(seconds)
        commit_many(commits)
        batch, where = [], []
        for i, (item, h) in enumerate(zip(call.items, held)):
            if h is None:
                continue
            if len(h.session.history) != item.context_len:  # not the request's state: rebuilt when tokens come
                self._drop(item.request_id)
                held[i] = None
                continue
            if h.noise is not None:
                h.noise.forget_before(item.context_len)
            batch.append(DraftRequest(h.session, item.config, item.params, h.generator, h.noise))
            where.append(i)
        drafts: list[Draft | None] = [None] * len(call.items)
        for i, draft in zip(where, draft_many(batch, call.min_path_prob)):
            drafts[i] = draft
            self.sessions.move_to_end(call.items[i].request_id)
        while len(self.sessions) > self.max_sessions:
            self._drop(next(iter(self.sessions)))
        return [DraftReply(d, s) for d, s in zip(drafts, prefill_s)]

    def _stale(self, item: DraftItem) -> bool:
        """Whether the item's session already holds more tokens than the item says it held before its verdicts (or
        than its tokens): a later call caught it up, and this one's verdicts or tokens would take it back. An item
        that adopts the fork drafted ahead says what the fork holds, which is more than the session: a session that
        holds as much adopted it already."""
        h = self.sessions.get(item.request_id)
        if h is None:
            return False
        before = len(item.tokens) if item.tokens is not None else \
            item.context_len - sum(len(v.new_tokens) for v in item.verdicts)  # fmt: skip
        held = len(h.session.history)
        return held >= before if item.adopt else held > before

    def _session(self, item: DraftItem, vocab_size: int) -> tuple[_Held | None, float]:
        """The item's session, built from its tokens when it has them -> (the session or None, prefill seconds)."""
        if item.tokens is None:
            h = self.sessions.get(item.request_id)
            if h is not None and not self._settle_fork(h, item.adopt):
                self._drop(item.request_id)
                h = None
            return h, 0.0
        h = self.sessions.get(item.request_id)
        if h is not None and list(h.session.history) == list(item.tokens):  # it holds them already (a call sent
            return h, 0.0  # again, or one whose reply was lost): kept, with the fork drafted ahead from it
        self._drop(item.request_id)
        device = self.drafter.device
        t0, hits = now(device), self.states.hits if self.states is not None else 0
        session = DrafterSession(self.drafter, item.tokens, vocab_size, self.states, self.slots)
        seconds = 0.0 if self.states is not None and self.states.hits > hits else now(device) - t0
        generator = torch.Generator(device="cpu").manual_seed(item.draft_seed)
        noise = KeyedGumbel(*item.noise) if item.noise is not None else None
        h = self.sessions[item.request_id] = _Held(session, generator, noise)
        return h, seconds

    def _drop(self, request_id: str) -> bool:
        h = self.sessions.pop(request_id, None)
        if h is not None:
            self._settle_fork(h, adopt=False)
            h.session.close()
        return h is not None

    @staticmethod
    def _settle_fork(h: _Held, adopt: bool) -> bool:
        """The fork becomes the session (adopt) or goes -> False where adopt finds none (the session is stale)."""
        fork, h.fork = h.fork, None
        if adopt:
            if fork is None:
                return False
            h.session.close()
            h.session = fork[1]
        elif fork is not None:
            fork[1].close()
        return True

    def _ahead(self, call: DraftCall) -> list[DraftReply]:
        """Each item's next round, drafted from a fork at its last draft's likeliest path (module docstring)."""
        replies = [DraftReply(None)] * len(call.items)
        held = []
        for i, item in enumerate(call.items):
            h = self.sessions.get(item.request_id)
            if h is None or self._stale(item):
                continue
            if not self._settle_fork(h, item.adopt) or len(h.session.history) != item.context_len:
                self._drop(item.request_id)
                continue
            held.append((i, h))
        forks = [(i, h, *fork) for (i, h), fork in zip(held, self._forks([h for _, h in held],
                                                                          [call.items[i].params for i, _ in held]))
                 if fork is not None]  # fmt: skip
        batch = [DraftRequest(fork, call.items[i].config, call.items[i].params, h.generator, h.noise)
                 for i, h, _, fork in forks]  # fmt: skip
        for (i, h, assumed, fork), draft in zip(forks, draft_many(batch, call.min_path_prob)):
            h.fork = (assumed, fork)
            replies[i] = DraftReply(draft, 0.0, assumed)
        return replies

    def _forks(self, held: Sequence[_Held],
               params: Sequence[SamplingParams]) -> list[tuple[tuple[int, ...], DrafterSession] | None]:
        """Per session, a session after its last draft's first-child path and the drafter's own pick after its leaf
        -> (those tokens, the session), or None without such a draft. Every fork's catch-ups run together."""
        starts = []  # (index, session, path tokens, state at the path's deepest stepped node, tokens still to run)
        for j, h in enumerate(held):
            session, draft = h.session, h.session._draft
            if draft is None or not draft.config.depth:
                continue
            rows = {p: row for row, p in enumerate(draft.tree.paths, 1)}
            chain = [(0,) * k for k in range(1, draft.config.depth + 1)]
            if any(p not in rows for p in chain):
                continue
            tokens = [int(draft.tokens[rows[p] - 1]) for p in chain]
            state, done = None, 0
            for k in range(len(chain) - 1, 0, -1):  # the deepest stepped node on the path (leaves are never stepped)
                where = session._stepped.get(chain[k - 1])
                if where is not None:
                    depth, row = where
                    state, done = self.drafter.copy_rows(session._depth_states[depth], torch.tensor([row])), k
                    break
            if state is None:
                state = self.drafter.copy_rows(session.root_state, torch.zeros(1, dtype=torch.long))
            starts.append((j, session, tokens, state, tokens[done:]))
        if not starts:
            return [None] * len(held)
        states = [state for *_, state, _ in starts]
        logits = self._extend(states, [rest for *_, rest in starts])
        coupled = [(held[j].noise, [len(session.history) + len(tokens)]) for j, session, tokens, *_ in starts
                   if held[j].noise is not None]  # fmt: skip
        if coupled:  # the bonus tokens' positions: the context, then the path; all in one pass
            prefetch(coupled, starts[0][1].vocab_size, logits[0].device)
        bonus = []
        for (j, session, tokens, *_), row in zip(starts, logits):
            h, vocab = held[j], session.vocab_size
            noise = None if h.noise is None else h.noise.at([len(session.history) + len(tokens)], vocab, row.device)[0]
            picked, _ = pick_children(align_vocab(row.unsqueeze(0), vocab), 1, params[j], h.generator, noise)
            bonus.append(int(picked[0, 0]))
        logits = self._extend(states, [[b] for b in bonus])
        out: list[tuple[tuple[int, ...], DrafterSession] | None] = [None] * len(held)
        for (j, session, tokens, state, _), b, row in zip(starts, bonus, logits):
            assumed = (*tokens, b)
            out[j] = assumed, DrafterSession(self.drafter, [*session.history, *assumed], session.vocab_size,
                                             slots=self.slots, start=(state, row))  # fmt: skip
        return out

    def _extend(self, states, tokens: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        """Each one-row state advanced over its tokens (in place) -> the logits [V_d] after each: one batched
        catch-up where the drafter has it."""
        ids = [drafter_ids(self.drafter, t) for t in tokens]
        if len(states) > 1 and hasattr(self.drafter, "extend_rows"):
            return list(self.drafter.extend_rows(states, ids))
        return [self.drafter.extend(state, i) for state, i in zip(states, ids)]

    def timings(self) -> tuple[float, float, float, float]:
        """Seconds of the drafter's step at 1 and 16 rows, a catch-up over two tokens and a prefill over 64
        (controller.measure_prior's drafter part), each the fastest of three."""
        from ray_specdec.speculation.controller import drafter_timings

        return drafter_timings(self.drafter)


def _plain(verdict: Verdict) -> Verdict:
    """The verdict as tokens only: the session advances its root over all of them (no draft state is reused)."""
    return replace(verdict, accepted_rows=())
