"""The speculation controller: the exact batch optimum, the posterior, the cost fit, and its choices."""

import itertools

import numpy as np
import pytest

from ray_specdec.config import TreeConfig
from ray_specdec.speculation.controller import (FEATURES, NO_TREE, Pick, RoundFacts, SpeculationConfig,
                                                SpeculationController, StepCostModel, StepShape, choose_options,
                                                implied_acceptance, posterior_tokens, tree_tokens)

CHAIN = TreeConfig((1, 1, 1))
WIDE = TreeConfig((4, 2, 1))


class StatsPolicy:
    """A policy with fixed statistics: per arm (rounds, mean tokens, sd)."""

    def __init__(self, stats: dict[TreeConfig, tuple[float, float, float]]):
        self.stats = stats

    @property
    def arms(self):
        return tuple(self.stats)

    def token_sums(self, context_len, sampled):
        rows = []
        for n, mean, sd in self.stats.values():
            rows.append((n, n * mean, n * (sd * sd + mean * mean)))
        return np.array(rows)


def trees(picks) -> list[TreeConfig]:
    return [pick.tree for pick in picks]


def weights(**values) -> list[float]:
    return [values.get(name, 0.0) for name in FEATURES]


def controller(stats, explore=False, **cost) -> SpeculationController:
    c = SpeculationController(StatsPolicy(stats), SpeculationConfig(explore=explore), seed=0)
    c.cost.set_prior(weights(**cost))
    return c


def facts(context_len=100, remaining=100, options=(CHAIN, NO_TREE), **kw) -> RoundFacts:
    return RoundFacts(context_len, False, remaining, options, **kw)


@pytest.mark.parametrize("seed", range(40))
def test_choose_options_is_the_exact_optimum(seed):
    rng = np.random.default_rng(seed)
    requests, options = rng.integers(1, 5), rng.integers(1, 5)
    tokens = rng.uniform(1, 5, (requests, options))
    seconds = rng.uniform(0.001, 0.01, (requests, options))
    tokens[rng.random((requests, options)) < 0.2] = -np.inf
    tokens[:, 0] = rng.uniform(1, 5, requests)  # the first option is always available
    fixed = float(rng.uniform(0, 0.02))
    best = max(itertools.product(range(options), repeat=requests),
               key=lambda c: sum(tokens[r, j] for r, j in enumerate(c)) / (fixed + sum(seconds[r, j]
                                                                                     for r, j in enumerate(c))))
    choice = choose_options(tokens, seconds, fixed)

    def rate(c):
        return sum(tokens[r, j] for r, j in enumerate(c)) / (fixed + sum(seconds[r, j] for r, j in enumerate(c)))

    assert rate(choice) == pytest.approx(rate(best), rel=1e-9)


def reference_price(c: SpeculationController, f: RoundFacts, pick: Pick, expected: dict) -> tuple[float, float]:
    """One round's (expected tokens, seconds) of one pick, written out term by term."""
    w = dict(zip(FEATURES, c.cost.weights()))
    row_s = w["target_rows"] + w["verify_row_kilotokens"] * f.context_len / 1024
    tree = pick.tree
    finish = c.finish_s[f.sampled, tree.depth > 0]
    if not tree.depth:
        if not pick.plain_lookup:
            return 1.0, row_s + finish
        tokens = expected[NO_TREE]
        return tokens, (1 + (f.plain_lookup_rows or 0.0)) * row_s + finish + w["replays"] * min(tokens - 1, 1.0)
    full = expected.get(tree)
    if full is None:
        full = max(v for arm, v in expected.items() if arm.depth and arm.truncated(tree.depth) == tree)
    tokens = min(full, 1 + tree.max_depth + f.lookup_rows)
    rows = 1 + tree.num_nodes + (tree.lookup or f.lookup_rows)
    seconds = rows * row_s + w["drafting"] + w["drafter_rows"] * sum(tree.rows_per_depth[:-1]) + finish
    seconds += w["replays"] * min(max(tokens - 1, 0.0), 1.0)  # the commit's replay, where it keeps a drafted row
    if f.prefill_tokens:
        seconds += c.prefill_s_per_token * f.prefill_tokens * min(1.0, tokens / max(f.remaining, 1))
    return tokens, seconds


