"""Test policies in place of the bandit: trees picked from a script, arms with fixed statistics for the speculation
controller to price, or one tree with a note of the load each pick and lesson came at."""

from __future__ import annotations

import numpy as np

from ray_specdec.config import TreeConfig


class ScriptedPolicy:
    """Picks trees from a script, round after round (the last one once the script runs out)."""

    arms = ()  # no statistics to price: the controller keeps every pick

    def __init__(self, script):
        self.script, self.round, self.records = [TreeConfig(b) for b in script], 0, []

    def throughput(self, context_len, sampled=False, draw=False, *, load=1):
        return {}

    def select(self, context_len, sampled=False, *, load=1):
        tree = self.script[min(self.round, len(self.script) - 1)]
        self.round += 1
        return tree

    def record(self, tree, context_len, accepted_tokens, round_time_s, sampled=False, what_if=None, *, load=1):
        self.records.append((str(tree), round_time_s))


class PricedPolicy:
    """The bandit's side as the speculation controller reads it, with fixed statistics: its arms, and per arm the
    mean tokens of a round (a thousand rounds' worth, no spread: the controller's draws are its means)."""

    def __init__(self, tokens):
        self.tokens = {TreeConfig(b): float(t) for b, t in tokens.items()}
        self.records = []

    @property
    def arms(self):
        return tuple(self.tokens)

    def token_sums(self, context_len, sampled=False):
        return np.array([(1000.0, 1000.0 * t, 1000.0 * t * t) for t in self.tokens.values()])

    def record(self, tree, context_len, accepted_tokens, round_time_s, sampled=False, what_if=None, *, load=1):
        self.records.append((str(tree), round_time_s))


def fix_costs(controller, prefill_s_per_token: float | None) -> None:
    """A speculation controller whose step costs are fixed, whatever this machine's steps take: 10 ms a step, its
    verify rows free, 0.1 ms per drafting request (so drafting pays wherever the drafter's prefill does not eat its
    tokens), and the drafter's prefill at `prefill_s_per_token` (None: not measured yet)."""
    from ray_specdec.speculation.controller import FEATURES

    controller.cost.set_prior([{"fixed": 10e-3, "drafting": 0.1e-3}.get(name, 0.0) for name in FEATURES])
    controller.observe_step = lambda shape, seconds, draft_seconds=0.0: None
    controller.prefill_s_per_token = prefill_s_per_token


class LoadRecorder:
    """A policy with one tree that notes the load it is asked and taught at."""

    arms = (TreeConfig((1, 1)),)

    def __init__(self):
        self.asked, self.taught = [], []

    def throughput(self, context_len, sampled=False, draw=False, *, load=1):
        return {}

    def select(self, context_len, sampled=False, *, load=1):
        self.asked.append(load)
        return self.arms[0]

    def record(self, tree, context_len, accepted_tokens, round_time_s, sampled=False, what_if=None, *, load=1):
        self.taught.append(load)
