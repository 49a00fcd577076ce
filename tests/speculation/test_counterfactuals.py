"""Sub-tree ("what-if") feedback: a greedy round of one tree says exactly what every smaller arm would have kept.

`counterfactuals.what_if` is checked against the real thing: each smaller arm drafted from the same history by a fresh
drafter session and walked by `accept_greedy` against the same deterministic target (an oracle whose greedy token is
a function of the context, steered to follow chosen paths of the big tree: drafter nodes of every rank, lookup nodes
and the nodes they share). Then the bandit side: what-if rounds sharpen an arm's token estimate, never its time.
"""

from __future__ import annotations

import functools
import random

import numpy as np
import pytest
import torch

from ray_specdec.config import NO_TREE, SamplingParams, TreeConfig
from ray_specdec.engine.llm import SpeculativeEngine
from ray_specdec.speculation.acceptance import accept_greedy
from ray_specdec.speculation.bandit import UCB1, Bandit, BanditConfig, ThroughputReward
from ray_specdec.speculation.bandit.policies import ArmStats
from ray_specdec.speculation.counterfactuals import what_if
from ray_specdec.speculation.drafting import Draft, DrafterSession
from tests.helpers.configs import lookup_off
from tests.helpers.inputs import random_prompt, repetitive_history
from tests.helpers.models import tiny_gpt_neox, tiny_mamba

VOCAB = 128
BIG = TreeConfig((2, 2, 1))
LOOKUP = 5
CONTAINED = [NO_TREE, TreeConfig((1,)), TreeConfig((2,)), TreeConfig((1, 1)), TreeConfig((2, 1)), TreeConfig((1, 2)),
             TreeConfig((2, 2)), TreeConfig((1, 1, 1)), BIG, TreeConfig((1, 1), 2), TreeConfig((2,), 5)]
NOT_CONTAINED = [TreeConfig((3,)), TreeConfig((1, 1, 1, 1)), TreeConfig((2, 2, 2)), TreeConfig((1,), 6)]


def token_paths(draft: Draft) -> list[tuple[int, ...]]:
    """Tokens from the root to every row (row 0: the root, an empty path)."""
    tree, tokens = draft.tree, draft.tokens.tolist()
    row_of = {p: row for row, p in enumerate(tree.paths, start=1)}
    return [()] + [tuple(tokens[row_of[p[:k]] - 1] for k in range(1, len(p) + 1)) for p in tree.paths]


def oracle_logits(draft: Draft, continuation: tuple[int, ...]) -> torch.Tensor:
    """A deterministic target: after the context plus `path`, its greedy token is the continuation's next token while
    the path follows it, else a token fixed by the path (a function of the context either way)."""
    rows = token_paths(draft)
    logits = torch.zeros(len(rows), VOCAB, dtype=torch.float64)
    for row, path in enumerate(rows):
        on_track = path == continuation[: len(path)] and len(path) < len(continuation)
        best = continuation[len(path)] if on_track else random.Random(hash(path)).randrange(VOCAB)
        logits[row, best] = 1.0
    return logits


def round_of(history: list[int], arm: TreeConfig, continuation: tuple[int, ...]):
    if arm.depth == 0:
        return None, 0  # no drafting: the bonus token only
    session = DrafterSession(tiny_mamba(), history, vocab_size=VOCAB)
    draft = session.draft(arm.with_lookup(LOOKUP), SamplingParams(), None)
    verdict = accept_greedy(oracle_logits(draft, continuation), draft.tree, draft.tokens)
    return (draft, verdict), len(verdict.accepted_rows)