@pytest.mark.parametrize("seed", range(10))
def test_the_batched_prices_are_each_options_own(seed):
    """The controller prices every round's options in arrays, per group of rounds with the same options: each entry
    is the one written out for that round and option, cut trees and lookup proposals included."""
    rng = np.random.default_rng(seed)
    arms = (NO_TREE, CHAIN, WIDE, TreeConfig((2, 1), 3))
    stats = {arm: (int(rng.integers(0, 50)), float(rng.uniform(1, 3)), 0.5) for arm in arms}
    c = controller(stats, fixed=2e-3, target_rows=float(rng.uniform(0.1, 1)) * 1e-3, verify_row_kilotokens=2e-5,
                   drafting=0.3e-3, drafter_rows=0.05e-3, replays=float(rng.uniform(0, 1)) * 1e-3)  # fmt: skip
    c.prefill_s_per_token = 2e-5
    for sampled, drafted in itertools.product((False, True), repeat=2):
        c.observe_finish(sampled, drafted, float(rng.uniform(0.05, 2)) * 1e-3)
    rounds = []
    for _ in range(6):
        cut = int(rng.integers(1, 5))
        options = tuple(dict.fromkeys(arm.truncated(cut) for arm in arms))
        rounds.append(RoundFacts(int(rng.integers(10, 3000)), bool(rng.random() < 0.3), int(rng.integers(1, 100)),
                                 options,
                                 lookup_rows=float(rng.uniform(0, 3)),
                                 plain_lookup_rows=float(rng.uniform(0, 4)) if rng.random() < 0.5 else None,
                                 prefill_tokens=int(rng.integers(0, 2000)) if rng.random() < 0.5 else 0))
    expected = c.expected_tokens(100, False)
    draws = {(max(f.context_len, 1).bit_length(), sampled, draw): expected for f in rounds
             for sampled in (False, True) for draw in (False, True)}  # every cell: the means (greedy's, for the test)
    for f in rounds:
        picks = c._expand(f)
        tokens, seconds = c._price(picks, [f], c.cost.weights(), draws)
        for j, pick in enumerate(picks):
            want_tokens, want_seconds = reference_price(c, f, pick, expected)
            assert tokens[0, j] == pytest.approx(want_tokens, rel=1e-12)
            assert seconds[0, j] == pytest.approx(want_seconds, rel=1e-12)
    many = c._price(c._expand(rounds[0]), [rounds[0]] * 3, c.cost.weights(), draws)
    one = c._price(c._expand(rounds[0]), [rounds[0]], c.cost.weights(), draws)
    np.testing.assert_array_equal(many[0], np.repeat(one[0], 3, axis=0))


def test_posterior_is_the_prior_without_rounds_and_the_rounds_mean_with_many():
    config = SpeculationConfig()
    arms = (NO_TREE, CHAIN)
    empty = posterior_tokens(arms, np.zeros((2, 3)), config, None)
    assert empty.tolist() == pytest.approx([1.0, 1.0 + 0.6 * 3])
    n = 10_000.0
    sums = np.array([[n, n * 1.5, n * (0.25 + 2.25)], [n, n * 2.2, n * (1 + 2.2**2)]])
    assert posterior_tokens(arms, sums, config, None).tolist() == pytest.approx([1.5, 2.2], rel=1e-3)
    draws = np.array([posterior_tokens(arms, np.zeros((2, 3)), config, np.random.default_rng(s)) for s in range(500)])
    assert draws[:, 1].min() >= 1.0 and draws[:, 1].max() <= 4.0  # within what a chain of 3 can give
    assert draws[:, 1].std() > 0.3  # unmeasured: wide
    narrow = np.array([posterior_tokens(arms, sums, config, np.random.default_rng(s)) for s in range(500)])
    assert narrow[:, 1].std() < 0.05  # well measured: narrow
    # the undrafted arm: at most 1 token a round without a lookup proposal, up to 1 + its size with one, so an
    # undrafted arm measured at one token may still draw more (and be tried with a proposal)
    few = np.array([[3.0, 4.0, 6.0], [0.0, 0.0, 0.0]])  # rounds of 1, 1 and 2 tokens
    plain = np.array([posterior_tokens(arms, few, config, np.random.default_rng(s)) for s in range(500)])
    assert plain[:, 0].max() == 1.0 and plain[:, 0].min() == 1.0
    proposing = np.array([posterior_tokens(arms, few, config, np.random.default_rng(s), undrafted_top=5.0)
                          for s in range(500)])  # fmt: skip
    assert 1.0 < proposing[:, 0].max() <= 5.0 and proposing[:, 0].min() >= 1.0


