"""Coupled sampling's pieces: Philox-4x32-10 against Random123's known answers, keyed uniforms that are uniform and
depend only on their key, Gumbel-max draws that follow the processed distribution, and coupled verification that is
target-only coupled decoding whatever the draft."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from scipy.stats import chisquare, kstest

import ray_specdec.speculation.coupled as coupled
from ray_specdec.config import SamplingParams, TreeConfig
from ray_specdec.speculation.acceptance import accept_greedy
from ray_specdec.speculation.coupled import KeyedGumbel, keyed_argmax, keyed_top_k, keyed_uniforms, philox4x32
from ray_specdec.speculation.drafting import Draft, empty_draft, pick_children, tree_for
from ray_specdec.speculation.logits_processing import TokenHistory
from ray_specdec.speculation.sampling import logits_to_probs
from ray_specdec.speculation.verify import coupled_tokens, judge, judge_plain_coupled

# Random123's tests/kat_vectors, the philox4x32 10 lines: counter (4 words), key (2 words) -> output (4 words)
KNOWN_ANSWERS = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]


@pytest.mark.parametrize("counter, key, expected", KNOWN_ANSWERS)
def test_philox_gives_random123s_known_answers(counter, key, expected):
    out = philox4x32([torch.tensor([c]) for c in counter], key)
    assert tuple(int(w) for w in out) == expected


def test_keyed_uniforms_depend_on_their_key_alone():
    u = keyed_uniforms(12345, 2, [7, 8, 9], 1001)
    assert u.shape == (3, 1001) and u.dtype == torch.float64
    assert torch.equal(u, keyed_uniforms(12345, 2, [7, 8, 9], 1001))
    # a position's values do not depend on the others asked with it, nor on the vocabulary's size
    assert torch.equal(u[1], keyed_uniforms(12345, 2, [8], 1001)[0])
    assert torch.equal(u[:, :500], keyed_uniforms(12345, 2, [7, 8, 9], 500))
    # another seed, choice or position gives other values
    for other in (keyed_uniforms(12346, 2, [7], 1001), keyed_uniforms(12345, 3, [7], 1001),
                  keyed_uniforms(12345 + 2**32, 2, [7], 1001), keyed_uniforms(12345, 2 + 2**32, [7], 1001)):
        assert not torch.equal(other[0], u[0])
    assert (u > 0).all() and (u < 1).all()


def test_keyed_uniforms_are_uniform(monkeypatch):
    """Kolmogorov-Smirnov on the values, chi-square on their leading 8 bits and on the last bit used (bit 52); the
    extremes stay inside (0, 1)."""
    u = keyed_uniforms(2**62 + 17, 0, range(64), 4096).reshape(-1).numpy()  # 262144 values
    assert kstest(u, "uniform").pvalue > 1e-3
    top = np.floor(u * 256).astype(int)
    assert chisquare(np.bincount(top, minlength=256)).pvalue > 1e-3
    low = (np.floor(u * 2.0**52)).astype(np.int64) & 1
    assert chisquare(np.bincount(low, minlength=2)).pvalue > 1e-3
    for word in (0, 0xFFFFFFFF):  # the extreme words (through the torch path's own arithmetic) stay inside (0, 1);
        # the native kernel makes the same bits as that path (tests/models/native/test_philox.py)
        monkeypatch.setattr(coupled, "philox4x32", lambda counter, key, w=word: [torch.full_like(counter[0], w)] * 4)
        ends = coupled.torch_keyed_rows(torch.tensor([[0, 0, 0]]), 4)
        assert ((0 < ends) & (ends < 1)).all() and (-torch.log(-torch.log(ends))).isfinite().all()
    monkeypatch.undo()
    # neighbouring tokens and positions are uncorrelated
    grid = keyed_uniforms(5, 1, range(256), 256).numpy()
    assert abs(np.corrcoef(grid[:, :-1].ravel(), grid[:, 1:].ravel())[0, 1]) < 0.01
    assert abs(np.corrcoef(grid[:-1].ravel(), grid[1:].ravel())[0, 1]) < 0.01


def test_keyed_gumbel_keeps_positions_until_the_sequence_passes_them():
    noise = KeyedGumbel(99, 1)
    a = noise.at([10, 11, 12], 50)
    assert torch.equal(a, -torch.log(-torch.log(keyed_uniforms(99, 1, [10, 11, 12], 50))))
    assert torch.equal(noise.at([12, 11], 50), a[[2, 1]])
    assert torch.equal(noise.at([12], 80)[0, :50], a[2])  # a wider vocabulary: the same first tokens
    noise.forget_before(12)
    assert sorted(noise._noise) == [12]
    assert torch.equal(noise.at([10], 50)[0], a[0])  # asked again after all: the same noise


SETTINGS = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.6), SamplingParams(temperature=1.7, top_k=3),
            SamplingParams(temperature=1.0, top_p=0.8), SamplingParams(temperature=0.8, top_k=5, top_p=0.9)]


@pytest.mark.parametrize("params", SETTINGS, ids=lambda p: f"T{p.temperature}-k{p.top_k}-p{p.top_p}")
def test_keyed_argmax_draws_the_processed_distribution(params):
    """One draw per seed (position and choice fixed), 5000 seeds: chi-square against the processed distribution;
    tokens top-k / top-p remove are never drawn."""
    logits = torch.log(torch.tensor([0.3, 0.02, 0.2, 0.15, 0.1, 0.08, 0.05, 0.05, 0.04, 0.01], dtype=torch.float64))
    p = logits_to_probs(logits[None], params)[0]
    n = 5000
    draws = torch.cat([keyed_argmax(p[None], KeyedGumbel(seed, 0).at([41], p.numel())) for seed in range(n)])
    counts = torch.bincount(draws, minlength=p.numel()).numpy()
    assert counts[(p == 0).numpy()].sum() == 0
    support = (p > 0).numpy()
    assert chisquare(counts[support], p.numpy()[support] * n).pvalue > 1e-3


def test_positions_and_choices_draw_independently():
    """The draws of one seed at two positions (or two choices at one position) are independent: chi-square of the
    joint counts against the product of the marginals."""
    p = torch.tensor([[0.5, 0.3, 0.2]], dtype=torch.float64)
    n = 3000
    for first, second in (((0, 7), (0, 8)), ((0, 7), (1, 7))):
        joint = np.zeros((3, 3))
        for seed in range(n):
            a = int(keyed_argmax(p, KeyedGumbel(seed, first[0]).at([first[1]], 3)))
            b = int(keyed_argmax(p, KeyedGumbel(seed, second[0]).at([second[1]], 3)))
            joint[a, b] += 1
        expected = np.outer(p[0].numpy(), p[0].numpy()) * n
        assert chisquare(joint.ravel(), expected.ravel()).pvalue > 1e-3


def test_keyed_top_k_is_the_argmax_then_draws_without_replacement():
    p = torch.tensor([[0.5, 0.3, 0.2, 0.0]], dtype=torch.float64)
    n = 8000
    firsts, second_is_2 = [], 0
    for seed in range(n):
        noise = KeyedGumbel(seed).at([3], 4)
        top = keyed_top_k(p, noise, 3)[0]
        assert int(top[0]) == int(keyed_argmax(p, noise)) and len(set(top.tolist())) == 3 and 3 not in top.tolist()
        firsts.append(int(top[0]))
        second_is_2 += int(top[1]) == 2
    assert chisquare(np.bincount(firsts, minlength=3), p[0, :3].numpy() * n).pvalue > 1e-3
    # P(second = 2) = 0.5 * 0.2 / 0.5 + 0.3 * 0.2 / 0.7 (Gumbel-top-k is sampling without replacement)
    assert abs(second_is_2 / n - (0.2 + 0.3 * 0.2 / 0.7)) < 0.02  # 4.4 standard deviations


def test_coupled_children_start_with_the_keyed_argmax_of_the_drafters_distribution():
    logits = torch.randn(4, 40, generator=torch.Generator().manual_seed(0))
    params = SamplingParams(temperature=0.8, top_k=10)
    noise = KeyedGumbel(3).at([17], 40)[0]
    children, q = pick_children(logits, 3, params, None, noise)
    assert q is None and children.shape == (4, 3)
    expected = keyed_argmax(logits_to_probs(logits.float(), params), noise.expand(4, -1))
    assert torch.equal(children[:, 0], expected)


def coupled_decoding(logits_of, prefix: list[int], n: int, params: SamplingParams, noise: KeyedGumbel) -> list[int]:
    """Target-only coupled decoding: the keyed argmax at each position in turn."""
    tokens = list(prefix)
    for _ in range(n):
        p = logits_to_probs(logits_of(tokens)[None], params)
        tokens.append(int(keyed_argmax(p, noise.at([len(tokens)], p.shape[-1]))))
    return tokens[len(prefix):]


def toy_logits(tokens: list[int], vocab: int = 7) -> torch.Tensor:
    """A deterministic toy model: logits from the last two tokens."""
    g = torch.Generator().manual_seed(1000 * tokens[-1] + (tokens[-2] if len(tokens) > 1 else 0))
    return torch.randn(vocab, generator=g, dtype=torch.float64)


@pytest.mark.parametrize("tree", ["1,1,1", "3,2,1", "2,2"])
def test_coupled_verification_is_target_only_coupled_decoding(tree):
    """Random drafts of several trees, and a draft that follows the target: each round's verdict is exactly the next
    tokens of target-only coupled decoding (the bonus included), and the target's tokens at the draft's rows are
    their keyed argmaxes at their depths' positions."""
    params = SamplingParams(temperature=1.0, top_p=0.95)
    config = TreeConfig.parse(tree)
    shape = tree_for(config)
    hits = 0
    for seed, follow in itertools.product(range(30), (False, True)):
        prefix = [1, 2, 3, 4][: 1 + seed % 4]
        noise = KeyedGumbel(seed, seed % 2)
        truth = coupled_decoding(toy_logits, prefix, config.depth + 1, params, noise)
        g = torch.Generator().manual_seed(seed)
        tokens = torch.randint(7, (shape.num_nodes,), generator=g)
        if follow:  # every node's first child is the target's own token
            for row, path in enumerate(shape.paths, 1):
                if all(r == 0 for r in path):
                    tokens[row - 1] = truth[len(path) - 1]
        rows = [prefix + [int(tokens[r - 1]) for r in _path_rows(shape, row)] for row in range(1 + shape.num_nodes)]
        logits = torch.stack([toy_logits(r) for r in rows])
        draft = Draft(config, tokens, None)
        verdict = judge(logits, draft, params, None, TokenHistory(prefix, len(prefix)), noise)
        assert list(verdict.new_tokens) == truth[: len(verdict.new_tokens)]
        hits += len(verdict.accepted_rows)
        if follow:
            assert len(verdict.accepted_rows) == config.depth
        at_rows = coupled_tokens(logits_to_probs(logits, params), shape, len(prefix), noise)
        for row in range(1 + shape.num_nodes):
            depth = int(shape.depths[row])
            own = keyed_argmax(logits_to_probs(logits[row:row + 1], params), noise.at([len(prefix) + depth], 7))
            assert int(at_rows[row]) == int(own)
        assert accept_greedy(at_rows, shape, tokens) == verdict
    assert hits > 0


