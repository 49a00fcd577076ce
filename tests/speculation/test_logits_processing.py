"""speculation/logits_processing.py against a slow loop reference on random trees; logprobs rows; SamplingParams
validation."""

from __future__ import annotations

import random

import pytest
import torch

from ray_specdec.config import SamplingParams, TreeConfig
from ray_specdec.speculation.acceptance import Verdict
from ray_specdec.speculation.drafting import Draft, empty_draft
from ray_specdec.speculation.logits_processing import (TokenHistory, apply_logit_bias, path_counts, process_logits,
                                                       token_logprobs)
from ray_specdec.speculation.tree import build_tree
from ray_specdec.speculation.verify import judge
from tests.helpers.reference import reference_row

V = 12


def random_tree(n: int, rng: random.Random) -> list[tuple[int, ...]]:
    """n nodes, each hung under a random earlier node (or the root) as its next child."""
    paths: list[tuple[int, ...]] = []
    children: dict[tuple[int, ...], int] = {(): 0}
    for _ in range(n):
        parent = rng.choice([(), *paths])
        path = parent + (children[parent],)
        children[parent] += 1
        children[path] = 0
        paths.append(path)
    return paths


PARAMS = [
    SamplingParams(presence_penalty=0.7, frequency_penalty=0.4),
    SamplingParams(frequency_penalty=-1.5, repetition_penalty=1.8),
    SamplingParams(repetition_penalty=0.6, logit_bias=((1, 5.0), (7, -100.0))),
    SamplingParams(presence_penalty=2.0, frequency_penalty=2.0, repetition_penalty=1.3, logit_bias=((3, 1.0),),
                   min_tokens=4, temperature=0.8),
    SamplingParams(min_tokens=3),
]


@pytest.mark.parametrize("params", PARAMS)
@pytest.mark.parametrize("seed", range(6))
def test_process_logits_equals_a_loop_over_each_rows_path(params, seed):
    rng = random.Random(seed)
    tree = build_tree(random_tree(rng.randint(0, 14), rng))
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(1 + tree.num_nodes, V, dtype=torch.float64, generator=g) * 3
    draft_tokens = torch.randint(0, V, (tree.num_nodes,), generator=g)
    prompt = [rng.randrange(V) for _ in range(rng.randint(1, 6))]
    generated = [rng.randrange(V) for _ in range(rng.randint(0, 4))]
    stop_ids = frozenset({0, 5})
    out = process_logits(logits, tree, draft_tokens, TokenHistory(prompt + generated, len(prompt), stop_ids), params)
    assert out.shape == logits.shape
    for row in range(1 + tree.num_nodes):
        path, a = [], row
        while a > 0:
            path.append(int(draft_tokens[a - 1]))
            a = int(tree.parents[a])
        expected = reference_row(logits[row], prompt, generated + path[::-1], params, stop_ids)
        torch.testing.assert_close(out[row], expected, rtol=1e-12, atol=1e-12)


def test_path_counts_on_a_three_node_tree():
    tree = build_tree([(0,), (1,), (0, 0)])  # rows: root, a, b, a's child c
    counts = path_counts(tree, torch.tensor([4, 5, 4]), torch.bincount(torch.tensor([5]), minlength=6))
    assert counts.tolist() == [[0, 0, 0, 0, 0, 1], [0, 0, 0, 0, 1, 1], [0, 0, 0, 0, 0, 2], [0, 0, 0, 0, 2, 1]]


def test_defaults_leave_the_logits_alone_and_need_no_history():
    logits = torch.randn(1, V)
    no_tokens = torch.empty(0, dtype=torch.long)
    assert process_logits(logits, empty_draft().tree, no_tokens, None, SamplingParams()) is logits
    assert judge(logits, empty_draft(), SamplingParams(), None).bonus_token == int(logits.argmax())
    with pytest.raises(ValueError, match="token history"):
        judge(logits, empty_draft(), SamplingParams(presence_penalty=1.0), None)


