"""Speculation by goodput: how much each request of a step drafts, from a measured cost model of the step.

SmartSpec's lesson: when requests share the target's forward, every drafted node costs verify time that every other
request of the step waits for, so acceptance alone cannot decide the tree. Here each step's tree sizes maximise the
batch's expected tokens per second of step time:

    goodput = sum_r E[tokens of r's round | r's tree] / T(step)

- `StepCostModel` predicts T(step) from what the step runs: a fixed cost, verify rows, requests that draft (their
  drafter catch-up), drafter rows (all depths' stepped rows) and prefill rows. The scheduler measures a few forwards
  and drafter steps at start (`Scheduler.calibrate`) for a prior, then every step refines it by exponentially
  weighted least squares (on this machine, under its real load: nothing is assumed about the hardware). Steps alone
  cannot tell the terms apart when the batch keeps one shape (8 requests, 8 rows, step after step); the prior can.
- `AcceptanceModel` keeps E[accepted draft tokens] per (tree, context bucket, greedy/sampled): a running mean of what
  each tree's rounds accepted, fed also by what-if counts (a round of a tree teaches the trees it contains).
- `size_trees` starts every request at its policy's pick (the bandit's, which explores) and shrinks picks to smaller
  candidates, one change at a time, while that raises the batch's goodput. At one request in flight that keeps a tree
  only where it beats plain decoding; under load trees shrink, down to none where that pays.
"""

from __future__ import annotations

import bisect
import math
import time
from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np
import torch

from ray_specdec.config import TreeConfig
from ray_specdec.engine.target_backend import SegmentSpec, StepWork, TargetBackend
from ray_specdec.models.device_clock import now, settle

# Features of a step: 1, verify rows, requests that draft, drafter rows, prefill rows.
N_FEATURES = 5
# Typical size of each feature: the prior's weight per feature is PRIOR_STEPS steps of this size.
FEATURE_SCALE = np.array([1.0, 32.0, 8.0, 16.0, 512.0])
# How many steps' worth of evidence the calibrated prior counts as.
PRIOR_STEPS = 64.0
# Weight of the past in the cost model's least squares (per step): ~200 steps of memory, so it follows load changes.
COST_FORGET = 0.995
# Steps measured before the cost model's predictions are trusted to shrink the policy's picks.
COST_WARMUP_STEPS = 16
# Prior acceptance of a tree no round has measured yet, per depth (optimistic: it must be tried to be learned).
PRIOR_ACCEPT_PER_DEPTH = 0.6
ACCEPT_BUCKETS = (256, 1024, 4096)  # context tokens


@dataclass(frozen=True)
class StepShape:
    verify_rows: int = 0
    draft_rows: int = 0
    prefill_rows: int = 0
    drafting: int = 0  # requests that draft

    def features(self) -> np.ndarray:
        return np.array([1.0, self.verify_rows, self.drafting, self.draft_rows, self.prefill_rows])


def drafter_rows(tree: TreeConfig) -> int:
    """Rows the drafter steps for a tree: every depth but the last is stepped (leaves are never stepped)."""
    return sum(tree.rows_per_depth[:-1])


