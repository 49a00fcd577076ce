"""Speculation by goodput: the step cost model, the acceptance model, tree sizing for a whole batch, and the
scheduler settling on no tree where drafting never pays."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ray_specdec.config import NO_TREE, SamplingParams, TreeConfig
from ray_specdec.engine.llm import SpeculativeEngine
from ray_specdec.models.target.model import TargetModel
from ray_specdec.speculation.bandit import Bandit, BanditConfig
from ray_specdec.speculation.goodput import (COST_WARMUP_STEPS, PRIOR_ACCEPT_PER_DEPTH, AcceptanceModel, Candidate,
                                             StepCostModel, StepShape, drafter_rows, size_trees)
from tests.helpers.inputs import random_prompt
from tests.helpers.models import tiny_gpt_neox, tiny_mamba

CHAIN, BIG = TreeConfig((1, 1, 1, 1)), TreeConfig((3, 2, 2, 1, 1))


def random_shape(rng: np.random.Generator) -> StepShape:
    drafting = int(rng.integers(0, 32))
    verify, draft = drafting + int(rng.integers(1, 200)), drafting * int(rng.integers(0, 8))
    return StepShape(verify, draft, int(rng.integers(0, 600)), drafting)


def fitted(weights, steps: int = 200, noise: float = 0.0, model: StepCostModel | None = None) -> StepCostModel:
    """A cost model fed `steps` steps of random shapes whose seconds are
    weights . [1, verify rows, drafting requests, drafter rows, prefill rows] (times 1 + noise)."""
    rng = np.random.default_rng(0)
    model = model or StepCostModel()
    for _ in range(steps):
        shape = random_shape(rng)
        seconds = float(np.dot(weights, shape.features())) * (1 + noise * rng.standard_normal())
        model.observe(shape, seconds)
    return model


WEIGHTS = [(5e-3, 2e-4, 3e-4, 1e-4, 5e-5), (1e-3, 1e-5, 0.0, 3e-4, 0.0)]


@pytest.mark.parametrize("noise", [0.0, 0.005])
@pytest.mark.parametrize("weights", WEIGHTS)
def test_the_cost_model_recovers_linear_step_costs(weights, noise):
    model = fitted(weights, noise=noise)
    assert model.warm and not model.calibrated
    np.testing.assert_allclose(model.weights(), weights, rtol=0.05 if noise else 1e-5, atol=3e-5 if noise else 1e-8)
    shape = StepShape(40, 12, 64, 4)
    assert model.predict(shape) == pytest.approx(float(np.dot(weights, shape.features())), rel=0.03 if noise else 1e-5)


@pytest.mark.parametrize("weights", WEIGHTS)
def test_a_calibrated_prior_is_trusted_at_once_and_steps_refine_it(weights):
    model = StepCostModel()
    prior = np.array(weights) * 2  # a prior measured on a quieter machine, say
    model.set_prior(prior)
    assert model.warm and model.steps == 0
    np.testing.assert_allclose(model.weights(), prior, rtol=1e-9)
    fitted(weights, steps=2000, model=model)  # ~200 steps of memory against the prior's 64
    rng = np.random.default_rng(1)
    for shape in (random_shape(rng) for _ in range(50)):  # nearer the steps than the prior (which keeps ~1/4 weight)
        truth = float(np.dot(weights, shape.features()))
        assert abs(model.predict(shape) - truth) < 0.5 * abs(float(np.dot(prior, shape.features())) - truth)


def test_the_cost_model_never_prices_a_row_below_zero_and_warms_up():
    model = StepCostModel()
    for i in range(COST_WARMUP_STEPS):
        assert not model.warm
        model.observe(StepShape(1 + i % 3, 0, 0), 1e-2 - 1e-3 * (i % 3))  # more verify rows, faster: noise
    assert model.warm
    assert model.weights()[1] == 0.0 and (model.weights() >= 0).all()


def candidate(*trees: TreeConfig, accepted: float = 1.0, per_depth: float = 0.0, fixed: bool = False) -> Candidate:
    """Trees expected to accept `accepted` draft tokens (at most their depth), or `per_depth` of their depth."""
    return Candidate(list(trees), [1.0 + min(accepted, t.depth) + per_depth * t.depth for t in trees], fixed)


def cost(fixed_s: float, verify_row_s: float, draft_row_s: float = 0.0) -> StepCostModel:
    return fitted((fixed_s, verify_row_s, 0.0, draft_row_s, 1e-5), steps=COST_WARMUP_STEPS + 10)


def test_size_trees_keeps_every_pick_before_warm_up():
    model = cost(1e-3, 1.0)  # rows that would make any tree a loss...
    cold = StepCostModel()
    for _ in range(COST_WARMUP_STEPS - 1):
        cold.observe(StepShape(5, 3, 0), 1.0)
    picks = [candidate(BIG, CHAIN, NO_TREE) for _ in range(8)]
    assert size_trees(picks, cold, prefill_rows=0) == [0] * 8  # ...are not trusted yet
    assert size_trees(picks, model, prefill_rows=0) == [2] * 8


@pytest.mark.parametrize("batch", [1, 4, 32])
def test_size_trees_shrinks_trees_where_verify_rows_cost_more_than_they_accept(batch):
    """10 ms fixed + 1 ms per verify row, one token accepted per round: a chain of 4 gives 2 tokens for 4 more rows.
    Alone that pays (2 / 15 ms > 1 / 11 ms); in a batch of 4 or 32 the fixed cost is shared and it does not."""
    model = cost(1e-2, 1e-3)
    picks = [candidate(CHAIN, NO_TREE) for _ in range(batch)]
    choice = size_trees(picks, model, prefill_rows=0)
    assert choice == ([0] if batch == 1 else [1] * batch)


@pytest.mark.parametrize("batch", [1, 32])
def test_size_trees_keeps_trees_where_rows_are_cheap(batch):
    model = cost(2e-2, 1e-6, 1e-6)  # a step costs its fixed part: rows are nearly free (an accelerator)
    picks = [candidate(BIG, CHAIN, NO_TREE, accepted=0, per_depth=0.5) for _ in range(batch)]
    assert size_trees(picks, model, prefill_rows=0) == [0] * batch


def test_size_trees_prefers_the_smaller_tree_that_accepts_as_much():
    model = cost(1e-2, 1e-3)
    picks = [Candidate([BIG, CHAIN, NO_TREE], [3.0, 3.0, 1.0])]  # the chain accepts what the big tree does
    assert size_trees(picks, model, prefill_rows=0) == [1]


def test_size_trees_costs_the_lookup_rows_a_drafted_tree_carries():
    """Alone, 10 ms fixed + 1 ms per verify row: a chain of 4 that accepts one token pays (2 / 15 ms > 1 / 11 ms),
    but not once the engine's lookup branch adds 8 rows to it (2 / 23 ms); plain decoding carries none."""
    model = cost(1e-2, 1e-3)
    assert size_trees([candidate(CHAIN, NO_TREE)], model, prefill_rows=0) == [0]
    with_lookup = candidate(CHAIN, NO_TREE)
    with_lookup.extra_rows = 8.0
    assert size_trees([with_lookup], model, prefill_rows=0) == [1]
    own = Candidate([CHAIN.with_lookup(2), NO_TREE], with_lookup.tokens, extra_rows=8.0)  # a tree's own lookup counts
    assert size_trees([own], model, prefill_rows=0) == [0]  # 2 / 17 ms > 1 / 11 ms


