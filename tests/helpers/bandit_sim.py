"""Simulated rounds for the bandit's tests: environments with known arm rewards, a select/record loop, random
rounds over every cell, and a state comparison."""

from __future__ import annotations

import math
from typing import Callable

import numpy as np

from ray_specdec.config import TreeConfig
from ray_specdec.speculation.bandit import DEFAULT_ARMS, Bandit, BanditState

# An environment answers one round: (arm index, round number, context_len, rng) -> (accepted_tokens, round_time_s).
Env = Callable[[int, int, int, np.random.Generator], tuple[int, float]]

# Throughput per arm (tokens/s) for the 9 default arms: arm 3 is best by 20 tokens/s; per-round noise ~30%.
MEANS = np.array([50.0, 60, 70, 100, 75, 65, 55, 80, 45])
NOISE = 30.0


def gaussian_env(means: np.ndarray, switch_at: int | None = None, after: np.ndarray | None = None) -> Env:
    """One token (no accepted draft) per round in 1/mean seconds times lognormal jitter (sigma NOISE / 100): every
    arm's throughput, sum(tokens) / sum(time), is its mean times the same factor, so the arms' order is the means'."""

    def step(arm: int, t: int, context_len: int, rng: np.random.Generator) -> tuple[int, float]:
        mu = after[arm] if switch_at is not None and t >= switch_at else means[arm]
        return 0, math.exp(NOISE / 100 * rng.standard_normal()) / mu

    return step


def simulate(
    bandit: Bandit, env: Env, rounds: int, seed: int = 1, context_len: int = 100, sampled: bool = False, load: int = 1
) -> np.ndarray:
    """Run `rounds` select/record rounds; returns the arm index picked in each."""
    rng = np.random.default_rng(seed)
    arms = bandit.config.arms
    picks = np.empty(rounds, dtype=np.int64)
    for i in range(rounds):
        tree = bandit.select(context_len, sampled, load=load)
        picks[i] = arm = arms.index(tree)
        accepted, seconds = env(arm, i, context_len, rng)
        bandit.record(tree, context_len, accepted, seconds, sampled, load=load)
    return picks


def late_share(picks: np.ndarray, arm: int, tail: float = 0.2) -> float:
    return float((picks[int(len(picks) * (1 - tail)) :] == arm).mean())


def random_rounds(n: int, seed: int) -> list[tuple[TreeConfig, int, int, float, bool, int]]:
    """(tree, context_len, accepted_tokens, round_time_s, sampled, load) of random rounds over every cell."""
    rng = np.random.default_rng(seed)
    rounds = []
    for _ in range(n):
        tree = DEFAULT_ARMS[rng.integers(len(DEFAULT_ARMS))]
        accepted = int(rng.integers(0, tree.depth + 1))
        sampled = bool(rng.integers(2))
        load = int(rng.choice([1, 2, 4, 5, 16, 17, 64]))
        rounds.append((tree, int(rng.integers(0, 10_000)), accepted, float(rng.uniform(0.01, 0.1)), sampled, load))
    return rounds


def replay(bandit: Bandit, rounds: list[tuple[TreeConfig, int, int, float, bool, int]]) -> None:
    for tree, context_len, accepted, seconds, sampled, load in rounds:
        bandit.record(tree, context_len, accepted, seconds, sampled, load=load)


def assert_same_state(a: BanditState, b: BanditState) -> None:
    np.testing.assert_array_equal(a.steps, b.steps)
    np.testing.assert_allclose(a.raw, b.raw, rtol=1e-12)
    np.testing.assert_allclose(a.disc, b.disc, rtol=1e-9)
