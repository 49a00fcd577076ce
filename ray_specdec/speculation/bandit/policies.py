"""Rewards and arm-selection rules of the tree bandit (pure functions of one bucket's statistics).

Rewards (one number per round):
- `ThroughputReward` (the serving default): emitted tokens per second of round time, (accepted + 1) / round_time_s.
  An arm's value is estimated as a ratio of sums, sum(tokens) / sum(time): what a stream of its rounds delivers. The
  mean of per-round ratios would be biased wherever round time varies with what a round keeps (measured: by 0-20%
  depending on the tree, more than the arms differ). Its variance comes from the delta method. The unit depends on
  the hardware, so the rules below measure exploration in units of the observed reward noise.
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
  a prior variance (one pseudo-observation: the bucket's pooled variance, at least (PRIOR_CV r_k)^2 for an unbounded
  reward); pick the largest sample.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ray_specdec.config import TreeConfig


@dataclass(frozen=True)
class ThroughputReward:
    name = "throughput"
    bounded = False
    ratio = True  # arm values are sum(tokens) / sum(time), not the mean of this per-round number

    def __call__(self, tree: TreeConfig, accepted_tokens: int, round_time_s: float, max_depth: int) -> float:
        return (accepted_tokens + 1) / round_time_s


@dataclass(frozen=True)
class PaperReward:
    depth_cost: float = 0.2  # reward given up per level of depth, relative to the deepest arm
    name = "paper"
    bounded = True
    ratio = False

    def __call__(self, tree: TreeConfig, accepted_tokens: int, round_time_s: float, max_depth: int) -> float:
        d = max(max_depth, 1)
        kept = min(accepted_tokens, d)  # a lookup branch may go deeper than any arm: the reward stays bounded
        return (kept + 1) / (d + 1) - self.depth_cost * tree.max_depth / d


Reward = ThroughputReward | PaperReward


@dataclass(frozen=True)
class ArmStats:
    """One cell's estimates for every arm (from plain or discounted sums), as a policy sees them.

    mean: the arm's value (0 when unpulled); sq_dev: pulls x the per-round variance, so that sq_dev / pulls**2 is the
    variance of `mean` (for a plain mean, the sum of squared deviations).
    """

    pulls: np.ndarray  # [arms]
    mean: np.ndarray  # [arms]
    sq_dev: np.ndarray  # [arms]
    bounded: bool  # reward lies in a known range of width ~1: no noise scaling

    @classmethod
    def from_sums(cls, sums: np.ndarray, reward) -> "ArmStats":
        """sums [arms, len(state.FIELDS)] -> the estimates `reward` calls for (a plain mean or a ratio of sums).

        Ratio rewards also use what-if rounds (tokens an arm would have kept in rounds of arms whose tree contained
        its own): tokens per round from the arm's own and what-if rounds, time per round from its own rounds, and
        `pulls` is then the effective number of rounds behind the estimate (own pulls when there are no what-if
        rounds; an arm never pulled in the cell still counts as unpulled: its round time is unknown).
        """
        pulls, reward_sum, reward_sq, tokens, time, tokens_sq, time_sq, tokens_time, wi_n, wi_tokens, wi_sq = sums.T
        pulled = pulls > 0
        if not reward.ratio:
            mean = np.divide(reward_sum, pulls, out=np.zeros_like(reward_sum), where=pulled)
            return cls(pulls, mean, np.maximum(reward_sq - mean * reward_sum, 0.0), reward.bounded)
        timed = pulled & (time > 0)
        n_all = pulls + wi_n
        t_mean = np.divide(time, pulls, out=np.zeros_like(time), where=timed)  # seconds per round: own rounds only
        x_own = np.divide(tokens, pulls, out=np.zeros_like(tokens), where=timed)
        x_mean = np.divide(tokens + wi_tokens, n_all, out=np.zeros_like(tokens), where=timed)  # tokens per round
        ratio = np.divide(x_mean, t_mean, out=np.zeros_like(x_mean), where=timed)
        var_x = np.maximum(np.divide(tokens_sq + wi_sq, n_all, out=np.zeros_like(tokens), where=timed) - x_mean**2, 0)
        var_t = np.maximum(np.divide(time_sq, pulls, out=np.zeros_like(time), where=timed) - t_mean**2, 0)
        cov = np.divide(tokens_time, pulls, out=np.zeros_like(time), where=timed) - x_own * t_mean  # own rounds
        # delta method for x_mean / t_mean; only own rounds pair tokens with time: Cov(x_mean, t_mean) = cov / n_all
        t2 = np.where(timed, t_mean**2, 1.0)
        per_round = np.maximum(var_x - 2 * ratio * cov + ratio**2 * var_t, 0.0) / t2
        var_of_mean = np.maximum(
            np.divide(var_x - 2 * ratio * cov, n_all, out=np.zeros_like(time), where=timed)
            + np.divide(ratio**2 * var_t, pulls, out=np.zeros_like(time), where=timed), 0.0) / t2  # fmt: skip
        effective = np.divide(per_round, var_of_mean, out=pulls.astype(np.float64), where=timed & (var_of_mean > 0))
        effective = np.where(timed, np.clip(effective, np.minimum(pulls, n_all), n_all), 0.0)
        return cls(effective, ratio, effective * effective * var_of_mean, reward.bounded)

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


# Spread of one round's unbounded reward assumed a priori, relative to the arm's mean. The bucket's pooled spread
# alone can be far too small for an arm: rounds without a draft emit one token each and barely vary, drafted rounds
# emit one to nine, so an arm whose one or two first rounds were slow (cold caches) would never be sampled again.
PRIOR_CV = 1.0


def posterior_draws(stats: ArmStats, rng: np.random.Generator) -> np.ndarray:
    """One draw per arm from N(mean, v / pulls), v the arm's per-round variance shrunk toward a prior variance (one
    pseudo-round): 0.25 for a bounded reward (the largest variance on a unit range), else the larger of the bucket's
    pooled variance and (PRIOR_CV x the arm's mean)^2. Arms must have been pulled."""
    prior_var = 0.25 if stats.bounded else np.maximum(stats.pooled_var(), (PRIOR_CV * stats.mean) ** 2)
    var = (stats.sq_dev + prior_var) / (stats.pulls + 1.0)
    return rng.normal(stats.mean, np.sqrt(var / stats.pulls))


@dataclass(frozen=True)
class GaussianThompson:
    discounted = True

    def choose(self, stats: ArmStats, rng: np.random.Generator) -> int:
        unpulled = _first_unpulled(stats)
        if unpulled is not None:
            return unpulled
        return int(np.argmax(posterior_draws(stats, rng)))


Policy = UCB1 | DiscountedUCB | GaussianThompson
