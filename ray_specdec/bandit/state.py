"""The bandit's statistics as pure data: what is shared between router replicas and persisted across restarts.

A `BanditState` holds, for every context cell and every arm (tree config), plain and discounted sums (for the
non-stationary policies) of the same fields: pulls, reward, reward², and the round's tokens x (accepted + bonus) and
time t with x², t², x*t, plus what-if rounds (tokens an arm would have kept in other arms' rounds), from which the
throughput policies estimate tokens per second as a ratio of sums (what a stream of rounds delivers) rather than a
mean of per-round ratios (biased by how round time varies). A cell is a
prompt-length bucket times a sampling mode (greedy or sampled rounds: their best trees differ, e.g. a lookup branch
pays more in greedy rounds), or the bucket alone with the single mode "all". Discounting is per record of a cell:
each record multiplies that cell's discounted sums by gamma first. Arrays are indexed by cell = mode * buckets +
bucket; the code calls a cell a "bucket" where only its index matters.

The same type is the batched update a router pushes: a router records into an empty state (its delta) and the hub
merges it. Because a delta remembers how many records it holds per bucket, `merge` rescales the hub's discounted sums
by gamma**records before adding, which equals applying the records one by one (up to float rounding).
"""

from __future__ import annotations

import bisect
import json
import os
import tempfile
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import numpy as np

from ray_specdec.config import TreeConfig

FORMAT = "ray_specdec.bandit"
VERSION = 3  # 3: what-if fields; 2: sampling modes and token/time moments (version-1 files lack the moments)
READABLE_VERSIONS = (2, 3)  # a version-2 file loads with empty what-if fields
SPLIT_MODES = ("greedy", "sampled")
ONE_MODE = ("all",)

# Columns of `BanditState.raw` and `BanditState.disc` ([cells, arms, len(FIELDS)] each). The first eight come from
# the arm's own rounds; the what-if fields count rounds of other arms whose tree contained this arm's, with the tokens
# this arm would have kept in them (`drafting.what_if`). No time: a round of another arm does not say how long this
# arm's round takes.
OWN_FIELDS = ("pulls", "reward_sum", "reward_sq", "tokens_sum", "time_sum", "tokens_sq", "time_sq", "tokens_time")
WHAT_IF_FIELDS = ("what_if_rounds", "what_if_tokens_sum", "what_if_tokens_sq")
FIELDS = OWN_FIELDS + WHAT_IF_FIELDS


def bucket_labels(edges: Sequence[int]) -> list[str]:
    """(1024, 2048) -> ['<1k', '1k-2k', '>=2k'] (edges in tokens; k = 1024)."""

    def k(n: int) -> str:
        return f"{n // 1024}k" if n % 1024 == 0 else str(n)

    if not edges:
        return ["all"]
    middle = [f"{k(lo)}-{k(hi)}" for lo, hi in zip(edges, edges[1:])]
    return [f"<{k(edges[0])}", *middle, f">={k(edges[-1])}"]


