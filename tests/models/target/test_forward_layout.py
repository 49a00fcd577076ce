"""models/target/forward_layout.py: how a step's segments are laid out in a forward (the forwards themselves are tested
in test_forward_batch.py, test_one_forward.py and test_kv_pool.py)."""

import torch

from ray_specdec.models.target.forward_layout import Rows, Segment, prefill_rounds, verify_positions
from ray_specdec.speculation.tree import build_tree


def _rows(cache, tokens, tree=None, cache_len=0):
    tokens = torch.as_tensor(tokens)
    return Rows(Segment(cache, tokens, tree), tokens, cache_len)


def test_prefill_pieces_run_in_rounds_together_or_one_forward_each():
    a, b, c = object(), object(), object()
    chunks = [_rows(a, range(10)), _rows(b, range(100, 103)), _rows(c, range(200, 207))]
    together = prefill_rounds(chunks, size=4, together=True)
    # round r holds the r-th piece of every segment that has one, in the segments' order
    assert [[(id(cache), t.tolist()) for cache, t in work] for work in together] == [
        [(id(a), [0, 1, 2, 3]), (id(b), [100, 101, 102]), (id(c), [200, 201, 202, 203])],
        [(id(a), [4, 5, 6, 7]), (id(c), [204, 205, 206])],
        [(id(a), [8, 9])],
    ]
    apart = prefill_rounds(chunks, size=4, together=False)
    assert [[(id(cache), t.tolist()) for cache, t in work] for work in apart] == [
        [(id(a), [0, 1, 2, 3])], [(id(a), [4, 5, 6, 7])], [(id(a), [8, 9])], [(id(b), [100, 101, 102])],
        [(id(c), [200, 201, 202, 203])], [(id(c), [204, 205, 206])],
    ]
    assert prefill_rounds([], size=4, together=True) == []


def test_verify_positions_are_each_rows_depth_past_its_own_cache():
    chain = build_tree([[0], [0, 0]])  # root, depth 1, depth 2
    fork = build_tree([[0], [1]])  # root, two children at depth 1
    root = build_tree([])
    verify = [_rows(None, [5, 6, 7], chain, cache_len=10), _rows(None, [1], root, cache_len=3),
              _rows(None, [2, 3, 4], fork, cache_len=0)]  # fmt: skip
    assert verify_positions(verify).tolist() == [10, 11, 12, 3, 0, 1, 1]
    roots = [_rows(None, [1], root, cache_len=n) for n in (4, 9)]
    assert verify_positions(roots).tolist() == [4, 9]