def test_tree_tokens_and_the_acceptance_they_imply():
    assert tree_tokens(TreeConfig((1, 1, 1)), 0.5) == pytest.approx(1 + 0.5 + 0.25 + 0.125)
    assert tree_tokens(TreeConfig((2, 1)), 0.5) == pytest.approx(1 + 0.75 + 0.75 * 0.5)
    assert tree_tokens(NO_TREE, 0.9) == 1.0
    for tree in (CHAIN, WIDE, TreeConfig((3, 2, 2, 1, 1))):
        for alpha in (0.05, 0.3, 0.7, 0.95):
            assert implied_acceptance(tree, tree_tokens(tree, alpha)) == pytest.approx(alpha, abs=1e-3)
    assert implied_acceptance(CHAIN, 0.5) == pytest.approx(0.0, abs=1e-3)  # below what any acceptance gives
    assert implied_acceptance(CHAIN, 9.0) == pytest.approx(1.0, abs=1e-3)


def test_a_measured_arm_informs_the_prior_of_the_cells_unmeasured_arms():
    """An arm with rounds says what acceptance the cell has; an unmeasured arm starts from what its tree would give at
    it where that is below the optimistic per-depth prior, and never above it."""
    config = SpeculationConfig()
    big = TreeConfig((3, 2, 2, 1, 1))
    arms = (NO_TREE, CHAIN, big)
    optimistic = 1 + config.prior_accept_per_depth * big.depth
    low = np.array([[0, 0, 0], [50, 50 * 1.3, 50 * 1.3**2], [0, 0, 0]], dtype=float)  # the chain: 1.3 tokens a round
    informed = posterior_tokens(arms, low, config, None)[2]
    assert informed == pytest.approx(tree_tokens(big, implied_acceptance(CHAIN, 1.3)), rel=1e-3)
    assert informed < optimistic - 1
    high = np.array([[0, 0, 0], [50, 50 * 3.9, 50 * 3.9**2], [0, 0, 0]], dtype=float)  # nearly every token accepted
    assert posterior_tokens(arms, high, config, None)[2] == pytest.approx(optimistic)
    few = low.copy()
    few[1] = [3, 3 * 1.3, 3 * 1.3**2]  # too few rounds to inform
    assert posterior_tokens(arms, few, config, None)[2] == pytest.approx(optimistic)
    off = SpeculationConfig(prior_from_rounds=0)
    assert posterior_tokens(arms, low, off, None)[2] == pytest.approx(optimistic)


def test_step_cost_model_recovers_the_weights_of_what_steps_run():
    rng = np.random.default_rng(0)
    truth = np.array([2e-3, 1e-4, 2e-5, 5e-4, 3e-5, 4e-4])
    model = StepCostModel(SpeculationConfig(cost_forget=1.0))
    for _ in range(400):
        shape = StepShape(int(rng.integers(1, 64)), float(rng.uniform(0, 64)), int(rng.integers(0, 8)),
                          int(rng.integers(0, 32)), int(rng.integers(0, 512)), int(rng.integers(0, 8)))
        x = shape.features()
        model.observe(shape, float(truth @ x), draft_seconds=float(truth[3:5] @ x[3:5]))
    assert model.weights() == pytest.approx(truth, rel=1e-3, abs=1e-9)