@dataclass
class BanditState:
    arms: tuple[TreeConfig, ...]
    bucket_edges: tuple[int, ...]  # ascending token counts; bucket i holds edges[i-1] <= len < edges[i]
    gamma: float  # discount per record of a cell, for the discounted sums
    reward: str  # name of the reward the sums hold (a state only merges with states of the same reward)
    raw: np.ndarray  # [cells, arms, len(FIELDS)] float64
    disc: np.ndarray  # [cells, arms, len(FIELDS)] float64, discounted
    steps: np.ndarray  # [cells] int64, records seen per cell
    modes: tuple[str, ...] = SPLIT_MODES  # SPLIT_MODES or ONE_MODE

    @classmethod
    def empty(
        cls,
        arms: Sequence[TreeConfig],
        bucket_edges: Sequence[int],
        gamma: float,
        reward: str,
        modes: Sequence[str] = SPLIT_MODES,
    ) -> "BanditState":
        arms, edges, modes = tuple(arms), tuple(int(e) for e in bucket_edges), tuple(modes)
        if not arms or len(set(arms)) != len(arms):
            raise ValueError(f"arms must be a non-empty list of distinct tree configs, got {[str(a) for a in arms]}")
        if any(e <= 0 for e in edges) or list(edges) != sorted(set(edges)):
            raise ValueError(f"bucket edges must be positive and strictly ascending, got {edges}")
        if not 0.0 < gamma <= 1.0:
            raise ValueError(f"gamma must be in (0, 1], got {gamma}")
        if modes not in (SPLIT_MODES, ONE_MODE):
            raise ValueError(f"modes must be {list(SPLIT_MODES)} or {list(ONE_MODE)}, got {list(modes)}")
        shape = ((len(edges) + 1) * len(modes), len(arms))
        return cls(
            arms, edges, float(gamma), reward,
            np.zeros((*shape, len(FIELDS))), np.zeros((*shape, len(FIELDS))),
            np.zeros(shape[0], dtype=np.int64), modes,
        )  # fmt: skip

    def fresh(self) -> "BanditState":
        """An empty state with the same arms, buckets, modes, gamma and reward (a delta to record into)."""
        return BanditState.empty(self.arms, self.bucket_edges, self.gamma, self.reward, self.modes)

    def copy(self) -> "BanditState":
        return BanditState(
            self.arms, self.bucket_edges, self.gamma, self.reward, self.raw.copy(), self.disc.copy(), self.steps.copy(),
            self.modes,
        )  # fmt: skip

    @property
    def num_buckets(self) -> int:
        """Prompt-length buckets (cells per mode)."""
        return len(self.bucket_edges) + 1

    @property
    def num_cells(self) -> int:
        return self.num_buckets * len(self.modes)

    def bucket_of(self, context_len: int, sampled: bool = False) -> int:
        """The cell of a round: its prompt-length bucket within its sampling mode."""
        mode = 1 if sampled and len(self.modes) > 1 else 0
        return mode * self.num_buckets + bisect.bisect_right(self.bucket_edges, context_len)

    def cell_labels(self) -> list[str]:
        """'<1k', '1k-2k', ... per bucket, prefixed by the mode ('greedy <1k') when modes are split."""
        labels = bucket_labels(self.bucket_edges)
        if self.modes == ONE_MODE:
            return labels
        return [f"{mode} {label}" for mode in self.modes for label in labels]

    def with_modes(self, modes: Sequence[str]) -> "BanditState":
        """A one-mode state split into modes: every mode starts from the pooled statistics (a warm start)."""
        modes = tuple(modes)
        if modes == self.modes:
            return self
        if self.modes != ONE_MODE:
            raise ValueError(f"cannot turn a state with modes {list(self.modes)} into {list(modes)}")
        out = BanditState.empty(self.arms, self.bucket_edges, self.gamma, self.reward, modes)
        out.raw[:], out.disc[:] = np.tile(self.raw, (len(modes), 1, 1)), np.tile(self.disc, (len(modes), 1, 1))
        out.steps[:] = np.tile(self.steps, len(modes))
        return out

    def arm_index(self, tree: TreeConfig) -> int | None:
        try:
            return self.arms.index(tree)
        except ValueError:
            return None

    def record(
        self,
        bucket: int,
        arm: int,
        reward: float,
        accepted_tokens: int,
        round_time_s: float,
        what_if: dict[int, int] | None = None,
    ) -> None:
        """One round of `arm`; what_if: other arm -> draft tokens it would have had accepted in this round."""
        x, t = accepted_tokens + 1.0, round_time_s
        row = (1.0, reward, reward * reward, x, t, x * x, t * t, x * t)
        own = slice(0, len(OWN_FIELDS))
        self.disc[bucket] *= self.gamma
        self.disc[bucket, arm, own] += row
        self.raw[bucket, arm, own] += row
        for other, kept in (what_if or {}).items():
            if other != arm:
                y = kept + 1.0
                self.disc[bucket, other, own.stop :] += (1.0, y, y * y)
                self.raw[bucket, other, own.stop :] += (1.0, y, y * y)
        self.steps[bucket] += 1

    def merge(self, updates: "BanditState | Iterable[BanditState]") -> "BanditState":
        """Add deltas (in order) to this state, in place; returns self."""
        for delta in [updates] if isinstance(updates, BanditState) else updates:
            self._check_compatible(delta)
            decay = self.gamma ** delta.steps.astype(np.float64)  # [buckets]
            self.disc = self.disc * decay[:, None, None] + delta.disc
            self.raw += delta.raw
            self.steps += delta.steps
        return self

    def _check_compatible(self, other: "BanditState") -> None:
        mine = (self.arms, self.bucket_edges, self.gamma, self.reward, self.modes)
        theirs = (other.arms, other.bucket_edges, other.gamma, other.reward, other.modes)
        if mine != theirs:
            raise ValueError(
                f"cannot merge bandit states with different settings: {_describe(mine)} vs {_describe(theirs)}"
            )

    def adapted(self, arms: Sequence[TreeConfig], gamma: float) -> "BanditState":
        """This state for another arm set and gamma: arms in both keep their sums, new arms start empty."""
        out = BanditState.empty(arms, self.bucket_edges, gamma, self.reward, self.modes)
        for j, tree in enumerate(out.arms):
            i = self.arm_index(tree)
            if i is not None:
                out.raw[:, j], out.disc[:, j] = self.raw[:, i], self.disc[:, i]
        out.steps[:] = self.steps
        return out

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable form (also what crosses process boundaries)."""
        return {
            "format": FORMAT,
            "version": VERSION,
            "arms": [str(a) for a in self.arms],
            "bucket_edges": list(self.bucket_edges),
            "modes": list(self.modes),
            "gamma": self.gamma,
            "reward": self.reward,
            "steps": self.steps.tolist(),
            "raw": {name: self.raw[..., i].tolist() for i, name in enumerate(FIELDS)},
            "disc": {name: self.disc[..., i].tolist() for i, name in enumerate(FIELDS)},
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "BanditState":
        if data.get("format") != FORMAT or data.get("version") not in READABLE_VERSIONS:
            raise ValueError(
                f"not a version-{VERSION} bandit state (format={data.get('format')!r}, "
                f"version={data.get('version')!r}); move the state file away to start over"
            )
        modes = data.get("modes", ONE_MODE)
        state = cls.empty(
            [TreeConfig.parse(a) for a in data["arms"]], data["bucket_edges"], data["gamma"], data["reward"], modes
        )
        shape = (state.num_cells, len(state.arms))
        state.raw, state.disc = (
            np.stack([np.asarray(data[table][f], dtype=np.float64) if f in data[table] or f in OWN_FIELDS
                      else np.zeros(shape) for f in FIELDS], axis=-1)
            for table in ("raw", "disc")
        )  # fmt: skip
        state.steps = np.asarray(data["steps"], dtype=np.int64)
        if state.raw.shape[:2] != (state.num_cells, len(state.arms)) or state.disc.shape != state.raw.shape:
            raise ValueError(f"bandit state arrays have shape {state.raw.shape}, expected cells x arms x fields")
        return state

    def save(self, path: str | os.PathLike) -> None:
        """Write JSON atomically: a temporary file in the same directory, fsync, then rename over `path`."""
        path = os.fspath(path)
        directory = os.path.dirname(os.path.abspath(path))
        os.makedirs(directory, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".bandit-", suffix=".json.tmp", dir=directory)
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(self.to_dict(), f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise

    @classmethod
    def load(cls, path: str | os.PathLike) -> "BanditState":
        with open(path) as f:
            return cls.from_dict(json.load(f))


def _describe(settings: tuple) -> str:
    arms, edges, gamma, reward, modes = settings
    return f"(arms={[str(a) for a in arms]}, edges={list(edges)}, gamma={gamma}, reward={reward}, modes={list(modes)})"
