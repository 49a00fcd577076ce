"""The in-process speculative decoding engine: draft -> verify -> accept -> commit, one round at a time.

The same session classes and the same `judge` run inside the Ray Serve deployments; there the router makes one
remote call per side per round. Without a drafter every round has an empty tree: plain target decoding through the
same code path.
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch

from ray_specdec.acceptance import Verdict, accept_greedy, accept_sampled
from ray_specdec.config import MAX_LOOKUP_TOKENS, SamplingParams, TreeConfig
from ray_specdec.drafting import Draft, DrafterSession, tree_for, what_if
from ray_specdec.models.mamba_drafter import MambaDrafter
from ray_specdec.models.target import TargetModel
from ray_specdec.sampling import logits_to_probs
from ray_specdec.stats import GenerationStats
from ray_specdec.stopping import StopChecker

NO_TREE = TreeConfig(())
# Default cut of drafts by the drafter's own path probabilities (DrafterSession.draft); see docs/BENCHMARKS.md.
DEFAULT_MIN_PATH_PROB = 0.0
# Of the requests that the start rule (SpeculativeEngine._start_rule) keeps undrafted, one in this many drafts
# anyway, so that the drafting arms' estimates in that context keep learning and a wrong "no" does not last.
START_ANYWAY_EVERY = 8
# Weight of the newest measurement in the running estimate of the drafter's prefill cost per token.
PREFILL_RATE_EMA = 0.2
# The start rule's word on a request: draft as the policy picks; never draft; draft in every round (exploration).
DRAFT, PLAIN, EXPLORE = "draft", "plain", "explore"


class TargetSession:
    """One request's target state: its KV cache and the root token, which is not in the cache yet."""

    def __init__(self, target: TargetModel, prompt_ids: Sequence[int]):
        self.target = target
        ids = torch.as_tensor(list(prompt_ids), dtype=torch.long, device=target.device)
        self.cache = target.new_cache()
        target.prefill(self.cache, ids[:-1])
        self.root = int(ids[-1])

    def forward(self, draft: Draft) -> torch.Tensor:
        """-> target logits [1 + n, V] at the root and every draft node."""
        return self.target.verify(self.cache, self.root, draft.tree, draft.tokens.to(self.target.device))

    def commit(self, verdict: Verdict) -> None:
        self.target.commit(self.cache, verdict.keep_rows)
        self.root = verdict.bonus_token


def judge(
    target_logits: torch.Tensor,  # [1 + n, V]
    draft: Draft,
    params: SamplingParams,
    generator: torch.Generator | None,
) -> Verdict:
    """Acceptance for one round: greedy walk, or multi-draft rejection sampling on processed distributions."""
    tokens = draft.tokens.to(target_logits.device)
    if params.greedy:
        return accept_greedy(target_logits, draft.tree, tokens)
    p = logits_to_probs(target_logits, params)
    q = draft.probs.to(p.device) if draft.probs is not None else p[:0]
    return accept_sampled(p, q, draft.tree, tokens, params.draft_sampling == "without_replacement", generator,
                          draft.deterministic, draft.q_rows)


def empty_draft() -> Draft:
    return Draft(NO_TREE, torch.empty(0, dtype=torch.long), None)


def _best_drafting(estimates: dict[TreeConfig, float]) -> tuple[float | None, TreeConfig]:
    """(rate, arm) of the drafting arm with the highest estimate; (None, NO_TREE) when no drafting arm has one."""
    return max(((rate, arm) for arm, rate in estimates.items() if arm.depth), key=lambda pair: pair[0],
               default=(None, NO_TREE))


