"""Prompt lookup in undrafted rounds (`SchedulerConfig.plain_lookup`): greedy rounds the scheduler runs without a
drafter draft verify what followed the context's last tokens earlier on instead. The output stays the target's own
greedy decoding (alone, batched, around drafted rounds, at every max_new_tokens); a client's own tree (`none`
included) and sampled requests never get it; the KV reservation holds its rows; the drafter catches up on the tokens
such rounds accepted."""

from __future__ import annotations

import pytest
import torch

from ray_specdec.config import NO_TREE, SamplingParams, TreeConfig
from ray_specdec.engine.llm import SpeculativeEngine
from ray_specdec.engine.scheduler import PLAIN_LOOKUP_MIN_NGRAM
from ray_specdec.speculation.controller import SpeculationConfig
from ray_specdec.models.target.model import TargetModel
from ray_specdec.speculation.acceptance import Verdict
from ray_specdec.speculation.drafting import LOOKUP_ONLY, DrafterSession, lookup_draft
from ray_specdec.speculation.prompt_lookup import LookupIndex
from ray_specdec.speculation.tree_policy import FixedTree
from tests.helpers.configs import lookup_off
from tests.helpers.inputs import random_prompt
from tests.helpers.models import tiny_gpt_neox, tiny_mamba
from tests.helpers.policies import ScriptedPolicy

LOOKUP = 4


@pytest.fixture(scope="module")
def target() -> TargetModel:
    model = TargetModel(tiny_gpt_neox(torch.float32, max_positions=1024))
    assert model.batch_invariant, model.batch_invariant_why
    return model


def repetitive(n: int, seed: int) -> list[int]:
    """A prompt that repeats a random stretch (lookup proposes its continuation) after a random lead-in."""
    stretch = random_prompt(12, seed=seed)
    return random_prompt(n, seed=seed + 100) + stretch * 3 + stretch[:5]


def alone(target: TargetModel, prompt: list[int], max_new: int) -> list[int]:
    params = SamplingParams(max_new_tokens=max_new, ignore_eos=True)
    return SpeculativeEngine(target, None, config=lookup_off()).generate(prompt, params).token_ids


class Alternating(FixedTree):
    """A policy whose picks alternate between no tree and a chain: drafted rounds and lookup rounds interleave."""

    def __init__(self):
        super().__init__(TreeConfig((1, 1)))
        self.calls = 0

    @property
    def arms(self) -> tuple[TreeConfig, ...]:
        return (NO_TREE, self.tree)

    def select(self, context_len, sampled=False, max_nodes=None, *, load=1) -> TreeConfig:
        self.calls += 1
        return self.tree if self.calls % 2 else NO_TREE


@pytest.mark.parametrize("max_new", [1, 2, 5, 40])
def test_undrafted_rounds_verify_lookup_and_keep_the_targets_tokens(target, max_new):
    engine = SpeculativeEngine(target, None, config=lookup_off(plain_lookup=LOOKUP))
    prompts = [repetitive(30, seed) for seed in range(4)] + [random_prompt(50, seed=9)]
    lookup_rounds = 0
    for prompt in prompts:
        got = engine.generate(prompt, SamplingParams(max_new_tokens=max_new, ignore_eos=True))
        assert got.token_ids == alone(target, prompt, max_new)
        assert len(got.token_ids) == max_new  # a proposal never runs past max_new_tokens
        lookup_rounds += got.stats.trees.get(LOOKUP_ONLY, 0)
    if max_new >= 5:
        assert lookup_rounds > 0  # the repeated stretches were proposed (and verified)


def test_lookup_rounds_take_several_tokens_where_the_text_repeats(target):
    """A tiny random target's greedy text falls into a loop; lookup then proposes it and rounds accept it."""
    prompt = repetitive(20, seed=1)
    got = SpeculativeEngine(target, None, config=lookup_off(plain_lookup=LOOKUP)).generate(
        prompt, SamplingParams(max_new_tokens=60, ignore_eos=True))
    assert got.token_ids == alone(target, prompt, 60)
    assert got.stats.trees.get(LOOKUP_ONLY, 0) > 0
    assert sum(got.stats.trees.values()) < len(got.token_ids)  # rounds that took more than the bonus token


def test_in_a_batch_only_the_schedulers_own_greedy_rounds_get_lookup(target):
    """Requests of every kind in one batch, drafted and lookup rounds interleaved by the policy: each gets its tokens
    alone; a client's `none`, a client's tree and a sampled request never run a lookup round."""
    engine = SpeculativeEngine(target, tiny_mamba(torch.float32), Alternating(),
                               config=lookup_off(plain_lookup=LOOKUP))  # fmt: skip
    greedy = SamplingParams(max_new_tokens=40, ignore_eos=True)
    requests = [("policy0", repetitive(25, 3), greedy, None), ("policy1", repetitive(40, 4), greedy, None),
                ("none", repetitive(25, 3), greedy, NO_TREE), ("chain", repetitive(30, 5), greedy, TreeConfig((2, 1))),
                ("sampled", repetitive(25, 6), SamplingParams(max_new_tokens=40, temperature=1.0, seed=7), None)]
    for request_id, prompt, params, tree in requests:
        engine.scheduler.add(request_id, prompt, params, tree)
    rounds: dict[str, dict[str, int]] = {}
    tokens: dict[str, list[int]] = {r[0]: [] for r in requests}
    while engine.scheduler.has_work:
        for out in engine.scheduler.step():
            tokens[out.request_id] += out.chunk.token_ids
            if out.chunk.finish_reason is not None:
                rounds[out.request_id] = dict(out.chunk.stats.trees)
    for request_id, prompt, params, tree in requests[:4]:
        assert tokens[request_id] == alone(target, prompt, 40), request_id
    assert all(rounds[r].get(LOOKUP_ONLY, 0) > 0 for r in ("policy0", "policy1")), rounds
    assert all(any(label not in (LOOKUP_ONLY, "none") for label in rounds[r]) for r in ("policy0", "policy1"))
    assert all(LOOKUP_ONLY not in rounds[r] for r in ("none", "chain", "sampled")), rounds