def test_the_measured_prior_weighs_as_a_few_steps_of_the_size_observed():
    """Steps of one request (one drafting request, a few rows) move a wrong prior within a few hundred steps: the
    prior counts as `cost_prior_steps` steps like them, not as steps of eight drafting requests and 64 rows."""
    rng = np.random.default_rng(1)
    truth = np.array([5e-3, 0.3e-3, 0.0, 2e-3, 0.7e-3, 0.0])
    model = StepCostModel()
    model.set_prior([2e-3, 0.1e-3, 0.0, 1e-3, 0.2e-3, 0.0])  # measured low: the steps' own overheads are not in it
    for _ in range(300):
        nodes = int(rng.integers(1, 8))
        drafted = rng.random() < 0.9
        shape = StepShape(1 + nodes if drafted else 1, 0.0, int(drafted), nodes if drafted else 0)
        x = shape.features()
        model.observe(shape, float(truth @ x), draft_seconds=float(truth[3:5] @ x[3:5]))
    assert model.weights()[[0, 1, 3, 4]] == pytest.approx(truth[[0, 1, 3, 4]], rel=0.2)


def test_one_request_drafts_where_verify_rows_are_cheap_and_not_where_they_cost_a_step():
    stats = {NO_TREE: (100, 1.0, 0.0), CHAIN: (100, 3.0, 1.0)}
    memory_bound = controller(stats, fixed=10e-3, target_rows=0.05e-3, drafting=1e-3, drafter_rows=0.2e-3)
    assert trees(memory_bound.choose([facts()])) == [CHAIN]
    cache_bound = controller(stats, fixed=1e-3, target_rows=1.5e-3, drafting=1e-3, drafter_rows=0.2e-3)
    assert trees(cache_bound.choose([facts()])) == [NO_TREE]


def test_under_load_trees_shrink_to_none_where_rows_add_up():
    stats = {NO_TREE: (100, 1.0, 0.0), TreeConfig((1,)): (100, 1.8, 0.4), CHAIN: (100, 2.6, 1.0),
             WIDE: (100, 3.0, 1.0)}  # fmt: skip
    options = (WIDE, CHAIN, TreeConfig((1,)), NO_TREE)
    c = controller(stats, fixed=10e-3, target_rows=0.05e-3, drafting=0.5e-3, drafter_rows=0.02e-3)
    alone = trees(c.choose([facts(options=options)]))
    crowd = trees(c.choose([facts(options=options) for _ in range(64)]))
    assert alone == [WIDE]  # the wide tree pays for one request: its step is mostly the fixed cost
    assert max(t.num_nodes for t in crowd) < WIDE.num_nodes  # shared by 64: smaller trees
    c_saturated = controller(stats, fixed=1e-3, target_rows=1e-3, drafting=0.5e-3, drafter_rows=0.1e-3)
    assert set(trees(c_saturated.choose([facts(options=options) for _ in range(64)]))) == {NO_TREE}


def test_the_drafter_prefill_is_charged_over_the_tokens_left():
    stats = {NO_TREE: (100, 1.0, 0.0), CHAIN: (100, 3.0, 1.0)}
    c = controller(stats, fixed=10e-3, target_rows=0.05e-3, drafting=1e-3, drafter_rows=0.2e-3)
    c.prefill_s_per_token = 1e-4  # a prefill over 2,000 tokens: 0.2 s
    assert trees(c.choose([facts(context_len=2000, remaining=1000, prefill_tokens=2000)])) == [CHAIN]
    assert trees(c.choose([facts(context_len=2000, remaining=4, prefill_tokens=2000)])) == [NO_TREE]
    assert trees(c.choose([facts(context_len=2000, remaining=4, prefill_tokens=0)])) == [CHAIN]  # its state is kept


