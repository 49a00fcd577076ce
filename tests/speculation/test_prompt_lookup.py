"""Prompt lookup: the n-gram index, the merge of its branch into a drafted tree, and the tree syntax."""

import pytest
import torch

from ray_specdec.config import SamplingParams, TreeConfig
from ray_specdec.speculation.acceptance import Verdict
from ray_specdec.speculation.drafting import DrafterSession, _merge_lookup
from ray_specdec.speculation.prompt_lookup import LookupIndex
from tests.helpers.inputs import repetitive_history
from tests.helpers.models import tiny_mamba


def brute_force_propose(seq, k, max_ngram=3, min_ngram=1):
    for n in range(max_ngram, min_ngram - 1, -1):
        if len(seq) <= n:
            continue
        suffix = seq[-n:]
        for start in range(len(seq) - n - 1, -1, -1):
            if seq[start : start + n] == suffix:
                return seq[start + n : start + n + k]
    return []


def test_proposes_what_followed_the_latest_longest_match():
    index = LookupIndex([1, 2, 3, 4, 5, 1, 2])
    assert index.propose(3) == [3, 4, 5]
    index.extend([9])  # 9 never occurred before
    assert index.propose(3) == []
    index.extend([1, 2])  # (9, 1, 2) is new; (1, 2) last occurred at 5, followed by 9, 1
    assert index.propose(2) == [9, 1]
    index.extend([3])  # (1, 2, 3) occurred at 0 only: the longest match wins over the later (2, 3)...
    assert index.propose(4) == [4, 5, 1, 2]
    assert index.propose(0) == []


@pytest.mark.parametrize("seed", range(5))
def test_incremental_index_matches_brute_force(seed):
    g = torch.Generator().manual_seed(seed)
    seq = torch.randint(0, 6, (200,), generator=g).tolist()
    index = LookupIndex(seq[:1])
    for i in range(1, len(seq)):
        index.extend([seq[i]])
        assert index.propose(5) == brute_force_propose(seq[: i + 1], 5), i
    assert LookupIndex(seq).propose(5) == index.propose(5)


def test_index_rejects_bad_ngram_bounds():
    with pytest.raises(ValueError, match="min_ngram"):
        LookupIndex(max_ngram=1, min_ngram=2)


def test_merge_follows_agreeing_nodes_and_branches_at_the_first_disagreement():
    paths, tokens = [(0,), (1,), (0, 0)], [5, 6, 7]
    merged_paths, merged_tokens = _merge_lookup(paths, tokens, [5, 8, 9])
    assert merged_paths == [(0,), (1,), (0, 0), (0, 1), (0, 1, 0)]  # BFS order, new ranks after the drafter's
    assert merged_tokens == [5, 6, 7, 8, 9]
    assert _merge_lookup(paths, tokens, [5, 7]) is None  # nothing new: the drafter's tree already holds it
    merged_paths, merged_tokens = _merge_lookup([(0,)], [5], [6, 7])
    assert merged_paths == [(0,), (1,), (1, 0)] and merged_tokens == [5, 6, 7]


@pytest.mark.parametrize(
    "text, branching, lookup, canonical",
    [("1,1,1,1+L4", (1, 1, 1, 1), 4, "1,1,1,1+L4"), ("2,2 + lookup8", (2, 2), 8, "2,2+L8"), ("3,2", (3, 2), 0, "3,2")],
)
def test_tree_syntax_with_lookup(text, branching, lookup, canonical):
    config = TreeConfig.parse(text)
    assert (config.branching, config.lookup, str(config)) == (branching, lookup, canonical)
    assert TreeConfig.parse(str(config)) == config
    assert config.max_depth == max(len(branching), lookup)


def test_truncation_caps_the_lookup_branch_too():
    assert TreeConfig.parse("1,1,1,1+L6").truncated(2) == TreeConfig((1, 1), 2)
    assert TreeConfig.parse("1,1+L6").truncated(4) == TreeConfig((1, 1), 4)
    assert TreeConfig.parse("1,1+L6").truncated(0) == TreeConfig(())