def test_min_tokens_holds_back_stop_ids_by_row_depth():
    tree = build_tree([(0,), (0, 0), (0, 0, 0)])  # a chain: rows at depths 0..3
    history = TokenHistory([1, 2, 9, 9], prompt_len=2, stop_ids=frozenset({0, 3}))  # 2 generated so far
    out = process_logits(torch.zeros(4, V), tree, torch.tensor([4, 4, 4]), history, SamplingParams(min_tokens=4))
    held = torch.isinf(out[:, [0, 3]]).all(dim=-1).tolist()
    assert held == [True, True, False, False]  # 2 and 3 tokens generated before rows 0 and 1: still short of 4
    assert torch.isfinite(out[:, [1, 2, 4]]).all()


def test_greedy_follows_the_processed_logits():
    """A bias that makes the drafted token the argmax gets it accepted; then its own presence penalty at the next row
    hands the bonus to another token."""
    logits = torch.zeros(2, V)
    logits[:, 2] = 1.0
    params = SamplingParams(logit_bias=((6, 2.0),), presence_penalty=2.0)
    draft = Draft(TreeConfig((1,)), torch.tensor([6]), None)
    verdict = judge(logits, draft, params, None, TokenHistory([1], 1))
    # row 0: 6 has 2.0 against 1.0 -> accepted; row 1: 6 was generated, 2.0 - 2.0 = 0 -> the bonus is 2
    assert verdict.new_tokens == (6, 2)
    assert judge(logits, draft, SamplingParams(), None).new_tokens == (2,)


def test_token_logprobs_are_the_raw_rows_log_softmax():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, V, generator=g)
    verdict = Verdict(accepted_rows=(2, 3), accepted_tokens=(7, 1), bonus_token=5)  # rows 0 -> 2 -> 3, then the bonus
    out = token_logprobs(logits, verdict, k=3)
    expected_rows = [0, 2, 3]
    for (lp, top), row, token in zip(out, expected_rows, verdict.new_tokens):
        ref = torch.log_softmax(logits[row], dim=-1)
        assert lp == float(ref[token])
        assert [t for t, _ in top] == torch.topk(ref, 3).indices.tolist()
        assert [v for _, v in top] == torch.topk(ref, 3).values.tolist()
    assert [t.logprob for t in token_logprobs(logits, verdict, k=0, count=2)] == [out[0].logprob, out[1].logprob]
    assert token_logprobs(logits, verdict, k=0)[0].top == []


def test_logit_bias_adds_to_every_row():
    logits = torch.zeros(3, V)
    out = apply_logit_bias(logits, SamplingParams(logit_bias={4: 1.5, 0: -100}))
    assert out[:, 4].tolist() == [1.5] * 3 and out[:, 0].tolist() == [-100.0] * 3 and logits.abs().sum() == 0


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -2.1}, "frequency_penalty"),
        ({"frequency_penalty": float("nan")}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"repetition_penalty": float("inf")}, "repetition_penalty"),
        ({"logit_bias": ((3, 101.0),)}, "logit_bias values"),
        ({"logit_bias": ((-1, 1.0),)}, "logit_bias token ids"),
        ({"logit_bias": ((3, 1.0), (3, 2.0))}, "twice"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 65}, "min_tokens"),
        ({"stop_token_ids": (2, -5)}, "stop_token_ids"),
        ({"logprobs": 21}, "logprobs"),
        ({"logprobs": -1}, "logprobs"),
    ],
)
def test_sampling_params_refuse_bad_target_options(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_sampling_params_normalise_target_options():
    params = SamplingParams(logit_bias={9: 2, 1: -3}, stop_token_ids=[4, 2], logprobs=0)
    assert params.logit_bias == ((1, -3.0), (9, 2.0)) and params.stop_token_ids == (4, 2)
    assert not SamplingParams(logprobs=5, stop_token_ids=(3,)).processes_logits  # neither changes the logits
    assert SamplingParams(min_tokens=1).processes_logits and not SamplingParams(min_tokens=1).penalized
    hash(params)  # still a frozen, hashable value
    with pytest.raises(ValueError, match="vocabulary"):
        params.check_vocab(8)
