"""The engine's drafter is paid for only in rounds that draft (LazyDrafter), and the speculation controller charges
its prefill to the request's drafted rounds: where the tokens left cannot repay it, the request runs undrafted.
Output stays exactly the target's either way."""

from __future__ import annotations

import pytest
import torch

from ray_specdec.config import SamplingParams, TreeConfig
from ray_specdec.engine.llm import SpeculativeEngine
from ray_specdec.models.drafter.mamba import MambaDrafter
from ray_specdec.speculation.drafting import DrafterSession
from tests.helpers.configs import lookup_off
from tests.helpers.inputs import random_prompt
from tests.helpers.models import tiny_mamba
from tests.helpers.policies import PricedPolicy, ScriptedPolicy, fix_costs
from tests.helpers.reference import hf_greedy


class NoDrafterCalls:
    """A drafter that fails the test if anything runs it."""

    device, vocab_size, prefill_window = torch.device("cpu"), 128, None

    def __getattr__(self, name):
        raise AssertionError(f"the drafter's {name} ran in a request that never drafted")


def test_a_request_that_never_drafts_never_runs_the_drafter(target):
    prompt = random_prompt(37, seed=7)
    engine = SpeculativeEngine(target, NoDrafterCalls(), ScriptedPolicy([()]), config=lookup_off())
    result = engine.generate(prompt, SamplingParams(max_new_tokens=12))
    assert result.token_ids == hf_greedy(target, prompt, 12)
    assert result.stats.trees == {"none": 12}


@pytest.mark.parametrize("script", [
    [(), (), (1, 1), (), (3, 2), (), (), (1,)],  # drafting starts late: the drafter is prefilled mid-request
    [(2, 1), (), (), (1, 1, 1), (1, 1, 1), (), (2, 2, 1)],  # stretches without a draft between drafted rounds
])
def test_interleaved_undrafted_rounds_keep_output_and_drafter_state_exact(target, script):
    prompt = random_prompt(37, seed=8)
    engine = SpeculativeEngine(target, tiny_mamba(), ScriptedPolicy(script))
    result = engine.generate(prompt, SamplingParams(max_new_tokens=40))
    assert result.token_ids == hf_greedy(target, prompt, 40)
    assert "none" in result.stats.trees and len(result.stats.trees) > 2


def test_lazy_drafter_catches_up_to_a_prefill_from_scratch():
    """Every draft after rounds with and without drafts starts from the state a fresh prefill of every token so far
    gives, and proposes the same tree (greedy)."""
    from ray_specdec.speculation.acceptance import Verdict
    from ray_specdec.speculation.drafter_sessions import LazyDrafter

    drafter = tiny_mamba(vocab=32)
    tokens = random_prompt(12, seed=5, vocab=32)
    lazy = LazyDrafter(drafter, vocab_size=32)
    g = torch.Generator().manual_seed(1)
    script = [None, None, (2, 1), None, (1, 1, 1), (1, 1, 1), None, None, None, (3, 2), (2,)]
    for round_, branching in enumerate(script):
        if branching is None:
            verdict = Verdict((), (), bonus_token=int(torch.randint(32, (1,), generator=g)))
        else:
            config = TreeConfig(branching)
            lazy.ready(tokens)
            draft = lazy.session.draft(config, SamplingParams(), None, 0.0)
            fresh = DrafterSession(drafter, tokens, vocab_size=32)
            torch.testing.assert_close(lazy.session.root_state.ssm, fresh.root_state.ssm)
            torch.testing.assert_close(lazy.session.root_state.conv, fresh.root_state.conv)
            assert torch.equal(draft.tokens, fresh.draft(config, SamplingParams(), None, 0.0).tokens)
            leaf = draft.tree.leaf_paths[round_ % len(draft.tree.leaf_paths)]
            rows = leaf[1 : 1 + round_ % (config.depth + 1)]
            accepted = tuple(int(draft.tokens[r - 1]) for r in rows)
            verdict = Verdict(rows, accepted, bonus_token=int(torch.randint(32, (1,), generator=g)))
        lazy.commit(verdict)
        tokens += verdict.new_tokens
    assert lazy.session is not None and lazy.pending  # the last verdicts are never applied: no draft followed


def test_the_drafters_prefill_is_a_request_cost_not_a_rounds(target):
    """A late drafter prefill goes to stats.prefill_s; the round the policy is told about leaves it out."""
    import time as _time

    class SlowPrefill(MambaDrafter):
        def prefill(self, ids):
            _time.sleep(1.0)
            return super().prefill(ids)

    slow = tiny_mamba()
    slow.__class__ = SlowPrefill
    policy = ScriptedPolicy([(), (), (1, 1)])
    engine = SpeculativeEngine(target, slow, policy)
    result = engine.generate(random_prompt(37, seed=9), SamplingParams(max_new_tokens=12))
    assert result.stats.prefill_s >= 1.0
    assert max(t for _, t in policy.records) < 1.0
    assert result.stats.draft_s < 1.0 and result.stats.total_s >= 1.0


@pytest.mark.parametrize("max_new, drafts", [(40, True), (4, False)])
def test_the_controller_drafts_only_where_the_tokens_left_pay_for_the_drafters_prefill(target, max_new, drafts):
    """Verify rows nearly free, a chain that gives 3 tokens a round: drafting wins unless the drafter's prefill (37
    tokens at 5 ms) must be repaid by a request with few tokens left (4: 0.185 s against ~8 ms saved)."""
    prompt = random_prompt(37, seed=10)
    policy = PricedPolicy({(): 1.0, (1, 1): 3.0})
    engine = SpeculativeEngine(target, tiny_mamba() if drafts else NoDrafterCalls(), policy)
    fix_costs(engine.controller, 5e-3)
    result = engine.generate(prompt, SamplingParams(max_new_tokens=max_new))
    assert result.token_ids == hf_greedy(target, prompt, max_new)
    assert ("1,1" in result.stats.trees) == drafts
    if not drafts:
        assert result.stats.trees == {"none": max_new}
        assert {tree for tree, _ in policy.records} == {"none"}  # the policy learns what ran


def test_a_kept_drafter_state_costs_no_prefill_and_a_tree_asked_for_is_drafted_whatever_the_cost(target):
    prompt = random_prompt(37, seed=11)
    engine = SpeculativeEngine(target, tiny_mamba(), PricedPolicy({(): 1.0, (1, 1): 3.0}))
    fix_costs(engine.controller, 1.0)  # a prefill that would never pay
    assert set(engine.generate(prompt, SamplingParams(max_new_tokens=6)).stats.trees) == {"none"}
    asked = engine.generate(prompt, SamplingParams(max_new_tokens=6), TreeConfig((2,)))
    assert "2" in asked.stats.trees  # its client's tree: drafted, and its drafter state kept (prefix cache)
    assert "1,1" in engine.generate(prompt, SamplingParams(max_new_tokens=6)).stats.trees  # now no prefill to pay


def test_the_drafters_prefill_rate_is_measured_where_it_runs(target):
    engine = SpeculativeEngine(target, tiny_mamba(), PricedPolicy({(): 1.0, (1, 1): 3.0}))
    fix_costs(engine.controller, None)
    assert engine.controller.prefill_s_per_token is None  # nothing measured: no charge, draft
    assert "1,1" in engine.generate(random_prompt(37, seed=12), SamplingParams(max_new_tokens=6)).stats.trees
    assert 0 < engine.controller.prefill_s_per_token < 1.0