def test_exploring_never_starts_a_drafter():
    """An arm that loses on its means but may win on a draw is tried by requests whose drafter already runs, never by
    one that would pay the drafter's prefill for it."""
    stats = {NO_TREE: (1000, 1.0, 0.0), CHAIN: (8, 1.2, 1.0)}  # the chain: a few rounds, a poor mean, a wide posterior
    c = controller(stats, explore=True, fixed=2e-3, target_rows=0.3e-3, drafting=0.4e-3, drafter_rows=0.1e-3)
    c.prefill_s_per_token = 1e-9  # a prefill that costs nothing: only the draws differ
    running = [trees(c.choose([facts()]))[0] for _ in range(300)]
    starting = [trees(c.choose([facts(prefill_tokens=100)]))[0] for _ in range(300)]
    assert running.count(CHAIN) > 0
    assert starting.count(CHAIN) == 0


def test_rounds_of_one_option_keep_it_and_weigh_on_the_others():
    stats = {NO_TREE: (100, 1.0, 0.0), CHAIN: (100, 2.0, 1.0)}
    c = controller(stats, fixed=2e-3, target_rows=0.5e-3, drafting=0.2e-3, drafter_rows=0.1e-3)
    big = TreeConfig((4, 4, 2))  # a client's own tree: 56 rows the step pays whatever the others run
    picks = trees(c.choose([facts(options=(big,)), facts()]))
    assert picks[0] == big
    assert trees(c.choose([facts(options=(NO_TREE,))])) == [NO_TREE]


def test_an_undrafted_rounds_lookup_proposal_is_priced_as_an_option_of_its_own():
    """Undrafted with a lookup proposal (its mean rows measured) and without are two options: the proposal's rows
    pay where rows are cheap, and are left out where they cost more than its tokens bring."""
    stats = {NO_TREE: (100, 1.5, 0.5), CHAIN: (100, 1.2, 0.5)}  # the lookup proposals gave 0.5 tokens a round
    cheap = controller(stats, fixed=10e-3, target_rows=0.1e-3, drafting=5e-3)
    dear = controller(stats, fixed=1e-3, target_rows=1e-3, drafting=5e-3)
    proposal = facts(plain_lookup_rows=3.0, proposal_rows=3, proposal_tokens=0.5)
    assert cheap.choose([proposal]) == [Pick(NO_TREE, plain_lookup=True)]
    assert dear.choose([proposal]) == [Pick(NO_TREE, plain_lookup=False)]
    assert dear.choose([facts()]) == [Pick(NO_TREE)]  # no lookup allowed (a sampled or a client's round): one option
    counts = {name: cheap.summary()[name] for name in ("drafted_rounds", "undrafted_rounds", "plain_lookup_rounds")}
    assert counts == {"drafted_rounds": 0, "undrafted_rounds": 1, "plain_lookup_rounds": 1}
    assert (dear.summary()["undrafted_rounds"], dear.summary()["plain_lookup_rounds"]) == (2, 0)


def test_each_step_verifies_a_proposal_only_where_it_pays():
    """The trees are chosen on averages (and held between choices), but a lookup proposal changes every step: an
    undrafted round verifies this step's proposal exactly where its expected confirmed tokens beat the seconds its
    rows add at the rate the choice reached, and never an empty one."""
    stats = {NO_TREE: (100, 2.5, 0.0), CHAIN: (100, 1.2, 0.5)}  # undrafted rounds gave 1.5 lookup tokens on average
    c = controller(stats, fixed=2e-3, target_rows=0.5e-3, drafting=5e-3)
    keys = ["a", "b"]
    first = c.choose([facts(plain_lookup_rows=2.0, proposal_rows=2, proposal_tokens=1.5), facts()], keys)
    assert first == [Pick(NO_TREE, plain_lookup=True), Pick(NO_TREE)]
    rate = c._rate  # tokens per second of that choice: 1 + the undrafted arm's ~2.5 tokens over 2 ms + 4 rows of 0.5 ms
    assert rate == pytest.approx((1 + c.expected_tokens(100, False)[NO_TREE]) / 4e-3)
    pays = 3 * 0.5e-3 * rate  # the tokens three more rows must bring at that rate
    for rows, tokens, verify in ((3, pays * 1.05, True), (3, pays * 0.95, False), (0, 0.0, False), (1, 0.9, True)):
        held = c.choose([facts(plain_lookup_rows=2.0, proposal_rows=rows, proposal_tokens=tokens), facts()], keys)
        assert held == [Pick(NO_TREE, plain_lookup=verify), Pick(NO_TREE)], (rows, tokens)
    assert c._held_steps == 4  # held all along: no new choice was made