class StepCostModel:
    """T(step) = w . [1, verify rows, drafting requests, drafter rows, prefill rows], by exponentially weighted
    least squares around a prior (ridge towards it)."""

    def __init__(self, forget: float = COST_FORGET):
        self.forget = forget
        self._prior_xtx = np.diag(FEATURE_SCALE**2) * 1e-6
        self._prior_xty = np.zeros(N_FEATURES)
        self._xtx = np.zeros((N_FEATURES, N_FEATURES))
        self._xty = np.zeros(N_FEATURES)
        self.steps = 0
        self.calibrated = False
        self._w: np.ndarray | None = None

    def set_prior(self, weights: np.ndarray, steps: float = PRIOR_STEPS) -> None:
        """Pull the fit towards `weights` with the evidence of `steps` steps of typical size."""
        self._prior_xtx = np.diag(FEATURE_SCALE**2) * steps
        self._prior_xty = self._prior_xtx @ np.asarray(weights, dtype=np.float64)
        self.calibrated = True
        self._w = None

    def observe(self, shape: StepShape, seconds: float) -> None:
        x = shape.features()
        self._xtx = self.forget * self._xtx + np.outer(x, x)
        self._xty = self.forget * self._xty + x * seconds
        self.steps += 1
        self._w = None

    @property
    def warm(self) -> bool:
        return self.calibrated or self.steps >= COST_WARMUP_STEPS

    def weights(self) -> np.ndarray:
        if self._w is None:
            w = np.linalg.solve(self._xtx + self._prior_xtx, self._xty + self._prior_xty)
            # a row never makes a step cheaper; noise with few distinct shapes can say otherwise
            self._w = np.maximum(w, 0.0)
        return self._w

    def predict(self, shape: StepShape) -> float:
        return float(self.weights() @ shape.features())


class AcceptanceModel:
    """Mean accepted draft tokens per round, per (tree, context bucket, sampled)."""

    def __init__(self):
        self._sum: dict[tuple, float] = {}
        self._n: dict[tuple, int] = {}

    @staticmethod
    def _key(tree: TreeConfig, context_len: int, sampled: bool) -> tuple:
        return tree, bisect.bisect_right(ACCEPT_BUCKETS, context_len), sampled

    def record(self, tree: TreeConfig, context_len: int, sampled: bool, accepted: int,
               what_if: Mapping[TreeConfig, int] | None = None) -> None:
        """A round of `tree` accepted `accepted` draft tokens (what_if: what smaller arms would have). Trees without
        a drafter's depth are not kept: their expected tokens are 1 whatever they accepted (an undrafted round's
        lookup tokens are the scheduler's, not sized here), and most rounds under load are such."""
        for arm, kept in {tree: accepted, **(what_if or {})}.items():
            if not arm.depth:
                continue
            key = self._key(arm, context_len, sampled)
            self._sum[key] = self._sum.get(key, 0.0) + kept
            self._n[key] = self._n.get(key, 0) + 1

    def expected_tokens(self, tree: TreeConfig, context_len: int, sampled: bool) -> float:
        """Expected tokens a round of `tree` emits (accepted draft tokens + the bonus token)."""
        if not tree.depth:
            return 1.0
        key = self._key(tree, context_len, sampled)
        n = self._n.get(key, 0)
        if n == 0:
            return 1.0 + PRIOR_ACCEPT_PER_DEPTH * tree.max_depth
        return 1.0 + self._sum[key] / n


@dataclass
class Candidate:
    """One request's choice for a step: its trees from largest (the policy's pick) to NO_TREE."""

    trees: Sequence[TreeConfig]  # the policy's pick first, then smaller trees
    tokens: Sequence[float]  # expected tokens of each
    fixed: bool = False  # a tree the client asked for: honoured as given
    # verify rows a drafted tree of this request carries beyond its nodes (the engine's prompt-lookup branch, added
    # after sizing): what they accept is in `tokens` (rounds are learned with them), so their rows must be costed too
    extra_rows: float = 0.0


