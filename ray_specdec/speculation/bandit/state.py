"""The bandit's statistics as pure data: what is shared between router replicas and persisted across restarts.

A `BanditState` holds, for every context cell and every arm (tree config), plain and discounted sums (for the
non-stationary policies) of the same fields: pulls, reward, reward², and the round's tokens x (accepted + bonus) and
time t with x², t², x*t, plus what-if rounds (tokens an arm would have kept in other arms' rounds), from which the
throughput policies estimate tokens per second as a ratio of sums (what a stream of rounds delivers) rather than a
mean of per-round ratios (biased by how round time varies). A cell is a
prompt-length bucket times a sampling mode (greedy or sampled rounds: their best trees differ, e.g. a lookup branch
pays more in greedy rounds; or the single mode "all") times a load level (requests decoding in the round's step: a
round's time is the batched step's, so the same tree is worth less at high load; or the single level "all").
Discounting is per record of a cell: each record multiplies that cell's discounted sums by gamma first. Arrays are
indexed by cell = (mode * loads + load level) * buckets + bucket, so a state with one load level has version 3's
layout; the code calls a cell a "bucket" where only its index matters.

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
# 4: load levels; 3: what-if fields; 2: sampling modes and token/time moments (version-1 files lack the moments)
VERSION = 4
READABLE_VERSIONS = (2, 3, 4)  # older files load with one load level ("all") and, version 2, empty what-if fields
SPLIT_MODES = ("greedy", "sampled")
ONE_MODE = ("all",)

# Columns of `BanditState.raw` and `BanditState.disc` ([cells, arms, len(FIELDS)] each). The first eight come from
# the arm's own rounds; the what-if fields count rounds of other arms whose tree contained this arm's, with the tokens
# this arm would have kept in them (`counterfactuals.what_if`). No time: a round of another arm does not say how long
# this arm's round takes.
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


def load_labels(edges: Sequence[int]) -> list[str]:
    """(1, 4, 16) -> ['1', '2-4', '5-16', '17+'] (edges: the largest load of each level but the last)."""
    if not edges:
        return ["all"]
    lows = (1, *(e + 1 for e in edges))
    return [str(lo) if lo == hi else f"{lo}-{hi}" for lo, hi in zip(lows, edges)] + [f"{lows[-1]}+"]


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
    load_edges: tuple[int, ...] = ()  # ascending; level i holds edges[i-1] < load <= edges[i]; (): one level "all"

    @classmethod
    def empty(
        cls,
        arms: Sequence[TreeConfig],
        bucket_edges: Sequence[int],
        gamma: float,
        reward: str,
        modes: Sequence[str] = SPLIT_MODES,
        load_edges: Sequence[int] = (),
    ) -> "BanditState":
        arms, edges, modes = tuple(arms), tuple(int(e) for e in bucket_edges), tuple(modes)
        load_edges = tuple(int(e) for e in load_edges)
        if not arms or len(set(arms)) != len(arms):
            raise ValueError(f"arms must be a non-empty list of distinct tree configs, got {[str(a) for a in arms]}")
        if any(e <= 0 for e in edges) or list(edges) != sorted(set(edges)):
            raise ValueError(f"bucket edges must be positive and strictly ascending, got {edges}")
        if any(e <= 0 for e in load_edges) or list(load_edges) != sorted(set(load_edges)):
            raise ValueError(f"load edges must be positive and strictly ascending, got {load_edges}")
        if not 0.0 < gamma <= 1.0:
            raise ValueError(f"gamma must be in (0, 1], got {gamma}")
        if modes not in (SPLIT_MODES, ONE_MODE):
            raise ValueError(f"modes must be {list(SPLIT_MODES)} or {list(ONE_MODE)}, got {list(modes)}")
        shape = ((len(edges) + 1) * len(modes) * (len(load_edges) + 1), len(arms))
        return cls(
            arms, edges, float(gamma), reward,
            np.zeros((*shape, len(FIELDS))), np.zeros((*shape, len(FIELDS))),
            np.zeros(shape[0], dtype=np.int64), modes, load_edges,
        )  # fmt: skip

    def fresh(self) -> "BanditState":
        """An empty state with the same arms, buckets, modes, load levels, gamma and reward (a delta to record into)."""
        return BanditState.empty(self.arms, self.bucket_edges, self.gamma, self.reward, self.modes, self.load_edges)

    def copy(self) -> "BanditState":
        return BanditState(
            self.arms, self.bucket_edges, self.gamma, self.reward, self.raw.copy(), self.disc.copy(), self.steps.copy(),
            self.modes, self.load_edges,
        )  # fmt: skip

    @property
    def num_buckets(self) -> int:
        """Prompt-length buckets (cells per mode)."""
        return len(self.bucket_edges) + 1

    @property
    def num_loads(self) -> int:
        """Load levels (cells per mode and bucket)."""
        return len(self.load_edges) + 1

    @property
    def cells_per_mode(self) -> int:
        return self.num_buckets * self.num_loads

    @property
    def num_cells(self) -> int:
        return self.cells_per_mode * len(self.modes)

    def bucket_of(self, context_len: int, sampled: bool = False, load: int = 1) -> int:
        """The cell of a round: its prompt-length bucket at its load level (requests decoding in its step) within
        its sampling mode."""
        mode = 1 if sampled and len(self.modes) > 1 else 0
        level = bisect.bisect_left(self.load_edges, load)
        return (mode * self.num_loads + level) * self.num_buckets + bisect.bisect_right(self.bucket_edges, context_len)

    def cell_parts(self, cell: int) -> tuple[str, int, int]:
        """(mode, load level, prompt-length bucket) of a cell (the level and bucket as indices)."""
        mode, rest = divmod(cell, self.cells_per_mode)
        level, bucket = divmod(rest, self.num_buckets)
        return self.modes[mode], level, bucket

    def cell_labels(self) -> list[str]:
        """'<1k', '1k-2k', ... per cell's bucket, prefixed by the mode ('greedy <1k') when modes are split (the load
        level is not in the label: `cell_parts`)."""
        labels = bucket_labels(self.bucket_edges)
        parts = [self.cell_parts(cell) for cell in range(self.num_cells)]
        if self.modes == ONE_MODE:
            return [labels[bucket] for _, _, bucket in parts]
        return [f"{mode} {labels[bucket]}" for mode, _, bucket in parts]

    def with_modes(self, modes: Sequence[str]) -> "BanditState":
        """A one-mode state split into modes: every mode starts from the pooled statistics (a warm start)."""
        modes = tuple(modes)
        if modes == self.modes:
            return self
        if self.modes != ONE_MODE:
            raise ValueError(f"cannot turn a state with modes {list(self.modes)} into {list(modes)}")
        out = BanditState.empty(self.arms, self.bucket_edges, self.gamma, self.reward, modes, self.load_edges)
        out.raw[:], out.disc[:] = np.tile(self.raw, (len(modes), 1, 1)), np.tile(self.disc, (len(modes), 1, 1))
        out.steps[:] = np.tile(self.steps, len(modes))
        return out

    def with_loads(self, load_edges: Sequence[int]) -> "BanditState":
        """A one-level state (version 3, or load edges ()) split into load levels: its statistics, gathered at
        whatever loads ran, go to the first level ("1") and the other levels start empty, so totals are kept and a
        level learns its own trees from its own rounds (the policy's prior, `BanditConfig.prior_pulls`, warm-starts
        it from the others) instead of first outweighing thousands of rounds of mixed loads."""
        load_edges = tuple(int(e) for e in load_edges)
        if load_edges == self.load_edges:
            return self
        if self.load_edges:
            raise ValueError(f"cannot turn a state with load edges {list(self.load_edges)} into {list(load_edges)}")
        out = BanditState.empty(self.arms, self.bucket_edges, self.gamma, self.reward, self.modes, load_edges)
        for mode in range(len(self.modes)):
            mine = slice(mode * self.num_buckets, (mode + 1) * self.num_buckets)
            first_level = slice(mode * out.cells_per_mode, mode * out.cells_per_mode + out.num_buckets)
            out.raw[first_level], out.disc[first_level] = self.raw[mine], self.disc[mine]
            out.steps[first_level] = self.steps[mine]
        return out

    def arm_index(self, tree: TreeConfig) -> int | None:
        """The arm's index (None: not an arm), by a dict of this state's arm tuple: once per round of every
        request, where `tuple.index` compared dataclasses one by one."""
        cache = self.__dict__.get("_arm_indices")
        if cache is None or cache[0] is not self.arms:
            cache = self.__dict__["_arm_indices"] = (self.arms, {arm: i for i, arm in enumerate(self.arms)})
        return cache[1].get(tree)

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
        mine = (self.arms, self.bucket_edges, self.gamma, self.reward, self.modes, self.load_edges)
        theirs = (other.arms, other.bucket_edges, other.gamma, other.reward, other.modes, other.load_edges)
        if mine != theirs:
            raise ValueError(
                f"cannot merge bandit states with different settings: {_describe(mine)} vs {_describe(theirs)}"
            )

    def adapted(self, arms: Sequence[TreeConfig], gamma: float) -> "BanditState":
        """This state for another arm set and gamma: arms in both keep their sums, new arms start empty."""
        out = BanditState.empty(arms, self.bucket_edges, gamma, self.reward, self.modes, self.load_edges)
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
            "load_edges": list(self.load_edges),
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
        modes, load_edges = data.get("modes", ONE_MODE), data.get("load_edges", ())
        state = cls.empty(
            [TreeConfig.parse(a) for a in data["arms"]], data["bucket_edges"], data["gamma"], data["reward"], modes,
            load_edges,
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
    arms, edges, gamma, reward, modes, loads = settings
    return (f"(arms={[str(a) for a in arms]}, edges={list(edges)}, gamma={gamma}, reward={reward}, "
            f"modes={list(modes)}, load_edges={list(loads)})")
