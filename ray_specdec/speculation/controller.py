"""The speculation controller: every request's tree (`none` included), chosen to maximise the batch's expected tokens
per second of step time.

    rate(step) = sum_r E[tokens of r's round | r's tree] / T(step)

This is the one place that decides how much to draft. Its parts:

- **T(step)**: `StepCostModel`, a linear model of the step's wall time in what the step runs: a fixed cost, target
  rows (verify and prefill alike), verify rows times their context (attention), requests that draft and drafter rows
  (these two fitted on the drafts' own time), and replays: requests whose commit in the step keeps rows past the
  root of their last verify. An SSM target writes only its verify's root state and runs its scan again along the
  kept path at the commit (a few tenths of a millisecond per request on a small target on CPU, as much as a few
  verify rows), a KV cache only keeps the rows; a round is charged its expected replay, its chance of keeping a row
  past the root (its expected tokens past the bonus, at most 1). Its
  prior is measured on this target and drafter when the scheduler starts (`measure_prior`), and every step refines
  it by exponentially weighted least squares on the step's measured time. Nothing is assumed about the hardware: on
  a target whose weights fit the cache a verify row costs nearly a plain step, on a memory-bound one almost nothing.
- **E[tokens]**: the shared bandit's statistics (`bandit.Bandit.token_sums`): the tokens (accepted + the bonus) a
  round of each arm gave, per prompt-length bucket and greedy or sampled, pooled over load levels (acceptance does
  not depend on load), fed by the what-if counterfactuals (`counterfactuals.py`: one round teaches every arm its
  tree contains). The undrafted arm's tokens are those of undrafted rounds as they run, with their prompt-lookup
  proposals where they verify one (`SpeculationConfig.plain_lookup`), so the choice of a tree weighs prompt lookup
  in undrafted rounds as in drafted ones (there as extra verify rows, `lookup_rows`), on the same footing: averages
  over rounds.
- **Whether an undrafted round verifies its proposal**: decided every step, after the trees, by the same rule. The
  proposal is known before the step (a few dictionary reads, speculation/prompt_lookup.py), so its verify rows are
  exact, and the tokens of it the target will confirm are estimated position by position from the request's own
  rounds (`lookup_value.py`). It is verified where those tokens are worth more than its seconds at the rate the
  step's choice reached: a request whose context keeps repeating itself verifies long proposals, one whose never
  does verifies none, and a step with no proposal adds no rows.
- **A round's finishing time**: judging it, committing it and checking its stops, on the host after the forward.
  It depends on the round's kind more than on its rows (a sampled round with a draft runs rejection sampling over
  its tree's distributions; an undrafted greedy one reads an argmax), and a step has one per round, so a fit would
  confuse it with the step's fixed cost wherever every round is of one kind (one request in flight, always
  drafting). It is measured instead, each round timed (`observe_finish`), per kind (greedy or sampled, drafted or
  not): the median of the kind's latest rounds, robust to a round the machine delayed; while a kind has fewer than
  three, their least, so that a kind rarely run is not priced out by one slow round.
- **The drafter's prefill**: a request whose drafter holds no state yet pays one prefill over its context before its
  first drafted round. That is a per-request cost, not a per-round one: a drafted option is charged its share, the
  prefill's seconds times the option's expected tokens over the tokens the request has left to generate.
- **Exploration**: Thompson sampling. Each step draws every arm's expected tokens from its posterior (a normal around
  the mean of its rounds, with `prior_rounds` pseudo-rounds at an optimistic prior), so arms with few rounds are
  tried where they could win and not where even an optimistic draw loses.
- **The choice**: the step's rate is a ratio of sums over requests, each of which picks one option. Dinkelbach's
  method finds its exact maximum: for a rate lambda every request takes its option of highest tokens - lambda x
  seconds (a separable problem), lambda becomes the rate of those picks, and this repeats until the picks hold
  (2-4 passes; `choose_options`). One request in flight keeps a tree only where it beats plain decoding; under load,
  where every verify row adds to a step the others wait for, trees shrink, down to none where that pays.
- **How often**: a choice holds for `decide_every` steps (and ends when a request joins or leaves, or a round's pick
  is no longer among its options). Choosing costs ~0.2-0.6 ms of host time, a step of a small target on CPU a few
  milliseconds: chosen every step, 8 requests ran 0.87-0.93x of `tree none` in process on the same prompts with the
  same rounds (every one undrafted). The statistics and the cost model still learn from every step.

Requests whose client asked for a tree keep it (truncated to what they have left); a policy of one arm (a fixed
tree: `--tree`, the benchmarks' fixed cells) is not second-guessed either.
"""

from __future__ import annotations

import collections
import functools
import math
import statistics
import time
from dataclasses import dataclass
from typing import Hashable, Literal, NamedTuple, Sequence

import numpy as np
import torch

from ray_specdec.config import MAX_LOOKUP_TOKENS, TreeConfig
from ray_specdec.engine.target_backend import SegmentSpec, StepWork, TargetBackend
from ray_specdec.models.device_clock import now, settle
from ray_specdec.speculation.lookup_value import LookupAcceptance
from ray_specdec.settings import bounded, check_bounds

NO_TREE = TreeConfig(())