def _path_rows(shape, row: int) -> list[int]:
    """The rows from the root's first child to `row` (row's ancestors and itself, root excluded)."""
    out = []
    while row:
        out.append(row)
        row = int(shape.parents[row])
    return out[::-1]


def test_coupled_rounds_need_the_history():
    with pytest.raises(ValueError, match="history"):
        judge(torch.zeros(1, 5), Draft(TreeConfig(()), torch.empty(0, dtype=torch.long), None),
              SamplingParams(temperature=1.0), None, None, KeyedGumbel(1))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_the_same_noise_on_a_gpu():
    cpu = keyed_uniforms(2**40 + 3, 5, [0, 9, 2**31], 5003)
    gpu = keyed_uniforms(2**40 + 3, 5, [0, 9, 2**31], 5003, device="cuda")
    assert torch.equal(cpu, gpu.cpu())
    logits = torch.randn(8, 5003, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    p = logits_to_probs(logits, SamplingParams(temperature=0.9, top_k=100))
    noise = KeyedGumbel(7)
    on_cpu = keyed_argmax(p, noise.at([5] * 8, 5003))
    on_gpu = keyed_argmax(p.cuda(), KeyedGumbel(7).at([5] * 8, 5003, device="cuda"))
    assert torch.equal(on_cpu, on_gpu.cpu())


def test_plain_coupled_rounds_judged_together_get_their_verdicts_alone():
    """A step's undrafted coupled rounds, judged together (settings grouped, noise made in one pass), get exactly the
    verdicts `judge` gives each alone."""
    settings = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=5),
                SamplingParams(temperature=1.2, top_p=0.8)]
    g = torch.Generator().manual_seed(4)
    rows = [torch.randn(1, 300, generator=g) for _ in range(9)]
    params = [settings[i % 3] for i in range(9)]
    positions = [5 + 3 * i for i in range(9)]
    together = judge_plain_coupled(rows, params, [KeyedGumbel(i, i % 2) for i in range(9)], positions)
    for i in range(9):
        alone = judge(rows[i], empty_draft(), params[i], None, TokenHistory([1] * positions[i], 1),
                      KeyedGumbel(i, i % 2))
        assert together[i] == alone
    assert len({v.bonus_token for v in together}) > 3
