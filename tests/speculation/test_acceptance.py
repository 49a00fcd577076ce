"""Acceptance: literal greedy cases, and sampled acceptance that emits exactly the target distribution."""

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from ray_specdec.config import TreeConfig
from ray_specdec.speculation.acceptance import accept_greedy, accept_sampled
from ray_specdec.speculation.tree import build_tree

V = 6


def one_hot_logits(argmaxes, vocab=V):
    logits = torch.zeros(len(argmaxes), vocab)
    logits[torch.arange(len(argmaxes)), torch.tensor(argmaxes)] = 5.0
    return logits


def chain(depth):
    return build_tree(TreeConfig.chain(depth).index_paths())


def test_greedy_perfect_match():
    tree = chain(3)
    verdict = accept_greedy(one_hot_logits([1, 2, 3, 4]), tree, torch.tensor([1, 2, 3]))
    assert verdict.accepted_rows == (1, 2, 3)
    assert verdict.accepted_tokens == (1, 2, 3)
    assert verdict.bonus_token == 4
    assert verdict.keep_rows == (0, 1, 2, 3)
    assert verdict.new_tokens == (1, 2, 3, 4)


def test_greedy_early_mismatch():
    verdict = accept_greedy(one_hot_logits([1, 5, 3, 4]), chain(3), torch.tensor([1, 2, 3]))
    assert verdict.accepted_rows == (1,)
    assert verdict.bonus_token == 5


def test_greedy_first_mismatch_emits_target_argmax():
    verdict = accept_greedy(one_hot_logits([0, 2, 3, 4]), chain(3), torch.tensor([1, 2, 3]))
    assert verdict.accepted_rows == () and verdict.bonus_token == 0


def test_greedy_takes_the_matching_branch():
    # root children: rows 1 (tok 1), 2 (tok 2); row 1 children: 3 (tok 3), 4 (tok 4); row 2 children: 5, 6
    tree = build_tree(TreeConfig((2, 2)).index_paths())
    draft = torch.tensor([1, 2, 3, 4, 5, 0])
    logits = one_hot_logits([2, 0, 0, 0, 0, 0, 3])  # root -> 2; row 2 argmax 0 -> row 6 (tok 0); row 6 -> 3
    verdict = accept_greedy(logits, tree, draft)
    assert verdict.accepted_rows == (2, 6)
    assert verdict.accepted_tokens == (2, 0)
    assert verdict.bonus_token == 3


def test_greedy_empty_tree_is_plain_decoding():
    verdict = accept_greedy(one_hot_logits([4]), build_tree([]), torch.empty(0, dtype=torch.long))
    assert verdict.accepted_rows == () and verdict.bonus_token == 4


def random_dist(gen, vocab=V, zeros=0):
    p = torch.rand(vocab, generator=gen, dtype=torch.float64) ** 2
    if zeros:
        p[torch.randperm(vocab, generator=gen)[:zeros]] = 0
    return p / p.sum()


def draw_children(q, k, without_replacement, gen):
    if without_replacement:
        keys = torch.log(q) - torch.log(-torch.log(torch.rand(q.shape, generator=gen, dtype=torch.float64)))
        return torch.topk(keys, k).indices
    return torch.multinomial(q, k, replacement=True, generator=gen)


def assert_distributed_as(counts: np.ndarray, p: torch.Tensor) -> None:
    """counts [V] of emitted tokens over n draws match p: nothing outside its support, chi-square, total variation."""
    n = counts.sum()
    expected = p.numpy() * n
    support = expected > 0
    assert counts[~support].sum() == 0, "a zero-probability token was emitted"
    assert chisquare(counts[support], expected[support]).pvalue > 1e-3
    assert 0.5 * np.abs(counts / n - p.numpy()).sum() < 0.03