@dataclass(frozen=True)
class SpeculationConfig:
    """How much is drafted and how the choice is made: the proposers' settings and every tuning constant of the
    speculation controller. Part of `engine.config.EngineConfig`; each field is a flag of `generate` and `bench` and an
    argument of the app, its comment the documentation."""

    # drafts stop at depths whose paths the drafter itself rates below this probability (0: always the whole tree)
    min_path_prob: float = bounded(0.0, ge=0, lt=1)
    # every drafted tree of a greedy request also verifies up to this many tokens copied from earlier in the context
    # (prompt lookup, speculation/prompt_lookup.py; 0: off): free drafts where the context repeats itself, a few more
    # verify rows when it does (docs/BENCHMARKS.md). Trees written with their own "+L<k>" keep theirs.
    lookup: int = bounded(8, ge=0, le=MAX_LOOKUP_TOKENS)
    # greedy rounds the controller runs undrafted (never a request's own tree) verify up to this many lookup tokens
    # instead: no drafter step, a few verify rows (0: off)
    plain_lookup: int = bounded(4, ge=0, le=MAX_LOOKUP_TOKENS)
    # Weight of the past in the step cost model's least squares, per step: ~200 steps of memory, so that the model
    # follows load changes within a second or two of traffic.
    cost_forget: float = bounded(0.995, gt=0, le=1)
    # How many steps of typical size the measured prior counts as (a ridge towards it): a few, as it is measured on a
    # quiet machine with small shapes, and the steps of real traffic should take over within a second.
    cost_prior_steps: float = bounded(8.0, ge=0)
    # Steps measured before the cost model is trusted without a measured prior.
    cost_warmup_steps: int = bounded(16, ge=0)
    # Prior tokens an arm's round accepts per draft depth, before any round of it was measured: optimistic, so that
    # an arm is tried where it could pay.
    prior_accept_per_depth: float = bounded(0.6, ge=0)
    # Rounds an arm needs in a cell before its acceptance informs the prior of the cell's unmeasured arms (below the
    # optimistic per-depth prior where it is lower; 0: never).
    prior_from_rounds: float = bounded(4.0, ge=0)
    # Pseudo-rounds the prior counts as in an arm's posterior; a handful of real rounds outweigh it.
    prior_rounds: float = bounded(2.0, ge=0)
    # Standard deviation of one round's tokens assumed where an arm's own rounds do not say yet.
    prior_round_sd: float = bounded(1.0, ge=0)
    # Draw expected tokens from their posteriors (Thompson sampling); off: use the posterior means (no exploration).
    explore: bool = True
    # Steps a choice holds: the trees are chosen anew every this many steps and whenever the step's requests change;
    # between, each round keeps its request's last pick while its options still hold it. Choosing costs a few tenths
    # of a millisecond of host time, a step on a small target a few milliseconds (1: every step).
    decide_every: int = bounded(8, ge=1, le=1000)
    # Weight of a round in the running means of the verify rows a lookup proposal adds (drafted and undrafted).
    lookup_rows_weight: float = bounded(0.05, gt=0, le=1)
    # Weight of the past per round in the acceptance of undrafted rounds' lookup proposals pooled over requests
    # (speculation/lookup_value.py): ~1000 rounds of memory.
    lookup_forget: float = bounded(0.999, gt=0, le=1)
    # Rounds of the pooled lookup acceptance a request's own estimate starts from: a few of its own rounds outweigh it.
    lookup_request_prior: float = bounded(4.0, gt=0)
    # Weight of the newest measurement in the running estimate of the drafter's prefill seconds per token.
    prefill_rate_weight: float = bounded(0.2, gt=0, le=1)
    # Rounds of each kind whose finishing seconds (judge, commit, stops) the median is taken over.
    finish_window: int = bounded(15, ge=1, le=1000)
    # How sampled requests are drawn and verified. "coupled": Gumbel-max under noise keyed by (seed, choice,
    # position), verified by exact matching (speculation/coupled.py): the same text for the same seed whatever the
    # tree, batch or load. "rejection": multi-draft rejection sampling, its draws depending on the trees.
    # "auto": coupled for requests with a seed, rejection for the others.
    sampling_coupling: Literal["auto", "coupled", "rejection"] = "auto"

    def __post_init__(self) -> None:
        check_bounds(self)
        if self.sampling_coupling not in SAMPLING_COUPLINGS:
            raise ValueError(f"sampling_coupling must be one of {', '.join(SAMPLING_COUPLINGS)}, "
                             f"got {self.sampling_coupling!r}")

    def coupled(self, seed: int | None) -> bool:
        """Whether a sampled request with this seed (None: none given) is drawn in the coupled mode."""
        return self.sampling_coupling == "coupled" or (self.sampling_coupling == "auto" and seed is not None)


SAMPLING_COUPLINGS = ("auto", "coupled", "rejection")


# ----- the step's cost -----

# Features of a step: 1, target rows (verify and prefill rows alike: for the forward's matrix products a row is a
# row, and prefill steps then teach the cost of a verify row too), verify rows x their context in thousands of tokens
# (attention), requests that draft, drafter rows, requests whose commit keeps rows past their verify's root.
FEATURES = ("fixed", "target_rows", "verify_row_kilotokens", "drafting", "drafter_rows", "replays")
# Typical size of each feature: the prior's weight per feature is `cost_prior_steps` steps of this size.
FEATURE_SCALE = np.array([1.0, 64.0, 32.0, 8.0, 16.0, 8.0])
# The least size the prior is weighed at, as a share of FEATURE_SCALE's (squared): a feature that recent steps stopped
# having (no request drafts, no commit replays) returns to its prior as its evidence is forgotten, so that a weight
# learned too high, on a few noisy steps, does not keep the controller from that option for good.
PRIOR_FLOOR = 0.005


