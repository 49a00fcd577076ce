"""A measured guard on speculation: at each load level, greedy or sampled, the policy's trees run only while steps
with them are measured to decode no slower than steps whose rounds run undrafted.

Why. Goodput sizing (speculation/goodput.py) and the bandit choose trees from models, a step cost model and acceptance
estimates. Under load both have been optimistic (issue 18: closed loop at 8 and 32 requests, the service's own choice
9-20% slower than tree none) and nothing checked the realised result. The guard does, per load level of the bandit
(`BanditConfig.load_edges`, of the requests admitted to the step) and per greedy or sampled step, and where drafting
loses it has the scheduler run that level's rounds undrafted.

Load. A level is the bandit's load level (`BanditConfig.load_edges`) of the requests admitted to the step, decoding
or prefilling: under steady traffic that count holds still while the decoding count dips whenever requests end and
their successors prefill. Keyed by the decoding count, such dips fell into a lower level with a verdict of its own,
and its drafted steps paid every request's drafter catch-up over the tokens of the plain steps before (measured
served at 8 requests: steps of 3 decoding requests took 35-90 ms drafted, against 6 ms plain).

Greedy and sampled. Each level keeps two verdicts (two `_Level`s): one for steps whose steered requests (below) are
all greedy, one for steps with a sampled one among them. Drafting pays less at T=1, where fewer drafted tokens are
accepted; under one verdict per level, T=1 traffic ran the greedy traffic's verdict and exploration period and
measured its steps into the same windows (served at T=1 and 8 requests, drafting measured 0.45-0.86x). A step of
both kinds goes with the sampled set: it drafts or not as a whole, and its sampled requests gain the least from it,
so the greedy verdict stays one measured on greedy steps alone.

What is compared. The guard's two modes, step by step: *policy* steps, whose trees the policy and goodput choose as
always, against *plain* steps, whose rounds it runs undrafted (what forcing tree none does). A request with a tree the
client asked for drafts in both modes: common to both sides, it leaves the comparison the one the guard decides. A
step with no request the guard steers (all of them on a tree of their client's, `tree none` included, or kept
undrafted by the start rule) is neither side and is not handed in at all: served, a benchmark's `tree none` cell
between two of the service's own moved load 1's verdict to undrafted, and the next cell at concurrency 1 ran so. A
request the start rule explores with drafts only in policy steps (it once drafted in plain steps too: served at 8
requests, one explorer in flight made every plain step pay a draft call and its verify rows, 13 ms against 10). Only
decode-only steps are measured: a prefill chunk's time says nothing about drafting.

Drafter prefills. A request that drafts pays one drafter prefill over its context (a request never drafted never
pays one: LazyDrafter), and short requests can lose to it alone. Each measured policy step is charged the steady
state's share of them, `drafting_s`: the tokens its steered requests decoded times a drafting request's prefill
spread over the tokens it decodes (start_rule.StartRule.prefill_s_per_decoded_token). The prefills that actually ran
in a step are left out of both sides (those of requests on trees of their own are common to both). Charging those
instead (as earlier versions did, carrying the prefills of unmeasured steps to the next measured one) weighed the
mode switches, not drafting: the first drafted step of an exploration run builds a session for every request in flight,
and a run measures three steps, so at concurrency 1 one request's whole prefill counted against three rounds where
steady drafting spreads it over twenty. In process the level measured drafting at 0.6-0.8x, ran undrafted for most
of a 15-second run, and decoded 289 tokens/s against 319-340 with the guard off. (Even earlier, prefills counted only
inside measured steps, which under load mostly carry a target prefill chunk too: served at 32 requests the guard
measured drafting 1.7x faster while the service ran at 0.57x of tree none.)
- plain side: per plain step of the level's last WINDOW, the seconds it took to give each of its n requests one token,
  seconds * n / tokens (its seconds, when none drafted), fitted as a line a + b n (a, b >= 0; one n seen: its mean).
  Steps of different n are not comparable raw; the line makes them so.
- policy side: per policy step of the last WINDOW (more where steps hold few requests: the last POLICY_ROUNDS
  request-rounds, as what a round commits depends on its text), the seconds plain steps would have taken to give
  each of its n requests as many tokens, (tokens / n) * plain(n), against the seconds it took. speedup = the sum of
  the former over the sum of the latter: a ratio of throughputs (a mean of per-step ratios would be biased up by
  noisy steps).
- stalls: on either side a step counts as at most STALL_CAP times what the side's steps of its size take (a line
  fitted over n, as for the plain side), so that one stall of the process does not decide a verdict; a policy step's
  drafter prefill charge is added after the cap, being drafting's real cost.
- verdict, with hysteresis against noise: a level goes plain when speedup < 1 - MARGIN, and back to the policy when
  speedup > 1 + MARGIN, once the level is *settled*: both sides have MIN_SAMPLES steps, or EARLY_SAMPLES and a gap
  clear of the noise (|log speedup| > EARLY_Z standard errors, from the steps' own scatter: `_clear`). Under load with
  prompts arriving all the time most steps carry a prefill chunk and are not measured, and warming up drafts half the
  steps: at 32 requests on the 2-core machine, where a drafted step cost 2.3x a plain one, waiting for MIN_SAMPLES cost
  ~7% of a 15-second run; a 2x gap is clear after three steps a side.

Exploration. Of every `period` steps at a level, EXPLORE_RUN consecutive ones run the other mode, so both sides stay
measured and a wrong verdict ends. Runs, not single steps: the first step that drafts after plain ones pays each
request's drafter catch-up over the tokens committed meanwhile and the prefills of the requests that came meanwhile, a
cost of switching rather than of drafting, so the first step after a switch is on neither side (it is measured as the
switch's cost, below). While a level warms up (not settled, no prior: below) the period is two runs, to decide soon;
with a prior, the one the prior level's gap and switches call for. Once settled it starts at EXPLORE_PERIOD and doubles
after every run that leaves the verdict as it was, up to MAX_EXPLORE_PERIOD (exploring the losing mode costs a share of
its gap, and a settled verdict needs it less); a verdict that changes sets it back to EXPLORE_PERIOD. And it is never
shorter than what keeps one run's cost within EXPLORE_COST of the level's time: its EXPLORE_RUN steps each losing `gap`
(1/speedup - 1 or speedup - 1) of a step, and its two switches. A wide gap is explored rarely from the start (as a
bandit pulls an arm far behind rarely), a narrow one often, where noise could have put the verdict on the wrong side.
Served at 8 requests on the 2-core machine, a drafting step cost ~40% more than a plain one there, so exploring 4 steps
in 32 cost ~5% of throughput; at 256, under 1%. At 32 requests a drafted step cost 2.3x: 4 in 256 at once.

Switch cost. A run pays for its switches too, and they can outweigh its steps: served at T=1 and 8 requests, level
5-16 was undrafted before and after a cell, but a flip and a flip back had reset its period to 32, and every run's
first step paid drafter prefills for the requests that came since the last (498 steps in the cell, against 754-795 in
the other cells of T=1 at 8). Periods sized on the gap alone left that out, so exploring cost far more than
EXPLORE_COST. The step after a switch is measured where the level itself switched (not where the load moved between
levels of different verdicts): the seconds it took, with the drafter prefills that ran in it if it drafts (in a plain
step they are those of requests on trees of their own, common to both modes), beyond what a steady step of its mode at
the level takes for its tokens (the plain line's time for them; for a policy step, that over the measured speedup,
which holds its drafter prefill charge). The mean excess of the last SWITCHES such steps into each mode (at least 0)
summed is one run's switch cost; the period counts it in steps of the verdict's mode. Like the sides, only steps
without a target prefill are measured; a stall in one lengthens the period for a few runs, the cheap way to err.

Priors. A level not settled yet runs undrafted where the nearest settled level at lower load of its own set is
undrafted (a sampled level: or the nearest settled greedy level at its load or lower), and explores at the period the
prior level's gap and switches call for (not its doubled one: here the verdict is unconfirmed). Drafting gains less
with more requests in a step and less when sampling, so where it lost with fewer requests, or greedy, it is the best
guess at hand. A drafted verdict carries over nowhere: that drafting won with fewer requests says little of more (a
first version took drafted priors too; served, greedy at 8 requests then started from concurrency 1's drafted verdict,
explored it at concurrency 1's long period, and ran 0.85x of undrafted for both cells). Warming up from scratch drafts
half the steps until the level settles, and under load few steps are measured: served at 32 requests, level 17+ had
never been visited while 5-16 was settled undrafted, only 8 policy steps were measured by the end of the 15-second
cell (with fresh prompts most steps carry a prefill chunk), and the whole cell ran half drafted where drafting was 2x
slower, at 0.79x of undrafted throughput. The exploration runs still measure the level, so a wrong prior ends when it
settles (a clear gap after one run). With no settled level to learn from, a level warms up as before.

Clock-free and deterministic: callers hand in the seconds they measured, so tests drive it with made-up timings.
"""