@pytest.mark.parametrize("without_replacement", [False, True])
@pytest.mark.parametrize("k, zeros", [(1, 0), (2, 0), (3, 0), (3, 3), (5, 2)])
def test_first_emitted_token_has_target_distribution(k, zeros, without_replacement):
    """Root with k children drawn from q: the first emitted token (accepted child or bonus) is distributed as p."""
    gen = torch.Generator().manual_seed(1000 * k + zeros + without_replacement)
    p, q = random_dist(gen, zeros=zeros), random_dist(gen)
    tree = build_tree(TreeConfig((k,)).index_paths())
    target = torch.stack([p] + [random_dist(gen) for _ in range(k)])
    n = 8000
    counts = np.zeros(V)
    for _ in range(n):
        children = draw_children(q, k, without_replacement, gen)
        verdict = accept_sampled(target, q[None], tree, children, without_replacement, gen)
        counts[verdict.new_tokens[0]] += 1
    assert_distributed_as(counts, p)


@pytest.mark.parametrize("without_replacement", [False, True])
def test_two_token_path_has_target_distribution(without_replacement):
    """Depth-2 tree (2, 2): when the first token is accepted, the second emitted token is distributed as p(.|x1)."""
    gen = torch.Generator().manual_seed(7 + without_replacement)
    p_root = random_dist(gen)
    p_next = torch.stack([random_dist(gen) for _ in range(V)])  # target distribution after token x
    q_root = random_dist(gen)
    q_next = torch.stack([random_dist(gen) for _ in range(V)])
    tree = build_tree(TreeConfig((2, 2)).index_paths())
    n = 8000
    counts = np.zeros((V, V))
    for _ in range(n):
        first = draw_children(q_root, 2, without_replacement, gen)
        second = torch.cat([draw_children(q_next[x], 2, without_replacement, gen) for x in first.tolist()])
        tokens = torch.cat([first, second])
        target = torch.stack([p_root] + [p_next[x] for x in first.tolist()] + [random_dist(gen) for _ in range(4)])
        q = torch.stack([q_root] + [q_next[x] for x in first.tolist()])
        verdict = accept_sampled(target, q, tree, tokens, without_replacement, gen)
        if len(verdict.new_tokens) >= 2:
            counts[verdict.new_tokens[0], verdict.new_tokens[1]] += 1
    # given the first token was accepted as x1, the next token must follow p_next[x1]
    for x1 in range(V):
        row = counts[x1]
        if row.sum() < 500:
            continue
        expected = p_next[x1].numpy() * row.sum()
        assert chisquare(row, expected).pvalue > 1e-3


@pytest.mark.parametrize("without_replacement", [False, True])
@pytest.mark.parametrize("k, det_token, zeros", [(0, 2, 0), (2, 2, 0), (3, 0, 3), (2, 1, 2)])
def test_a_deterministic_child_tried_first_keeps_the_target_distribution(k, det_token, zeros, without_replacement):
    """Root with a lookup child (token d, q one-hot) and k children drawn from q: the first emitted token is still
    distributed as p, whether d is likely, unlikely, impossible under p, or also among the drafted children."""
    gen = torch.Generator().manual_seed(77 * k + det_token + 7 * zeros + without_replacement)
    p, q = random_dist(gen, zeros=zeros), random_dist(gen)
    # rows: root, k drafted children (ranks 0..k-1), the lookup child (rank k): the lookup row is the last
    tree = build_tree([(r,) for r in range(k + 1)])
    target = torch.stack([p] + [random_dist(gen) for _ in range(k + 1)])
    det_row = k + 1
    n = 8000
    counts = np.zeros(V)
    for _ in range(n):
        drafted = draw_children(q, k, without_replacement, gen) if k else torch.empty(0, dtype=torch.long)
        tokens = torch.cat([drafted, torch.tensor([det_token])])
        verdict = accept_sampled(target, q[None], tree, tokens, without_replacement, gen,
                                 deterministic=frozenset({det_row}), q_rows=(0,) + (-1,) * (k + 1))
        counts[verdict.new_tokens[0]] += 1
    assert_distributed_as(counts, p)
