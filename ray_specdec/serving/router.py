"""The router's round loop for one request, over async clients of the target and drafter sides, without Ray.

Per round exactly one remote call per side: `drafter.draft(key, commits since the last draft, tree, ...)` then
`target.verify(request_id, draft, params)` (forward, acceptance and the target's commit happen there). A round the
policy or the back-off runs without a tree makes no drafter call at all; its verdict (one bonus token) joins the
commits that ride on the next draft call, which costs the drafter one step per such round instead of a rebuild. The
first round's draft (which includes the drafter's prefill) runs concurrently with the target's prefill
(`target.start`).

Drafter state and recovery. The drafter keeps a request's state under a *key* = request id + epoch. Whenever the
router cannot vouch for that state (a replica answered None because it lacks it, a draft call failed or timed out,
or more than MAX_CATCH_UP_ROUNDS rounds ran without a draft), it moves to a new epoch and sends every token so far, which rebuilds the state by
prefill on whichever replica gets the call. A key's state is therefore built once and only ever advanced by this
router in order, so a replica can never draft from a stale copy (say a request that moved away and came back), and
sticky routing is an optimisation, not a correctness condition. A failed or slow drafter costs a round of plain
decoding, never the request.

Load-aware back-off (`LoadBackoff`). SmartSpec's lesson is that goodput, not acceptance, decides how much to draft:
when many requests share the target, every drafted node costs verify time that other requests wait for. The rule
here is deliberately simple: up to `full_below` requests in flight on this router the tree policy's pick is used as
is; from `off_at` on nothing is drafted; in between a node budget shrinks linearly: a bandit picks among its arms
that fit it (so that every round still teaches it about the arm it ran), a fixed tree is cut to its share. A tree
the client asked for explicitly is honoured as given.

Whatever ends the request (completion, client disconnect or cancellation, an error), both sides' state is released
in a `finally` block, by background tasks that a second cancellation cannot interrupt.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass
from typing import AsyncIterator, Awaitable, Protocol, Sequence

from ray_specdec.acceptance import Verdict
from ray_specdec.bandit import TreePolicy
from ray_specdec.config import SamplingParams, TreeConfig
from ray_specdec.drafting import Draft, what_if
from ray_specdec.engine import NO_TREE, Generation, StreamChunk, empty_draft
from ray_specdec.stats import GenerationStats
from ray_specdec.stopping import StopChecker

logger = logging.getLogger(__name__)


class TargetClient(Protocol):
    async def start(self, request_id: str, prompt_ids: list[int], seed: int | None) -> None: ...

    async def verify(self, request_id: str, draft: Draft, params: SamplingParams) -> Verdict: ...

    async def release(self, request_id: str) -> None: ...


class DrafterClient(Protocol):
    async def draft(
        self,
        request_id: str,
        commits: Sequence[Verdict],
        config: TreeConfig,
        params: SamplingParams,
        seed: int | None,
        token_ids: list[int] | None = None,
    ) -> Draft | None: ...

    async def release(self, request_id: str) -> None: ...


# Rounds without a draft whose verdicts may queue up for the next draft call; beyond that the drafter state is
# rebuilt from the token ids (one prefill beats many single-token steps).
MAX_CATCH_UP_ROUNDS = 64


class PromptTooLong(ValueError):
    """The prompt plus max_tokens does not fit the target's context (HTTP 400)."""