from __future__ import annotations

import bisect
import itertools
import math
import operator
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Iterable

import numpy as np

from ray_specdec.speculation.bandit import DEFAULT_LOAD_EDGES, load_labels

# Steps per side a level's comparison remembers: ~32 keeps per-step noise (~20% on a shared 2-core machine) to a few
# percent in the ratio, while a reversed trend takes over within about one window of the losing side's runs.
WINDOW = 32
# The policy side keeps more steps where they hold few requests: at least this many request-rounds (steps x their
# decoding requests), up to as many steps. What a drafted round commits depends on the text, so at one request 32
# steps are one or two requests: one text the drafter reads badly measured 0.98 in a 20-second run whose drafting
# won 1.6x, the level went undrafted, and the stale window kept it so for half the run (292 against 331 tokens/s).
POLICY_ROUNDS = 256
# Steps per side before a level's verdict may leave the policy's own choice.
MIN_SAMPLES = 8
# Hysteresis around speedup 1: a level changes sides only when the other is this much (relative) faster.
MARGIN = 0.03
# Steps per side before a verdict whose gap is clear of the noise: |log speedup| > EARLY_Z relative standard errors
# (with few steps the scatter is itself uncertain: a wide z, and never below EARLY_MIN_SE of relative error).
EARLY_SAMPLES = 3
EARLY_Z = 4.0
EARLY_MIN_SE = 0.05
# Of every EXPLORE_PERIOD steps at a level, EXPLORE_RUN consecutive ones run the losing mode (3 of them measured):
# 1/8 of the steps, costing at most an eighth of the gap between the modes while keeping the losing side fresh.
EXPLORE_PERIOD = 32
EXPLORE_RUN = 4
# The period doubles after each run that confirms the verdict, up to this (a reversed trend then still shows within
# WINDOW / (EXPLORE_RUN - 1) runs: about 11 runs, ~2,800 steps at most).
MAX_EXPLORE_PERIOD = 256
# The share of a level's throughput exploration may cost once settled: the period is at least one run's cost (its
# EXPLORE_RUN losing steps, EXPLORE_RUN * gap, and its two switches, in the level's steps) / EXPLORE_COST (up to
# MAX_EXPLORE_PERIOD).
EXPLORE_COST = 0.02
# Switch steps per level whose excess is remembered (both directions): about four exploration runs.
SWITCHES = 8
# A step counts as at most this many times what its side's steps of its size take (their fitted line): served at
# concurrency 1, a level's measured speedup fell from 1.31 to 0.89 within one cell and ran it undrafted while drafting
# won 1.3x; one stall of the process (a burst of Ray's own work, a collection) among ~6 ms steps does that. The
# drafter prefill charge of a policy step is a cost of drafting, not noise: it is added after the cap.
STALL_CAP = 2.0
# A settled level weighs its verdict at every step of the side it explores and at every RECHECK-th step of the side
# its verdict runs: one more step of a window of WINDOW moves the ratio by a few percent of its gap at most, and
# weighing costs ~0.17 ms (NumPy over both windows), 10% of a one-request step on a GPU. A flip comes at most
# RECHECK - 1 steps later.
RECHECK = 8