@pytest.mark.parametrize("history", [repetitive_history(), random_prompt(40, seed=11)], ids=["lookup", "no-lookup"])
def test_what_if_equals_each_smaller_arm_drafted_and_verified(history):
    session = DrafterSession(tiny_mamba(), history, vocab_size=VOCAB)
    big = session.draft(BIG.with_lookup(LOOKUP), SamplingParams(), None)
    assert bool(big.lookup_tokens) == (history == repetitive_history())
    rng = random.Random(0)
    # continuations along every node of the big tree (then off it), and some that leave it at once
    continuations = [path + (rng.randrange(VOCAB),) for path in token_paths(big)]
    continuations += [(rng.randrange(VOCAB),) for _ in range(3)]
    kept_by_arm = {arm: [] for arm in CONTAINED}
    for continuation in continuations:
        (draft, verdict), _ = round_of(history, BIG, continuation)
        predicted = what_if(draft, verdict, CONTAINED + NOT_CONTAINED, LOOKUP)
        assert set(predicted) == set(CONTAINED), continuation  # arms not inside the drafted round are left out
        for arm in CONTAINED:
            _, kept = round_of(history, arm, continuation)
            assert predicted[arm] == kept, (continuation, str(arm))
            kept_by_arm[arm].append(kept)
    # the check is not vacuous: deep acceptance happened, through ranks > 0 and (with lookup) past the drafter's depth
    assert max(kept_by_arm[BIG]) >= 3 and 1 in kept_by_arm[TreeConfig((2,))]
    assert kept_by_arm[TreeConfig((2,))] != kept_by_arm[TreeConfig((1,))]
    if big.lookup_tokens:
        assert max(kept_by_arm[TreeConfig((1,))]) == LOOKUP  # the lookup branch carried an arm of depth 1 to 5
        assert max(kept_by_arm[TreeConfig((1, 1), 2)]) == 2  # its own, shorter lookup branch


def test_no_what_if_when_the_drafter_cut_the_tree():
    session = DrafterSession(tiny_mamba(), random_prompt(40, seed=12), vocab_size=VOCAB)
    draft = session.draft(TreeConfig((2, 2, 1)), SamplingParams(), None, min_path_prob=0.999)
    assert draft.config.branching != (2, 2, 1)  # a random drafter is never that sure
    verdict = accept_greedy(oracle_logits(draft, ()), draft.tree, draft.tokens)
    assert what_if(draft, verdict, CONTAINED, 0) == {}


def test_engine_feeds_what_if_rounds_to_the_bandit():
    from ray_specdec.models.target.model import TargetModel

    target = TargetModel(tiny_gpt_neox(torch.float64, max_positions=512))
    arms = (TreeConfig((2, 1)), TreeConfig((1,)), NO_TREE)
    bandit = Bandit(BanditConfig(arms=arms, policy=UCB1(), prior_pulls=0), seed=0)
    engine = SpeculativeEngine(target, tiny_mamba(), bandit, config=lookup_off(lookup=2))
    prompt = random_prompt(30, seed=13)
    engine.generate(prompt, SamplingParams(max_new_tokens=40))
    state = bandit.state
    greedy_cell = state.bucket_of(len(prompt))
    pulls, what_ifs = state.raw[greedy_cell, :, 0], state.raw[greedy_cell, :, 8]
    # every round of "2,1" taught "1" and "none"; "1" taught "none"; "none" teaches nobody
    assert what_ifs[0] == 0 and what_ifs[1] == pulls[0] and what_ifs[2] == pulls[0] + pulls[1]
    engine.generate(prompt, SamplingParams(max_new_tokens=40, temperature=1.0, seed=1))
    sampled_cell = state.bucket_of(len(prompt), sampled=True)
    pulls, what_ifs = bandit.state.raw[sampled_cell, :, 0], bandit.state.raw[sampled_cell, :, 8]
    assert pulls.sum() > 0 and what_ifs[0] == 0 and what_ifs[2] == pulls[0] + pulls[1]


def sums(rounds: list[tuple[float, float]], what_ifs: list[float] = ()) -> np.ndarray:
    """One arm's sums from its own rounds (tokens, seconds) and what-if token counts."""
    x, t = np.array([r[0] for r in rounds]), np.array([r[1] for r in rounds])
    y = np.array(what_ifs, dtype=float)
    return np.array([[len(x), 0, 0, x.sum(), t.sum(), (x * x).sum(), (t * t).sum(), (x * t).sum(),
                      len(y), y.sum(), (y * y).sum()]])  # fmt: skip


