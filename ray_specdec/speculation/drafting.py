"""Tree drafting by batch generation with a state-space drafter, and the drafter's commit after verification.

From the root state (all committed tokens consumed) the drafter's logits give the root distribution; N_1 children are
picked; the state is copied into B_1 rows (state-copy kernel) and all rows step once on their tokens; N_2 children are
picked per row; and so on. The leaves are never stepped. The states of every depth are kept until the commit, which
reuses the state of the last accepted node instead of re-running tokens; tokens past it (a leaf, lookup tokens, the
bonus) go through the drafter in one sequence pass (`MambaDrafter.extend`).

Coupled sampled requests (speculation/coupled.py) pick children by perturbed score under the keyed noise of the
position they are drafted for: the first child is the drafter's keyed argmax, the rest its next candidates.

With `TreeConfig.lookup` > 0, rounds add a prompt-lookup branch (speculation/prompt_lookup.py): the tokens that followed
the latest earlier occurrence of the context's suffix. Greedy and coupled rounds (verified by exact matching) merge it
into the drafter's tree where prefixes agree. Rejection-sampled rounds hang it from the root as a chain of its own
whose nodes are deterministic drafts (q = one-hot): acceptance tries such a child first, with probability p(x), and on
rejection removes x from p before the drafter's children are tried against what is left, so the emitted token still
has exactly the distribution p (`accept_sampled`). The draft then carries its own index paths (`Draft.paths`): rows
are the tree's BFS order.

A scheduler step drafts all its requests in one batch (`draft_many`): at each depth the rows of every request that
reaches it are copied from their parents' rows (by request and parent) and stepped together, which gives each
request exactly its own draft only because the drafter's step is row-invariant (`MambaDrafter.steps_row_invariant`).
A single draft is a batch of one.
"""

from __future__ import annotations

import functools
import math
import weakref
from dataclasses import dataclass
from typing import Sequence

import torch

from ray_specdec.config import NO_TREE, SamplingParams, TreeConfig
from ray_specdec.models.drafter.mamba import MambaDrafter, MambaState
from ray_specdec.models.drafter.mamba_state import StateSlots
from ray_specdec.speculation.acceptance import Verdict
from ray_specdec.speculation.coupled import KeyedGumbel, keyed_top_k, prefetch
from ray_specdec.speculation.drafter_cache import DrafterStates
from ray_specdec.speculation.logits_processing import apply_logit_bias
from ray_specdec.speculation.prompt_lookup import LookupIndex
from ray_specdec.speculation.sampling import gumbel_top_k, logits_to_probs, sample
from ray_specdec.speculation.tree import TreeTensors, build_tree


@functools.lru_cache(maxsize=64)
def tree_for(config: TreeConfig) -> TreeTensors:
    return build_tree(config.index_paths())


@functools.lru_cache(maxsize=512)
def tree_from_paths(paths: tuple[tuple[int, ...], ...]) -> TreeTensors:
    return build_tree(paths)


@dataclass
class Draft:
    config: TreeConfig
    tokens: torch.Tensor  # [n] draft tokens of tree rows 1..n
    probs: torch.Tensor | None  # [m, V] draft distribution q at rows 0..m-1 (rows with children); None when greedy
    requested: TreeConfig | None = None  # the tree asked for, when this draft differs (min_path_prob, lookup)
    paths: tuple[tuple[int, ...], ...] | None = None  # index paths (BFS) when not config's own tree: lookup nodes
    # sampled drafts with a lookup branch: rows whose token is a deterministic proposal (tried first, q = one-hot),
    # and the row of `probs` for every tree row (-1: none); None: the plain layout (probs row i = tree row i)
    deterministic: frozenset[int] = frozenset()
    q_rows: tuple[int, ...] | None = None
    lookup_tokens: tuple[int, ...] = ()  # the lookup proposal the tree holds (up to the lookup size asked for)

    @property
    def arm(self) -> TreeConfig:
        """The tree the policy chose for this round (what a bandit learns about)."""
        return self.requested if self.requested is not None else self.config

    @property
    def tree(self) -> TreeTensors:
        return tree_for(self.config) if self.paths is None else tree_from_paths(self.paths)

    @property
    def label(self) -> str:
        """The round's tree in statistics: what was drafted, with a lookup branch named by the size asked for (its
        actual length varies from round to round)."""
        if self.config.lookup and self.requested is not None and self.requested.lookup:
            return str(TreeConfig(self.config.branching, self.requested.lookup))
        if not self.config.branching and self.lookup_tokens:
            return LOOKUP_ONLY
        return str(self.config)