def test_a_round_that_keeps_rows_past_its_root_pays_the_commits_replay():
    """An SSM target's commit runs its scan again along the kept rows (the `replays` feature). Where rows are cheap
    but a replay is not, a lookup proposal that would pay by its rows alone is left out, and the cost model learns a
    replay's seconds from steps that had them."""
    stats = {NO_TREE: (100, 1.5, 0.5), CHAIN: (100, 1.2, 0.5)}
    proposal = facts(plain_lookup_rows=3.0, proposal_rows=3, proposal_tokens=0.4)
    rows_only = controller(stats, fixed=10e-3, target_rows=0.1e-3, drafting=5e-3)
    replaying = controller(stats, fixed=10e-3, target_rows=0.1e-3, drafting=5e-3, replays=10e-3)
    assert rows_only.choose([proposal]) == [Pick(NO_TREE, plain_lookup=True)]
    assert replaying.choose([proposal]) == [Pick(NO_TREE, plain_lookup=False)]
    model = StepCostModel(SpeculationConfig(cost_prior_steps=0.0, cost_forget=1.0))
    for rows, replays in itertools.product((8, 16, 32), (0, 2, 5)):
        model.observe(StepShape(rows, replays=replays), 4e-3 + 0.1e-3 * rows + 0.5e-3 * replays)
    assert model.summary()["replays"] == pytest.approx(0.5e-3, rel=1e-6)


def test_a_weight_learned_high_returns_to_its_prior_once_its_feature_is_gone():
    """Drafting priced far too high by a few slow steps would keep the controller from drafting for good (no drafted
    step would correct it): once steps stop having the feature, its evidence is forgotten and its weight returns to
    the measured prior, so the option is tried again. While the feature is seen, the steps outweigh the prior."""
    model = StepCostModel(SpeculationConfig(cost_forget=0.995, cost_prior_steps=8.0))
    model.set_prior(weights(fixed=2e-3, target_rows=0.1e-3, drafting=1e-3))
    for _ in range(200):  # one drafting request a step, whose drafts took 15 ms (a noisy stretch)
        model.observe(StepShape(4, drafting=1, drafter_rows=3), 2e-3 + 0.4e-3 + 15e-3, draft_seconds=15e-3)
    def drafts_s() -> float:  # what the model charges a drafting request's three drafter rows
        w = model.summary()
        return w["drafting"] + 3 * w["drafter_rows"]

    assert drafts_s() == pytest.approx(15e-3, rel=0.1)
    for _ in range(2000):  # then no step drafts
        model.observe(StepShape(1), 2e-3 + 0.1e-3)
    assert drafts_s() < 2e-3