@dataclass(frozen=True)
class LoadBackoff:
    """Cap the drafted tree by how many requests are in flight on this router (see the module docstring)."""

    full_below: int = 4  # in-flight requests (this one included) up to which the policy's tree is used as is
    off_at: int = 32  # in-flight requests from which nothing is drafted

    def __post_init__(self) -> None:
        if not 1 <= self.full_below < self.off_at:
            raise ValueError(f"need 1 <= full_below < off_at, got {self.full_below}, {self.off_at}")

    def share(self, in_flight: int) -> float:
        """1 up to full_below requests in flight, 0 from off_at, linear in between."""
        if in_flight <= self.full_below:
            return 1.0
        if in_flight >= self.off_at:
            return 0.0
        return (self.off_at - in_flight) / (self.off_at - self.full_below)

    def limit(self, config: TreeConfig, in_flight: int) -> TreeConfig:
        """A fixed tree cut to its share of nodes (at least one while any share is left)."""
        share = self.share(in_flight)
        if share == 1.0:
            return config
        if share == 0.0:
            return NO_TREE
        budget = max(1, int(config.num_nodes * share))
        while config.num_nodes > budget:
            config = config.truncated(config.depth - 1)
        return config

    def node_budget(self, arms: Sequence[TreeConfig], in_flight: int) -> int | None:
        """For a policy over `arms`: the most draft nodes a pick may have (None: any), the share of the largest arm's
        nodes. The policy then picks among the arms that fit instead of having its pick cut to a shape it never
        learns about (a cut round is no arm's round)."""
        share = self.share(in_flight)
        if share == 1.0:
            return None
        if share == 0.0:
            return 0
        return max(1, int(max(arm.num_nodes for arm in arms) * share))


class _DrafterLink:
    """What the router knows about one request's drafter state (see "Drafter state and recovery")."""

    def __init__(self, request_id: str):
        self.request_id = request_id
        self.epoch = 0
        self.sent = False  # a draft call went out under `key`: some replica may hold (or be building) its state
        self.synced = False  # the state under `key` holds every token except those of `commits`
        # verdicts since the last draft (its round's first, then rounds without a draft), sent with the next call
        self.commits: list[Verdict] = []

    @property
    def key(self) -> str:
        return f"{self.request_id}#{self.epoch}"

    def lost(self) -> str | None:
        """Stop vouching for the state: the next draft call rebuilds it under a new key. -> the old key, if used."""
        old = self.key if self.sent else None
        if self.sent:
            self.epoch += 1
        self.sent, self.synced, self.commits = False, False, []
        return old

    def drafted(self) -> None:
        self.synced, self.commits = True, []