@dataclass(frozen=True)
class StepShape:
    """What a step ran, in the cost model's features."""

    verify_rows: int = 0
    verify_row_kilotokens: float = 0.0  # sum over rounds of verify rows x context / 1024
    drafting: int = 0  # requests that ran the drafter
    drafter_rows: int = 0  # rows the drafter stepped, all depths
    prefill_rows: int = 0
    replays: int = 0  # requests whose commit (run with this step's forward) keeps rows past their verify's root

    def features(self) -> np.ndarray:
        return np.array([1.0, self.verify_rows + self.prefill_rows, self.verify_row_kilotokens, self.drafting,
                         self.drafter_rows, self.replays])  # fmt: skip


def drafter_rows(tree: TreeConfig) -> int:
    """Rows the drafter steps for a tree: every depth but the last (leaves are never stepped)."""
    return sum(tree.rows_per_depth[:-1])


# The features the draft's own time is fitted on, and those the rest of the step's time is fitted on.
DRAFT_FEATURES = (3, 4)  # drafting, drafter_rows
FORWARD_FEATURES = (0, 1, 2, 5)  # fixed, target_rows, verify_row_kilotokens, replays


class StepCostModel:
    """T(step) = w . features(step), by exponentially weighted least squares around a prior (a ridge towards it);
    no weight below 0 (a row never makes a step cheaper, though noise over few distinct shapes can say so).

    The step's time is measured in two parts, each fitted on its own features: the drafts (requests that draft,
    drafter rows) and the rest (the target's forward over verify and prefill rows, judging, committing). Fitted on
    the whole step's time, the two sides' features move together under steady traffic (every request drafts a similar
    tree), and the fit could not tell a drafter row from a verify row."""

    def __init__(self, config: SpeculationConfig = SpeculationConfig()):
        self.config = config
        self._parts = [_Ridge(np.array(DRAFT_FEATURES)), _Ridge(np.array(FORWARD_FEATURES))]
        self.steps = 0
        self.calibrated = False
        self._w: np.ndarray | None = None

    def set_prior(self, weights: Sequence[float]) -> None:
        """Pull the fit towards `weights` (one per feature) with the evidence of `cost_prior_steps` typical steps."""
        for part in self._parts:
            part.set_prior(np.asarray(weights, dtype=np.float64), self.config.cost_prior_steps)
        self.calibrated = True
        self._w = None

    def observe(self, shape: StepShape, seconds: float, draft_seconds: float = 0.0) -> None:
        """A step of `shape` took `seconds`, `draft_seconds` of them drafting."""
        x = shape.features()
        draft, forward = self._parts
        draft.observe(x, draft_seconds, self.config.cost_forget)
        forward.observe(x, seconds - draft_seconds, self.config.cost_forget)
        self.steps += 1
        self._w = None

    @property
    def warm(self) -> bool:
        return self.calibrated or self.steps >= self.config.cost_warmup_steps

    def weights(self) -> np.ndarray:
        if self._w is None:
            w = np.zeros(len(FEATURES))
            for part in self._parts:
                w[part.features] = part.solve()
            self._w = np.maximum(w, 0.0)
        return self._w

    def summary(self) -> dict[str, float]:
        """The fitted weights by feature (seconds per unit)."""
        return dict(zip(FEATURES, map(float, self.weights())))


class _Ridge:
    """One part of the step's time: least squares on some of the features, forgetting the past, around a prior.

    The prior counts as `steps` steps of the size the observed steps have (each feature's mean square over them; the
    typical sizes of `FEATURE_SCALE` before any): at one request a step has one drafting request and a few rows, and a
    prior weighed in steps of eight drafting requests and 64 rows would outweigh every real step. It is never weighed
    below PRIOR_FLOOR of the typical size, so that a feature the steps stopped having returns to its prior."""

    def __init__(self, features: np.ndarray):
        self.features = features
        self._prior_w = np.zeros(len(features))
        self._prior_steps = 1e-6
        self._xtx = np.zeros((len(features), len(features)))
        self._xty = np.zeros(len(features))
        self._n = 0.0  # the observed steps, forgetting as the sums do

    def set_prior(self, weights: np.ndarray, steps: float) -> None:
        self._prior_w = np.asarray(weights, dtype=np.float64)[self.features]
        self._prior_steps = max(steps, 1e-6)

    def observe(self, x: np.ndarray, seconds: float, forget: float) -> None:
        x = x[self.features]
        self._xtx = forget * self._xtx + np.outer(x, x)
        self._xty = forget * self._xty + x * seconds
        self._n = forget * self._n + 1.0

    def solve(self) -> np.ndarray:
        typical = FEATURE_SCALE[self.features] ** 2
        if self._n > 0:
            seen = np.diag(self._xtx) / self._n
            typical = np.where(seen > 0, np.maximum(seen, PRIOR_FLOOR * typical), typical)
        prior_xtx = np.diag(typical) * self._prior_steps
        return np.linalg.solve(self._xtx + prior_xtx, self._xty + prior_xtx @ self._prior_w)


# ----- expected tokens -----


