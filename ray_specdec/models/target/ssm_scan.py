"""A Mamba layer's recurrence over rows that form trees: each row's conv window and SSM state come from its parent's.

A forward's rows belong to segments (one per request). Each segment starts from its request's state (the last
`d_conv - 1` conv inputs and the SSM state after its committed tokens) and its rows form a tree by parent index: a
prefill chunk is a chain (row i's parent is row i - 1), a verify is `[root, *tree nodes]` with the tree's parents. The
root's parent (-1) is the segment's starting state. Then for every row r with parent p:

    conv window(r) = the last d_conv inputs along r's ancestor chain (into the starting conv state past the root)
    h(r) = exp(dt(r) A) * h(p) + dt(r) x(r) B(r)                     (h(-1) = the segment's starting SSM state)

`RowTrees` lays a forward's rows out once (window indices and depth levels, shared by every layer); `tree_conv` and
`tree_scan` run one layer. The scan steps every row of one depth of every segment at once (depth levels in BFS order),
so a verify of depth d costs d + 1 vectorised updates per layer however wide its tree, and a prefill chunk of S tokens
S updates. `tree_scan_ref` is the definition: each row's state by a sequential scan along its root-to-row path.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Sequence

import torch

from ray_specdec.models.drafter.mamba_ops import contract_state


@dataclass(frozen=True)
class RowTrees:
    """Where a forward's rows sit: segment s's rows are [starts[s], starts[s + 1]); `parents` are global row indices
    (-1: the segment's starting state)."""

    starts: tuple[int, ...]  # [segments + 1]
    parents: torch.Tensor  # [R] long
    windows: torch.Tensor  # [R, d_conv] long: each row's conv inputs, oldest first, as indices into `conv_inputs`
    depths: torch.Tensor  # [R] long: each row's depth in its segment (a chain's row i: i)
    levels: tuple[tuple[torch.Tensor, torch.Tensor], ...]  # per depth: (rows [n], their parents' state rows [n])
    single_rows: tuple[tuple[int, int] | None, ...]  # per depth: (row, its parent's state row) where n == 1
    segment_of: torch.Tensor  # [R] long, on the CPU: each row's segment

    @functools.cached_property
    def native_tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(starts, parents) as contiguous int64 CPU tensors: what the native scan reads (native/ssm_scan.py)."""
        return torch.tensor(self.starts, dtype=torch.int64), self.parents.to(torch.int64).contiguous()

    @property
    def rows(self) -> int:
        return self.starts[-1]

    @property
    def segments(self) -> int:
        return len(self.starts) - 1

    @classmethod
    def build(cls, parents: Sequence[torch.Tensor], d_conv: int, device: torch.device | str = "cpu") -> "RowTrees":
        """parents: per segment [S_i] long, each row's parent row within the segment (-1 for its first row), every
        parent before its child; device: where the forward runs (the indices go there)."""
        sizes = [p.numel() for p in parents]
        starts = [0]
        for n in sizes:
            starts.append(starts[-1] + n)
        history = d_conv - 1
        rows = starts[-1]
        # every segment at once (a step's forward holds tens of them): rows' segments, local and global parents
        segment_of = torch.repeat_interleave(torch.arange(len(parents)), torch.tensor(sizes, dtype=torch.long))
        offset = torch.tensor(starts[:-1], dtype=torch.long)[segment_of]
        local = torch.arange(rows) - offset
        p = torch.cat([torch.empty(0, dtype=torch.long)] + [q.to(torch.long).cpu().reshape(-1) for q in parents])
        first = local == 0
        if (p[first] != -1).any() or (p[~first] < 0).any() or (p[~first] >= local[~first]).any():
            raise ValueError("a segment's first row must be its root (-1) and every parent must precede its row")
        parents_all = torch.where(p >= 0, p + offset, -1)
        plist, dlist = parents_all.tolist(), [0] * rows
        for i, q in enumerate(plist):  # (parents precede children: one pass)
            if q >= 0:
                dlist[i] = dlist[q] + 1
        depth_all = torch.tensor(dlist, dtype=torch.long)
        # ancestors at lags 0 .. d_conv-1 (-1 past the root)
        lagged = torch.empty(rows, d_conv, dtype=torch.long)
        lagged[:, 0] = torch.arange(rows)
        padded = torch.cat([parents_all, torch.tensor([-1])])  # padded[-1] = -1: the parent of "past the root"
        for j in range(1, d_conv):
            lagged[:, j] = padded[lagged[:, j - 1]]
        # inputs before a segment: its starting conv state, rows [rows + s * history, + history), oldest first; lag j
        # of a row at depth d (j > d) is that state's input j - d - 1 before its end
        lags = torch.arange(d_conv)
        before = rows + (segment_of * history + history)[:, None] - (lags[None, :] - depth_all[:, None])
        windows_all = torch.where(lagged >= 0, lagged, before).flip(1)  # oldest first
        # state rows of a level's parents: a segment's starting state is row s, row r is row segments + r
        state_row = torch.where(parents_all >= 0, parents_all + len(parents), segment_of)
        levels, single = [], []
        by_depth = torch.argsort(depth_all, stable=True)
        counts = torch.bincount(depth_all).tolist() if rows else []
        for at in by_depth.split(counts):
            levels.append((at.to(device), state_row[at].to(device)))
            single.append((int(at[0]), int(state_row[at[0]])) if at.numel() == 1 else None)
        return cls(tuple(starts), parents_all, windows_all.to(device), depth_all, tuple(levels), tuple(single),
                   segment_of)


def tree_conv(
    x: torch.Tensor,  # [R, d_inner]: every row's conv input
    conv_states: torch.Tensor,  # [segments, d_conv - 1, d_inner]: each segment's inputs before its root, oldest first
    layout: RowTrees,
    weight: torch.Tensor,  # [d_inner, d_conv]
    bias: torch.Tensor | None,  # [d_inner]
) -> tuple[torch.Tensor, torch.Tensor]:  # [R, d_inner] conv outputs (before the activation); [R + ..., d_inner]
    """The depthwise causal conv of every row over its own ancestors' inputs -> (outputs, all inputs: x, then the
    segments' starting conv states, which `layout.windows` index: a row's window is `inputs[windows[row]]`)."""
    inputs = torch.cat([x, conv_states.reshape(-1, x.shape[1]).to(x.dtype)])
    window = inputs[layout.windows]  # [R, d_conv, d_inner]
    out = window[:, 0] * weight[:, 0]
    for k in range(1, weight.shape[1]):
        out = torch.addcmul(out, window[:, k], weight[:, k])
    return (out if bias is None else out + bias), inputs


def tree_scan(
    dt: torch.Tensor,  # [R, d_inner] (after softplus)
    x: torch.Tensor,  # [R, d_inner]
    B: torch.Tensor,  # [R, d_state], or [R, groups, d_state]: each of `groups` runs of channels has its own
    C: torch.Tensor,  # like B
    A: torch.Tensor,  # [d_inner, d_state]
    ssm_states: torch.Tensor,  # [segments, d_inner, d_state]: each segment's starting state
    layout: RowTrees,
) -> tuple[torch.Tensor, torch.Tensor]:  # y [R, d_inner] (C . state, before the D skip and the gate); states
    """Every row's SSM state from its parent's, one depth level of every segment at a time -> (y, states [R, d_inner,
    d_state]: row r's state after its token). Mamba2's heads are channels here: a head's dt and A repeated over its
    head_dim channels, its group's B and C over the group's channels."""
    rows_n, d_inner = x.shape
    decay = torch.exp(dt.unsqueeze(-1) * A)  # [R, d_inner, d_state]
    if B.dim() == 2:
        inject = (dt * x).unsqueeze(-1) * B.unsqueeze(1)
    else:
        inject = ((dt * x).view(rows_n, B.shape[1], -1, 1) * B.unsqueeze(2)).view(decay.shape)
    states = torch.cat([ssm_states.to(decay.dtype), torch.empty_like(decay)])  # segments' starts, then the rows
    base = layout.segments
    for (rows, parents), single in zip(layout.levels, layout.single_rows):
        if single is not None:  # one row (a lone prefill chunk): views, no gathers
            r, p = single
            torch.addcmul(inject[r], decay[r], states[p], out=states[base + r])
        else:
            states[base + rows] = torch.addcmul(inject[rows], decay[rows], states[parents])
    states = states[base:]
    if C.dim() == 2:
        return contract_state(states, C), states
    y = states.view(rows_n, C.shape[1], -1, states.shape[-1]) @ C.unsqueeze(-1)  # [R, groups, d_inner / groups, 1]
    return y.view(rows_n, d_inner), states


def tree_scan_ref(dt, x, B, C, A, ssm_states, layout: RowTrees) -> tuple[torch.Tensor, torch.Tensor]:
    """`tree_scan` by definition: each row's state is a sequential scan from its segment's starting state along its
    root-to-row path."""
    R, d_inner = x.shape

    def per_channel(t):  # [R, d_inner, d_state]
        return t[:, None, :].expand(R, d_inner, t.shape[-1]) if t.dim() == 2 else t.repeat_interleave(
            d_inner // t.shape[1], dim=1)

    B, C = per_channel(B), per_channel(C)
    states = torch.empty(R, *A.shape, dtype=torch.promote_types(dt.dtype, A.dtype))
    for s in range(layout.segments):
        for r in range(layout.starts[s], layout.starts[s + 1]):
            path, a = [], r
            while a != -1:
                path.append(a)
                a = int(layout.parents[a])
            h = ssm_states[s].clone()
            for a in reversed(path):
                h = torch.exp(dt[a, :, None] * A) * h + (dt[a] * x[a])[:, None] * B[a]
            states[r] = h
    return (states * C).sum(-1), states