class RouterCore:
    """Runs many concurrent requests' round loops (one asyncio task each) against one target and one drafter."""

    def __init__(
        self,
        target: TargetClient,
        drafter: DrafterClient | None,
        tokenizer,
        eos_token_ids: frozenset[int],
        max_context: int,
        policy: TreePolicy,
        backoff: LoadBackoff = LoadBackoff(),
        target_timeout_s: float = 120.0,
        draft_timeout_s: float = 30.0,
        lookup: int = 0,
    ):
        """lookup: every drafted tree of a greedy request also verifies up to this many prompt-lookup tokens
        (sampled requests: only trees naming their own, as in the engine)."""
        self.target = target
        self.drafter = drafter
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_context = max_context
        self.policy = policy
        self.backoff = backoff
        self.target_timeout_s = target_timeout_s
        self.draft_timeout_s = draft_timeout_s
        self.lookup = lookup
        self.in_flight = 0
        self.draft_failures = 0  # draft calls that failed or timed out (each cost one round of plain decoding)
        # rounds whose tree is none of the policy's arms (cut by the back-off, or by what was left to generate): the
        # policy cannot learn from them
        self.rounds_unrecorded = 0
        self._background: set[asyncio.Task] = set()

    def encode(self, prompt: str) -> list[int]:
        ids = self.tokenizer(prompt, add_special_tokens=False)["input_ids"]
        if not ids:
            raise PromptTooLong("the prompt encodes to no tokens")
        return list(ids)

    def check_length(self, prompt_len: int, params: SamplingParams) -> None:
        if prompt_len + params.max_new_tokens > self.max_context:
            raise PromptTooLong(
                f"prompt ({prompt_len} tokens) + max_tokens ({params.max_new_tokens}) exceeds the model's context "
                f"length of {self.max_context} tokens"
            )

    async def generate(
        self, prompt_ids: Sequence[int], params: SamplingParams, tree: TreeConfig | None = None
    ) -> Generation:
        token_ids, text, chunk = [], [], None
        async for chunk in self.stream(prompt_ids, params, tree):
            token_ids += chunk.token_ids
            text.append(chunk.text)
        return Generation(token_ids, "".join(text), chunk.finish_reason, chunk.stats, len(prompt_ids))

    async def stream(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        tree: TreeConfig | None = None,
        request_id: str | None = None,
    ) -> AsyncIterator[StreamChunk]:
        """Yield one chunk per round (tokens kept, text delta); the last chunk has finish_reason set."""
        tokens = [int(t) for t in prompt_ids]
        self.check_length(len(tokens), params)
        request_id = request_id or uuid.uuid4().hex
        link = _DrafterLink(request_id)
        stats = GenerationStats()
        stop = StopChecker(self.tokenizer, params, self.eos_token_ids)
        self.in_flight += 1
        try:
            arm = self._pick_tree(tree, len(tokens), stop.remaining, params)
            lookup = self._lookup(params, stop.remaining)
            config = arm.with_lookup(lookup)
            draft = await self._start(request_id, link, config, params, tokens, stats)
            draft_s = 0.0  # the first draft is hidden behind the target's prefill
            while True:
                t0 = time.perf_counter()
                verdict = await self._call(self.target.verify(request_id, draft, params), self.target_timeout_s)
                verify_s = time.perf_counter() - t0
                if link.synced:
                    link.commits.append(verdict)  # rides on the next draft call
                stats.verify_s += verify_s
                stats.last_round_s = draft_s + verify_s
                # the policy learns about the tree it picked, or "none" when the draft failed
                self._record(arm if draft.arm == config else draft.arm, draft, len(tokens), verdict, stats, params,
                             lookup)
                tokens += verdict.new_tokens
                kept, delta = stop.feed(verdict.new_tokens)
                stats.new_tokens += len(kept)
                yield StreamChunk(kept, delta, stop.finish_reason, stats)
                if stop.finished:
                    return
                t0 = time.perf_counter()
                arm = self._pick_tree(tree, len(tokens), stop.remaining, params)
                lookup = self._lookup(params, stop.remaining)
                config = arm.with_lookup(lookup)
                draft = await self._draft(link, config, params, tokens)
                draft_s = time.perf_counter() - t0
                stats.draft_s += draft_s
        finally:
            self.in_flight -= 1
            self._release(request_id, link)

    async def _start(
        self,
        request_id: str,
        link: _DrafterLink,
        config: TreeConfig,
        params: SamplingParams,
        tokens: list[int],
        stats: GenerationStats,
    ) -> Draft:
        """Target prefill and the first draft (drafter prefill included), concurrently. -> the first draft."""
        t0 = time.perf_counter()
        first_draft = asyncio.create_task(self._draft(link, config, params, tokens))
        try:
            await self._call(self.target.start(request_id, list(tokens), params.seed), self.target_timeout_s)
        except BaseException:
            first_draft.cancel()
            raise
        draft = await first_draft
        stats.prefill_s = time.perf_counter() - t0
        return draft

    def _lookup(self, params: SamplingParams, remaining: int) -> int:
        """Lookup tokens added to the round's tree: greedy requests only, never past what is left to generate."""
        return min(self.lookup if params.greedy else 0, remaining - 1)

    def _pick_tree(
        self, override: TreeConfig | None, context_len: int, remaining: int, params: SamplingParams
    ) -> TreeConfig:
        if self.drafter is None:
            return NO_TREE
        arms = getattr(self.policy, "arms", ())
        if override is not None:
            config = override
        elif arms:
            budget = self.backoff.node_budget(arms, self.in_flight)
            config = self.policy.select(context_len, not params.greedy, max_nodes=budget)
        else:
            config = self.backoff.limit(self.policy.select(context_len, not params.greedy), self.in_flight)
        # the bonus token comes for free: never draft deeper than what is left to generate
        return config.truncated(remaining - 1)

    async def _draft(self, link: _DrafterLink, config: TreeConfig, params: SamplingParams, tokens: list[int]) -> Draft:
        """The round's draft from the drafter, or an empty one (no drafting, or the drafter failed)."""
        if self.drafter is not None and config.depth == 0 and link.synced:
            if len(link.commits) < MAX_CATCH_UP_ROUNDS:
                return empty_draft()  # the drafter catches up on this round's verdict with the next draft call
        if self.drafter is None or config.depth == 0:
            stale = link.lost()  # the drafter misses this round's tokens
            if stale is not None:
                self._background_release("drafter", stale, self.drafter.release)
            return empty_draft()
        try:
            if link.synced:
                draft = await self._call_drafter(link, config, params, None)
                if draft is not None:
                    return draft
                link.lost()  # this replica lacks the state (new, restarted, evicted): rebuild it
            return await self._call_drafter(link, config, params, tokens)
        except Exception as exc:  # a drafter problem costs one round of plain decoding, never the request
            self.draft_failures += 1
            logger.warning("draft call for %s failed (%s: %s); this round verifies no tree", link.key,
                           type(exc).__name__, exc)  # fmt: skip
            link.lost()
            return empty_draft()

    async def _call_drafter(
        self, link: _DrafterLink, config: TreeConfig, params: SamplingParams, tokens: list[int] | None
    ) -> Draft | None:
        """One draft call: the pending commits (tokens None), or a rebuild from every token so far."""
        commits = list(link.commits) if tokens is None else []
        link.sent = True
        draft = await self._call(self.drafter.draft(link.key, commits, config, params, params.seed, tokens),
                                 self.draft_timeout_s)  # fmt: skip
        if draft is None and tokens is not None:
            raise RuntimeError("the drafter answered None to a call with token ids")
        if draft is not None:
            link.drafted()
        return draft

    def _record(
        self,
        arm: TreeConfig,
        draft: Draft,
        context_len: int,
        verdict: Verdict,
        stats: GenerationStats,
        params: SamplingParams,
        lookup: int,
    ) -> None:
        accepted = len(verdict.accepted_rows)
        # every round teaches the policy, rounds without a tree too (they are the "none" arm when it has one), and the
        # arms whose trees this one contained (drafting.what_if; none when the drafter cut the tree)
        arms = getattr(self.policy, "arms", ())
        what = what_if(draft, verdict, arms, lookup, not params.greedy) if arms and arm in arms else None
        if arms and arm not in arms:
            self.rounds_unrecorded += 1
        self.policy.record(arm, context_len, accepted, max(stats.last_round_s, 1e-9), not params.greedy, what)
        stats.record_round(draft.label, draft.tree.depth, accepted)

    @staticmethod
    async def _call(awaitable: Awaitable, timeout_s: float):
        return await asyncio.wait_for(awaitable, timeout_s)

    def _release(self, request_id: str, link: _DrafterLink) -> None:
        self._background_release("target", request_id, self.target.release)
        if self.drafter is not None and link.sent:
            self._background_release("drafter", link.key, self.drafter.release)

    def _background_release(self, side: str, key: str, release) -> None:
        task = asyncio.get_running_loop().create_task(self._release_one(side, key, release))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _release_one(self, side: str, key: str, release) -> None:
        try:
            await self._call(release(key), self.target_timeout_s)
        except Exception as exc:  # the side's own idle eviction frees it later
            logger.warning("release of %s on the %s failed: %s: %s", key, side, type(exc).__name__, exc)

    async def drain(self) -> None:
        """Wait for pending release calls (tests, shutdown)."""
        while self._background:
            await asyncio.gather(*list(self._background), return_exceptions=True)
