"""The speculation guard inside the scheduler: it runs a load undrafted where drafted steps measure slower (on a
made-up clock), learns nothing from steps it does not steer, charges drafting its drafter prefills at their
steady-state share, and keeps steps with a sampled request it steers apart from greedy ones; every greedy request's
tokens stay target-alone greedy decoding's."""

from __future__ import annotations

import pytest
import torch

from ray_specdec.config import NO_TREE, SamplingParams, TreeConfig
from ray_specdec.engine.llm import SpeculativeEngine
from ray_specdec.engine.scheduler import Scheduler
from ray_specdec.engine.scheduler_config import SchedulerConfig
from ray_specdec.engine.target_backend import LocalTarget
from ray_specdec.speculation.start_rule import EXPLORE
from tests.helpers.bigram import agreeing_pair
from tests.helpers.inputs import random_prompt
from tests.helpers.policies import LoadRecorder



class AlwaysDrafts(LoadRecorder):
    """A policy that picks (2, 1) every round, with no tree among its arms (the guard may run rounds undrafted)."""

    arms = (TreeConfig((2, 1)), NO_TREE)

    def record(self, tree, context_len, accepted_tokens, round_time_s, sampled=False, what_if=None, *, load=1):
        self.taught.append(tree)


class SlowDrafts:
    """The scheduler's clock: 1 ms per reading, and 3 ms more per request that drafts in a step."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self) -> float:
        self.now += 1e-3
        return self.now


def slow_drafts(monkeypatch, scheduler: Scheduler, clock: SlowDrafts, seconds: float, per_request: bool) -> None:
    """Each step's drafts advance the clock `seconds` more: per request that drafts, or once if any does."""
    draft = scheduler._draft

    def slow_draft(decoding):
        out = draft(decoding)
        drafting = [r.draft.tree.depth > 0 for r in decoding]
        clock.now += seconds * (sum(drafting) if per_request else any(drafting))
        return out

    monkeypatch.setattr(scheduler, "_draft", slow_draft)


@pytest.mark.parametrize("guard", [True, False])
def test_the_guard_runs_a_load_undrafted_where_drafted_steps_measure_slower(long_context_pair, monkeypatch, guard):
    """Goodput off (it would learn the same clock and shrink trees itself): the policy drafts every round; the guard
    sees its steps take ~28 ms against ~7 ms undrafted (where only the request that asked for a tree drafts, as it keeps
    doing; one the start rule explores with does not) and runs the load's rounds undrafted but for its exploration runs.
    Every request's tokens are target-alone greedy decoding's."""
    import ray_specdec.engine.scheduler as scheduler_module

    target, drafter = long_context_pair
    clock = SlowDrafts()
    monkeypatch.setattr(scheduler_module, "time", clock)
    policy = AlwaysDrafts()
    scheduler = Scheduler(LocalTarget(target), drafter, None, policy, SchedulerConfig(goodput=False, guard=guard))
    slow_drafts(monkeypatch, scheduler, clock, 3e-3, per_request=True)
    params = SamplingParams(max_new_tokens=300, ignore_eos=True)
    requests = [(f"g{i}", random_prompt(10 + i, seed=80 + i), params, TreeConfig((1,)) if i == 0 else None)
                for i in range(8)]  # fmt: skip
    for request in requests:
        scheduler.add(*request)
    tokens, steps = {r[0]: [] for r in requests}, []
    while scheduler.has_work:
        taught = len(policy.taught)
        outputs = scheduler.step()
        for out in outputs:
            tokens[out.request_id] += out.chunk.token_ids
        trees = policy.taught[taught:]
        steps.append((len(outputs), scheduler.guarded, trees))
        if len(steps) == 1:  # one request the start rule explores with: in a step run undrafted it is undrafted too
            scheduler.running["g1"].start = EXPLORE
    late = [(guarded, trees) for _, guarded, trees in steps[40:90]]  # no request near its end (< 3 tokens a round)
    assert len(late) == 50
    if guard:
        assert scheduler.guard.levels[scheduler.guard.level(8)].undrafted
        assert [lv.undrafted for lv in scheduler.guard.levels] == [False, False, True, False]
        assert sum(guarded for guarded, _ in late) / len(late) > 0.8  # all but the exploration runs
    else:
        assert scheduler.guard is None and not any(guarded for guarded, _ in late)
    for guarded, trees in late:  # the policy's tree only where not guarded; the asked-for tree in every round
        policy_trees = [tree for tree in trees if tree != TreeConfig((1,))]
        assert len(trees) == 8 and len(policy_trees) == 7
        assert set(policy_trees) == {NO_TREE if guarded else TreeConfig((2, 1))}
    plain = SpeculativeEngine(target, None)
    for request_id, prompt, params, _ in requests:
        assert tokens[request_id] == plain.generate(prompt, params).token_ids, request_id