class LazyDrafter:
    """One request's drafter, paid for only in rounds that draft.

    The `DrafterSession` is built (a prefill over every token so far) on the request's first drafted round, so a
    request whose rounds all go undrafted never runs the drafter. Verdicts wait until the next draft and go through
    the drafter in one `commit_all` (one sequence pass over their tokens), as the Serve router sends them: rounds
    without a draft cost the drafter nothing then, and the last round's verdict is never applied.
    """

    def __init__(self, drafter: MambaDrafter, prompt_ids: Sequence[int], vocab_size: int):
        self.drafter, self.vocab_size = drafter, vocab_size
        self.tokens = list(prompt_ids)  # every token so far (prompt + generated): what a late prefill runs over
        self.session: DrafterSession | None = None
        self.pending: list[Verdict] = []  # verdicts since the last draft, that draft's own first
        self.prefill_s = 0.0  # the drafter's prefill, when it happened

    def draft(self, config: TreeConfig, params: SamplingParams, generator, min_path_prob: float) -> Draft:
        if self.session is None:
            t0 = time.perf_counter()
            self.session = DrafterSession(self.drafter, self.tokens, self.vocab_size)
            self.prefill_s = time.perf_counter() - t0
        else:
            self.session.commit_all(self.pending)
        self.pending = []
        return self.session.draft(config, params, generator, min_path_prob)

    def commit(self, verdict: Verdict) -> None:
        self.tokens += verdict.new_tokens
        if self.session is not None:
            self.pending.append(verdict)


class FixedTree:
    """A tree policy that always picks one config (the bandit is the adaptive one)."""

    def __init__(self, tree: TreeConfig):
        self.tree = tree

    def select(self, context_len: int, sampled: bool = False) -> TreeConfig:
        return self.tree

    def record(
        self,
        tree: TreeConfig,
        context_len: int,
        accepted_tokens: int,
        round_time_s: float,
        sampled: bool = False,
        what_if=None,
    ) -> None:
        pass


@dataclass
class StreamChunk:
    token_ids: list[int]  # tokens kept this round
    text: str  # text delta
    finish_reason: str | None
    stats: GenerationStats


@dataclass
class Generation:
    token_ids: list[int]
    text: str
    finish_reason: str
    stats: GenerationStats
    prompt_tokens: int


def make_generators(seed: int | None) -> tuple[torch.Generator, torch.Generator]:
    """Independent (draft, target) random streams; the same seed gives the same output."""
    seed = secrets.randbits(62) if seed is None else seed
    draft_gen = torch.Generator(device="cpu").manual_seed(seed)
    target_gen = torch.Generator(device="cpu").manual_seed(seed ^ 0x5DEECE66D)
    return draft_gen, target_gen