def posterior_tokens(arms: Sequence[TreeConfig], sums: np.ndarray, config: SpeculationConfig,
                     rng: np.random.Generator | None, undrafted_top: float = 1.0) -> np.ndarray:  # fmt: skip
    """Expected tokens of a round of each arm (accepted + the bonus): the posterior mean, or with `rng` one draw from
    the posterior. sums [arms, 3]: rounds, sum and sum of squares of their tokens (`Bandit.token_sums`).

    The posterior is a normal around the mean of the rounds plus `prior_rounds` pseudo-rounds at the prior: the
    optimistic 1 + prior_accept_per_depth x depth (1 for the undrafted arm), or lower where the cell's best-measured
    drafted arm says so (`prior_from_rounds` rounds or more): the tokens the arm's tree would give at the per-node
    acceptance that arm's mean implies (`tree_tokens`, `implied_acceptance`). Its spread is the rounds' own (the
    prior's sd until two rounds say otherwise) over sqrt(rounds + prior_rounds). Draws stay within what a round can
    give: [1, 1 + max depth], and for the undrafted arm [1, undrafted_top] (1 + the lookup proposal's size where its
    rounds verify one)."""
    sums = np.asarray(sums, dtype=np.float64).reshape(len(arms), 3)
    n, total, sq = sums.T
    depth = np.array([arm.max_depth for arm in arms], dtype=np.float64)
    prior = 1.0 + config.prior_accept_per_depth * depth
    drafted = depth > 0
    if config.prior_from_rounds > 0 and (n[drafted] >= config.prior_from_rounds).any():
        best = int(np.flatnonzero(drafted)[np.argmax(n[drafted])])  # the drafted arm with the most rounds
        alpha = implied_acceptance(arms[best], round(float(total[best] / n[best]), 2))
        informed = np.array([tree_tokens(arm, alpha) if arm.depth else 1.0 for arm in arms])
        prior = np.minimum(prior, informed)
    k = config.prior_rounds
    mean = np.divide(total + k * prior, n + k, out=prior.copy(), where=(n + k) > 0)
    own_var = np.divide(sq, n, out=np.zeros_like(sq), where=n > 0) - np.divide(total, n, out=np.zeros_like(sq),
                                                                                where=n > 0) ** 2  # fmt: skip
    var = np.where(n >= 2, np.maximum(own_var, 0.0), config.prior_round_sd**2)
    if rng is None:
        return mean
    se = np.sqrt(var / np.maximum(n + k, 1e-9))
    draw = mean + se * rng.standard_normal(len(arms))
    top = np.where(depth > 0, 1.0 + depth, max(undrafted_top, 1.0))
    return np.clip(draw, 1.0, top)


@functools.lru_cache(maxsize=4096)
def tree_tokens(tree: TreeConfig, acceptance: float) -> float:
    """Expected tokens of a round of `tree` (accepted + the bonus) where each drafted child is accepted with
    probability `acceptance`, independently: 1 + the sum over depths of the chance that the walk reaches it, which at
    depth d is the product over depths i <= d of 1 - (1 - acceptance)^N_i."""
    reach, total = 1.0, 1.0
    for children in tree.branching:
        reach *= 1.0 - (1.0 - acceptance) ** children
        total += reach
    return total


@functools.lru_cache(maxsize=4096)
def implied_acceptance(tree: TreeConfig, tokens: float) -> float:
    """The per-child acceptance at which `tree_tokens(tree, .)` gives `tokens` (bisection to 1e-4; clipped to
    [0, 1])."""
    lo, hi = 0.0, 1.0
    for _ in range(14):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if tree_tokens(tree, mid) < tokens else (lo, mid)
    return (lo + hi) / 2


# ----- the choice -----


def choose_options(tokens: np.ndarray, seconds: np.ndarray, fixed_s: float, max_passes: int = 16) -> np.ndarray:
    """The option per request (row) that maximises sum(tokens) / (fixed_s + sum(seconds)) over the step.

    tokens, seconds: [requests, options]; an option that is not available has tokens -inf. Dinkelbach's method: from
    each request's first option, at the rate lambda of the current picks every request takes its option of highest
    tokens - lambda * seconds; the rate of those picks is the next lambda. Each pass raises the rate, and picks that
    hold are the exact maximum (the problem is separable in the requests once lambda is fixed)."""
    rows = np.arange(tokens.shape[0])
    choice = np.zeros(tokens.shape[0], dtype=np.int64)
    if not tokens.shape[0]:
        return choice
    for _ in range(max_passes):
        rate = tokens[rows, choice].sum() / max(fixed_s + seconds[rows, choice].sum(), 1e-12)
        value = tokens - rate * seconds
        best = np.argmax(value, axis=1)
        # keep the current pick on ties (no churn between equal options)
        keep = value[rows, choice] >= value[rows, best] - 1e-12 * np.abs(value[rows, best])
        best = np.where(keep, choice, best)
        if (best == choice).all():
            break
        choice = best
    return choice


class Pick(NamedTuple):
    """A round's choice: its tree, and for an undrafted round whether it verifies a prompt-lookup proposal."""

    tree: TreeConfig
    plain_lookup: bool = False


@dataclass
class RoundFacts:
    """What the controller needs to know of a request's next round."""

    context_len: int
    sampled: bool
    remaining: int  # tokens the request may still generate
    options: Sequence[TreeConfig]  # trees it may run; NO_TREE among them where drafting is optional
    lookup_rows: float = 0.0  # verify rows a drafted option's lookup branch adds (mean measured)
    # verify rows an undrafted round's lookup proposal adds (mean measured over undrafted rounds); None: the round
    # may not verify one (sampled, or a client's own tree)
    plain_lookup_rows: float | None = None
    proposal_rows: int = 0  # this step's lookup proposal: its tokens (0: the context has no match)
    proposal_tokens: float = 0.0  # of those, the expected tokens the target confirms (`lookup_value.py`)
    prefill_tokens: int = 0  # tokens the drafter must prefill before this request's first drafted round (0: none)


