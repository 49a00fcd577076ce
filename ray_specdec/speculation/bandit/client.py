"""The tree bandit as the engine sees it (`Bandit`, a TreePolicy) and its shared side (`BanditHub`).

Sharing across router replicas, with no remote call per round:
- every router holds a `Bandit`: `select` reads its local view (the latest snapshot plus its own records since), and
  `record` updates the view and a pending delta;
- a wrapper (a Ray actor holding one `BanditHub`) periodically takes `bandit.drain_updates()` from each router,
  `hub.push(delta)`, then hands `hub.snapshot()` back to `bandit.apply_snapshot(...)`.
Push before pull: a snapshot taken before the hub merged a drained delta drops those records from the router's view
until the next snapshot (they are not lost: the hub merges them whenever the push lands).
"""

from __future__ import annotations

import math
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import numpy as np

from ray_specdec.config import MAX_LOOKUP_TOKENS, PAPER_TREES, TreeConfig
from ray_specdec.speculation.bandit.policies import (ArmStats, GaussianThompson, Policy, Reward, ThroughputReward,
                                                     posterior_draws)
from ray_specdec.speculation.bandit.state import ONE_MODE, OWN_FIELDS, SPLIT_MODES, BanditState, load_labels

# The paper's trees and the chain, plus shallower / wider shapes that win when verification is expensive.
DEFAULT_ARMS = (
    *PAPER_TREES,
    TreeConfig((1, 1)),
    TreeConfig((2, 1, 1)),
    TreeConfig((4, 2, 1)),
    TreeConfig((2, 2, 1, 1)),
    # no drafting: where speculation does not pay (a target step as cheap as a few drafter steps, a saturated
    # target), the step's cost, not acceptance, decides (SmartSpec's lesson)
    TreeConfig(()),
)
DEFAULT_BUCKET_EDGES = (1024, 2048, 4096, 8192)  # prompt tokens: <1k, 1-2k, 2-4k, 4-8k, >=8k
# Requests decoding in a step: 1, 2-4, 5-16, 17+. Alone, a round's time is its own and trees grow while the target's
# forward stays memory-bound; in a batch a round's time is its share of the whole step, and every tree's rows add to
# a step shared by the others, so the best tree shrinks (to none where the target is saturated). Levels widen ~4x
# because what matters is the batch's size in proportion (2 -> 4 requests changes a tree's worth about as much as
# 8 -> 16); four levels keep each one's data plentiful (more cells learn slower), and they separate the concurrency
# levels the benchmarks run (1, 8, 32).
DEFAULT_LOAD_EDGES = (1, 4, 16)