def test_without_what_if_rounds_the_estimate_is_the_ratio_of_sums_with_its_delta_method_variance():
    rng = np.random.default_rng(0)
    rounds = [(float(rng.integers(1, 6)), float(rng.uniform(0.01, 0.03))) for _ in range(50)]
    stats = ArmStats.from_sums(sums(rounds), ThroughputReward())
    x, t = np.array(rounds).T
    ratio = x.sum() / t.sum()
    variance = ((x - ratio * t) ** 2).sum() / t.sum() ** 2
    assert stats.pulls[0] == 50 and stats.mean[0] == pytest.approx(ratio)
    assert stats.sq_dev[0] / stats.pulls[0] ** 2 == pytest.approx(variance)


def test_what_if_rounds_sharpen_the_token_estimate_but_not_the_time():
    rng = np.random.default_rng(1)
    rounds = [(float(rng.integers(1, 6)), 0.02) for _ in range(20)]  # constant time: tokens are all the noise
    more = [float(rng.integers(1, 6)) for _ in range(180)]
    alone = ArmStats.from_sums(sums(rounds), ThroughputReward())
    taught = ArmStats.from_sums(sums(rounds, more), ThroughputReward())
    tokens = np.array([r[0] for r in rounds] + more)
    assert taught.mean[0] == pytest.approx(tokens.mean() / 0.02)
    assert taught.pulls[0] == pytest.approx(200)  # time is certain here, so every round counts fully
    var_alone, var_taught = (s.sq_dev[0] / s.pulls[0] ** 2 for s in (alone, taught))
    assert var_taught == pytest.approx(tokens.var() / 200 / 0.02**2) and var_taught < var_alone / 5
    # never pulled in the cell: its round time is unknown, so what-if rounds alone leave it to be tried
    stats = ArmStats.from_sums(sums([], more), ThroughputReward())
    assert stats.pulls[0] == 0 and stats.mean[0] == 0


CHAINS = tuple(TreeConfig((1,) * d) for d in (1, 2, 3, 4, 6)) + (NO_TREE,)


def chain_round(arm: TreeConfig, rng: np.random.Generator) -> tuple[int, float, dict[TreeConfig, int]]:
    """A greedy round of a chain: the target agrees with the drafter for a geometric number of depths (0.7 per
    depth); time grows with depth; what-if: every shorter chain keeps the same prefix, no drafting keeps nothing."""
    agreed = int(rng.geometric(0.3)) - 1
    if arm == NO_TREE:
        return 0, 0.010 * rng.lognormal(0, 0.1), {}
    time = (0.010 + 0.0018 * arm.depth) * rng.lognormal(0, 0.1)
    shorter = {a: min(agreed, a.depth) for a in CHAINS if a.depth < arm.depth}
    return min(agreed, arm.depth), time, shorter


@functools.lru_cache(maxsize=1)
def chain_rates() -> dict[TreeConfig, float]:
    """Tokens per second of every arm, from a long run of the environment."""
    rates = {}
    for arm in CHAINS:
        rng, tokens, seconds = np.random.default_rng(7), 0.0, 0.0
        for _ in range(4000):
            kept, time, _ = chain_round(arm, rng)
            tokens, seconds = tokens + kept + 1, seconds + time
        rates[arm] = tokens / seconds
    return rates


def chain_regret(use_what_if: bool, seed: int, rounds: int = 1500) -> float:
    rates = chain_rates()
    best = max(rates.values())
    rng = np.random.default_rng(seed + 1000)
    bandit = Bandit(BanditConfig(arms=CHAINS, prior_pulls=0), seed=seed)
    regret = 0.0
    for _ in range(rounds):
        arm = bandit.select(100)
        kept, time, shorter = chain_round(arm, rng)
        bandit.record(arm, 100, kept, time, what_if=shorter if use_what_if else None)
        regret += (best - rates[arm]) / best
    return regret


def test_what_if_rounds_lower_the_regret_on_nested_chains():
    """The arms' throughputs differ by a few percent (chains of 2-4); what-if rounds make the shorter chains'
    token estimates as good as the pulled arm's, so the bandit wastes fewer rounds telling them apart."""
    plain = [chain_regret(False, seed) for seed in range(12)]
    taught = [chain_regret(True, seed) for seed in range(12)]
    assert np.mean(taught) < 0.95 * np.mean(plain), (np.mean(taught), np.mean(plain))  # 29.3 vs 33.0