def test_the_reservation_holds_the_lookup_rows(target):
    scheduler = SpeculativeEngine(target, None, config=lookup_off(plain_lookup=LOOKUP)).scheduler
    greedy, sampled = SamplingParams(max_new_tokens=10), SamplingParams(max_new_tokens=10, temperature=1.0)
    assert scheduler.check(20, greedy) == 20 + 10 + 1 + LOOKUP
    assert scheduler.check(20, greedy, NO_TREE) == 20 + 10 + 1  # the client's `none`: plain rounds only
    assert scheduler.check(20, sampled) == 20 + 10 + 1
    plain = SpeculativeEngine(target, None, config=lookup_off()).scheduler
    assert plain.check(20, greedy) == 20 + 10 + 1


def test_the_drafter_catches_up_on_tokens_a_lookup_round_accepted():
    drafter = tiny_mamba(torch.float64)
    context = random_prompt(30, seed=2)
    session = DrafterSession(drafter, context, vocab_size=128)
    draft = session.draft(TreeConfig((1, 1)), SamplingParams(), torch.Generator())
    assert draft.tree.depth == 2
    drafted = Verdict((), (), 17)  # the drafted round: nothing accepted, bonus 17
    looked_up = Verdict((1, 2), (40, 41), 42)  # then a lookup round that accepted two tokens
    session.commit_all([drafted, looked_up])
    fresh = DrafterSession(drafter, context + [17, 40, 41, 42], vocab_size=128)
    assert session.history == fresh.history
    torch.testing.assert_close(session.root_logits, fresh.root_logits, atol=1e-9, rtol=0)


def test_a_lookup_draft_is_a_chain_of_the_proposal():
    draft = lookup_draft([5, 6, 7])
    assert draft.config == NO_TREE and draft.arm == NO_TREE  # nothing to learn of the drafter
    assert draft.tree.depth == 3 and draft.tree.num_nodes == 3
    assert draft.tokens.tolist() == [5, 6, 7] and draft.label == LOOKUP_ONLY


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="plain_lookup"):
        SpeculationConfig(plain_lookup=-1)
    with pytest.raises(ValueError, match="plain_lookup"):
        SpeculationConfig(plain_lookup=33)


class TeachingRecorder(ScriptedPolicy):
    """Drafts a chain every round and keeps what each round taught: (context length, accepted, what-if)."""

    def record(self, tree, context_len, accepted_tokens, round_time_s, sampled=False, what_if=None, *, load=1):
        self.records.append((context_len, accepted_tokens, dict(what_if or {})))


def test_drafted_rounds_teach_the_undrafted_arm_what_its_proposal_would_have_accepted(target):
    """A greedy round's undrafted arm verifies a lookup proposal, so a drafted round teaches it (as a what-if) the
    proposal's tokens the target's new tokens confirm: recomputed here from the target's own greedy text."""
    max_new = 40
    taught = 0
    for seed in range(3):
        prompt = repetitive(20, seed)
        policy = TeachingRecorder([(1, 1)])
        engine = SpeculativeEngine(target, tiny_mamba(torch.float32), policy, config=lookup_off(plain_lookup=LOOKUP))
        engine.scheduler.add("a", prompt, SamplingParams(max_new_tokens=max_new, ignore_eos=True))
        engine.scheduler.add("own", prompt, SamplingParams(max_new_tokens=max_new, ignore_eos=True), TreeConfig((1,)))
        while engine.scheduler.has_work:
            engine.scheduler.step()
        text = alone(target, prompt, max_new)
        records = policy.records
        assert records
        own_rounds = 0
        for context_len, accepted, what in records:
            done = context_len - len(prompt)
            index = LookupIndex(prompt + text[:done], min_ngram=PLAIN_LOOKUP_MIN_NGRAM)
            proposal = index.propose(min(LOOKUP, max_new - done - 1))
            confirmed = text[done:done + accepted + 1]
            want = next((i for i, (p, t) in enumerate(zip(proposal, confirmed)) if p != t),
                        min(len(proposal), len(confirmed)))  # fmt: skip
            if NO_TREE not in what:  # the client's own tree: its rounds never teach the undrafted arm
                own_rounds += 1
                continue
            assert what[NO_TREE] == want, (context_len, proposal, confirmed)
            taught += want
        assert own_rounds > 0
    assert taught > 0  # the repeated stretches were confirmed somewhere