@dataclass(frozen=True)
class BanditConfig:
    arms: tuple[TreeConfig, ...] = DEFAULT_ARMS
    bucket_edges: tuple[int, ...] = DEFAULT_BUCKET_EDGES
    # Discounted Thompson sampling: follows load changes (a stationary bandit with a long history would not), and
    # its randomness spreads the routers' picks between two snapshots. In simulation its stationary regret is lower
    # than discounted UCB's and it follows a changed best arm as well (tests/speculation/bandit/test_bandit.py).
    policy: Policy = field(default_factory=GaussianThompson)
    reward: Reward = field(default_factory=ThroughputReward)
    # Discount per round of a bucket: ~1/(1 - gamma) = 5000 recent rounds carry the discounted statistics, enough to
    # tell arms apart through per-round noise while still following load changes within minutes of traffic.
    gamma: float = 0.9998
    # Separate statistics for greedy and sampled rounds: their best trees differ (acceptance is lower when sampling,
    # and a lookup branch pays more in greedy rounds).
    split_sampling: bool = True
    # Separate statistics per load level (requests decoding in the step; DEFAULT_LOAD_EDGES says why these): level i
    # holds edges[i-1] < load <= edges[i]. (): one level for every load.
    load_edges: tuple[int, ...] = DEFAULT_LOAD_EDGES
    # Pseudo-rounds a cell borrows from its mode's other cells (prompt-length buckets and load levels; an
    # empirical-Bayes prior): a new cell starts from what the others learned instead of trying every arm (wide trees
    # included) on live traffic, and its own rounds outweigh the prior after a few pulls. 0: every cell learns alone.
    prior_pulls: float = 4.0
    # Rounds of its own below which an arm's round time in a cell is taken as no slower than a cost model fitted to
    # the cell's well-measured arms predicts (time = a + b * tree nodes): optimism bounded by this many rounds per arm.
    # An arm's token estimate learns from other arms' rounds (what-if feedback), its time only from its own, so a
    # couple of slow first rounds (one-time costs of a new shape in a fresh replica) would otherwise lock it out:
    # measured through Serve, a chain pulled twice at 20 tokens/s against 66 for the arm in use (docs/BENCHMARKS.md).
    # 0: no optimism.
    optimistic_rounds: float = 8.0

    @property
    def modes(self) -> tuple[str, ...]:
        return SPLIT_MODES if self.split_sampling else ONE_MODE

    def empty_state(self) -> BanditState:
        return BanditState.empty(self.arms, self.bucket_edges, self.gamma, self.reward.name, self.modes,
                                 self.load_edges)  # fmt: skip

    def arm_stats(self, state: BanditState, bucket: int, discounted: bool) -> ArmStats:
        sums = state.disc[bucket] if discounted else state.raw[bucket]  # [arms, fields]
        return ArmStats.from_sums(sums, self.reward)

    def policy_stats(self, state: BanditState, cell: int) -> ArmStats:
        """What the policy decides on: the cell's statistics plus up to `prior_pulls` pseudo-rounds per arm at the
        mean (and spread) of the arm in the other cells (buckets and load levels) of the cell's sampling mode."""
        table = state.disc if self.policy.discounted else state.raw  # [cells, arms, fields]
        own = table[cell]
        per_mode = state.cells_per_mode
        if self.prior_pulls <= 0 or per_mode == 1:
            return ArmStats.from_sums(self._optimistic_times(own), self.reward)
        first = cell - cell % per_mode
        others = sum(table[c] for c in range(first, first + per_mode) if c != cell)  # [arms, fields]
        own_fields = len(OWN_FIELDS)
        prior = others.copy()
        for columns in (slice(0, own_fields), slice(own_fields, None)):  # own rounds, and what-if rounds
            n = others[:, columns.start]
            scale = np.divide(np.minimum(n, self.prior_pulls), n, out=np.zeros_like(n), where=n > 0)
            prior[:, columns] *= scale[:, None]  # every sum scaled: same means
        return ArmStats.from_sums(self._optimistic_times(own + prior), self.reward)

    def _optimistic_times(self, sums: np.ndarray) -> np.ndarray:
        """sums [arms, fields] with the round times of arms timed in fewer than `optimistic_rounds` rounds scaled down
        to what the cell's cost model predicts, where their own mean is slower (see `optimistic_rounds`). The model,
        time per round = a + b * nodes with b >= 0, is a least-squares fit over the arms timed in at least that many
        rounds, weighted by their rounds; with fewer than two tree sizes among them there is none and nothing
        changes."""
        if not self.reward.ratio or self.optimistic_rounds <= 0:
            return sums
        pulls, time = sums[:, OWN_FIELDS.index("pulls")], sums[:, OWN_FIELDS.index("time_sum")]
        nodes = np.array([arm.num_nodes for arm in self.arms], dtype=np.float64)
        solid = pulls >= self.optimistic_rounds
        if len(set(nodes[solid])) < 2:
            return sums
        w, x, t = pulls[solid], nodes[solid], time[solid] / pulls[solid]
        x_bar, t_bar = np.average(x, weights=w), np.average(t, weights=w)
        b = max(float(np.sum(w * (x - x_bar) * (t - t_bar)) / np.sum(w * (x - x_bar) ** 2)), 0.0)
        predicted = t_bar + b * (nodes - x_bar)  # [arms]
        young = (pulls > 0) & ~solid & (predicted > 0)
        mean_time = np.divide(time, pulls, out=np.zeros_like(time), where=pulls > 0)
        scale = np.where(young & (mean_time > predicted), predicted / np.where(mean_time > 0, mean_time, 1.0), 1.0)
        if (scale == 1.0).all():
            return sums
        out = sums.copy()
        for name, power in (("time_sum", 1), ("time_sq", 2), ("tokens_time", 1)):
            out[:, OWN_FIELDS.index(name)] *= scale**power
        return out

    def restore(self, state: BanditState) -> BanditState:
        """A stored state made to fit this config (arm set and gamma may change, a one-mode state may be split into
        greedy and sampled, a one-level state into load levels (`BanditState.with_loads`: its statistics go to the
        first level); buckets, other load levels and reward may not)."""
        if state.modes == ONE_MODE and self.modes != ONE_MODE:
            state = state.with_modes(self.modes)
        if not state.load_edges and self.load_edges:
            state = state.with_loads(self.load_edges)
        if state.load_edges != tuple(self.load_edges):
            raise ValueError(
                f"stored bandit state has load edges {list(state.load_edges)}, but the config asks for "
                f"{list(self.load_edges)}; move the state file away to start over"
            )
        if state.modes != self.modes:
            raise ValueError(
                f"stored bandit state has modes {list(state.modes)}, but the config asks for {list(self.modes)}; "
                "move the state file away to start over"
            )
        if state.bucket_edges != tuple(self.bucket_edges) or state.reward != self.reward.name:
            raise ValueError(
                f"stored bandit state has buckets {list(state.bucket_edges)} and reward {state.reward!r}, but the "
                f"config asks for {list(self.bucket_edges)} and {self.reward.name!r}; "
                "move the state file away to start over"
            )
        if state.arms == tuple(self.arms) and state.gamma == self.gamma:
            return state
        return state.adapted(self.arms, self.gamma)

    def load_state(self, path: str | os.PathLike) -> BanditState:
        return self.restore(BanditState.load(path))