@dataclass
class _Level:
    # (n, tokens, seconds, drafting_s) of steps: n requests decoded `tokens` tokens in all
    plain: deque = field(default_factory=lambda: deque(maxlen=WINDOW))
    policy: deque = field(default_factory=lambda: deque(maxlen=POLICY_ROUNDS))  # trimmed to POLICY_ROUNDS rounds
    # (undrafted, seconds) of the steps right after a switch into that mode: what they took beyond a steady step
    switches: deque = field(default_factory=lambda: deque(maxlen=SWITCHES))
    clock: int = 0  # steps run at this level since its last exploration run ended
    period: int = EXPLORE_PERIOD  # steps per cycle of one exploration run, once settled or from a prior
    flipped: bool = False  # whether the verdict changed since the last exploration run ended
    undrafted: bool = False  # the verdict: run this level's rounds undrafted
    settled: bool = False  # enough steps measured for a verdict (MIN_SAMPLES a side, or a clear gap)
    unweighed: int = 0  # steps measured since the verdict was last weighed (RECHECK)


class SpeculationGuard:
    """Per load level, greedy or sampled: whether this step's rounds run undrafted (`plain`), fed every step's result
    (`observe`)."""

    def __init__(self, load_edges: tuple[int, ...] = DEFAULT_LOAD_EDGES):
        self.load_edges = tuple(load_edges)
        self.levels = [_Level() for _ in range(len(self.load_edges) + 1)]  # of steps whose steered requests are greedy
        self.sampled_levels = [_Level() for _ in self.levels]  # of steps with a sampled one
        self.plain_steps = 0  # steps the guard ran undrafted (verdict or exploration)
        self._mode: bool | None = None  # the current step's: undrafted?
        self._previous: bool | None = None  # the step before's
        self._level: _Level | None = None  # the current step's level
        self._previous_level: _Level | None = None  # the step before's

    def level(self, load: int) -> int:
        return bisect.bisect_left(self.load_edges, load)

    def plain(self, load: int, sampled: bool = False) -> bool:
        """Whether the rounds of this step, of `load` decoding requests, run undrafted; `sampled`: whether any request
        it steers samples. Once per step, before it runs: it advances the level's exploration clock."""
        index = self.level(load)
        lv = self._set(sampled)[index]
        prior = None if lv.settled else self._prior(index, sampled)
        if prior is not None:  # its verdict, explored at the period the prior's own gap and switches call for
            lv.undrafted = prior.undrafted
            if lv.clock == 0:
                lv.period = _explore_period(prior)
        warming = not lv.settled and prior is None
        period = 2 * EXPLORE_RUN if warming else lv.period
        explore = lv.clock >= period - EXPLORE_RUN
        lv.clock += 1
        if lv.clock >= period:  # the run ends with this step
            lv.clock = 0
            if lv.settled:
                lv.period = max(EXPLORE_PERIOD if lv.flipped else min(2 * lv.period, MAX_EXPLORE_PERIOD),
                                _explore_period(lv))  # fmt: skip
            lv.flipped = False
        self._previous, self._mode = self._mode, lv.undrafted != explore
        self._previous_level, self._level = self._level, lv
        self.plain_steps += self._mode
        return self._mode

    def observe(self, load: int, tokens: int, seconds: float, prefill: bool = False, decoding: int | None = None,
                drafting_s: float = 0.0, drafter_prefill_s: float = 0.0) -> None:
        """The step `plain` was last asked for (at `load`, measured at the level `plain` chose): `decoding` requests
        (None: `load`) decoded `tokens` tokens in all in `seconds` (drafter prefills left out); `drafting_s`: a policy
        step's charge for drafter prefills (ignored on a plain step); `drafter_prefill_s`: the drafter prefills that
        ran in it (counted only in a policy step right after a switch, in what the switch cost); `prefill`: whether it
        also ran target prefill rows (then it is not measured)."""
        n = load if decoding is None else decoding
        lv = self._level
        if prefill or seconds <= 0 or n < 1 or tokens < 1:
            return
        if self._mode != self._previous:  # a switch's cost, not a mode's: measured apart, where the level switched
            if self._previous_level is lv:
                excess = _switch_excess(lv, self._mode, n, tokens,
                                        seconds + (0.0 if self._mode else drafter_prefill_s))  # fmt: skip
                if excess is not None:
                    lv.switches.append((self._mode, excess))
            return
        (lv.plain if self._mode else lv.policy).append((n, tokens, seconds, 0.0 if self._mode else drafting_s))
        _trim(lv.policy)
        # a settled level's verdict side moves its ratio slowly: weighed every RECHECK of its steps (the ratio over
        # both windows is ~0.17 ms of NumPy, a tenth of a GPU step), the exploring side's at each of its steps
        lv.unweighed += 1
        if lv.settled and self._mode == lv.undrafted and lv.unweighed < RECHECK:
            return
        lv.unweighed = 0
        speedup = _speedup(lv)
        measured = min(len(lv.plain), len(lv.policy))
        if speedup is None or measured < EARLY_SAMPLES:
            return
        lv.settled = lv.settled or measured >= MIN_SAMPLES or _clear(lv, speedup)
        if not lv.settled:
            return
        if (speedup < 1 - MARGIN) if not lv.undrafted else (speedup > 1 + MARGIN):
            lv.undrafted = not lv.undrafted
            lv.flipped = True
            lv.period = _explore_period(lv)
            lv.clock = min(lv.clock, lv.period - EXPLORE_RUN)  # a whole run next, not the tail of a longer cycle

    def _set(self, sampled: bool) -> list[_Level]:
        return self.sampled_levels if sampled else self.levels

    def _prior(self, index: int, sampled: bool) -> _Level | None:
        """The settled undrafted level whose verdict an unsettled one at `index` runs: the nearest settled one at
        lower load of its own set, or for a sampled level the nearest settled greedy one at its load or lower, where
        that one is undrafted (a drafted verdict carries to no other level)."""
        own = next((lv for lv in reversed(self._set(sampled)[:index]) if lv.settled), None)
        greedy = next((lv for lv in reversed(self.levels[:index + 1]) if lv.settled), None) if sampled else None
        return next((lv for lv in (greedy, own) if lv is not None and lv.undrafted), None)

    def speedup(self, level: int, sampled: bool = False) -> float | None:
        """Policy steps' decode throughput over plain steps' at a level (None: a side unmeasured)."""
        return _speedup(self._set(sampled)[level])

    def summary(self) -> list[dict]:
        """Per load level: its label and the greedy steps' verdict, measured speedup, steps measured per side,
        exploration period and the seconds one run's switches cost beyond steady steps; the sampled steps' under
        "sampled"."""
        return [{"load": label, **_summary(greedy), "sampled": _summary(sampled)}
                for label, greedy, sampled in zip(load_labels(self.load_edges), self.levels, self.sampled_levels)]