def test_a_rounds_finishing_time_is_measured_per_kind_and_priced():
    """Judging a sampled round's tree costs the host a fixed time per round, whatever its rows: measured per kind, it
    keeps one sampled request from drafting where that time eats the tokens (and not a greedy one)."""
    stats = {NO_TREE: (100, 1.0, 0.0), CHAIN: (100, 2.0, 0.5)}
    c = controller(stats, fixed=2e-3, target_rows=0.1e-3, drafting=0.5e-3, drafter_rows=0.1e-3)
    sampled = RoundFacts(100, True, 100, (CHAIN, NO_TREE))
    assert trees(c.choose([sampled])) == [CHAIN] and trees(c.choose([facts()])) == [CHAIN]
    for _ in range(3):
        c.observe_finish(True, True, 4e-3)  # rejection sampling over the chain's distributions
        c.observe_finish(True, False, 0.2e-3)
    assert c.finish_s[True, True] == pytest.approx(4e-3) and c.finish_s[False, True] == 0.0
    assert trees(c.choose([sampled])) == [NO_TREE]
    assert trees(c.choose([facts()])) == [CHAIN]  # greedy rounds: not measured dear
    c.observe_finish(True, True, 1.0)  # a round the machine delayed: the median holds
    assert c.finish_s[True, True] == pytest.approx(4e-3)
    fresh = controller(stats)
    fresh.observe_finish(False, False, 0.5)  # one slow first round of a kind...
    fresh.observe_finish(False, False, 1e-3)
    assert fresh.finish_s[False, False] == pytest.approx(1e-3)  # ...does not price it out while it is rarely run


def test_unmeasured_arms_are_tried_by_posterior_draws():
    stats = {NO_TREE: (1000, 1.0, 0.0), CHAIN: (0, 0.0, 0.0)}  # the chain: prior only
    c = controller(stats, explore=True, fixed=2e-3, target_rows=0.8e-3, drafting=0.4e-3, drafter_rows=0.1e-3)
    picks = [trees(c.choose([facts()]))[0] for _ in range(200)]
    assert 0 < picks.count(CHAIN) < 200  # sometimes worth trying, never certain
    measured = controller({NO_TREE: (1000, 1.0, 0.0), CHAIN: (5000, 1.2, 0.5)}, explore=True, fixed=2e-3,
                          target_rows=0.8e-3, drafting=0.4e-3, drafter_rows=0.1e-3)  # fmt: skip
    assert [trees(measured.choose([facts()]))[0] for _ in range(200)].count(CHAIN) == 0  # known to lose: never


def test_without_a_warm_cost_model_each_round_keeps_its_first_option():
    c = SpeculationController(StatsPolicy({NO_TREE: (0, 0, 0), CHAIN: (0, 0, 0)}), seed=0)
    assert trees(c.choose([facts(options=(CHAIN, NO_TREE))])) == [CHAIN]


def test_config_rejects_bad_values():
    with pytest.raises(ValueError, match="cost_forget"):
        SpeculationConfig(cost_forget=0)
    with pytest.raises(ValueError, match="prior_rounds"):
        SpeculationConfig(prior_rounds=-1)


def test_in_the_engine_a_drafter_that_never_agrees_ends_in_plain_rounds():
    """Random tiny models: the drafter's tokens are (almost) never the target's. The controller, pricing the bandit's
    arms (none and two trees) with what their rounds accepted, learns that drafting only costs: after warm-up most
    rounds draft nothing. Output stays the target's own."""
    import torch

    from ray_specdec.config import SamplingParams
    from ray_specdec.engine.llm import SpeculativeEngine
    from ray_specdec.models.target.model import TargetModel
    from ray_specdec.speculation.bandit import Bandit, BanditConfig
    from tests.helpers.configs import lookup_off
    from tests.helpers.inputs import random_prompt
    from tests.helpers.models import tiny_gpt_neox, tiny_mamba

    target = TargetModel(tiny_gpt_neox(torch.float32, vocab=128, seed=1))
    bandit = Bandit(BanditConfig(arms=(NO_TREE, TreeConfig((1, 1, 1)), TreeConfig((2, 2, 1)))), seed=0)
    engine = SpeculativeEngine(target, tiny_mamba(torch.float32, seed=2), bandit, config=lookup_off())
    plain = SpeculativeEngine(target, None, config=lookup_off())
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    late = {}
    for i in range(12):
        prompt = random_prompt(20 + i, seed=100 + i)
        result = engine.generate(prompt, params)
        assert result.token_ids == plain.generate(prompt, params).token_ids
        if i >= 6:  # after warm-up
            for label, n in result.stats.trees.items():
                late[label] = late.get(label, 0) + n
    assert late.get("none", 0) > 0.75 * sum(late.values()), late
    assert engine.controller.cost.calibrated  # its step costs were measured on this target and drafter