def test_exploration_is_not_charged_the_drafter_sessions_its_switch_builds(monkeypatch):
    """At load 1, drafted steps cost 1.5x a plain one for several tokens, and a drafter session costs ten plain
    steps, paid once per request: steady drafting wins. The level starts undrafted (a verdict noise could give). Its
    exploration run's first step builds the session of the request in flight; charged to the run's three measured
    steps (as the guard once was), that one prefill weighed as if every three rounds paid one, and the level stayed
    undrafted (in process at concurrency 1: most of a run). Charged at its share per decoded token, the run measures
    drafting as it is and the level drafts again. The guard is handed step times without the prefills that ran in
    them, and those prefills apart (a switch's cost). Every token is target-alone greedy decoding's."""
    import ray_specdec.engine.scheduler as scheduler_module

    target, drafter = agreeing_pair(torch.float32, 512)
    clock, session_s = SlowDrafts(), 0.03
    monkeypatch.setattr(scheduler_module, "time", clock)

    class CostlySessions(scheduler_module.LazyDrafter):
        def _start(self, tokens):  # the session's prefill
            super()._start(tokens)
            clock.now += session_s
            return session_s

    monkeypatch.setattr(scheduler_module, "LazyDrafter", CostlySessions)
    scheduler = Scheduler(LocalTarget(target), drafter, None, AlwaysDrafts(), SchedulerConfig(goodput=False))
    slow_drafts(monkeypatch, scheduler, clock, 1.5e-3, per_request=False)
    guard = scheduler.guard
    seen = []
    observe = guard.observe
    charge = scheduler.start_rule.prefill_s_per_decoded_token
    monkeypatch.setattr(guard, "observe", lambda *a, **k: (seen.append((guard._mode, a[1], a[2], k, charge())),
                                                            observe(*a, **k)))  # fmt: skip
    level = guard.levels[guard.level(1)]
    level.undrafted = level.settled = True
    params = SamplingParams(max_new_tokens=120, ignore_eos=True)
    plain = SpeculativeEngine(target, None)
    for i in range(2):
        prompt = random_prompt(20 + i, seed=120 + i, vocab=target.vocab_size)
        scheduler.add(f"q{i}", prompt, params)
        tokens = []
        while scheduler.has_work:
            tokens += [t for out in scheduler.step() for t in out.chunk.token_ids]
        assert tokens == plain.generate(prompt, params).token_ids
    assert not level.undrafted and guard.speedup(guard.level(1)) > 1.3
    assert any(not mode for mode, *_ in seen) and all(seconds < session_s for _, _, seconds, _, _ in seen)
    assert 0 < charge() < session_s / 100
    assert all(k["drafting_s"] == pytest.approx(tokens * rate) for _, tokens, _, k, rate in seen)
    assert sum(k["drafter_prefill_s"] for *_, k, _ in seen) == pytest.approx(2 * session_s)  # a switch's cost, apart


def test_the_guard_learns_nothing_from_steps_its_mode_does_not_steer(long_context_pair, monkeypatch):
    """Requests with a tree of their client's (here "none", as a benchmark's `tree none` cells send) run the same
    rounds in both of the guard's modes: their steps are not measured, so they cannot move its verdicts (a served
    run flipped load 1 to undrafted during such a cell, and the service's next cell at concurrency 1 ran undrafted).
    A request the policy steers is measured again."""
    import ray_specdec.engine.scheduler as scheduler_module

    target, drafter = long_context_pair
    clock = SlowDrafts()
    monkeypatch.setattr(scheduler_module, "time", clock)
    scheduler = Scheduler(LocalTarget(target), drafter, None, AlwaysDrafts(), SchedulerConfig(goodput=False))
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    for i in range(4):
        scheduler.add(f"fixed{i}", random_prompt(10 + i, seed=90 + i), params, NO_TREE)
    while scheduler.has_work:
        scheduler.step()
    guard = scheduler.guard
    assert all(not lv.plain and not lv.policy for lv in guard.levels) and guard.plain_steps == 0
    scheduler.add("steered", random_prompt(12, seed=99), params)
    while scheduler.has_work:
        scheduler.step()
    level = guard.levels[guard.level(1)]
    assert level.plain or level.policy


def test_a_step_with_a_sampled_request_it_steers_takes_the_sampled_verdicts(long_context_pair, monkeypatch):
    """Two greedy requests and a shorter sampled one the policy steers, and a sampled one on its client's tree (not
    steered: its rounds are the same in both modes): steps go to the sampled verdict set while the steered sampled
    request decodes, and to the greedy set once it has ended. Greedy tokens stay target-alone greedy decoding's."""
    target, drafter = long_context_pair
    scheduler = Scheduler(LocalTarget(target), drafter, None, AlwaysDrafts(), SchedulerConfig(goodput=False))
    guard, asked = scheduler.guard, []
    plain = guard.plain
    monkeypatch.setattr(guard, "plain", lambda load, sampled=False: (asked.append(sampled), plain(load, sampled))[1])
    greedy = SamplingParams(max_new_tokens=30, ignore_eos=True)
    sampled = SamplingParams(max_new_tokens=8, ignore_eos=True, temperature=1.0, seed=5)
    fixed = SamplingParams(max_new_tokens=30, ignore_eos=True, temperature=1.0, seed=6)
    scheduler.add("fixed", random_prompt(9, seed=70), fixed, TreeConfig((1,)))
    scheduler.add("sampled", random_prompt(11, seed=71), sampled)
    for i in range(2):
        scheduler.add(f"g{i}", random_prompt(10 + i, seed=72 + i), greedy)
    tokens, steps = {"g0": [], "g1": []}, []
    while scheduler.has_work:
        asked.clear()
        outputs = scheduler.step()
        for out in outputs:
            if out.request_id in tokens:
                tokens[out.request_id] += out.chunk.token_ids
        if asked:  # a step that decoded a steered request: the set asked for, whether the sampled one decoded in it
            steps.append((asked[0], any(out.request_id == "sampled" for out in outputs)))
    assert [in_sampled for in_sampled, _ in steps] == [decoded for _, decoded in steps]
    assert sum(in_sampled for in_sampled, _ in steps) >= 3 and not steps[-1][0]
    levels = guard.sampled_levels, guard.levels
    assert all(any(lv.plain or lv.policy for lv in side) for side in levels)
    plain_engine = SpeculativeEngine(target, None)
    for i in range(2):
        assert tokens[f"g{i}"] == plain_engine.generate(random_prompt(10 + i, seed=72 + i), greedy).token_ids
