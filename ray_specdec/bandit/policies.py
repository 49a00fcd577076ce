"""Rewards and arm-selection rules of the tree bandit (pure functions of one bucket's statistics).

Rewards (one number per round):
- `ThroughputReward` (the serving default): emitted tokens per second of round time, (accepted + 1) / round_time_s.
  Its unit depends on the hardware, so the rules below measure exploration in units of the observed reward noise.
- `PaperReward`: a paper-style reward in the spirit of the test-time tree search of "Mamba Drafters for Speculative
  Decoding" (Choi et al., 2025), which penalises few accepted tokens and deep trees. This project's formula (not the
  paper's verbatim) is (accepted + 1) / (D + 1) - depth_cost * depth / D, with D the deepest arm's depth: bounded in
  [-depth_cost, 1], so UCB1 uses it unscaled, as the paper does.

Rules (`choose(stats, rng) -> arm index`; arms never pulled in the bucket are tried first, in arm order):
- `UCB1`: argmax_k r_k + lam * s * sqrt(2 ln t / n_k), with s = 1 for a bounded reward and the pooled within-arm
  standard deviation of the bucket otherwise (scale-free: multiplying every reward by c changes nothing).
- `DiscountedUCB`: the same index on discounted sums (Garivier & Moulines, 2011): old rounds fade with gamma per
  round, so the bandit follows load or traffic changes.
- `GaussianThompson`: sample mu_k ~ N(r_k, v_k / n_k) on discounted sums, with v_k the arm's variance shrunk toward
  the bucket's pooled variance (one pseudo-observation); pick the largest sample.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ray_specdec.config import TreeConfig


@dataclass(frozen=True)
class ThroughputReward:
    name = "throughput"
    bounded = False

    def __call__(self, tree: TreeConfig, accepted_tokens: int, round_time_s: float, max_depth: int) -> float:
        return (accepted_tokens + 1) / round_time_s


@dataclass(frozen=True)
class PaperReward:
    depth_cost: float = 0.2  # reward given up per level of depth, relative to the deepest arm
    name = "paper"
    bounded = True

    def __call__(self, tree: TreeConfig, accepted_tokens: int, round_time_s: float, max_depth: int) -> float:
        d = max(max_depth, 1)
        kept = min(accepted_tokens, d)  # a lookup branch may go deeper than any arm: the reward stays bounded
        return (kept + 1) / (d + 1) - self.depth_cost * tree.max_depth / d


Reward = ThroughputReward | PaperReward


@dataclass(frozen=True)
class ArmStats:
    """One bucket's sums for every arm (plain or discounted), as a policy sees them."""

    pulls: np.ndarray  # [arms]
    reward_sum: np.ndarray  # [arms]
    reward_sq: np.ndarray  # [arms]
    bounded: bool  # reward lies in a known range of width ~1: no noise scaling

    @property
    def mean(self) -> np.ndarray:  # [arms]; 0 for unpulled arms
        return np.divide(self.reward_sum, self.pulls, out=np.zeros_like(self.reward_sum), where=self.pulls > 0)

    @property
    def sq_dev(self) -> np.ndarray:  # [arms] sum of squared deviations from the arm's mean
        return np.maximum(self.reward_sq - self.mean * self.reward_sum, 0.0)

    def pooled_var(self) -> float:
        total = float(self.pulls.sum())
        return float(self.sq_dev.sum()) / total if total > 0 else 0.0

    def noise_scale(self) -> float:
        return 1.0 if self.bounded else float(np.sqrt(self.pooled_var()))

    def best(self) -> int | None:
        """Arm with the highest mean among pulled arms; None when nothing was pulled."""
        if not (self.pulls > 0).any():
            return None
        return int(np.argmax(np.where(self.pulls > 0, self.mean, -np.inf)))


def _first_unpulled(stats: ArmStats) -> int | None:
    unpulled = np.flatnonzero(stats.pulls <= 0)
    return int(unpulled[0]) if unpulled.size else None


@dataclass(frozen=True)
class UCB1:
    lam: float = 1.0  # exploration weight (the paper's lambda)
    discounted = False

    def choose(self, stats: ArmStats, rng: np.random.Generator) -> int:
        unpulled = _first_unpulled(stats)
        if unpulled is not None:
            return unpulled
        t = max(float(stats.pulls.sum()), 1.0)
        bonus = self.lam * stats.noise_scale() * np.sqrt(2.0 * np.log(t) / stats.pulls)
        return int(np.argmax(stats.mean + bonus))


@dataclass(frozen=True)
class DiscountedUCB(UCB1):
    discounted = True


@dataclass(frozen=True)
class GaussianThompson:
    discounted = True

    def choose(self, stats: ArmStats, rng: np.random.Generator) -> int:
        unpulled = _first_unpulled(stats)
        if unpulled is not None:
            return unpulled
        prior_var = 0.25 if stats.bounded else stats.pooled_var()  # 0.25: largest variance on a unit range
        var = (stats.sq_dev + prior_var) / (stats.pulls + 1.0)
        samples = rng.normal(stats.mean, np.sqrt(var / stats.pulls))
        return int(np.argmax(samples))


Policy = UCB1 | DiscountedUCB | GaussianThompson