class SpeculationController:
    """Chooses every request's tree per step (`choose`); learns the step's cost (`observe_step`) and the drafter's
    prefill rate (`observe_prefill`); reads expected tokens from the policy's shared statistics."""

    def __init__(self, policy, config: SpeculationConfig = SpeculationConfig(), seed: int | None = None):
        """policy: the bandit (`Bandit`: its arms and its shared statistics) or a fixed tree policy (one arm)."""
        self.policy = policy
        self.config = config
        self.cost = StepCostModel(config)
        self.prefill_s_per_token: float | None = None
        self.lookup_rows = 0.0  # mean verify rows a drafted tree's lookup branch added (running)
        self.plain_lookup_rows = 0.0  # mean verify rows an undrafted round's lookup proposal added (running)
        # seconds of a round's finishing, by (sampled, drafted); 0 until a round of the kind is measured
        kinds = [(sampled, drafted) for sampled in (False, True) for drafted in (False, True)]
        self.finish_s = dict.fromkeys(kinds, 0.0)
        self._finishes = {kind: collections.deque(maxlen=config.finish_window) for kind in kinds}
        self.drafted_rounds = 0  # rounds the controller chose a drafted tree for
        self.undrafted_rounds = 0  # rounds it chose none for
        self.plain_lookup_rounds = 0  # of those, the rounds it chose to verify a prompt-lookup proposal
        self.lookup = LookupAcceptance(config.lookup_forget, config.lookup_request_prior)
        self._rate: float | None = None  # the expected tokens per second the last choice reached
        self._rate_w: np.ndarray | None = None  # the cost weights it was reached with
        self._rng = np.random.default_rng(seed)
        self._expanded: dict[tuple[int, bool], tuple[Sequence[TreeConfig], tuple[Pick, ...]]] = {}
        self._held: dict[Hashable, Pick] = {}  # the last choice's pick per request (`choose` with keys)
        self._held_steps = 0  # steps since that choice

    @property
    def arms(self) -> tuple[TreeConfig, ...]:
        return tuple(self.policy.arms)

    @property
    def prices(self) -> bool:
        """Whether the controller chooses the trees: the policy keeps the shared statistics it prices its arms with
        (the bandit), and has more than one arm. Otherwise the policy's own pick is the round's tree (a fixed tree)."""
        return hasattr(self.policy, "token_sums") and len(self.arms) > 1

    def expected_tokens(self, context_len: int, sampled: bool, draw: bool = False) -> dict[TreeConfig, float]:
        """Each arm's expected tokens per round in this context (with `draw`: one posterior draw)."""
        arms = self.arms
        sums = self.policy.token_sums(context_len, sampled) if hasattr(self.policy, "token_sums") else None
        if sums is None:
            sums = np.zeros((len(arms), 3))
        undrafted_top = 1.0 + (0 if sampled else self.config.plain_lookup)
        values = posterior_tokens(arms, sums, self.config, self._rng if draw and self.config.explore else None,
                                  undrafted_top)  # fmt: skip
        return dict(zip(arms, map(float, values)))

    def choose(self, rounds: Sequence[RoundFacts], keys: Sequence[Hashable] | None = None) -> list[Pick]:
        """Every round's tree for this step, for the rounds' expected tokens per second of the step's decode time (its
        prompt chunks left out). A round of one option keeps it. Where an undrafted round may verify a prompt-lookup
        proposal (`plain_lookup_rows` not None), undrafted with and without one are two options, priced apart.

        keys: the rounds' requests. With them a choice holds for `decide_every` steps: the rounds keep their
        requests' last picks until then, unless a request joined or left, or a pick is no longer among its round's
        options (a request near its end, whose trees are cut)."""
        if keys is not None:
            self._held_steps += 1
            held = self._holding(rounds, keys)
            if held is not None:
                return self._counted(self._proposals_that_pay(rounds, held))
        picks = self._choose(rounds)
        if keys is not None:
            self._held, self._held_steps = dict(zip(keys, picks)), 0
        return self._counted(self._proposals_that_pay(rounds, picks))

    def _proposals_that_pay(self, rounds: Sequence[RoundFacts], picks: list[Pick]) -> list[Pick]:
        """The picks, each undrafted one that may verify a lookup proposal verifying this step's exactly where that
        pays at the rate the choice reached: its expected confirmed tokens above the seconds its rows (and the replay
        of what it keeps) add, priced with the weights of that choice (a solve of the cost model per step would cost
        a few tenths of a millisecond). Before any rate (a cold cost model), every proposal is verified."""
        w = self._rate_w
        out = []
        for facts, pick in zip(rounds, picks):
            if pick.tree.depth or facts.plain_lookup_rows is None:
                out.append(pick)
                continue
            pays = facts.proposal_rows > 0
            if pays and w is not None:
                gain = facts.proposal_tokens
                seconds = facts.proposal_rows * (w[1] + w[2] * facts.context_len / 1024) + w[5] * min(gain, 1.0)
                pays = gain > self._rate * seconds
            out.append(Pick(NO_TREE, pays))
        return out

    def _holding(self, rounds: Sequence[RoundFacts], keys: Sequence[Hashable]) -> list[Pick] | None:
        """The held picks of these rounds, or None where the choice must be made anew."""
        if self._held_steps >= self.config.decide_every or len(keys) != len(self._held):
            return None
        picks = []
        for facts, key in zip(rounds, keys):
            pick = self._held.get(key)
            if pick is None or pick not in self._expand(facts):
                return None
            picks.append(pick)
        return picks

    def _choose(self, rounds: Sequence[RoundFacts]) -> list[Pick]:
        options = [self._expand(facts) for facts in rounds]
        picks = [opts[0] for opts in options]
        if all(len(opts) == 1 for opts in options) or not self.cost.warm:
            return picks
        w = self.cost.weights()
        width = max(map(len, options))
        tokens = np.full((len(rounds), width), -np.inf)
        seconds = np.zeros((len(rounds), width))
        # one posterior draw (or the means) per cell per step
        draws: dict[tuple[int, bool, bool], dict[TreeConfig, float]] = {}
        groups: dict[int, tuple[tuple[Pick, ...], list[int]]] = {}  # rounds of the same options, priced together
        for i, opts in enumerate(options):
            groups.setdefault(id(opts), (opts, []))[1].append(i)
        for opts, members in groups.values():
            group_tokens, group_seconds = self._price(opts, [rounds[i] for i in members], w, draws)
            tokens[members, :len(opts)] = group_tokens
            seconds[members, :len(opts)] = group_seconds
        # the step's prompt chunks are left out: their rows are work every request pays once whatever the trees, and
        # counted here they would make a step that carries a long chunk look like a cheap place for verify rows.
        # Rounds that keep their one option add to the step as they are: one row of one option.
        closed = np.array([len(opts) == 1 for opts in options])
        open_rows = np.flatnonzero(~closed)
        fixed_s = w[0] + seconds[closed, 0].sum()
        closed_row = np.full((1, width), -np.inf)
        closed_row[0, 0] = tokens[closed, 0].sum()
        all_tokens = np.vstack([tokens[open_rows], closed_row])
        all_seconds = np.vstack([seconds[open_rows], np.zeros((1, width))])
        choice = choose_options(all_tokens, all_seconds, fixed_s)
        chosen = np.arange(len(choice)), choice
        self._rate = float(all_tokens[chosen].sum() / max(fixed_s + all_seconds[chosen].sum(), 1e-12))
        self._rate_w = w
        for row, i in enumerate(open_rows):
            picks[i] = options[i][choice[row]]
        return picks

    def _counted(self, picks: list[Pick]) -> list[Pick]:
        drafted = sum(1 for pick in picks if pick.tree.depth)
        self.drafted_rounds += drafted
        self.undrafted_rounds += len(picks) - drafted
        self.plain_lookup_rounds += sum(1 for pick in picks if pick.plain_lookup)
        return picks

    def _expand(self, facts: RoundFacts) -> tuple[Pick, ...]:
        """A round's options as picks: the undrafted one twice, with and without a lookup proposal, where it may have
        one. Remembered by the options' identity: the scheduler hands the same few option lists every step."""
        lookup = facts.plain_lookup_rows is not None
        known = self._expanded.get((id(facts.options), lookup))
        if known is not None and known[0] is facts.options:
            return known[1]
        picks = []
        for tree in facts.options:
            if not tree.depth and lookup:
                picks += [Pick(tree, True), Pick(tree, False)]
            else:
                picks.append(Pick(tree))
        if len(self._expanded) > 256:  # (the list is held, so its id is not reused while it is remembered)
            self._expanded.clear()
        self._expanded[(id(facts.options), lookup)] = (facts.options, tuple(picks))
        return tuple(picks)

    def _price(self, picks: tuple[Pick, ...], rounds: Sequence[RoundFacts], w: np.ndarray,
               draws: dict[tuple, dict[TreeConfig, float]]) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
        """(expected tokens, seconds each adds to the step) of every round in `rounds` (which share their options,
        `picks`) taking each pick: two [rounds, picks] arrays.

        A drafted pick's tokens are its arm's expected tokens in the round's cell, at most what its tree and lookup
        can give; its seconds are its verify rows at the round's context, the drafts' cost and its share of the
        drafter's prefill. An undrafted pick verifies its root (and with `plain_lookup`, the lookup proposal's
        rows); with a proposal it gives the undrafted arm's expected tokens, without one exactly one."""
        spec = _pick_spec(picks)
        full = np.empty((len(rounds), len(picks)))
        by_cell: dict[tuple[int, bool, bool], np.ndarray] = {}
        for row, facts in enumerate(rounds):
            # a request that would start its drafter is priced on the posterior means, not a draw: exploring must
            # not buy a drafter prefill that only a request drafting on would repay
            draw = not facts.prefill_tokens
            cell = (_bucket(facts.context_len), facts.sampled, draw)
            if cell not in by_cell:
                if cell not in draws:
                    draws[cell] = self.expected_tokens(facts.context_len, facts.sampled, draw=draw)
                by_cell[cell] = self._pick_tokens(picks, draws[cell])
            full[row] = by_cell[cell]
        context = np.array([facts.context_len for facts in rounds], dtype=np.float64)
        lookup_rows = np.array([facts.lookup_rows for facts in rounds])[:, None]
        plain_rows = np.array([facts.plain_lookup_rows or 0.0 for facts in rounds])[:, None]
        drafted = spec["drafted"]
        tokens = np.where(drafted, np.minimum(full, 1.0 + spec["max_depth"] + lookup_rows), full)
        rows = np.where(drafted, 1.0 + spec["nodes"] + np.where(spec["own_lookup"] > 0, spec["own_lookup"],
                                                                lookup_rows),
                        np.where(spec["plain"], 1.0 + plain_rows, 1.0))  # fmt: skip
        row_s = w[1] + w[2] * context / 1024  # a verify row at the round's context
        seconds = rows * row_s[:, None] + drafted * (w[3] + w[4] * spec["drafter_rows"])
        finish = np.array([(self.finish_s[facts.sampled, False], self.finish_s[facts.sampled, True])
                           for facts in rounds])  # fmt: skip
        seconds = seconds + np.where(drafted, finish[:, 1:], finish[:, :1])
        # the commit's replay of the kept rows (the next step's), where the round keeps any past its root
        seconds = seconds + w[5] * np.clip(tokens - 1.0, 0.0, 1.0)
        if self.prefill_s_per_token is not None:  # a drafted option's share of the drafter's prefill
            prefill = np.array([facts.prefill_tokens for facts in rounds], dtype=np.float64)[:, None]
            if prefill.any():
                remaining = np.array([max(facts.remaining, 1) for facts in rounds], dtype=np.float64)[:, None]
                share = np.minimum(1.0, tokens / remaining)
                seconds = seconds + drafted * self.prefill_s_per_token * prefill * share
        return tokens, seconds

    def _pick_tokens(self, picks: tuple[Pick, ...], expected: dict[TreeConfig, float]) -> np.ndarray:
        """Each pick's expected tokens per round from its cell's arm values (before capping by the round's lookup)."""
        values = []
        for pick in picks:
            tree = pick.tree
            if not tree.depth:  # the undrafted arm learns from its rounds as they run, lookup proposals and all
                values.append(expected.get(NO_TREE, 1.0) if pick.plain_lookup else 1.0)
                continue
            full = expected.get(tree)
            if full is None:  # a tree cut short (the request's last tokens): the largest arm it is a cut of
                full = max((v for arm, v in expected.items() if arm.depth and arm.truncated(tree.depth) == tree),
                           default=1.0 + self.config.prior_accept_per_depth * tree.max_depth)  # fmt: skip
            values.append(full)
        return np.array(values)

    # ----- learning -----

    def observe_step(self, shape: StepShape, seconds: float, draft_seconds: float = 0.0) -> None:
        """A step of `shape` took `seconds`, `draft_seconds` of them drafting."""
        self.cost.observe(shape, seconds, draft_seconds)

    def observe_finish(self, sampled: bool, drafted: bool, seconds: float) -> None:
        """A round of this kind took `seconds` to finish after the forward (judge, commit, stops)."""
        latest = self._finishes[sampled, drafted]
        latest.append(seconds)
        self.finish_s[sampled, drafted] = min(latest) if len(latest) < 3 else statistics.median(latest)

    def observe_prefill(self, seconds: float, tokens: int) -> None:
        """A drafter prefill over `tokens` took `seconds`."""
        rate = seconds / max(tokens, 1)
        old = self.prefill_s_per_token
        self.prefill_s_per_token = rate if old is None else old + self.config.prefill_rate_weight * (rate - old)

    def observe_lookup(self, rows: int, drafted: bool) -> None:
        """A round's lookup proposal added `rows` verify rows (in a drafted tree, or as an undrafted round's chain)."""
        weight = self.config.lookup_rows_weight
        if drafted:
            self.lookup_rows += weight * (rows - self.lookup_rows)
        else:
            self.plain_lookup_rows += weight * (rows - self.plain_lookup_rows)

    def calibrate(self, target: TargetBackend, drafters) -> None:
        """The step cost model's prior and the drafter's prefill rate, measured on this target and drafting side
        (speculation/drafters.py `Drafters`; None: no drafter)."""
        weights, prefill_s_per_token = measure_prior(target, drafters)
        self.cost.set_prior(weights)
        if self.prefill_s_per_token is None:
            self.prefill_s_per_token = prefill_s_per_token

    def summary(self) -> dict:
        """What `/v1/bandit` and the stats show of the controller: the cost model's weights, the drafter's prefill
        rate, the lookup rows, the rounds it drafted and those it ran undrafted (with a lookup proposal or not)."""
        total = self.drafted_rounds + self.undrafted_rounds
        return {"cost_weights": self.cost.summary(), "cost_steps": self.cost.steps,
                "drafter_prefill_s_per_token": self.prefill_s_per_token, "lookup_rows": self.lookup_rows,
                "plain_lookup_rows": self.plain_lookup_rows, "lookup_rates": self.lookup.summary(),
                "drafted_rounds": self.drafted_rounds,
                "finish_s": {f"{'sampled' if sampled else 'greedy'} {'drafted' if drafted else 'undrafted'}": value
                             for (sampled, drafted), value in self.finish_s.items()},
                "undrafted_rounds": self.undrafted_rounds, "plain_lookup_rounds": self.plain_lookup_rounds,
                "drafted_share": self.drafted_rounds / total if total else None}  # fmt: skip