def _summary(lv: _Level) -> dict:
    return {"undrafted": lv.undrafted, "speedup": _speedup(lv), "plain": len(lv.plain), "policy": len(lv.policy),
            "explore_period": lv.period, "switch_s": _switch_s(lv), "settled": lv.settled}


def _speedup(lv: _Level) -> float | None:
    if not lv.plain or not lv.policy:
        return None
    sides = _sides(lv)
    return float(sides.as_plain.sum() / sides.took.sum())


def _trim(policy: deque) -> None:
    """Drop the oldest policy steps while more than WINDOW remain that hold POLICY_ROUNDS request-rounds."""
    if len(policy) <= WINDOW:
        return
    rounds = sum(map(_requests, policy))
    while len(policy) > WINDOW and rounds - policy[0][0] >= POLICY_ROUNDS:
        rounds -= policy.popleft()[0]


_requests = operator.itemgetter(0)  # a step's requests (n)


def _explore_period(lv: _Level) -> int:
    """The shortest exploration period that keeps its cost within EXPLORE_COST of the level's time: one run is
    EXPLORE_RUN steps of the losing mode, each `gap` of a step slower, and a switch into each mode (_switch_s), in
    steps of the verdict's mode."""
    if not lv.plain or not lv.policy:
        return EXPLORE_PERIOD
    sides = _sides(lv)
    speedup = float(sides.as_plain.sum() / sides.took.sum())
    gap = abs(speedup - 1) / min(speedup, 1.0)  # 1/s - 1 where drafting loses, s - 1 where it wins
    step_s = float(sides.plain_s.mean() if lv.undrafted else sides.took.mean())
    run = EXPLORE_RUN * gap + _switch_s(lv) / step_s
    return min(MAX_EXPLORE_PERIOD, max(EXPLORE_PERIOD, math.ceil(run / EXPLORE_COST)))