def sampled_round(branching: tuple[int, ...], without_replacement: bool, gen: torch.Generator):
    """A sampled round over a small vocabulary: q and p at every node are fixed functions of the node's token path
    (p leans on q, so deep acceptance is common); children drawn from q, i.i.d. or without replacement."""
    from ray_specdec.speculation.acceptance import accept_sampled
    from ray_specdec.speculation.sampling import gumbel_top_k, sample
    from ray_specdec.speculation.tree import build_tree

    def dist(path: tuple[int, ...], salt: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(hash((salt, path)) % 2**31)
        return torch.softmax(2.0 * torch.randn(6, generator=g, dtype=torch.float64), 0)

    config = TreeConfig(branching)
    tree = build_tree(config.index_paths())
    token_of: dict[tuple[int, ...], int] = {}
    q_rows, p_rows = [], [dist((), 1) * 0.3 + dist((), 0) * 0.7]
    level = [()]
    for depth, k in enumerate(branching):
        nxt = []
        for parent in level:
            path = tuple(token_of[parent[:i]] for i in range(1, len(parent) + 1))
            q = dist(path, 0)
            q_rows.append(q)
            children = gumbel_top_k(q[None], k, gen)[0] if without_replacement else sample(q.expand(k, -1), gen)
            for rank, token in enumerate(children.tolist()):
                token_of[parent + (rank,)] = token
                nxt.append(parent + (rank,))
        level = nxt
    tokens = torch.tensor([token_of[p] for p in tree.paths])
    for node in tree.paths:
        path = tuple(token_of[node[:i]] for i in range(1, len(node) + 1))
        p_rows.append(dist(path, 1) * 0.3 + dist(path, 0) * 0.7)
    verdict = accept_sampled(torch.stack(p_rows), torch.stack(q_rows), tree, tokens, without_replacement, gen)
    return Draft(config, tokens, torch.stack(q_rows)), verdict


@pytest.mark.parametrize("without_replacement", [False, True], ids=["iid", "without-replacement"])
def test_sampled_what_if_has_each_smaller_arms_acceptance_distribution(without_replacement):
    """Rounds of (3, 2, 1) give, through what_if, draws of what (2, 1), (1, 1) and (3,) keep; rounds of those arms
    themselves must have the same distribution of accepted lengths (two-sample chi-square)."""
    from scipy.stats import chi2_contingency

    big, n = (3, 2, 1), 1500
    smaller = [TreeConfig((2, 1)), TreeConfig((1, 1)), TreeConfig((3,))]
    gen = torch.Generator().manual_seed(0)
    taught = {arm: [] for arm in smaller}
    for _ in range(n):
        draft, verdict = sampled_round(big, without_replacement, gen)
        for arm, kept in what_if(draft, verdict, smaller, 0, sampled=True).items():
            taught[arm].append(kept)
    for arm in smaller:
        direct = [len(sampled_round(arm.branching, without_replacement, gen)[1].accepted_rows) for _ in range(n)]
        levels = range(arm.depth + 1)
        table = np.array([[taught[arm].count(k) for k in levels], [direct.count(k) for k in levels]])
        assert table[:, 1:].sum() > 0.3 * n  # not vacuous: most rounds accept something
        assert chi2_contingency(table)[1] > 1e-3, (str(arm), table)


def test_sampled_what_if_needs_the_lookup_branch_the_round_had():
    """A rejected lookup token changes the p that the drafter's children meet: an arm without the branch cannot be
    read off a sampled round that had one (a greedy round is fine: greedy acceptance is a prefix walk)."""
    from ray_specdec.speculation.acceptance import Verdict

    session = DrafterSession(tiny_mamba(), repetitive_history(), vocab_size=VOCAB)
    draft = session.draft(TreeConfig((2, 1), 3), SamplingParams(temperature=1.0), torch.Generator().manual_seed(0))
    assert draft.lookup_tokens
    arms = [TreeConfig((1,)), TreeConfig((1,), 2), TreeConfig((2, 1), 3)]
    nothing = Verdict((), (), bonus_token=1)
    assert set(what_if(draft, nothing, arms, 0, sampled=True)) == {TreeConfig((1,), 2), TreeConfig((2, 1), 3)}
    assert set(what_if(draft, nothing, arms, 0, sampled=False)) == set(arms)
