"""The arms a round's tree is chosen among: the `TreePolicy` interface and `FixedTree`, the policy of one tree.

The bandit (speculation/bandit/) is the adaptive policy: its shared statistics are what the speculation controller
(speculation/controller.py) prices its arms with.
"""

from __future__ import annotations

from typing import Mapping, Protocol

from ray_specdec.config import TreeConfig


class TreePolicy(Protocol):
    """Context of a round: the request's context length, whether it samples (temperature > 0) or is greedy, and the
    load: the requests decoding in the round's step (1: alone).

    `arms`: the trees the speculation controller chooses among (with none; speculation/controller.py) where the policy
    also keeps the statistics it prices them with (`token_sums`: the bandit); `record`: what a round of one of them
    accepted; `select`: the policy's own pick, the round's tree where the policy has no `token_sums` (`FixedTree`);
    `throughput`: estimated tokens per second of round time per arm (what `/v1/bandit` reports)."""

    @property
    def arms(self) -> tuple[TreeConfig, ...]: ...

    def select(self, context_len: int, sampled: bool = False, *, load: int = 1) -> TreeConfig: ...

    def throughput(
        self, context_len: int, sampled: bool = False, draw: bool = False, *, load: int = 1
    ) -> dict[TreeConfig, float]: ...

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
    ) -> None: ...


class FixedTree:
    """A tree policy that always picks one config (the bandit is the adaptive one)."""

    def __init__(self, tree: TreeConfig):
        self.tree = tree

    @property
    def arms(self) -> tuple[TreeConfig, ...]:
        return (self.tree,)

    def select(self, context_len: int, sampled: bool = False, max_nodes: int | None = None, *,
               load: int = 1) -> TreeConfig:  # fmt: skip
        return self.tree

    def throughput(self, context_len: int, sampled: bool = False, draw: bool = False, *,
                   load: int = 1) -> dict[TreeConfig, float]:  # fmt: skip
        return {}  # no estimates: its one tree is not chosen

    def record(self, tree: TreeConfig, context_len: int, accepted_tokens: int, round_time_s: float,
               sampled: bool = False, what_if=None, *, load: int = 1) -> None:
        pass
