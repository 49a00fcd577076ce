"""The engine's drafter is paid for only in rounds that draft (LazyDrafter), and each request decides once whether
drafting can repay the drafter's prefill (the start rule). Output stays exactly the target's either way."""

from __future__ import annotations

import pytest
import torch

from ray_specdec.config import SamplingParams, TreeConfig
from ray_specdec.engine.llm import SpeculativeEngine
from ray_specdec.models.drafter.mamba import MambaDrafter
from ray_specdec.speculation.drafting import DrafterSession
from ray_specdec.speculation.start_rule import REQUEST_EMA, StartRule
from tests.helpers.inputs import random_prompt
from tests.helpers.models import tiny_mamba
from tests.helpers.policies import RatedPolicy, ScriptedPolicy
from tests.helpers.reference import hf_greedy


class NoDrafterCalls:
    """A drafter that fails the test if anything runs it."""

    device, vocab_size, prefill_window = torch.device("cpu"), 128, None

    def __getattr__(self, name):
        raise AssertionError(f"the drafter's {name} ran in a request that never drafted")


def test_a_request_that_never_drafts_never_runs_the_drafter(target):
    prompt = random_prompt(37, seed=7)
    engine = SpeculativeEngine(target, NoDrafterCalls(), ScriptedPolicy([()]))
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


@pytest.mark.parametrize("max_new, drafts", [(12, True), (6, False)])
def test_the_start_rule_drafts_only_when_the_tokens_left_pay_for_the_drafters_prefill(target, max_new, drafts):
    """prefill 37 tokens x 1 ms = 37 ms; drafting saves 1/100 - 1/200 = 5 ms per token: worth it past 7.4 tokens."""
    from ray_specdec.speculation.start_rule import START_ANYWAY_EVERY

    prompt = random_prompt(37, seed=10)
    policy = RatedPolicy([(1, 1)], {(1, 1): 200.0, (): 100.0})
    engine = SpeculativeEngine(target, tiny_mamba() if drafts else NoDrafterCalls(), policy)
    engine.prefill_s_per_token = 1e-3
    result = engine.generate(prompt, SamplingParams(max_new_tokens=max_new))
    assert result.token_ids == hf_greedy(target, prompt, max_new)
    assert ("1,1" in result.stats.trees) == drafts
    if not drafts:
        assert result.stats.trees == {"none": max_new} and engine.kept_plain == 1
        assert {tree for tree, _ in policy.records} == {"none"}  # the policy learns what ran
        engine.drafter = tiny_mamba()  # one request in START_ANYWAY_EVERY the rule keeps plain drafts anyway
        trees = [engine.generate(prompt, SamplingParams(max_new_tokens=max_new)).stats.trees
                 for _ in range(START_ANYWAY_EVERY - 1)]
        assert ["1,1" in t for t in trees] == [False] * (START_ANYWAY_EVERY - 2) + [True]
        assert engine.kept_plain == START_ANYWAY_EVERY


@pytest.mark.parametrize("script, first", [
    ([(2, 1), ()], "2,1"),  # the policy drafts its first round, then picks no tree
    ([()], "1,1"),  # the policy never picks a tree (it rates drafting too low): the rule is asked all the same
])
def test_a_request_started_anyway_drafts_in_every_round(target, script, first):
    """The request the start rule starts only to explore drafts every round, even where the policy (here: confident
    that drafting does not pay) picks no tree: then the drafting arm with the best draw."""
    from ray_specdec.speculation.start_rule import START_ANYWAY_EVERY

    prompt = random_prompt(37, seed=12)
    policy = RatedPolicy(script, {(1, 1): 150.0, (2, 1): 120.0, (): 200.0})
    engine = SpeculativeEngine(target, tiny_mamba(), policy)
    engine.prefill_s_per_token = 1e-3
    engine.kept_plain = START_ANYWAY_EVERY - 1  # the next request the rule keeps plain is started anyway
    result = engine.generate(prompt, SamplingParams(max_new_tokens=16))
    assert result.token_ids == hf_greedy(target, prompt, 16)
    rounds = [tree for tree, _ in policy.records]
    assert rounds[0] == first and len(rounds) > 2
    # later rounds: the best drafting draw, cut to the tokens left (a last round with one token left has no tree)
    assert all(tree in ("1,1", "1") for tree in rounds[1:-1]) and rounds[-1] in ("1,1", "1", "none")
    policy.round = 0  # the next request is kept plain again: no round drafts
    plain = engine.generate(prompt, SamplingParams(max_new_tokens=16))
    assert set(plain.stats.trees) == {"none"} and engine.kept_plain == START_ANYWAY_EVERY + 1
    assert plain.token_ids == result.token_ids


def test_the_start_rule_drafts_without_estimates_and_learns_the_prefill_cost(target):
    prompt = random_prompt(37, seed=11)
    for rates in ({(1, 1): 200.0}, {(): 100.0}, {}):  # a rate missing: no judgement, draft
        engine = SpeculativeEngine(target, tiny_mamba(), RatedPolicy([(1, 1)], rates))
        engine.prefill_s_per_token = 1.0  # a prefill that would never pay
        assert "1,1" in engine.generate(prompt, SamplingParams(max_new_tokens=6)).stats.trees
    engine = SpeculativeEngine(target, tiny_mamba(), RatedPolicy([(1, 1)], {(1, 1): 200.0, (): 100.0}))
    assert engine.prefill_s_per_token is None  # nothing measured yet: draft, and measure
    assert "1,1" in engine.generate(prompt, SamplingParams(max_new_tokens=6)).stats.trees
    assert 0 < engine.prefill_s_per_token < 1.0
    # a tree asked for explicitly is drafted whatever the estimates say
    engine.prefill_s_per_token = 1.0
    assert "2" in engine.generate(prompt, SamplingParams(max_new_tokens=6), TreeConfig((2,))).stats.trees


def test_a_drafting_requests_prefill_is_spread_over_the_tokens_it_decodes():
    """The speculation guard's charge per decoded token: the measured prefill rate, times a drafting request's
    prefill tokens, over the tokens it decodes (its max_tokens until one finishes); 0 until all three are known."""
    rule = StartRule()
    assert rule.prefill_s_per_decoded_token() == 0.0
    rule.note_request(prefill_tokens=50, remaining=100)
    assert rule.prefill_s_per_decoded_token() == 0.0  # no prefill measured yet
    rule.note_prefill(0.05, 50)
    assert rule.prefill_s_per_decoded_token() == pytest.approx(1e-3 * 50 / 100)
    rule.note_finished(20)  # requests end sooner than their max_tokens: each token carries more of the prefill
    decoded = 100 + REQUEST_EMA * (20 - 100)
    assert rule.prefill_s_per_decoded_token() == pytest.approx(1e-3 * 50 / decoded)
    rule.note_request(prefill_tokens=0, remaining=100)  # a kept drafter state: no prefill to pay
    assert rule.prefill_s_per_decoded_token() == pytest.approx(1e-3 * 50 * (1 - REQUEST_EMA) / decoded)