def _switch_excess(lv: _Level, undrafted: bool, n: int, tokens: int, seconds: float) -> float | None:
    """Seconds a step right after a switch into `undrafted`'s mode took beyond what a steady step of that mode at
    the level takes for its tokens: the plain line's time for them, over the measured speedup for a policy step
    (whose steady time includes its drafter prefill charge). None while a side is unmeasured."""
    if not lv.plain or not lv.policy:
        return None
    sides = _sides(lv)
    steady = 1.0 if undrafted else float(sides.took.sum() / sides.as_plain.sum())
    return seconds - tokens / n * float(sides.line(n)) * steady


def _switch_s(lv: _Level) -> float:
    """Seconds an exploration run's two switches cost beyond steady steps: per mode, the mean excess of the steps
    after a switch into it (at least 0; 0 where none measured), summed."""
    total = 0.0
    for undrafted in (False, True):
        excess = [seconds for mode, seconds in lv.switches if mode == undrafted]
        if excess:
            total += max(0.0, sum(excess) / len(excess))
    return total


def _clear(lv: _Level, speedup: float) -> bool:
    """Whether the measured speedup is off 1 by more than EARLY_Z of its relative standard errors: the policy side's
    by the delta method for a ratio of sums, the plain side's from its steps' scatter around their line."""
    if abs(speedup - 1) <= MARGIN:
        return False
    sides = _sides(lv)
    m, k = len(sides.took), len(sides.plain_s)
    residuals = float(((sides.as_plain - speedup * sides.took) ** 2).sum())
    policy_var = residuals * m / (m - 1) / float(sides.took.sum()) ** 2 / speedup**2
    scatter = sides.plain_s / sides.line(sides.plain_n) - 1
    plain_var = float((scatter * scatter).sum()) / (k - 1) / k
    se = max(math.sqrt(policy_var + plain_var), EARLY_MIN_SE)
    return abs(math.log(speedup)) > EARLY_Z * se