class Bandit:
    """A TreePolicy for one process (thread-safe), and the router-side client of a shared `BanditHub`."""

    def __init__(self, config: BanditConfig | None = None, state: BanditState | None = None, seed: int | None = None):
        self.config = config or BanditConfig()
        self._view = self.config.empty_state() if state is None else self.config.restore(state.copy())
        self._pending = self._view.fresh()
        self._max_depth = max(tree.max_depth for tree in self.config.arms)
        self._rng = np.random.default_rng(seed)
        self._lock = threading.Lock()
        # policy statistics per cell, until the next record: a scheduler step asks for every request in flight
        # before it records any (the statistics cost ~0.25 ms per cell to compute)
        self._stats: dict[int, ArmStats] = {}

    @classmethod
    def load(cls, path: str | os.PathLike, config: BanditConfig | None = None, seed: int | None = None) -> "Bandit":
        config = config or BanditConfig()
        return cls(config, config.load_state(path), seed)

    def select(
        self, context_len: int, sampled: bool = False, max_nodes: int | None = None, *, load: int = 1
    ) -> TreeConfig:
        """The policy's pick in the context's cell; with max_nodes (a load back-off's budget), among the arms of at
        most that many draft nodes only (no drafting when none fits), so that every round is an arm's round."""
        with self._lock:
            stats = self._policy_stats(self._view.bucket_of(context_len, sampled, load))
            if max_nodes is None:
                return self.config.arms[self.config.policy.choose(stats, self._rng)]
            fits = np.array([arm.num_nodes <= max_nodes for arm in self.config.arms])
            if not fits.any():
                return TreeConfig(())
            index = np.flatnonzero(fits)
            return self.config.arms[index[self.config.policy.choose(_pulled_only(stats, fits), self._rng)]]

    @property
    def arms(self) -> tuple[TreeConfig, ...]:
        return self.config.arms

    def throughput(
        self, context_len: int, sampled: bool = False, draw: bool = False, *, load: int = 1
    ) -> dict[TreeConfig, float]:
        """Estimated tokens per second of round time of every arm pulled in the context's cell: the values the
        policy decides on (prior pseudo-rounds included), or with `draw` one Thompson draw from each estimate's
        posterior (`posterior_draws`), so that a decision made on them explores where the estimates are uncertain.
        Empty under a reward that is not a throughput."""
        if not self.config.reward.ratio:
            return {}
        with self._lock:
            stats = self._policy_stats(self._view.bucket_of(context_len, sampled, load))
            pulled, values = stats.pulls > 0, stats.mean.copy()
            if draw and pulled.any():
                values[pulled] = posterior_draws(_pulled_only(stats, pulled), self._rng)
        return {arm: float(v) for arm, v, ok in zip(self.config.arms, values, pulled) if ok and v > 0}

    def token_sums(self, context_len: int, sampled: bool = False) -> np.ndarray:
        """[arms, 3]: the rounds, and the sum and sum of squares of their tokens (accepted + the bonus), of every arm
        in the context's prompt-length bucket and sampling mode, pooled over load levels (what a round accepts does
        not depend on the load), own rounds and what-if rounds together, discounted: what the speculation controller
        prices each arm's tokens with (speculation/controller.py)."""
        with self._lock:
            state = self._view
            cells = [state.bucket_of(context_len, sampled, load) for load in _level_loads(state.load_edges)]
            sums = state.disc[cells].sum(axis=0)  # [arms, fields]
        own, what = sums[:, [0, 3, 5]], sums[:, len(OWN_FIELDS):]
        return own + what

    def record(
        self,
        tree: TreeConfig,
        context_len: int,
        accepted_tokens: int,
        round_time_s: float,
        sampled: bool = False,
        what_if: Mapping[TreeConfig, int] | None = None,
        *,
        load: int = 1,
    ) -> None:
        """accepted_tokens: draft tokens the target kept (the bonus token excluded): for a round without a tree, 0 or
        the accepted tokens of the lookup proposal an engine verifies instead (`SchedulerConfig.plain_lookup`), else
        at most the tree's depth plus the lookup tokens an engine may add to it (`TreeConfig.with_lookup`).
        what_if: other arms -> the draft tokens each would have had accepted in this round (`counterfactuals.what_if`:
        arms whose tree this round's contained); their token estimates learn from it, their time estimates do not.
        load: requests decoding in the round's step (round_time_s is this round's share of that step).

        Rounds of trees outside the arm set (a tree cut short at the end of a generation) are not counted.
        """
        _check_accepted(tree, accepted_tokens)
        if not (math.isfinite(round_time_s) and round_time_s > 0):
            raise ValueError(f"round_time_s must be a positive number, got {round_time_s}")
        arm = self._view.arm_index(tree)
        if arm is None:
            return
        others: dict[int, int] = {}
        for other, kept in (what_if or {}).items():
            _check_accepted(other, kept)
            index = self._view.arm_index(other)
            if index is not None and index != arm:
                others[index] = int(kept)
        reward = self.config.reward(tree, accepted_tokens, round_time_s, self._max_depth)
        with self._lock:
            bucket = self._view.bucket_of(context_len, sampled, load)
            self._stats.clear()  # a cell's statistics borrow from the other cells of its mode
            self._view.record(bucket, arm, reward, accepted_tokens, round_time_s, others)
            self._pending.record(bucket, arm, reward, accepted_tokens, round_time_s, others)

    def _policy_stats(self, cell: int) -> ArmStats:
        """The policy's statistics of a cell (the caller holds the lock)."""
        stats = self._stats.get(cell)
        if stats is None:
            stats = self._stats[cell] = self.config.policy_stats(self._view, cell)
        return stats

    def drain_updates(self) -> BanditState:
        """Records since the last drain, as a delta for `BanditHub.push` (`.to_dict()` for JSON transport)."""
        with self._lock:
            delta, self._pending = self._pending, self._pending.fresh()
        return delta

    def apply_snapshot(self, snapshot: BanditState | dict[str, Any]) -> None:
        """Adopt the hub's state; records not drained yet stay on top of it."""
        state = BanditState.from_dict(snapshot) if isinstance(snapshot, dict) else snapshot.copy()
        state = self.config.restore(state)
        with self._lock:
            self._view = state.merge(self._pending)
            self._stats = {}

    @property
    def state(self) -> BanditState:
        """A copy of the local view."""
        with self._lock:
            return self._view.copy()

    def save(self, path: str | os.PathLike) -> None:
        self.state.save(path)

    def summary(self) -> dict[str, Any]:
        return summarize(self.state, self.config)


