"""Test policies in place of the bandit: trees picked from a script (with or without throughput estimates), or one
tree with a note of the load each pick and lesson came at."""

from __future__ import annotations

from ray_specdec.config import TreeConfig


class ScriptedPolicy:
    """Picks trees from a script, round after round (the last one once the script runs out)."""

    arms = ()  # no smaller arms: goodput sizing keeps every pick

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


class RatedPolicy(ScriptedPolicy):
    """A scripted policy that also reports throughput estimates (tokens per second of round time), as the bandit
    does."""

    def __init__(self, script, rates):
        super().__init__(script)
        self.rates = {TreeConfig(b): r for b, r in rates.items()}

    def throughput(self, context_len, sampled=False, draw=False, *, load=1):
        assert draw  # the engine decides on Thompson draws
        return dict(self.rates)


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