@dataclass(frozen=True)
class _Sides:
    """A level's two sides, as arrays (one entry per step kept)."""

    plain_n: np.ndarray  # plain steps' requests
    plain_s: np.ndarray  # plain steps' seconds to give each of their requests a token, stalls capped
    line: Callable  # the plain line through them: requests (a number or an array) -> seconds
    as_plain: np.ndarray  # per policy step: the seconds plain steps would have taken for its tokens
    took: np.ndarray  # per policy step: the seconds it took, stalls capped, its drafter prefill charge added


def _sides(lv: _Level) -> _Sides:
    """A level's two sides, stalls capped (STALL_CAP) and policy steps' drafter prefill charges added after the cap.
    NumPy over the windows: this runs after every measured step, over up to POLICY_ROUNDS policy steps (in Python
    lists it took ~0.5 ms a step, 3% of a step at one request)."""
    plain = _array(lv.plain)  # (n, tokens, seconds, drafting_s)
    plain_n = plain[:, 0]
    plain_s = _capped(plain_n, plain[:, 2] * plain_n / plain[:, 1])
    line = _line(plain_n, plain_s)
    policy = _array(lv.policy)
    n, tokens, seconds, charge = policy.T
    as_plain = tokens / n * line(n)
    took = _capped(n, seconds) + charge
    return _Sides(plain_n, plain_s, line, as_plain, took)


def _array(steps: deque) -> np.ndarray:
    """A side's steps (4-tuples) as an array [steps, 4] (fromiter: half the time of np.array over tuples)."""
    return np.fromiter(itertools.chain.from_iterable(steps), np.float64, count=4 * len(steps)).reshape(-1, 4)


def _capped(n: np.ndarray, seconds: np.ndarray) -> np.ndarray:
    """Seconds of one side's steps (of n requests each), each at most STALL_CAP times the side's line at its n
    (fitted once more without the excess, so that one long stall does not raise its own cap much)."""
    for _ in range(2):
        seconds = np.minimum(seconds, STALL_CAP * _line(n, seconds)(n))
    return seconds


def plain_line(samples: Iterable[tuple[int, float]]) -> Callable[[int], float]:
    """(n, seconds to give each of n requests a token) of plain steps -> n -> predicted seconds: least squares a + b n
    with 0 <= b and 0 <= a (more requests never make a step faster, nor has a step negative fixed cost); a single n
    seen: its mean."""
    samples = np.array(list(samples), dtype=np.float64).reshape(-1, 2)
    line = _line(samples[:, 0], samples[:, 1])
    return lambda n: float(line(n))


def _line(n: np.ndarray, seconds: np.ndarray) -> Callable:
    """`plain_line` over arrays: -> a function of a number or an array of request counts."""
    mean_n, mean_s = n.mean(), seconds.mean()
    var = ((n - mean_n) ** 2).mean()
    cov = ((n - mean_n) * (seconds - mean_s)).mean()
    slope = min(max(cov / var, 0.0), mean_s / mean_n) if var > 0 else 0.0
    return lambda x: mean_s + slope * (np.asarray(x, dtype=np.float64) - mean_n)
