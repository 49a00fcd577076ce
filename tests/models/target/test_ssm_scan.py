"""The tree scan and conv of an SSM target's layer against their definitions: each row's state by a sequential scan
along its root-to-row path, each row's conv over its ancestors' inputs."""

from __future__ import annotations

import pytest
import torch

from ray_specdec.models.drafter.mamba_ops import causal_conv
from ray_specdec.models.target.ssm_scan import RowTrees, tree_conv, tree_scan, tree_scan_ref
from ray_specdec.speculation.tree import build_tree

D_INNER, D_STATE = 6, 4


def segments_parents() -> list[torch.Tensor]:
    """A chain (a prefill chunk), a wide tree, a root alone, and a chunk followed by a tree (a prompt's last chunk and
    its first round)."""
    tree = build_tree([(0,), (1,), (2,), (0, 0), (0, 1), (2, 0), (0, 0, 0), (2, 0, 0), (2, 0, 0, 0)]).parents
    small = build_tree([(0,), (1,), (0, 0)]).parents
    chunk_then_tree = torch.cat([torch.arange(-1, 4), torch.where(small >= 0, small + 5, 4)])
    return [torch.arange(-1, 6), tree, torch.tensor([-1]), chunk_then_tree]


def random_inputs(rows: int, segments: int, g: torch.Generator, dtype=torch.float64):
    def r(*shape):
        return torch.randn(*shape, generator=g, dtype=dtype)

    dt = torch.nn.functional.softplus(r(rows, D_INNER))
    A = -torch.rand(D_INNER, D_STATE, generator=g, dtype=dtype) * 2
    return dt, r(rows, D_INNER), r(rows, D_STATE), r(rows, D_STATE), A, r(segments, D_INNER, D_STATE)


@pytest.mark.parametrize("groups", [None, 1, 3], ids=["mamba", "mamba2-1-group", "mamba2-3-groups"])
def test_tree_scan_states_are_sequential_scans_along_each_path(groups):
    """Mamba's B and C are shared by every channel; Mamba2's by each group's channels (its heads' channels)."""
    parents = segments_parents()
    layout = RowTrees.build(parents, d_conv=4)
    g = torch.Generator().manual_seed(0)
    dt, x, B, C, A, start = random_inputs(layout.rows, layout.segments, g)
    if groups is not None:
        B, C = (torch.randn(layout.rows, groups, D_STATE, generator=g, dtype=torch.float64) for _ in range(2))
    y, states = tree_scan(dt, x, B, C, A, start, layout)
    y_ref, states_ref = tree_scan_ref(dt, x, B, C, A, start, layout)
    torch.testing.assert_close(states, states_ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(y, y_ref, rtol=1e-12, atol=1e-12)
    # a chain segment is a sequential scan: row i's state after tokens 0..i
    h = start[0].clone()
    for i in range(6):
        b = B[i][None, :] if groups is None else B[i].repeat_interleave(D_INNER // groups, dim=0)
        h = torch.exp(dt[i, :, None] * A) * h + (dt[i] * x[i])[:, None] * b
        torch.testing.assert_close(states[i], h, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("d_conv", [1, 2, 4])
def test_tree_conv_windows_are_each_rows_ancestors(d_conv):
    """Row r's conv output equals a causal conv over the inputs along r's root-to-row path, preceded by its
    segment's starting conv state."""
    parents = segments_parents()
    layout = RowTrees.build(parents, d_conv=d_conv)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(layout.rows, D_INNER, generator=g, dtype=torch.float64)
    history = torch.randn(layout.segments, d_conv - 1, D_INNER, generator=g, dtype=torch.float64)
    weight = torch.randn(D_INNER, d_conv, generator=g, dtype=torch.float64)
    bias = torch.randn(D_INNER, generator=g, dtype=torch.float64)
    out, inputs = tree_conv(x, history, layout, weight, bias)
    for s in range(layout.segments):
        for r in range(layout.starts[s], layout.starts[s + 1]):
            path, a = [], r
            while a != -1:
                path.append(a)
                a = int(layout.parents[a])
            path.reverse()
            expected = causal_conv(x[path], weight, bias, history=history[s])[-1]
            torch.testing.assert_close(out[r], expected, rtol=1e-12, atol=1e-12)
            # the conv state after r: its window's last d_conv - 1 inputs
            after = torch.cat([history[s], x[path]])[len(path):]
            torch.testing.assert_close(inputs[layout.windows[r, 1:]], after)


def test_row_trees_refuse_parents_after_their_rows():
    with pytest.raises(ValueError, match="precede"):
        RowTrees.build([torch.tensor([-1, 2, 0])], d_conv=4)
    with pytest.raises(ValueError, match="root"):
        RowTrees.build([torch.tensor([0, 0])], d_conv=4)
