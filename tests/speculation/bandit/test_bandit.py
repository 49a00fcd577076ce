"""The tree bandit on simulated environments with known arm rewards (sharing and persistence:
test_bandit_sharing.py)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from ray_specdec.config import MAX_LOOKUP_TOKENS, TreeConfig
from ray_specdec.speculation.bandit import (DEFAULT_ARMS, UCB1, Bandit, BanditConfig, BanditHub, BanditState,
                                            DiscountedUCB, GaussianThompson, PaperReward, ThroughputReward,
                                            bucket_labels, load_labels)
from ray_specdec.speculation.bandit.state import OWN_FIELDS, WHAT_IF_FIELDS
from tests.helpers.bandit_sim import (MEANS, Env, assert_same_state, gaussian_env, late_share, random_rounds, replay,
                                      simulate)


# Regret is averaged over 4 seeded runs (a single run's ratio swings with when a rare exploration happens).
# Discounted policies forget on purpose: their regret turns linear (small slope) beyond ~1/(1-gamma) = 5000 rounds,
# so the horizons stay within that window.
@pytest.mark.parametrize(
    "policy, max_ratio",
    [(UCB1(), 1.3), (DiscountedUCB(), 1.6), (GaussianThompson(), 1.6)],
    ids=["ucb1", "discounted_ucb", "thompson_default"],
)
def test_stationary_regret_is_sublinear_and_best_arm_dominates(policy, max_ratio):
    horizon, runs = 1500, []
    for seed in range(4):
        bandit = Bandit(BanditConfig(policy=policy), seed=seed)
        runs.append(simulate(bandit, gaussian_env(MEANS), 2 * horizon, seed=seed + 10))
        assert late_share(runs[-1], int(MEANS.argmax())) >= 0.9
    regret = np.mean([np.cumsum(MEANS.max() - MEANS[picks]) for picks in runs], axis=0)
    assert regret[-1] / regret[horizon - 1] < max_ratio
    early = regret[horizon // 10 - 1] / (horizon // 10)
    assert regret[-1] / (2 * horizon) < 0.3 * early  # regret per round falls


def test_default_config_is_the_nonstationary_serving_bandit():
    config = BanditConfig()
    assert isinstance(config.policy, GaussianThompson) and config.policy.discounted
    assert isinstance(config.reward, ThroughputReward)
    assert config.arms[:4] == (TreeConfig((1, 1, 1, 1)), TreeConfig((3, 3, 2, 1)), TreeConfig((3, 2, 2, 1, 1)),
                               TreeConfig((2, 2, 2, 1, 1, 1)))  # fmt: skip
    assert bucket_labels(config.bucket_edges) == ["<1k", "1k-2k", "2k-4k", "4k-8k", ">=8k"]


@pytest.mark.parametrize("policy", [DiscountedUCB(), GaussianThompson()], ids=["discounted_ucb", "thompson"])
def test_nonstationary_policy_follows_a_new_best_arm(policy):
    # Halfway the best arm (3) degrades below the runner-up (7), which becomes the best: a load change.
    after = MEANS.copy()
    after[3], after[7] = 60.0, 100.0
    horizon = 6000
    picks = simulate(Bandit(BanditConfig(policy=policy), seed=0), gaussian_env(MEANS, horizon // 2, after), horizon)
    assert late_share(picks[: horizon // 2], 3, tail=0.4) >= 0.9
    assert late_share(picks, 7) >= 0.9


def test_buckets_keep_separate_statistics():
    # Short prompts: arm 3 is best; long prompts (>= 4k tokens): arm 5 is best.
    long_means = MEANS.copy()
    long_means[5] = 120.0
    short_env, long_env = gaussian_env(MEANS), gaussian_env(long_means)

    def env(arm, t, context_len, rng):
        return (long_env if context_len >= 4096 else short_env)(arm, t, context_len, rng)

    bandit = Bandit(BanditConfig(policy=UCB1()), seed=0)
    short = simulate(bandit, env, 2000, seed=1, context_len=300)
    before = bandit.state
    long = simulate(bandit, env, 2000, seed=2, context_len=5000)
    after = bandit.state
    short_bucket, long_bucket = before.bucket_of(300), before.bucket_of(5000)
    assert (short_bucket, long_bucket) == (0, 3)
    np.testing.assert_array_equal(after.raw[short_bucket], before.raw[short_bucket])
    np.testing.assert_array_equal(after.raw[[1, 2, 4]], 0.0)
    assert late_share(short, 3) >= 0.9 and late_share(long, 5) >= 0.9
    bests = [b["best"] for b in bandit.summary()["buckets"]]
    assert bests[:5] == [str(DEFAULT_ARMS[3]), None, None, str(DEFAULT_ARMS[5]), None]  # greedy, load 1
    assert set(bests[5:]) == {None}  # other load levels, sampled cells


def test_a_new_bucket_starts_from_what_the_other_buckets_learned():
    env = gaussian_env(MEANS)
    warm = Bandit(BanditConfig(policy=UCB1()), seed=0)
    simulate(warm, env, 2000, seed=1, context_len=300)
    first = simulate(warm, env, 20, seed=2, context_len=5000)  # a bucket it has never seen
    assert (first == 3).mean() >= 0.5 and (first == 8).sum() <= 1  # no round-robin over every (bad) arm
    alone = Bandit(BanditConfig(policy=UCB1(), prior_pulls=0), seed=0)
    simulate(alone, env, 2000, seed=1, context_len=300)
    assert list(simulate(alone, env, 9, seed=2, context_len=5000)) == list(range(9))  # tries every arm first
    assert warm.summary()["buckets"][3]["arms"][3]["pulls"] == int((first == 3).sum())  # the prior is not stored


def test_greedy_and_sampled_rounds_keep_separate_statistics():
    # Greedy rounds: arm 3 is best; sampled rounds (lower acceptance, no lookup branch): arm 8 is.
    sampled_means = MEANS.copy()
    sampled_means[8] = 120.0
    bandit = Bandit(BanditConfig(policy=UCB1()), seed=0)
    greedy = simulate(bandit, gaussian_env(MEANS), 2000, seed=1)
    before = bandit.state
    sampled = simulate(bandit, gaussian_env(sampled_means), 2000, seed=2, sampled=True)
    after = bandit.state
    greedy_cell, sampled_cell = before.bucket_of(100), before.bucket_of(100, sampled=True)
    assert (greedy_cell, sampled_cell) == (0, 5 * 4)  # after 5 buckets x 4 load levels of greedy cells
    np.testing.assert_array_equal(after.raw[greedy_cell], before.raw[greedy_cell])
    assert late_share(greedy, 3) >= 0.9 and late_share(sampled, 8) >= 0.9
    cells = {(c["mode"], c["bucket"], c["load"]): c["best"] for c in bandit.summary()["buckets"]}
    assert cells[("greedy", "greedy <1k", "1")] == str(DEFAULT_ARMS[3])
    assert cells[("sampled", "sampled <1k", "1")] == str(DEFAULT_ARMS[8])
    pooled = Bandit(BanditConfig(policy=UCB1(), split_sampling=False))
    pooled.record(DEFAULT_ARMS[0], 100, 1, 0.1, sampled=True)
    assert pooled.state.raw.shape[0] == 5 * 4 and [c["bucket"] for c in pooled.summary()["buckets"]][0] == "<1k"


def test_load_levels_keep_separate_statistics():
    # Alone (load 1) arm 3 is best; among 32 requests decoding together no drafting (arm 8) is: a round's time is its
    # share of the batched step, so the same tree is worth less. The default (Thompson) bandit.
    busy_means = MEANS.copy()
    busy_means[8] = 150.0
    bandit = Bandit(BanditConfig(), seed=0)
    alone = simulate(bandit, gaussian_env(MEANS), 2000, seed=1)
    before, choice = bandit.state, [bandit.select(100) for _ in range(200)]
    busy = simulate(bandit, gaussian_env(busy_means), 2000, seed=2, load=32)
    after = bandit.state
    alone_cell, busy_cell = before.bucket_of(100), before.bucket_of(100, load=32)
    assert (alone_cell, busy_cell) == (0, 3 * 5)  # level "17+", after 3 levels of 5 buckets
    np.testing.assert_array_equal(after.raw[alone_cell], before.raw[alone_cell])
    np.testing.assert_array_equal(after.disc[alone_cell], before.disc[alone_cell])
    assert late_share(alone, 3) >= 0.9 and late_share(busy, 8) >= 0.9
    # load 32's rounds leave the choice at load 1 as it was (they reach it only as a prior of prior_pulls rounds)
    assert choice.count(DEFAULT_ARMS[3]) >= 195
    assert [bandit.select(100) for _ in range(200)].count(DEFAULT_ARMS[3]) >= 195
    assert [bandit.select(100, load=17) for _ in range(200)].count(DEFAULT_ARMS[8]) >= 195
    cells = {(c["bucket"], c["load"]): c["best"] for c in bandit.summary()["buckets"]}
    assert cells[("greedy <1k", "1")] == str(DEFAULT_ARMS[3]) and cells[("greedy <1k", "17+")] == "none"


def test_default_load_levels_count_the_requests_decoding_in_a_step():
    config = BanditConfig()
    assert load_labels(config.load_edges) == ["1", "2-4", "5-16", "17+"]
    assert load_labels((2, 8)) == ["1-2", "3-8", "9+"] and load_labels(()) == ["all"]
    state = config.empty_state()
    assert state.num_cells == 2 * 4 * 5  # modes x load levels x prompt-length buckets
    levels = {load: state.cell_parts(state.bucket_of(100, load=load))[1] for load in (1, 2, 4, 5, 16, 17, 64)}
    assert levels == {1: 0, 2: 1, 4: 1, 5: 2, 16: 2, 17: 3, 64: 3}
    assert state.cell_parts(state.bucket_of(5000, sampled=True, load=3)) == ("sampled", 1, 3)
    one_level = BanditConfig(load_edges=()).empty_state()
    assert {one_level.bucket_of(100, load=n) for n in (1, 5, 64)} == {0}
    assert [c["load"] for c in BanditHub(BanditConfig(load_edges=())).summary()["buckets"]] == ["all"] * 10
    with pytest.raises(ValueError, match="load edges"):
        BanditConfig(load_edges=(4, 2)).empty_state()


def test_a_one_mode_state_warm_starts_both_modes_and_old_files_are_refused(tmp_path):
    one_mode = Bandit(BanditConfig(split_sampling=False))
    replay(one_mode, random_rounds(40, seed=3))
    path = tmp_path / "pooled.json"
    one_mode.save(path)
    split = Bandit.load(path)
    assert split.state.modes == ("greedy", "sampled")
    per_mode = split.state.cells_per_mode
    np.testing.assert_array_equal(split.state.raw[:per_mode], one_mode.state.raw)
    np.testing.assert_array_equal(split.state.raw[per_mode:], one_mode.state.raw)
    with pytest.raises(ValueError, match="modes"):
        BanditConfig(split_sampling=False).restore(split.state)
    data = one_mode.state.to_dict()
    data["version"] = 1  # per-round means only, no token/time moments: refused with what to do about it
    old = tmp_path / "old.json"
    old.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="not a version-4 bandit state.*move the state file away"):
        Bandit.load(old)
    data["version"] = 2  # before what-if rounds: loads, with none
    for table in ("raw", "disc"):
        for name in WHAT_IF_FIELDS:
            del data[table][name]
    old.write_text(json.dumps(data))
    v2 = Bandit.load(old, BanditConfig(split_sampling=False))
    np.testing.assert_array_equal(v2.state.raw, one_mode.state.raw)
    assert not v2.state.raw[..., len(OWN_FIELDS):].any()


def as_version_3(state: BanditState, path) -> None:
    """Write a one-level state as a version-3 file (no load levels)."""
    assert state.load_edges == ()
    data = state.to_dict()
    data["version"] = 3
    del data["load_edges"]
    path.write_text(json.dumps(data))


def test_a_version_3_state_loads_into_the_first_load_level_and_version_4_round_trips(tmp_path):
    old = Bandit(BanditConfig(load_edges=()))  # one level: version 3's layout
    replay(old, random_rounds(80, seed=7))
    as_version_3(old.state, tmp_path / "v3.json")
    state = Bandit.load(tmp_path / "v3.json").state
    assert state.load_edges == (1, 4, 16) and state.steps.sum() == 80  # nothing counted twice
    nb, per_mode = state.num_buckets, state.cells_per_mode
    for mode in range(2):
        start = mode * per_mode
        first_level, rest = slice(start, start + nb), slice(start + nb, start + per_mode)
        before = slice(mode * nb, (mode + 1) * nb)
        for table in ("raw", "disc", "steps"):
            np.testing.assert_array_equal(getattr(state, table)[first_level], getattr(old.state, table)[before])
            assert not getattr(state, table)[rest].any()
    v4, full = tmp_path / "v4.json", Bandit(state=state)
    replay(full, random_rounds(80, seed=9))  # rounds at every load level
    full.save(v4)
    assert_same_state(Bandit.load(v4).state, full.state)
    assert BanditState.load(v4).load_edges == (1, 4, 16)
    with pytest.raises(ValueError, match="load edges.*move the state file away"):
        Bandit.load(v4, BanditConfig(load_edges=(2, 8)))

    # the other levels start from it through the prior: the same estimates, then their own rounds
    learned = Bandit(BanditConfig(policy=UCB1(), load_edges=()), seed=0)
    simulate(learned, gaussian_env(MEANS), 500)
    as_version_3(learned.state, tmp_path / "learned.json")
    resumed = Bandit.load(tmp_path / "learned.json", BanditConfig(policy=UCB1()), seed=0)
    alone, busy = resumed.throughput(100), resumed.throughput(100, load=32)
    assert set(busy) == set(alone) and all(busy[arm] == pytest.approx(alone[arm]) for arm in alone)
    assert resumed.select(100, load=32) == DEFAULT_ARMS[3]


def test_throughput_is_a_ratio_of_sums_with_a_delta_method_variance():
    """Rounds of one arm: 1 token in 0.01 s, 3 tokens in 0.05 s. Per-round rates 100 and 60 average to 80 tokens/s,
    but the arm delivers 4 tokens per 0.06 s: 66.7 tokens/s, which is what the bandit must compare."""
    bandit = Bandit(BanditConfig(arms=HW_ARMS, policy=UCB1()))
    bandit.record(TreeConfig((1, 1)), 10, 0, 0.01)
    bandit.record(TreeConfig((1, 1)), 10, 2, 0.05)
    stats = bandit.config.arm_stats(bandit.state, 0, discounted=False)
    assert stats.mean[0] == pytest.approx(4 / 0.06)
    ratio = 4 / 0.06
    residual = (1 - ratio * 0.01) ** 2 + (3 - ratio * 0.05) ** 2
    assert stats.sq_dev[0] / 4 == pytest.approx(residual / 0.06**2)  # sq_dev / pulls^2 = Var(mean)
    assert bandit.summary()["buckets"][0]["arms"][0]["mean_reward"] == pytest.approx(ratio)
    paper = BanditConfig(arms=HW_ARMS, reward=PaperReward())
    per_round = Bandit(paper)
    per_round.record(TreeConfig((1, 1)), 10, 0, 0.01)
    per_round.record(TreeConfig((1, 1)), 10, 2, 0.05)
    expected = np.mean([PaperReward()(TreeConfig((1, 1)), a, 0.0, 4) for a in (0, 2)])
    assert paper.arm_stats(per_round.state, 0, discounted=False).mean[0] == pytest.approx(expected)


# Tree environment: each child at depth i matches the target with probability P_CHILD; a round costs
# BASE + per_node * nodes + PER_DEPTH * depth seconds, times lognormal jitter (the same factor in expectation for
# every arm, so the best arm is the one maximising E[accepted + 1] / nominal time).
P_CHILD, BASE_S, PER_DEPTH_S = 0.6, 0.02, 0.002
HW_ARMS = tuple(TreeConfig(b) for b in [(1, 1), (2, 1, 1), (1, 1, 1, 1), (3, 3, 2, 1)])
PER_NODE_S = {"gpu": 0.0001, "cpu": 0.004}  # verifying a big tree is nearly free on a GPU, not on a CPU


def expected_accepted(tree: TreeConfig) -> float:
    total, reach = 0.0, 1.0
    for n in tree.branching:
        reach *= 1 - (1 - P_CHILD) ** n
        total += reach
    return total


def nominal_time(tree: TreeConfig, hardware: str) -> float:
    return BASE_S + PER_NODE_S[hardware] * tree.num_nodes + PER_DEPTH_S * tree.depth


def tree_env(arms: tuple[TreeConfig, ...], hardware: str) -> Env:
    def step(arm: int, t: int, context_len: int, rng: np.random.Generator) -> tuple[int, float]:
        tree, accepted = arms[arm], 0
        for n in tree.branching:
            if rng.random() >= 1 - (1 - P_CHILD) ** n:
                break
            accepted += 1
        return accepted, nominal_time(tree, hardware) * math.exp(0.2 * rng.standard_normal())

    return step


@pytest.mark.parametrize("hardware, best", [("gpu", (3, 3, 2, 1)), ("cpu", (1, 1))])
def test_serving_reward_finds_the_hardware_dependent_best_tree(hardware, best):
    throughput = [(expected_accepted(t) + 1) / nominal_time(t, hardware) for t in HW_ARMS]
    by_acceptance = max(HW_ARMS, key=expected_accepted)
    assert HW_ARMS[int(np.argmax(throughput))] == TreeConfig(best)  # the environment is what the test says
    assert by_acceptance == TreeConfig((3, 3, 2, 1))

    bandit = Bandit(BanditConfig(arms=HW_ARMS), seed=0)
    picks = simulate(bandit, tree_env(HW_ARMS, hardware), 3000)
    assert late_share(picks, HW_ARMS.index(TreeConfig(best))) >= 0.9
    assert bandit.summary()["buckets"][0]["best"] == str(TreeConfig(best))


def test_paper_reward_with_ucb1_ignores_round_time():
    config = BanditConfig(arms=HW_ARMS, policy=UCB1(), reward=PaperReward(depth_cost=0.2))
    expected = [(expected_accepted(t) + 1) / 5 - 0.2 * t.depth / 4 for t in HW_ARMS]  # deepest arm: depth 4
    assert int(np.argmax(expected)) == 3
    picks = simulate(Bandit(config), tree_env(HW_ARMS, "cpu"), 3000)
    assert late_share(picks, 3) >= 0.9  # the biggest tree, although on this hardware it is the slowest


def test_rewards_are_the_documented_formulas():
    tree = TreeConfig((3, 2, 2, 1, 1))
    assert ThroughputReward()(tree, 3, 0.05, 6) == pytest.approx(80.0)
    assert PaperReward(depth_cost=0.3)(tree, 3, 0.05, 6) == pytest.approx(4 / 7 - 0.3 * 5 / 6)


def test_record_validates_and_skips_trees_outside_the_arm_set():
    bandit = Bandit(BanditConfig(arms=HW_ARMS))
    bandit.record(TreeConfig(()), 10, 2, 0.1)  # a round without a tree that verified a lookup proposal (no arm here)
    with pytest.raises(ValueError, match="bonus excluded"):
        bandit.record(TreeConfig(()), 10, MAX_LOOKUP_TOKENS + 1, 0.1)  # more than any lookup proposal holds
    with pytest.raises(ValueError, match="bonus excluded"):
        bandit.record(TreeConfig((1, 1)), 10, -1, 0.1)
    bandit.record(TreeConfig((1, 1)), 10, 6, 0.1)  # deeper than the tree: an engine-added lookup branch was accepted
    with pytest.raises(ValueError, match="positive"):
        bandit.record(TreeConfig((1, 1)), 10, 1, 0.0)
    bandit.record(TreeConfig((3, 3)), 10, 1, 0.1)  # a (3,3,2,1) round cut short at the end of a generation
    assert bandit.state.steps.sum() == 1


def test_summary_reports_pulls_means_and_best():
    bandit = Bandit(BanditConfig(arms=HW_ARMS, bucket_edges=(1024,), load_edges=(4,), policy=UCB1()))
    bandit.record(TreeConfig((1, 1)), 10, 2, 0.1)  # 30 tokens/s
    bandit.record(TreeConfig((1, 1)), 20, 0, 0.1, load=4)  # 10 tokens/s
    bandit.record(TreeConfig((2, 1, 1)), 30, 3, 0.1)  # 40 tokens/s
    bandit.record(TreeConfig((1, 1)), 5000, 1, 0.2)  # other bucket
    bandit.record(TreeConfig((1, 1, 1, 1)), 10, 0, 0.1, load=5)  # other load level
    summary = bandit.summary()
    assert summary["reward"] == "throughput"
    short, long, busy_short, busy_long, *sampled = summary["buckets"]
    assert len(sampled) == 4 and {c["rounds"] for c in sampled} == {0} and busy_long["rounds"] == 0
    assert (short["bucket"], short["mode"], short["rounds"], short["best"]) == ("greedy <1k", "greedy", 3, "2,1,1")
    assert (short["load"], short["min_load"], short["max_load"]) == ("1-4", 1, 4)
    assert (busy_short["bucket"], busy_short["load"], busy_short["min_load"], busy_short["max_load"]) == (
        "greedy <1k", "5+", 5, None)
    assert (busy_short["rounds"], busy_short["best"]) == (1, "1,1,1,1")
    chain = short["arms"][0]
    assert (chain["tree"], chain["pulls"]) == ("1,1", 2)
    assert chain["mean_reward"] == pytest.approx(20.0)
    assert chain["mean_accepted_length"] == pytest.approx(2.0)
    assert chain["tokens_per_s"] == pytest.approx(20.0)
    assert short["arms"][3]["pulls"] == 0 and short["arms"][3]["mean_reward"] is None
    assert (long["bucket"], long["min_context"], long["max_context"]) == ("greedy >=1k", 1024, None)
    assert long["best"] == "1,1"
    json.dumps(summary)


def test_throughput_estimates_are_the_cells_tokens_per_second():
    from ray_specdec.speculation.bandit import Bandit, BanditConfig, PaperReward

    arms = (TreeConfig((1, 1)), TreeConfig(()), TreeConfig((2,)))
    bandit = Bandit(BanditConfig(arms=arms, prior_pulls=0), seed=0)
    for _ in range(5):
        bandit.record(arms[0], 100, accepted_tokens=2, round_time_s=0.02)  # 3 tokens / 20 ms
        bandit.record(arms[1], 100, accepted_tokens=0, round_time_s=0.01)  # 1 token / 10 ms
        bandit.record(arms[0], 5000, accepted_tokens=0, round_time_s=0.02)  # another bucket
    rates = bandit.throughput(100)
    assert set(rates) == {arms[0], arms[1]}  # unpulled arms have no estimate
    assert rates[arms[0]] == pytest.approx(150.0) and rates[arms[1]] == pytest.approx(100.0)
    assert bandit.throughput(5000)[arms[0]] == pytest.approx(50.0)
    assert bandit.throughput(100, sampled=True) == {}  # greedy and sampled rounds are separate cells
    assert bandit.throughput(100, load=8) == {}  # and so are load levels
    paper = Bandit(BanditConfig(arms=arms, reward=PaperReward()), seed=0)
    paper.record(arms[0], 100, accepted_tokens=2, round_time_s=0.02)
    assert paper.throughput(100) == {}  # not a throughput


def test_an_arm_whose_first_rounds_were_slow_is_tried_again():
    """Cold start as measured in the engine: the first round of each drafted tree pays one-time costs (new shapes)
    and keeps few tokens, while rounds without a draft are steady. A prior spread taken only from the pooled
    variance (dominated by the steady arm) never samples the drafting arm again; the relative prior does."""
    arms = (TreeConfig((1, 1, 1)), TreeConfig(()))

    def env(arm, t, context_len, rng):
        if arm == 1:
            return 0, 0.010 * math.exp(0.02 * rng.standard_normal())  # 100 tokens/s, steady
        if first[0]:
            first[0] = False
            return 0, 0.030  # one token in 30 ms: 33 tokens/s
        return int(rng.integers(1, 4)), 0.015  # 3 tokens per 15 ms on average: 200 tokens/s

    for seed in range(4):
        first = [True]
        picks = simulate(Bandit(BanditConfig(arms=arms), seed=seed), env, 1000, seed=seed)
        assert late_share(picks, 0) >= 0.9, seed


def lockout_state(optimistic_rounds: float, slow_pulls: int) -> tuple[Bandit, tuple[TreeConfig, ...]]:
    """The sampled short-prompt cell of a Serve run at T=1 (docs/BENCHMARKS.md): plain rounds at 18 ms, tree 2,1,1 at
    43 ms keeping 3 tokens, and the chain 1,1,1,1, which keeps 4 tokens a round, timed only in `slow_pulls` rounds of
    200 ms (one-time costs of a new shape in a fresh replica)."""
    arms = (TreeConfig((1, 1, 1, 1)), TreeConfig((2, 1, 1)), TreeConfig(()))
    bandit = Bandit(BanditConfig(arms=arms, prior_pulls=0, optimistic_rounds=optimistic_rounds), seed=0)
    rng = np.random.default_rng(0)
    for _ in range(300):
        bandit.record(arms[2], 100, 0, 0.018 * math.exp(0.05 * rng.standard_normal()), sampled=True)
        bandit.record(arms[1], 100, 2, 0.043 * math.exp(0.05 * rng.standard_normal()), sampled=True)
    for _ in range(slow_pulls):
        bandit.record(arms[0], 100, 3, 0.200, sampled=True)
    return bandit, arms


def test_a_young_arm_is_timed_by_the_cells_cost_model_not_locked_out_by_slow_first_rounds():
    bandit, (chain, tree, plain) = lockout_state(optimistic_rounds=8, slow_pulls=2)
    rates = bandit.throughput(100, sampled=True)
    # cost model from the well-measured arms: 18 ms at 0 nodes, 43 ms at 6 -> ~34.7 ms at the chain's 4 nodes
    assert rates[chain] == pytest.approx(4 / (0.018 + 4 * (0.043 - 0.018) / 6), rel=0.05)
    assert rates[tree] == pytest.approx(3 / 0.043, rel=0.05) and rates[plain] == pytest.approx(1 / 0.018, rel=0.05)
    picks = [bandit.select(100, sampled=True) for _ in range(200)]
    assert picks.count(chain) > 150
    locked, _ = lockout_state(optimistic_rounds=0, slow_pulls=2)  # without it: 20 tokens/s, never picked
    assert locked.throughput(100, sampled=True)[chain] == pytest.approx(20.0, rel=0.01)
    assert [locked.select(100, sampled=True) for _ in range(200)].count(chain) == 0


def test_the_optimism_ends_once_an_arm_has_its_own_rounds():
    """A chain that really is slow is believed after `optimistic_rounds` rounds of its own (discounted: 10 rounds are
    a little under 10)."""
    bandit, (chain, tree, _) = lockout_state(optimistic_rounds=8, slow_pulls=10)
    assert bandit.throughput(100, sampled=True)[chain] == pytest.approx(20.0, rel=0.01)
    assert [bandit.select(100, sampled=True) for _ in range(200)].count(chain) < 10
    # an arm measured faster than the model predicts keeps its own (faster) time
    fast, (chain, _, _) = lockout_state(optimistic_rounds=8, slow_pulls=0)
    fast.record(chain, 100, 3, 0.020, sampled=True)
    assert fast.throughput(100, sampled=True)[chain] == pytest.approx(200.0, rel=0.01)


@pytest.mark.parametrize("policy", [GaussianThompson(), UCB1(), DiscountedUCB()])
def test_a_node_budget_restricts_the_pick_to_the_arms_that_fit(policy):
    """The router's load back-off: under a budget the policy picks the best arm that fits, never a bigger one."""
    arms = (TreeConfig((3, 3, 2, 1)), TreeConfig((2, 1, 1)), TreeConfig((1, 1)), TreeConfig(()))
    bandit = Bandit(BanditConfig(arms=arms, policy=policy), seed=3)
    for _ in range(200):  # the big tree is clearly best, then 2,1,1, then 1,1, then no drafting
        for arm, tokens, seconds in ((arms[0], 4, 0.05), (arms[1], 3, 0.05), (arms[2], 2, 0.05), (arms[3], 0, 0.05)):
            bandit.record(arm, 10, tokens, seconds)
    assert bandit.select(10) == arms[0]
    assert {bandit.select(10, max_nodes=None) for _ in range(20)} == {arms[0]}
    assert {bandit.select(10, max_nodes=6) for _ in range(20)} == {arms[1]}  # 2,1,1 has 6 nodes
    assert {bandit.select(10, max_nodes=5) for _ in range(20)} == {arms[2]}
    assert {bandit.select(10, max_nodes=0) for _ in range(20)} == {TreeConfig(())}
    no_plain = Bandit(BanditConfig(arms=arms[:2], policy=policy), seed=3)
    assert no_plain.select(10, max_nodes=1) == TreeConfig(())  # nothing fits: no drafting