class SpeculativeEngine:
    def __init__(
        self,
        target: TargetModel,
        drafter: MambaDrafter | None,
        tree_policy=TreeConfig((3, 2, 2, 1, 1)),
        tokenizer=None,
        min_path_prob: float = 0.0,
        lookup: int = 0,
    ):
        """min_path_prob: drafts stop at depths whose nodes the drafter rates below this (DrafterSession.draft).
        lookup: every drafted tree of a greedy request also verifies up to this many prompt-lookup tokens
        (lookup.py); the tree policy still learns about the tree it picked. Sampled requests get a lookup branch only
        from trees that name one ("1,1,1+L4"): at T=1 a lookup token is kept with probability p(x) only, and on this
        project's pair it did not pay (docs/BENCHMARKS.md)."""
        if not 0.0 <= min_path_prob < 1.0:
            raise ValueError(f"min_path_prob must be in [0, 1), got {min_path_prob}")
        if not 0 <= lookup <= MAX_LOOKUP_TOKENS:
            raise ValueError(f"lookup must be in [0, {MAX_LOOKUP_TOKENS}], got {lookup}")
        self.lookup = lookup
        self.target = target
        self.drafter = drafter
        self.min_path_prob = min_path_prob
        self.policy = FixedTree(tree_policy) if isinstance(tree_policy, TreeConfig) else tree_policy
        self.tokenizer = tokenizer if tokenizer is not None else target.tokenizer
        self.prefill_s_per_token: float | None = None  # the drafter's, measured (running estimate)
        self.kept_plain = 0  # requests the start rule kept undrafted (START_ANYWAY_EVERY)

    def encode(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("a text prompt needs a tokenizer; pass token ids instead")
            ids = self.tokenizer(prompt, add_special_tokens=False)["input_ids"]
        else:
            ids = [int(t) for t in prompt]
        if not ids:
            raise ValueError("prompt is empty")
        return ids

    def check_length(self, prompt_len: int, params: SamplingParams) -> None:
        limit = self.target.max_context
        if prompt_len + params.max_new_tokens > limit:
            raise ValueError(
                f"prompt ({prompt_len} tokens) + max_new_tokens ({params.max_new_tokens}) exceeds the target's "
                f"context length of {limit} tokens"
            )

    def generate(self, prompt: str | Sequence[int], params: SamplingParams, tree: TreeConfig | None = None) -> Generation:
        prompt_ids = self.encode(prompt)
        token_ids, text = [], []
        for chunk in self.stream(prompt_ids, params, tree):
            token_ids += chunk.token_ids
            text.append(chunk.text)
        return Generation(token_ids, "".join(text), chunk.finish_reason, chunk.stats, len(prompt_ids))

    def stream(
        self, prompt: str | Sequence[int], params: SamplingParams, tree: TreeConfig | None = None
    ) -> Iterator[StreamChunk]:
        prompt_ids = self.encode(prompt)
        self.check_length(len(prompt_ids), params)
        stats = GenerationStats()
        stop = StopChecker(self.tokenizer, params, self.target.eos_token_ids)
        draft_gen, target_gen = make_generators(params.seed)

        t0 = time.perf_counter()
        target_side = TargetSession(self.target, prompt_ids)
        stats.prefill_s = time.perf_counter() - t0
        drafter_side = LazyDrafter(self.drafter, prompt_ids, self.target.vocab_size) if self.drafter else None

        context_len = len(prompt_ids)
        # the start rule's word on this request; asked of every request the policy decides (not of explicit trees)
        policy_decides = drafter_side is not None and tree is None
        start = self._start_rule(context_len, stop.remaining, not params.greedy) if policy_decides else DRAFT
        while not stop.finished:
            arm = NO_TREE if start == PLAIN else self._pick_tree(tree, context_len, stop.remaining, params)
            if start == EXPLORE and not arm.depth:
                arm = self._drafting_arm(context_len, stop.remaining, params)
            lookup = min(self.lookup if params.greedy else 0, stop.remaining - 1)
            config = arm.with_lookup(lookup)
            draft, verdict = self._round(target_side, drafter_side, config, params, draft_gen, target_gen, stats)
            sampled = not params.greedy
            # the round also teaches the arms whose trees this one contained (unless the drafter cuts trees)
            arms = getattr(self.policy, "arms", ()) if self.min_path_prob == 0 else ()
            what = what_if(draft, verdict, arms, lookup, sampled) if arms and arm in arms else None
            self.policy.record(arm, context_len, len(verdict.accepted_rows), stats.last_round_s, sampled, what)
            context_len += len(verdict.new_tokens)
            kept, delta = stop.feed(verdict.new_tokens)
            stats.new_tokens += len(kept)
            stats.record_round(draft.label, draft.tree.depth, len(verdict.accepted_rows))
            yield StreamChunk(kept, delta, stop.finish_reason, stats)

    def _start_rule(self, context_len: int, remaining: int, sampled: bool) -> str:
        """Whether to start the drafter for a request (DRAFT, PLAIN or EXPLORE), asked before its first round.

        The drafter's prefill is paid once per request, so a per-round reward cannot weigh it. Goodput, not
        acceptance, decides: draft unless the policy's estimates say that over the tokens left, drafting's best rate
        would not make up for the prefill (prefill + remaining / best drafting rate >= remaining / rate without
        drafting); then the request stays undrafted (PLAIN), but for one in START_ANYWAY_EVERY (EXPLORE), which
        drafts in every round: it is there to learn what drafting does in this context, and a round the policy
        would leave undrafted would teach nothing the undrafted requests do not. It is asked of every request, not
        only of those whose rounds the policy starts drafting: a policy that rates drafting too low (slow first
        rounds in a cold process) would otherwise pick no tree round after round and never hear otherwise. The rates
        are Thompson draws from the policy's posteriors, not its means, so that uncertain estimates still get tried.
        Without estimates of both rates (a policy that has none, like a fixed tree) or of the prefill's cost, it
        drafts.
        """
        if getattr(self.policy, "throughput", None) is None or self.prefill_s_per_token is None:
            return DRAFT
        estimates = self.policy.throughput(context_len, sampled, draw=True)
        plain, (drafting, _) = estimates.get(NO_TREE), _best_drafting(estimates)
        if plain is None or drafting is None:
            return DRAFT
        if self.prefill_s_per_token * self._prefilled(context_len) + remaining / drafting < remaining / plain:
            return DRAFT
        self.kept_plain += 1
        return EXPLORE if self.kept_plain % START_ANYWAY_EVERY == 0 else PLAIN

    def _drafting_arm(self, context_len: int, remaining: int, params: SamplingParams) -> TreeConfig:
        """The drafting arm with the best Thompson draw (a round of an EXPLORE request the policy left undrafted)."""
        _, arm = _best_drafting(self.policy.throughput(context_len, not params.greedy, draw=True))
        return arm.truncated(remaining - 1)

    def _prefilled(self, context_len: int) -> int:
        """Tokens a drafter prefill over this context runs (its prefill window, if it has one)."""
        window = getattr(self.drafter, "prefill_window", None)
        return min(context_len, window) if window else context_len

    def _note_prefill(self, seconds: float, tokens: int) -> None:
        rate = seconds / max(tokens, 1)
        old = self.prefill_s_per_token
        self.prefill_s_per_token = rate if old is None else old + PREFILL_RATE_EMA * (rate - old)

    def _pick_tree(
        self, override: TreeConfig | None, context_len: int, remaining: int, params: SamplingParams
    ) -> TreeConfig:
        if self.drafter is None:
            return NO_TREE
        config = override if override is not None else self.policy.select(context_len, not params.greedy)
        # the bonus token comes for free: never draft deeper than what is left to generate
        return config.truncated(remaining - 1)

    def _round(
        self, target_side, drafter_side: LazyDrafter | None, config, params, draft_gen, target_gen, stats
    ) -> tuple[Draft, Verdict]:
        """One round; its time (the policy's reward) leaves out the drafter's prefill, a per-request cost that goes
        to stats.prefill_s; the drafter's catch-up on earlier verdicts counts as draft time."""
        t0 = time.perf_counter()
        drafter_prefill_s = 0.0
        if drafter_side is None or config.depth == 0:
            draft = empty_draft()
        else:
            built = drafter_side.session is not None
            draft = drafter_side.draft(config, params, draft_gen, self.min_path_prob)
            if not built:
                drafter_prefill_s = drafter_side.prefill_s
                self._note_prefill(drafter_prefill_s, self._prefilled(len(drafter_side.tokens)))
        t1 = time.perf_counter()
        logits = target_side.forward(draft)
        t2 = time.perf_counter()
        verdict = judge(logits, draft, params, target_gen)
        target_side.commit(verdict)
        if drafter_side is not None:
            drafter_side.commit(verdict)
        t3 = time.perf_counter()
        stats.prefill_s += drafter_prefill_s
        stats.draft_s += t1 - t0 - drafter_prefill_s
        stats.verify_s += t2 - t1
        stats.other_s += t3 - t2
        stats.last_round_s = t3 - t0 - drafter_prefill_s
        return draft, verdict
