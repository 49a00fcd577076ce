"""What an undrafted round's lookup proposal is worth (speculation/lookup_value.py): the positions a round tells,
the expected confirmed tokens as the product of position rates, and each request learning its own."""

from __future__ import annotations

import pytest
import torch

from ray_specdec.config import SamplingParams
from ray_specdec.engine.llm import SpeculativeEngine
from ray_specdec.speculation.lookup_value import PRIOR_RATE, PRIOR_WEIGHT, LookupAcceptance, LookupCounts
from tests.helpers.configs import lookup_off
from tests.helpers.inputs import random_prompt
from tests.helpers.bigram import VOCAB, agreeing_pair


@pytest.mark.parametrize(("proposal", "emitted", "matched", "tries", "hits"), [
    ([1, 2, 3, 4], [1, 2, 9], 2, [1, 1, 1], [1, 1, 0]),  # confirmed twice, then the mismatch seen
    ([1, 2, 3, 4], [1], 1, [1], [1]),  # an undrafted round without its proposal: one token tells the first position
    ([1, 2, 3, 4], [5], 0, [1], [0]),
    ([1, 2, 3], [1, 2], 2, [1, 1], [1, 1]),  # the round ended (a stop) inside the proposal: no mismatch seen
    ([1, 2], [1, 2, 3, 4], 2, [1, 1], [1, 1]),  # all of it confirmed
    ([7], [], 0, [], []),
])  # fmt: skip
def test_a_round_counts_the_positions_it_tells(proposal, emitted, matched, tries, hits):
    model, counts = LookupAcceptance(forget=1.0), LookupCounts()
    assert model.observe(counts, proposal, emitted) == matched
    assert (counts.tries, counts.hits) == (tries, hits)
    assert (model.tries, model.hits) == (tries, hits)


def test_the_expected_tokens_are_the_sum_of_the_products_of_position_rates():
    model = LookupAcceptance(forget=1.0, request_prior=3.0)
    for emitted in ([1, 2, 3, 4], [1, 2, 9], [1, 9], [9], [1, 2, 3, 9]):
        model.observe(None, [1, 2, 3, 4], emitted)
    pooled = [(h + PRIOR_WEIGHT * PRIOR_RATE) / (t + PRIOR_WEIGHT) for t, h in zip(model.tries, model.hits)]
    assert model.tries == [5, 4, 3, 2] and model.hits == [4, 3, 2, 1]
    assert model.expected(3) == pytest.approx(pooled[0] + pooled[0] * pooled[1] + pooled[0] * pooled[1] * pooled[2])
    assert model.expected(6) == pytest.approx(sum(
        pytest.importorskip("math").prod(pooled[:k] + [PRIOR_RATE] * max(0, k - 4)) for k in range(1, 7)))
    counts = LookupCounts()
    counts.tries, counts.hits = [2.0], [0.0]  # this request's two rounds: its first tokens were never confirmed
    own = (0.0 + 3.0 * pooled[0]) / (2.0 + 3.0)
    assert model.expected(2, counts) == pytest.approx(own + own * pooled[1])
    assert model.expected(0, counts) == 0.0


def test_each_request_learns_its_own_lookup_value():
    """Two greedy requests in one batch on the bigram target (its text follows long cycles of a successor table, so
    it repeats only what its context holds): one whose prompt holds the text it will write, one whose prompt holds
    decoys (pairs of the tokens it will write, each followed by a wrong one: lookup proposes, and misses). The pooled
    rates are shared, and each request's own estimate of a 4-token proposal moves its own way. Both keep the target's
    tokens."""
    target, _ = agreeing_pair(torch.float32, max_positions=512)
    params = SamplingParams(max_new_tokens=30, ignore_eos=True)
    plain = SpeculativeEngine(target, None, config=lookup_off())
    leads = {"repeats": random_prompt(8, seed=4, vocab=VOCAB), "misses": random_prompt(8, seed=6, vocab=VOCAB)}
    written = {request_id: plain.generate(lead, params).token_ids for request_id, lead in leads.items()}
    w = written["misses"]
    decoys = [t for i in range(0, 27, 3) for t in (w[i], w[i + 1], 2 + (w[i + 2] + 7) % (VOCAB - 2))]
    prompts = {"repeats": leads["repeats"] + written["repeats"] + leads["repeats"],
               "misses": leads["misses"] + decoys + leads["misses"]}  # fmt: skip
    scheduler = SpeculativeEngine(target, None, config=lookup_off(plain_lookup=4)).scheduler
    for request_id, prompt in prompts.items():
        scheduler.add(request_id, prompt, params)
    tokens = {request_id: [] for request_id in prompts}
    estimates = {}
    while scheduler.has_work:
        for request_id, r in scheduler.running.items():
            if r.lookup_counts is not None:
                estimates[request_id] = scheduler.controller.lookup.expected(4, r.lookup_counts)
        for out in scheduler.step():
            tokens[out.request_id] += out.chunk.token_ids
    for request_id, prompt in prompts.items():
        alone = SpeculativeEngine(target, None, config=lookup_off()).generate(prompt, params).token_ids
        assert tokens[request_id] == alone, request_id
    pooled = scheduler.controller.lookup.expected(4)
    assert estimates["misses"] < pooled < estimates["repeats"], (estimates, pooled)