def test_the_bandit_hands_the_controller_its_token_sums_pooled_over_load_levels():
    from ray_specdec.speculation.bandit import Bandit, BanditConfig

    bandit = Bandit(BanditConfig(arms=(NO_TREE, CHAIN), gamma=1.0))
    bandit.record(CHAIN, 100, 2, 0.01, load=1)
    bandit.record(CHAIN, 100, 0, 0.01, load=30)  # another load level: pooled
    bandit.record(CHAIN, 100, 3, 0.01, sampled=True)  # sampled: apart
    bandit.record(CHAIN, 5000, 3, 0.01)  # another prompt-length bucket: apart
    bandit.record(CHAIN, 100, 3, 0.01, what_if={NO_TREE: 0})  # a what-if round teaches the undrafted arm
    sums = bandit.token_sums(100, sampled=False)
    assert sums.tolist() == [[1.0, 1.0, 1.0], [3.0, 3.0 + 1.0 + 4.0, 9.0 + 1.0 + 16.0]]


def test_a_choice_holds_for_decide_every_steps_unless_the_requests_or_their_options_change():
    """With the rounds' requests as keys, a choice is made anew only every `decide_every` steps, when a request joins
    or leaves, or when a held pick is no longer among its round's options; without keys, every call chooses."""
    paying, not_paying = (100, 2.5, 0.5), (100, 1.0, 0.0)
    stats = {NO_TREE: (100, 1.0, 0.0), CHAIN: paying}
    c = SpeculationController(StatsPolicy(stats), SpeculationConfig(explore=False, decide_every=3), seed=0)
    c.cost.set_prior(weights(fixed=2e-3, target_rows=0.1e-3, drafting=0.5e-3, drafter_rows=0.1e-3))
    two = [facts(), facts()]
    assert trees(c.choose(two, ["a", "b"])) == [CHAIN, CHAIN]
    stats[CHAIN] = not_paying  # plain decoding is the choice from now on, once chosen anew
    assert trees(c.choose(two, ["a", "b"])) == [CHAIN, CHAIN]  # held: step 1 of 3
    assert trees(c.choose(two, ["b", "a"])) == [CHAIN, CHAIN]  # the same requests in another order: held
    assert trees(c.choose(two, ["a", "b"])) == [NO_TREE, NO_TREE]  # step 3: chosen anew
    stats[CHAIN] = paying
    assert trees(c.choose([facts()] * 3, ["a", "b", "c"])) == [CHAIN] * 3  # "c" joined: chosen anew
    stats[CHAIN] = not_paying
    assert trees(c.choose(two, ["a", "b"])) == [NO_TREE] * 2  # "c" left: chosen anew
    stats[CHAIN] = paying
    assert trees(c.choose(two, ["a", "b"])) == [NO_TREE] * 2  # held
    assert trees(c.choose(two, ["a", "b"])) == [NO_TREE] * 2  # held
    assert trees(c.choose(two, ["a", "b"])) == [CHAIN] * 2  # chosen anew
    stats[CHAIN] = not_paying
    cut = facts(options=(CHAIN.truncated(1), NO_TREE))  # "a" near its end: its held chain is no longer an option
    assert trees(c.choose([cut, facts()], ["a", "b"])) == [NO_TREE, NO_TREE]  # chosen anew
    stats[CHAIN] = paying
    assert trees(c.choose([facts()])) == [CHAIN]  # no keys: chosen every call
    summary = c.summary()
    assert summary["drafted_rounds"] + summary["undrafted_rounds"] == 2 * 9 + 3 + 1  # every round counted
