"""Algorithm settings: tree shapes and sampling parameters (frozen dataclasses, validated on creation)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

DraftSampling = Literal["iid", "without_replacement"]


@dataclass(frozen=True)
class TreeConfig:
    """T = (N_1, ..., N_gamma): at depth i every node gets N_i children. () means no drafting."""

    branching: tuple[int, ...]

    def __post_init__(self) -> None:
        if any((not isinstance(n, int)) or n < 1 for n in self.branching):
            raise ValueError(f"tree branching factors must be integers >= 1, got {self.branching}")
        if len(self.branching) > 32:
            raise ValueError(f"tree depth {len(self.branching)} is too deep (max 32)")
        if self.num_nodes > 1024:
            raise ValueError(f"tree {self.branching} has {self.num_nodes} nodes (max 1024)")

    @classmethod
    def parse(cls, text: str) -> "TreeConfig":
        """'3,2,2,1,1' -> (3, 2, 2, 1, 1); '' or 'none' -> no drafting."""
        text = text.strip().strip("()[]")
        if text.lower() in ("", "none"):
            return cls(())
        try:
            branching = tuple(int(part) for part in text.replace(" ", "").split(",") if part)
        except ValueError:
            raise ValueError(f"tree must be comma-separated integers like 3,2,2,1,1, got {text!r}") from None
        return cls(branching)

    @classmethod
    def chain(cls, depth: int) -> "TreeConfig":
        return cls((1,) * depth)

    @property
    def depth(self) -> int:
        return len(self.branching)

    @property
    def rows_per_depth(self) -> tuple[int, ...]:
        """B_i = N_1 * ... * N_i for i = 1..gamma."""
        rows, b = [], 1
        for n in self.branching:
            b *= n
            rows.append(b)
        return tuple(rows)

    @property
    def num_nodes(self) -> int:
        """Draft nodes in the tree, root excluded."""
        return sum(self.rows_per_depth)

    def truncated(self, max_depth: int) -> "TreeConfig":
        return TreeConfig(self.branching[: max(0, max_depth)])

    def index_paths(self) -> list[tuple[int, ...]]:
        """The tree as child-rank paths from the root, in BFS order: [(0,), (1,), (0, 0), ...]."""
        paths: list[tuple[int, ...]] = []
        level: list[tuple[int, ...]] = [()]
        for n in self.branching:
            level = [parent + (rank,) for parent in level for rank in range(n)]
            paths.extend(level)
        return paths

    def __str__(self) -> str:
        return ",".join(map(str, self.branching)) if self.branching else "none"


# The paper's trees plus the chain; the bandit's default arms extend this.
PAPER_TREES = (
    TreeConfig((1, 1, 1, 1)),
    TreeConfig((3, 3, 2, 1)),
    TreeConfig((3, 2, 2, 1, 1)),
    TreeConfig((2, 2, 2, 1, 1, 1)),
)


# What the CLI and the app use when no tree is given (the bandit learns better ones per deployment): on an
# accelerator verifying a few more rows is nearly free, so a small tree; on CPU every verified row costs, and the
# chain is the fastest shape (docs/BENCHMARKS.md).
DEFAULT_TREE = TreeConfig((2, 2, 1, 1))
CPU_DEFAULT_TREE = TreeConfig((1, 1, 1, 1))


def default_tree(device: str) -> TreeConfig:
    """The default tree for a device string ("cpu", "cuda", "cuda:1", ...)."""
    return CPU_DEFAULT_TREE if str(device).split(":")[0] == "cpu" else DEFAULT_TREE


@dataclass(frozen=True)
class SamplingParams:
    """Target-only sampling settings; speculation reproduces exactly this distribution.

    temperature == 0 means greedy. top_k == 0 and top_p == 1.0 disable those filters.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    max_new_tokens: int = 64
    stop: tuple[str, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    # How sampled rounds pick children: i.i.d. from q (multi-draft rejection sampling)
    # or without replacement (Gumbel-top-k; recursive rejection sampling).
    draft_sampling: DraftSampling = "without_replacement"

    def __post_init__(self) -> None:
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.draft_sampling not in ("iid", "without_replacement"):
            raise ValueError(f"draft_sampling must be 'iid' or 'without_replacement', got {self.draft_sampling!r}")
        object.__setattr__(self, "stop", tuple(s for s in self.stop if s))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