@pytest.mark.parametrize("text, message", [("none+L3", "ride on a drafted tree"), ("1,1+x", "like 1,1,1,1\\+L4"),
                                           ("1+L99", "lookup tokens must be")])
def test_bad_lookup_syntax_is_a_clear_error(text, message):
    with pytest.raises(ValueError, match=message):
        TreeConfig.parse(text)


@pytest.mark.parametrize("accept", [0, 1, 3, 5])
def test_commit_after_the_lookup_branch_equals_prefill_of_the_history(accept):
    """Accepting k lookup tokens, beyond the drafter's own depth, leaves the drafter exactly where a prefill of the
    whole history would: state copy of the deepest drafted node, then one extend over the rest and the bonus."""
    drafter = tiny_mamba()
    history = repetitive_history()
    session = DrafterSession(drafter, history, vocab_size=128)
    draft = session.draft(TreeConfig((1,), lookup=5), SamplingParams(), None)
    assert draft.config.lookup == 5 and draft.paths is not None
    tree, tokens = draft.tree, [-1, *draft.tokens.tolist()]
    assert [tokens[c] for c in tree.leaf_paths[-1][1:]][-5:] == [10, 11, 12, 13, 3]
    lookup_path = max(tree.leaf_paths, key=lambda rows: [tokens[r] for r in rows[1:2]] == [10])
    rows = lookup_path[1 : 1 + accept]
    verdict = Verdict(tuple(rows), tuple(tokens[r] for r in rows), bonus_token=42)
    later = Verdict((), (), bonus_token=43)
    session.commit_all([verdict, later])
    expected_history = history + [tokens[r] for r in rows] + [42, 43]
    assert session.history == expected_history
    state, logits = drafter.prefill(torch.tensor(expected_history))
    torch.testing.assert_close(session.root_state.conv, state.conv)
    torch.testing.assert_close(session.root_state.ssm, state.ssm)
    torch.testing.assert_close(session.root_logits[0], logits)


def test_commit_through_the_drafters_own_nodes_reuses_their_states():
    drafter = tiny_mamba()
    history = repetitive_history()
    session = DrafterSession(drafter, history, vocab_size=128)
    draft = session.draft(TreeConfig((2, 1), lookup=3), SamplingParams(), None)
    tree, tokens = draft.tree, [-1, *draft.tokens.tolist()]
    rows = tree.leaf_paths[0][1:]  # the drafter's first path, root to leaf
    session.commit(Verdict(tuple(rows), tuple(tokens[r] for r in rows), bonus_token=5))
    state, logits = drafter.prefill(torch.tensor(history + [tokens[r] for r in rows] + [5]))
    torch.testing.assert_close(session.root_state.ssm, state.ssm)
    torch.testing.assert_close(session.root_logits[0], logits)


def test_sampled_rounds_hang_the_lookup_branch_from_the_root():
    session = DrafterSession(tiny_mamba(), repetitive_history(), vocab_size=128)
    generator = torch.Generator().manual_seed(0)
    draft = session.draft(TreeConfig((2, 1), lookup=3), SamplingParams(temperature=1.0), generator)
    assert draft.config == TreeConfig((2, 1), lookup=3) and draft.arm == TreeConfig((2, 1), lookup=3)
    tree, tokens = draft.tree, [-1, *draft.tokens.tolist()]
    # the drafter's (0,), (1,), (0, 0), (1, 0) and the lookup chain (2,), (2, 0), (2, 0, 0), never merged
    assert tree.paths == ((0,), (1,), (2,), (0, 0), (1, 0), (2, 0), (2, 0, 0))
    assert draft.deterministic == frozenset({3, 6, 7})
    assert [tokens[r] for r in sorted(draft.deterministic)] == [10, 11, 12]
    # q rows: the root (0) and the drafter's depth-1 nodes (rows 1, 2); lookup rows and leaves have none
    assert draft.q_rows == (0, 1, 2, -1, -1, -1, -1, -1) and draft.probs.shape[0] == 3