class BanditHub:
    """The shared side: merges routers' deltas, serves snapshots and the summary, persists to `path`.

    Wrap one instance in a Ray actor; every method takes and returns plain JSON-able data or `BanditState`.
    """

    def __init__(
        self,
        config: BanditConfig | None = None,
        path: str | os.PathLike | None = None,
        save_interval_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.config = config or BanditConfig()
        self.path = path
        self.save_interval_s = save_interval_s
        self._clock = clock
        has_file = path is not None and os.path.exists(path)
        self.state = self.config.load_state(path) if has_file else self.config.empty_state()
        self._last_save = clock()

    def push(self, update: BanditState | dict[str, Any]) -> None:
        delta = BanditState.from_dict(update) if isinstance(update, dict) else update
        self.state.merge(self.config.restore(delta))
        if self.path is not None and self._clock() - self._last_save >= self.save_interval_s:
            self.save()

    def snapshot(self) -> dict[str, Any]:
        return self.state.to_dict()

    def summary(self) -> dict[str, Any]:
        return summarize(self.state, self.config)

    def save(self) -> None:
        if self.path is None:
            raise ValueError("this BanditHub has no path to save to")
        self.state.save(self.path)
        self._last_save = self._clock()


def _level_loads(edges: tuple[int, ...]) -> list[int]:
    """One load in each load level of these edges."""
    return [1, *(e + 1 for e in edges)] if edges else [1]


def _pulled_only(stats: ArmStats, pulled: np.ndarray) -> ArmStats:
    return ArmStats(stats.pulls[pulled], stats.mean[pulled], stats.sq_dev[pulled], stats.bounded)


def _check_accepted(tree: TreeConfig, accepted_tokens: int) -> None:
    most = max(tree.max_depth, MAX_LOOKUP_TOKENS)  # a round without a tree may verify a lookup proposal too
    if not 0 <= accepted_tokens <= most:
        raise ValueError(f"accepted_tokens={accepted_tokens} outside [0, {most}] for tree {tree} (bonus excluded)")


def _nan_to_none(x: float) -> float | None:
    return None if math.isnan(x) else float(x)


def summarize(state: BanditState, config: BanditConfig) -> dict[str, Any]:
    """What `GET /v1/bandit` shows: per cell (sampling mode x load level x prompt-length bucket), every arm's pulls
    and mean rewards, and the current best arm.

    `mean_reward` is over all rounds, `recent_mean_reward` over the discounted ones; the best arm is judged by the
    statistics the policy uses.
    """
    edges = (0, *state.bucket_edges, None)
    load_edges, loads = (0, *state.load_edges, None), load_labels(state.load_edges)
    buckets = []
    for b, label in enumerate(state.cell_labels()):
        mode, level, bucket = state.cell_parts(b)
        plain = config.arm_stats(state, b, discounted=False)
        recent = config.arm_stats(state, b, discounted=True)
        best = (recent if config.policy.discounted else plain).best()
        pulls, tokens, seconds = state.raw[b, :, 0], state.raw[b, :, 3], state.raw[b, :, 4]
        with np.errstate(invalid="ignore", divide="ignore"):
            accepted_length = tokens / pulls
            tokens_per_s = tokens / seconds
        arms = [
            {
                "tree": str(tree),
                "pulls": int(pulls[i]),
                "what_if_rounds": int(state.raw[b, i, len(OWN_FIELDS)]),  # other arms' rounds that taught this one
                "mean_reward": _nan_to_none(plain.mean[i]) if pulls[i] else None,
                "recent_mean_reward": _nan_to_none(recent.mean[i]) if recent.pulls[i] > 0 else None,
                "mean_accepted_length": _nan_to_none(accepted_length[i]),
                "tokens_per_s": _nan_to_none(tokens_per_s[i]),
            }
            for i, tree in enumerate(state.arms)
        ]
        buckets.append(
            {
                "bucket": label,
                "mode": mode,
                "load": loads[level],  # '1', '2-4', ... ('all': one level)
                "min_load": load_edges[level] + 1,
                "max_load": load_edges[level + 1],
                "min_context": edges[bucket],
                "max_context": edges[bucket + 1],
                "rounds": int(state.steps[b]),
                "best": None if best is None else str(state.arms[best]),
                "arms": arms,
            }
        )
    return {"policy": repr(config.policy), "reward": config.reward.name, "gamma": state.gamma, "buckets": buckets}