def size_trees(candidates: Sequence[Candidate], cost: StepCostModel, prefill_rows: int) -> list[int]:
    """-> the index into each candidate's trees that maximises the step's goodput: coordinate ascent from the
    policies' picks (each request in turn takes its best tree given the others' until none changes). The cost model
    is linear, so a change is judged from running totals in O(1)."""
    choice = [0] * len(candidates)
    if not cost.warm:
        return choice
    w_fixed, w_verify, w_drafting, w_draft, w_prefill = (float(v) for v in cost.weights())

    def seconds_of(c: Candidate, tree: TreeConfig) -> float:
        """What a request's tree adds to the step: its verify rows, and its drafting (catch-up and stepped rows)."""
        if not tree.depth:
            return w_verify
        extra = tree.lookup or c.extra_rows
        return w_verify * (1 + tree.num_nodes + extra) + w_drafting + w_draft * drafter_rows(tree)

    tokens = sum(c.tokens[0] for c in candidates)
    total = w_fixed + w_prefill * prefill_rows + sum(seconds_of(c, c.trees[0]) for c in candidates)
    for _ in range(4):  # passes; one or two settle it in practice
        changed = False
        for r, c in enumerate(candidates):
            if c.fixed or len(c.trees) == 1:
                continue
            rest_tokens, rest_seconds = tokens - c.tokens[choice[r]], total - seconds_of(c, c.trees[choice[r]])
            best, best_value = choice[r], None
            for i, tree in enumerate(c.trees):
                value = (rest_tokens + c.tokens[i]) / max(rest_seconds + seconds_of(c, tree), 1e-9)
                if best_value is None or value > best_value * (1 + 1e-9):
                    best, best_value = i, value
            if best != choice[r]:
                changed = True
                choice[r] = best
                tokens, total = rest_tokens + c.tokens[best], rest_seconds + seconds_of(c, c.trees[best])
        if not changed:
            break
    return choice


def measure_prior(target: TargetBackend, drafter) -> list[float]:
    """StepCostModel weights measured on a target side and a drafter: the target's forward at a few batch shapes
    (requests x rows per request, over 64 tokens of context, through `target.run` like any step), the drafter's step
    at 1 and 16 rows and its catch-up over two tokens. Each shape is timed three times, the fastest kept (the
    machine's noise only ever adds). ~20 forwards."""
    ids = [f"calibrate-{i}" for i in range(8)]
    context = 64
    t0 = time.perf_counter()
    settle(target.run(StepWork(allocations=[(i, 2 * context) for i in ids],
                               segments=[SegmentSpec(i, torch.zeros(context - 1, dtype=torch.long)) for i in ids])))
    prefill_s = (time.perf_counter() - t0) / (len(ids) * (context - 1))
    fastest: dict[int, float] = {}  # verify rows -> seconds
    pending: list[str] = []
    for requests, per_request in [(1, 1), (1, 16), (8, 1), (8, 4)] * 3:
        chain = tuple((0,) * d for d in range(1, per_request))
        work = StepWork(commits=[(i, (0,)) for i in pending],
                        segments=[SegmentSpec(i, torch.zeros(per_request, dtype=torch.long), chain)
                                  for i in ids[:requests]])  # fmt: skip
        t0 = time.perf_counter()
        settle(target.run(work))  # the device's time too, not the launches' (device_clock)
        rows = requests * per_request
        fastest[rows] = min(time.perf_counter() - t0, fastest.get(rows, math.inf))
        pending = ids[:requests]
    target.run(StepWork(commits=[(i, (0,)) for i in pending], releases=ids))
    x = torch.tensor([[1.0, n] for n in fastest], dtype=torch.float64)
    y = torch.tensor(list(fastest.values()), dtype=torch.float64)[:, None]
    fixed, per_row = torch.linalg.lstsq(x, y).solution[:, 0].tolist()
    step_1, step_16, catch_up = (min(_time_drafter(drafter, kind) for _ in range(3)) for kind in (1, 16, "extend"))
    per_drafter_row = max(step_16 - step_1, 0.0) / 15
    return [max(fixed, 0.0), max(per_row, 0.0), catch_up + max(step_1 - per_drafter_row, 0.0), per_drafter_row,
            prefill_s]  # fmt: skip


def _time_drafter(drafter, kind: int | str) -> float:
    """Seconds of one drafter step of `kind` rows, or (kind "extend") of a catch-up over two tokens, with the
    device idle at both ends (device_clock: on CUDA the launches alone would price drafting near zero)."""
    t0 = now(drafter.device)
    if kind == "extend":
        drafter.extend(drafter.new_state(1), torch.zeros(2, dtype=torch.long))
    else:
        drafter.step(drafter.new_state(kind), torch.zeros(kind, dtype=torch.long))
    return now(drafter.device) - t0