# The statistics label of an undrafted round that verifies a lookup proposal (`lookup_draft`).
LOOKUP_ONLY = "lookup"


def lookup_draft(proposal: Sequence[int]) -> Draft:
    """An undrafted round's draft of a prompt-lookup proposal alone (greedy): the tokens as a chain under the root, no
    drafter involved (its config is no tree: nothing is learned of the drafter from it)."""
    paths = tuple((0,) * depth for depth in range(1, len(proposal) + 1))
    return Draft(TreeConfig(()), torch.tensor(list(proposal), dtype=torch.long), None, paths=paths,
                 lookup_tokens=tuple(int(t) for t in proposal))


def empty_draft() -> Draft:
    """The draft of an undrafted round: no tree, no tokens."""
    return Draft(NO_TREE, torch.empty(0, dtype=torch.long), None)


def pick_children(
    logits: torch.Tensor,  # [rows, V]
    k: int,
    params: SamplingParams,
    generator: torch.Generator | None,
    noise: torch.Tensor | None = None,  # [V] float64: a coupled request's keyed noise at the rows' position
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """-> (children [rows, k], q [rows, V] or None). Greedy: top-k distinct tokens; coupled: the top-k by perturbed
    score (verification needs no q); sampled: i.i.d. or Gumbel-top-k.

    logit_bias applies here as on the target (speculation/logits_processing.py); q is what the children were drawn
    from."""
    logits = apply_logit_bias(logits, params)
    if params.greedy:
        return torch.topk(logits, k, dim=-1).indices, None
    q = logits_to_probs(logits.float(), params)
    if noise is not None:
        return keyed_top_k(q, noise.expand(q.shape[0], -1), k), None
    if params.draft_sampling == "iid":
        children = sample(q.unsqueeze(1).expand(-1, k, -1), generator)
    else:
        children = gumbel_top_k(q, k, generator)
    return children, q


def _draft_distribution(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The drafter's distribution that path probabilities use: q when sampling, the plain softmax when greedy."""
    if params.greedy:
        return torch.softmax(logits.double(), dim=-1)
    return logits_to_probs(logits.float(), params).double()


def align_vocab(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Drafter logits [rows, V_d] -> [rows, vocab_size]: extra drafter tokens are impossible, missing ones too."""
    v = logits.shape[-1]
    if v == vocab_size:
        return logits
    if v > vocab_size:
        return logits[..., :vocab_size]
    pad = logits.new_full((*logits.shape[:-1], vocab_size - v), float("-inf"))
    return torch.cat([logits, pad], dim=-1)


def drafter_ids(drafter: MambaDrafter, token_ids: Sequence[int]) -> torch.Tensor:
    """Target token ids as drafter inputs: ids the drafter's vocabulary lacks (a target with a larger or padded
    vocabulary) become id 0. The drafter never proposes them (`align_vocab`); its guesses after one get worse."""
    ids = torch.as_tensor(list(token_ids), dtype=torch.long, device=drafter.device)
    return ids.masked_fill(ids >= drafter.vocab_size, 0)


def _windowed(drafter: MambaDrafter, token_ids: Sequence[int]) -> Sequence[int]:
    """The context a prefill reads: its last `prefill_window` tokens (all without a window)."""
    window = getattr(drafter, "prefill_window", None)
    return token_ids[-window:] if window else token_ids


def prefill_input(drafter: MambaDrafter, token_ids: Sequence[int]) -> torch.Tensor:
    """What a session's prefill over a context runs, as drafter inputs on its device."""
    return drafter_ids(drafter, _windowed(drafter, token_ids))


def prefill_key(drafter: MambaDrafter, token_ids: Sequence[int]) -> tuple[int, ...]:
    """`prefill_input`'s ids as a tuple, made on the host: the key of the drafter's prefix cache
    (speculation/drafter_cache.py). The scheduler asks it at every admission; through the device tensor that cost a copy
    each way and a wait for the GPU."""
    ids = list(_windowed(drafter, token_ids))
    if ids and max(ids) >= drafter.vocab_size:
        ids = [t if t < drafter.vocab_size else 0 for t in ids]
    return tuple(ids)


class DrafterSession:
    """One request's drafter state: the root state, its logits, and the per-depth states of the open round."""

    def __init__(self, drafter: MambaDrafter, token_ids: Sequence[int], vocab_size: int,
                 states: DrafterStates | None = None, slots: StateSlots | None = None,
                 start: tuple[MambaState, torch.Tensor] | None = None):
        """states: the drafter's prefix cache (speculation/drafter_cache.py), where a prompt prefilled before is copied.
        slots: a slot pool of this drafter's states: the root state lives in a slot until `close` (or until the session
        is collected); a state of its own where every slot is taken (or the pool is another drafter's). start: the
        state after token_ids and its logits [V_d], instead of a prefill (a session forked from another's round)."""
        self.drafter = drafter
        self.vocab_size = vocab_size  # the target's: draft distributions live in its vocabulary
        self.history = [int(t) for t in token_ids]  # every token so far: the lookup branch searches it
        if start is not None:
            self.root_state, logits = start
        else:
            ids = prefill_input(drafter, self.history)
            self.root_state, logits = drafter.prefill(ids) if states is None else states.prefill(drafter, ids)
        self.slots = slots if slots is not None and slots.drafter is drafter else None
        self.slot = None if self.slots is None else self.slots.acquire()
        if self.slot is not None:
            self.root_state = drafter.copy_rows(self.root_state, [0], out=slots.state(self.slot))
            self._release = weakref.finalize(self, slots.release, self.slot)
        self.root_logits = align_vocab(logits.unsqueeze(0), vocab_size)  # [1, V]
        self._lookup: LookupIndex | None = None  # built on the first lookup, then kept up to date
        self._depth_states: list[MambaState] = []
        self._stepped: dict[tuple[int, ...], tuple[int, int]] = {}  # path -> (depth, row) in _depth_states
        self._draft: Draft | None = None

    def draft(
        self,
        config: TreeConfig,
        params: SamplingParams,
        generator: torch.Generator | None,
        min_path_prob: float = 0.0,
    ) -> Draft:
        """Draft the tree `config`, or its first depths only when min_path_prob > 0 says the rest is unlikely.

        A node's path probability is the drafter's probability of the tokens from the root to it. Drafting stops
        after depth d when no depth-d node reaches min_path_prob (no drafter step is spent on depth d + 1), or
        before picking depth d + 1 when no depth-d node times its best child's probability does (no verify rows
        are spent on it). Both decisions depend only on nodes already drafted and their distributions, never on
        the children they would drop, so every drafted child is still a sample of q given its ancestors: sampled
        output keeps the target's distribution exactly, and greedy output is the target's whatever the draft.
        Greedy rounds of a config with lookup tokens then merge the lookup branch in (`_merge_lookup`).
        This is `draft_many` of this one request.
        """
        return draft_many([DraftRequest(self, config, params, generator)], min_path_prob)[0]

    def _open_round(self, grown: "_Growth") -> Draft:
        """Keep a grown tree's per-depth states for the commit and make its draft, with the lookup branch if asked."""
        requested, params = grown.request.config, grown.request.params
        tree, states, probs = grown.tree, grown.states, grown.probs
        config = TreeConfig(requested.branching[: grown.drafted])
        self._depth_states = states
        paths = config.index_paths()
        self._stepped = {
            p: (len(p), row - tree.depth_starts[len(p)]) for row, p in enumerate(paths, 1) if len(p) < len(states)
        }
        draft_tokens = torch.cat(grown.tokens) if grown.tokens else torch.empty(0, dtype=torch.long)
        merged, deterministic, q_rows = None, frozenset(), None
        proposal = self._lookup_index().propose(requested.lookup) if requested.lookup else []
        if proposal:
            config = TreeConfig(config.branching, len(proposal))
            if params.greedy or grown.request.noise is not None:
                merged = _merge_lookup(paths, draft_tokens.tolist(), proposal)
            else:
                merged = _append_lookup(paths, draft_tokens.tolist(), proposal)
                row_of = {p: row for row, p in enumerate(merged[0], 1)}
                drafted_paths = set(paths)
                deterministic = frozenset(row for p, row in row_of.items() if p not in drafted_paths)
                # probs row k is the drafter tree's row k (the root, then its nodes with children in BFS order)
                index = [-1] * (len(row_of) + 1)
                for k, p in enumerate([(), *paths][: sum(q.shape[0] for q in probs)]):
                    index[row_of[p] if p else 0] = k
                q_rows = tuple(index)
        if merged is not None:
            paths, node_tokens = merged
            draft_tokens = torch.tensor(node_tokens, dtype=torch.long)
        self._draft = Draft(config, draft_tokens, torch.cat(probs) if probs else None,
                            requested if config != requested else None,
                            tuple(paths) if merged is not None else None, deterministic, q_rows,
                            tuple(proposal))  # fmt: skip
        return self._draft

    def close(self) -> None:
        """The request is done: its slot is free at once (else when the session is collected)."""
        if self.slot is not None:
            self._release()

    def commit(self, verdict: Verdict) -> None:
        self.commit_all([verdict])

    def commit_all(self, verdicts: Sequence[Verdict]) -> None:
        """Apply the open round's verdict, then those of rounds run without a draft (bonus tokens only).

        The root moves to the deepest accepted node whose state the draft holds (a row copy, into the session's slot
        where it has one); the tokens after it (an unstepped leaf, lookup tokens, every bonus token) go through the
        drafter in one `extend`. `commit_many` of this one session.
        """
        commit_many([(self, verdicts)])

    def _catch_up(self, verdicts: Sequence[Verdict]) -> tuple[MambaState, list[int]]:
        """The state a commit advances (the root, or the deepest accepted node's copy) and the tokens it advances by."""
        first = verdicts[0]
        state, start = self.root_state, 0  # no accepted state: the root is advanced in place
        if first.accepted_rows:
            tree = self._draft.tree
            for i in reversed(range(len(first.accepted_rows))):
                where = self._stepped.get(tree.paths[first.accepted_rows[i] - 1])
                if where is not None:
                    depth, row = where
                    index = torch.tensor([row], dtype=torch.long)  # on the host: copy_rows checks it there
                    into = {} if self.slot is None else {"out": self.root_state}  # the slot, or a new state
                    state, start = self.drafter.copy_rows(self._depth_states[depth], index, **into), i + 1
                    break
        pending = [*first.accepted_tokens[start:], first.bonus_token]
        for later in verdicts[1:]:  # rounds without a drafter draft: a bonus token, after a lookup proposal's if any
            pending.extend(later.new_tokens)
        return state, pending

    def _caught_up(self, verdicts: Sequence[Verdict], state: MambaState, logits: torch.Tensor) -> None:
        new_tokens = [t for v in verdicts for t in v.new_tokens]
        self.history += new_tokens
        if self._lookup is not None:
            self._lookup.extend(new_tokens)
        self.root_state, self.root_logits = state, align_vocab(logits.unsqueeze(0), self.vocab_size)
        self._depth_states, self._stepped, self._draft = [], {}, None

    def _lookup_index(self) -> LookupIndex:
        if self._lookup is None:
            self._lookup = LookupIndex(self.history)
        return self._lookup


def commit_many(commits: Sequence[tuple["DrafterSession", Sequence[Verdict]]]) -> None:
    """`DrafterSession.commit_all` of several sessions (each at most once): the catch-ups of the sessions of one drafter
    run in one `MambaDrafter.extend_rows`, which on the native kernels reads the weights once for all of them and
    gives each session the bits its own commit gives."""
    if len({id(session) for session, _ in commits}) != len(commits):
        raise ValueError("a session may commit only once per batch")
    by_drafter: dict[int, list[tuple[DrafterSession, Sequence[Verdict], MambaState, list[int]]]] = {}
    for session, verdicts in commits:
        if verdicts:
            state, pending = session._catch_up(verdicts)
            by_drafter.setdefault(id(session.drafter), []).append((session, verdicts, state, pending))
    for group in by_drafter.values():
        drafter = group[0][0].drafter
        states, ids = [state for _, _, state, _ in group], [drafter_ids(drafter, pending) for *_, pending in group]
        if len(group) > 1 and hasattr(drafter, "extend_rows"):  # (a test's stand-in drafter extends one by one)
            logits = drafter.extend_rows(states, ids)
        else:
            logits = [drafter.extend(state, i) for state, i in zip(states, ids)]
        for (session, verdicts, state, _), row in zip(group, logits):
            session._caught_up(verdicts, state, row)


# Most rows a batched step takes, summed over its requests' widest depths. The native step of the shipped drafter
# costs the same per row from ~6 to ~96 rows on a 2-core CPU (its products are compute-bound past a few rows),
# while the states and logits of a few hundred rows leave the caches and fault in fresh pages: a 384-row step and
# its row copy cost ~2x per row.
MAX_BATCH_ROWS = 64


@dataclass
class DraftRequest:
    """One request's part of a batched draft: what `DrafterSession.draft` takes."""

    session: DrafterSession
    config: TreeConfig
    params: SamplingParams
    generator: torch.Generator | None  # the request's draft random stream (None: torch's global one)
    noise: KeyedGumbel | None = None  # a coupled request's keyed noise (its picks then draw from no stream)


def draft_many(requests: Sequence[DraftRequest], min_path_prob: float = 0.0) -> list[Draft]:
    """Draft every request's tree in one batch -> their drafts, in order: at each depth the rows of all requests that
    reach it take one row copy (by request and parent) and one drafter step together.

    Each draft, and the state its session keeps for the commit, is bit for bit what `request.session.draft` alone
    gives: trees of any shapes and depths, greedy and sampled requests (each draws from its own generator in the
    same order as alone), min_path_prob cuts and lookup branches per request; a depth-0 tree never touches the
    drafter. That needs a drafter whose step is row-invariant (`MambaDrafter.steps_row_invariant`); on others each
    request drafts alone, one after the other. Requests step together up to MAX_BATCH_ROWS rows (`_batches`).
    """
    if len({id(r.session) for r in requests}) != len(requests):
        raise ValueError("a session may draft only once per batch")
    drafts: list[Draft] = []
    for batch in _batches(requests):
        grown = [_Growth(r) for r in batch]
        _grow(grown, min_path_prob)
        drafts += [g.request.session._open_round(g) for g in grown]
    return drafts


def _batches(requests: Sequence[DraftRequest]) -> list[list[DraftRequest]]:
    """Runs of requests that draft together, in order. A run ends at a request on another drafter, at one whose
    sampled draws use a generator already drawn from in the run (torch's global one included: draws from one
    stream must come in the order of one-by-one drafting), at one that would take the run's steps past
    MAX_BATCH_ROWS, and after every request on a drafter whose steps are not row-invariant."""
    batches: list[list[DraftRequest]] = []
    streams: set[int] = set()  # generators the last run's sampled requests draw from
    rows = 0  # the last run's stepped rows, at each request's widest depth
    for r in requests:
        drafter, width = r.session.drafter, _stepped_rows(r.config)
        stream = None if r.params.greedy or r.noise is not None else id(r.generator)  # greedy, coupled: no draws
        last = batches[-1] if batches else None
        if (last is None or last[0].session.drafter is not drafter or not drafter.steps_row_invariant
                or stream in streams or rows + width > MAX_BATCH_ROWS):  # fmt: skip
            batches.append([])
            streams, rows = set(), 0
        batches[-1].append(r)
        rows += width
        if stream is not None:
            streams.add(stream)
    return batches


def _stepped_rows(config: TreeConfig) -> int:
    """Rows of the tree's widest depth that the drafter steps: all but the leaves (depths only grow wider)."""
    return math.prod(config.branching[:-1]) if config.depth > 1 else 0


class _Growth:
    """One request's tree while it grows: the loop of drafting one tree, a depth at a time (`_grow` steps the rows)."""

    def __init__(self, request: DraftRequest):
        self.request = request
        self.tree = tree_for(request.config.without_lookup())
        self.logits = request.session.root_logits  # [rows, V] at the last drafted depth's rows
        self.states = [request.session.root_state]  # per drafted depth, all but the leaves'
        self.tokens: list[torch.Tensor] = []  # per depth: [rows at that depth]
        self.probs: list[torch.Tensor] = []  # per depth with children, when sampled: q [rows, V]
        self.path_prob = torch.ones(1, dtype=torch.float64)  # [rows of the last drafted depth]
        self.drafted = request.config.depth  # depths drafted: fewer where min_path_prob cuts the tree
        self.first_row = 0  # this tree's first row in the batch's state of the last stepped depth

    def pick(self, depth: int, min_path_prob: float) -> bool:
        """Pick this depth's children (see `DrafterSession.draft` for the cuts) -> whether they need a drafter step,
        to have children of their own."""
        config, params = self.request.config, self.request.params
        if min_path_prob > 0:
            dist = _draft_distribution(self.logits, params)  # [rows, V] at the last drafted depth's rows
            if depth > 1 and float((self.path_prob * dist.max(dim=-1).values).max()) < min_path_prob:
                self.drafted = depth - 1
                return False
        noise = self._noise(depth)
        children, q = pick_children(self.logits, config.branching[depth - 1], params, self.request.generator, noise)
        self.tokens.append(children.reshape(-1))
        if q is not None:
            self.probs.append(q)
        if depth == config.depth:
            return False
        if min_path_prob > 0:
            self.path_prob = (self.path_prob[:, None] * dist.gather(-1, children)).reshape(-1)
            if float(self.path_prob.max()) < min_path_prob:
                self.drafted = depth  # depth's nodes stay, as leaves (never stepped)
                return False
        return True


    def _noise(self, depth: int) -> torch.Tensor | None:
        """[V]: a coupled request's noise at the position depth's nodes are drafted for (the root's logits predict
        position len(history), the context's length)."""
        noise = self.request.noise
        if noise is None:
            return None
        position = len(self.request.session.history) + depth - 1
        return noise.at([position], self.logits.shape[-1], self.logits.device)[0]


def _grow(trees: Sequence[_Growth], min_path_prob: float) -> None:
    """Grow the trees of one drafter to their depths: at each depth, every tree that goes deeper has its rows copied
    from their parents' (one copy for all trees) and stepped on its new tokens (one step for all trees)."""
    growing = [t for t in trees if t.request.config.depth > 0]
    coupled = [t for t in growing if t.request.noise is not None]
    if coupled:  # the noise of every depth's position, for all trees in one pass
        prefetch([(t.request.noise, range(len(t.request.session.history),
                                          len(t.request.session.history) + t.request.config.depth)) for t in coupled],
                 coupled[0].logits.shape[-1], coupled[0].logits.device)  # fmt: skip
    source: MambaState | None = None  # the batch's state at the last stepped depth
    depth = 1
    while growing := [t for t in growing if t.pick(depth, min_path_prob)]:
        drafter = growing[0].request.session.drafter
        # depth 1 of several trees from a slot pool: the roots' rows, each once per child, in one gather (a lone tree's
        # root is its slot's contiguous view: the plain path copies from it as cheaply)
        slots = _common_slots(growing) if source is None and len(growing) > 1 else None
        if slots is not None:
            index = torch.cat([t.tree.parents_at_depth(1) + t.request.session.slot for t in growing])
            source = drafter.copy_rows(slots.rows(), index)
        else:
            if source is None:  # depth 1: the parents are the roots
                source = MambaState.cat([t.states[0] for t in growing])
                for i, t in enumerate(growing):
                    t.first_row = i
            index = torch.cat([t.tree.parents_at_depth(depth) + t.first_row for t in growing])  # [rows of all trees]
            source = drafter.copy_rows(source, index)
        logits = drafter.step(source, torch.cat([t.tokens[-1] for t in growing]))  # [rows of all trees, V_d]
        start = 0
        for t in growing:
            stop = start + t.tokens[-1].shape[0]
            t.first_row = start
            t.states.append(source.row_slice(start, stop))  # a view: the commit copies the one row it keeps
            t.logits = align_vocab(logits[start:stop], t.request.session.vocab_size)
            start = stop
        depth += 1


def _common_slots(trees: Sequence[_Growth]) -> StateSlots | None:
    """The slot pool every tree's root lives in, if there is one."""
    slots = trees[0].request.session.slots
    if slots is None or any(t.request.session.slot is None or t.request.session.slots is not slots for t in trees):
        return None
    return slots


def _append_lookup(
    paths: Sequence[tuple[int, ...]], tokens: Sequence[int], proposal: Sequence[int]
) -> tuple[list[tuple[int, ...]], list[int]]:
    """A lookup chain as a branch of its own at the root (next free rank) -> (index paths in BFS order, tokens)."""
    token_of = dict(zip(paths, tokens))
    rank = 1 + max((p[0] for p in paths), default=-1)
    for depth, token in enumerate(proposal, start=1):
        token_of[(rank,) + (0,) * (depth - 1)] = token
    ordered = sorted(token_of, key=lambda p: (len(p), p))
    return ordered, [token_of[p] for p in ordered]


def _merge_lookup(
    paths: Sequence[tuple[int, ...]], tokens: Sequence[int], proposal: Sequence[int]
) -> tuple[list[tuple[int, ...]], list[int]] | None:
    """Merge a lookup chain into a drafted tree -> (index paths in BFS order, their tokens), None if nothing is new.

    The chain follows the tree's nodes while their tokens agree and continues as new nodes (the next free child
    rank) from the first disagreement, so a greedy walk can go as deep as either the drafter or the lookup.
    """
    token_of = dict(zip(paths, tokens))
    child_of: dict[tuple[tuple[int, ...], int], tuple[int, ...]] = {(p[:-1], t): p for p, t in token_of.items()}
    ranks: dict[tuple[int, ...], int] = {}
    for p in paths:
        ranks[p[:-1]] = max(ranks.get(p[:-1], 0), p[-1] + 1)
    node, added = (), False
    for token in proposal:
        nxt = child_of.get((node, token))
        if nxt is None:
            nxt = node + (ranks.get(node, 0),)
            ranks[node] = nxt[-1] + 1
            token_of[nxt], child_of[(node, token)], added = token, nxt, True
        node = nxt
    if not added:
        return None
    ordered = sorted(token_of, key=lambda p: (len(p), p))
    return ordered, [token_of[p] for p in ordered]