def test_size_trees_never_touches_fixed_candidates():
    model = cost(1e-2, 1e-2)  # rows so costly that every free request drops its tree
    picks = [candidate(CHAIN, NO_TREE, fixed=True), candidate(CHAIN, NO_TREE), candidate(CHAIN, NO_TREE, fixed=True)]
    assert size_trees(picks, model, prefill_rows=0) == [0, 1, 0]


def test_drafter_rows_count_every_stepped_depth():
    assert drafter_rows(NO_TREE) == 0 and drafter_rows(TreeConfig((1,))) == 0
    assert drafter_rows(TreeConfig((3, 2, 1))) == 3 + 6 and drafter_rows(CHAIN) == 3


def test_the_acceptance_model_keeps_means_per_tree_context_and_mode():
    model = AcceptanceModel()
    assert model.expected_tokens(NO_TREE, 10, False) == 1.0
    assert model.expected_tokens(CHAIN, 10, False) == pytest.approx(1 + PRIOR_ACCEPT_PER_DEPTH * 4)
    assert model.expected_tokens(TreeConfig((1,), lookup=6), 10, False) == pytest.approx(1 + PRIOR_ACCEPT_PER_DEPTH * 6)
    for accepted in (0, 1, 4, 3):
        model.record(CHAIN, 100, False, accepted, what_if={TreeConfig((1, 1)): min(accepted, 2)})
    assert model.expected_tokens(CHAIN, 100, False) == pytest.approx(1 + 8 / 4)
    assert model.expected_tokens(TreeConfig((1, 1)), 200, False) == pytest.approx(1 + 5 / 4)  # what-if counts
    assert model.expected_tokens(CHAIN, 100, True) == pytest.approx(1 + PRIOR_ACCEPT_PER_DEPTH * 4)  # sampled apart
    assert model.expected_tokens(CHAIN, 3000, False) == pytest.approx(1 + PRIOR_ACCEPT_PER_DEPTH * 4)  # longer context
    model.record(CHAIN, 3000, False, 0)
    assert model.expected_tokens(CHAIN, 3000, False) == 1.0
    kept = dict(model._n)
    model.record(NO_TREE, 100, False, 0)  # undrafted rounds (most under load) are not kept: 1 token whatever
    model.record(NO_TREE, 100, True, 0)
    assert model._n == kept and model.expected_tokens(NO_TREE, 100, False) == 1.0
    assert model.expected_tokens(CHAIN, 100, False) == pytest.approx(3.0)


def test_at_batch_one_a_drafter_that_never_agrees_ends_in_plain_rounds():
    """Random tiny models: the drafter's tokens are (almost) never the target's. The bandit (arms: none and two
    trees) and goodput sizing learn that drafting only costs: after warm-up most rounds draft nothing. Output stays
    the target's own."""
    target = TargetModel(tiny_gpt_neox(torch.float32, vocab=128, seed=1))
    bandit = Bandit(BanditConfig(arms=(NO_TREE, TreeConfig((1, 1, 1)), TreeConfig((2, 2, 1)))), seed=0)
    engine = SpeculativeEngine(target, tiny_mamba(torch.float32, seed=2), bandit)
    plain = SpeculativeEngine(target, None)
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