@functools.lru_cache(maxsize=256)
def _pick_spec(picks: tuple[Pick, ...]) -> dict[str, np.ndarray]:
    """The per-pick constants of pricing, as rows of arrays: drafted or not, with a lookup proposal or not, the deepest
    it can accept, its draft nodes, its own lookup tokens and the drafter rows it steps."""
    trees = [pick.tree for pick in picks]
    return {"drafted": np.array([tree.depth > 0 for tree in trees]),
            "plain": np.array([pick.plain_lookup for pick in picks]),
            "max_depth": np.array([tree.max_depth for tree in trees], dtype=np.float64),
            "nodes": np.array([tree.num_nodes for tree in trees], dtype=np.float64),
            "own_lookup": np.array([tree.lookup for tree in trees], dtype=np.float64),
            "drafter_rows": np.array([drafter_rows(tree) if tree.depth else 0 for tree in trees], dtype=np.float64)}


def _bucket(context_len: int) -> int:
    """A coarse context key for sharing one posterior draw per step between requests of similar contexts."""
    return max(context_len, 1).bit_length()


# ----- the measured prior -----


def measure_prior(target: TargetBackend, drafters) -> tuple[list[float], float]:
    """-> (StepCostModel weights, the drafter's prefill seconds per token), measured on a target side and a drafting
    side (`Drafters.timings`, local or remote; None: no drafter):
    the target's forward at a few batch shapes (requests x rows per request, over 64 tokens of context, and one
    request over up to 512 for the attention's share, through `target.run` like any step), the drafter's step at 1
    and 16 rows, its catch-up over two tokens and its prefill over 64. Each shape is timed three times and the
    fastest kept (the machine's noise only ever adds)."""
    ids = [f"calibrate-{i}" for i in range(8)]
    long = min(512, target.max_context // 2)  # a small test model's context may be short
    contexts = {i: (long if i == ids[0] else 64) for i in ids}
    settle(target.run(StepWork(allocations=[(i, contexts[i] + 64) for i in ids],
                               segments=[SegmentSpec(i, torch.zeros(contexts[i] - 1, dtype=torch.long))
                                         for i in ids])))  # fmt: skip
    samples: dict[tuple[int, int], float] = {}  # (requests, rows per request) -> seconds
    pending: list[str] = []
    shapes = [(1, 1), (1, 16), (8, 1), (8, 4)]
    for requests, per_request in shapes * 3:
        chain = tuple((0,) * d for d in range(1, per_request))
        members = ids[1:requests + 1] if requests < len(ids) else ids
        work = StepWork(commits=[(i, (0,)) for i in pending],
                        segments=[SegmentSpec(i, torch.zeros(per_request, dtype=torch.long), chain)
                                  for i in members])  # fmt: skip
        t0 = time.perf_counter()
        settle(target.run(work))  # the device's time too, not the launches' (device_clock)
        key = (requests, per_request)
        samples[key] = min(time.perf_counter() - t0, samples.get(key, math.inf))
        pending = members
    # one request over the long context, 16 rows: the attention's share
    long_chain = tuple((0,) * d for d in range(1, 16))
    long_s = math.inf
    for _ in range(3):
        work = StepWork(commits=[(i, (0,)) for i in pending],
                        segments=[SegmentSpec(ids[0], torch.zeros(16, dtype=torch.long), long_chain)])
        t0 = time.perf_counter()
        settle(target.run(work))
        long_s = min(long_s, time.perf_counter() - t0)
        pending = [ids[0]]
    target.run(StepWork(commits=[(i, (0,)) for i in pending], releases=ids))
    x = np.array([[1.0, r * n] for r, n in samples], dtype=np.float64)
    y = np.array(list(samples.values()), dtype=np.float64)
    fixed, per_row = np.linalg.lstsq(x, y, rcond=None)[0].tolist()
    fixed, per_row = max(fixed, 0.0), max(per_row, 0.0)
    # beyond a 16-row step at 64 tokens: attention over the longer context's extra tokens, per row and kilotoken
    per_row_kilotoken = max(long_s - samples[(1, 16)], 0.0) / (16 * max(long - 64, 1) / 1024) if long > 64 else 0.0
    # a replay's cost is learned from traffic (its prior 0: a KV cache's commit replays nothing)
    if drafters is None:
        return [fixed, per_row, per_row_kilotoken, 0.0, 0.0, 0.0], 0.0
    step_1, step_16, catch_up, prefill_64 = drafters.timings()
    per_drafter_row = max(step_16 - step_1, 0.0) / 15
    drafting = catch_up + max(step_1 - per_drafter_row, 0.0)
    return [fixed, per_row, per_row_kilotoken, drafting, per_drafter_row, 0.0], prefill_64 / 64


def drafter_timings(drafter) -> tuple[float, float, float, float]:
    """Seconds of the drafter's step at 1 and 16 rows, a catch-up over two tokens and a prefill over 64, each the
    fastest of three."""
    return tuple(min(_time_drafter(drafter, kind) for _ in range(3)) for kind in (1, 16, "extend", "prefill"))


def _time_drafter(drafter, kind: int | str) -> float:
    """Seconds of one drafter step of `kind` rows, of a catch-up over two tokens ("extend") or of a prefill over 64
    ("prefill"), with the device idle at both ends (device_clock: on CUDA the launches alone would price drafting
    near zero)."""
    t0 = now(drafter.device)
    if kind == "extend":
        drafter.extend(drafter.new_state(1), torch.zeros(2, dtype=torch.long))
    elif kind == "prefill":
        drafter.prefill(torch.zeros(64, dtype=torch.long))
    else:
        drafter.step(drafter.new_state(kind), torch.zeros(kind, dtype=torch.long))
    return now(drafter.device) - t0
