"""Token trees as index paths, and the one pure function that turns a tree into tensors.

A tree is a list of child-rank paths from the root (EAGLE / vLLM format): ``[(0,), (1,), (0, 0)]`` is a root with
two children, the first of which has a child. Tensors index the nodes in BFS order with the root at index 0, which is
also the row order of a verify forward: ``[root, *nodes]``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch


@dataclass(frozen=True)
class TreeTensors:
    paths: tuple[tuple[int, ...], ...]  # index path of every node, BFS order, root excluded
    parents: torch.Tensor  # [1 + n] long, parent row of each row; -1 for the root
    depths: torch.Tensor  # [1 + n] long, 0 for the root
    attn_mask: torch.Tensor  # [1 + n, 1 + n] bool, row i may attend to column j (j is i or an ancestor of i)
    leaf_paths: tuple[tuple[int, ...], ...]  # root-to-leaf row lists, root included
    children: tuple[tuple[int, ...], ...]  # children rows of each row, in rank order
    depth_starts: tuple[int, ...]  # first row of each depth 0..gamma, plus the end: rows of depth d = [s[d], s[d+1])

    @property
    def num_nodes(self) -> int:
        """Draft nodes, root excluded."""
        return len(self.paths)

    @property
    def depth(self) -> int:
        return len(self.depth_starts) - 2

    def position_ids(self, cache_len: int) -> torch.Tensor:
        """[1 + n] positions of the verify rows when the cache holds cache_len tokens."""
        return self.depths + cache_len

    def parents_at_depth(self, d: int) -> torch.Tensor:
        """[rows at depth d] parent row index relative to the first row of depth d - 1."""
        start, end = self.depth_starts[d], self.depth_starts[d + 1]
        return self.parents[start:end] - self.depth_starts[d - 1]


def build_tree(paths: Sequence[Sequence[int]]) -> TreeTensors:
    """Parents, depths, ancestor mask, leaf paths and children of a tree given as index paths.

    Paths may come in any order; they are sorted into BFS order (by depth, then lexicographically). Every prefix of a
    path must itself be a path, and sibling ranks must be 0..k-1 without gaps.
    """
    nodes = sorted({tuple(int(r) for r in p) for p in paths}, key=lambda p: (len(p), p))
    if len(nodes) != len(paths):
        raise ValueError("tree has duplicate paths")
    row_of: dict[tuple[int, ...], int] = {(): 0}
    for row, path in enumerate(nodes, start=1):
        if len(path) == 0 or any(r < 0 for r in path):
            raise ValueError(f"invalid tree path {path}")
        if path[:-1] not in row_of:
            raise ValueError(f"tree path {path} has no parent {path[:-1]}")
        if path[-1] > 0 and path[:-1] + (path[-1] - 1,) not in row_of:
            raise ValueError(f"tree path {path} skips sibling rank {path[-1] - 1}")
        row_of[path] = row

    n = len(nodes) + 1
    parents = [-1] + [row_of[p[:-1]] for p in nodes]
    depths = [0] + [len(p) for p in nodes]
    mask = torch.zeros(n, n, dtype=torch.bool)
    children: list[list[int]] = [[] for _ in range(n)]
    for row in range(n):
        a = row
        while a != -1:
            mask[row, a] = True
            a = parents[a]
        if row > 0:
            children[parents[row]].append(row)

    leaf_paths = []
    for row in range(n):
        if not children[row]:
            chain, a = [], row
            while a != -1:
                chain.append(a)
                a = parents[a]
            leaf_paths.append(tuple(reversed(chain)))

    max_depth = max(depths)
    depth_starts = [depths.index(d) for d in range(max_depth + 1)] + [n]
    return TreeTensors(
        paths=tuple(nodes),
        parents=torch.tensor(parents, dtype=torch.long),
        depths=torch.tensor(depths, dtype=torch.long),
        attn_mask=mask,
        leaf_paths=tuple(leaf_paths),
        children=tuple(tuple(c) for c in children),
        depth_starts=tuple(depth_starts),
    )
