"""RouterCore and DrafterWorker without Ray: in-process sides, exact outputs against the engine, recovery, release."""

from __future__ import annotations

import asyncio
import itertools

import pytest
import torch
from pydantic import ValidationError

from ray_specdec.acceptance import Verdict
from ray_specdec.bandit import Bandit
from ray_specdec.config import SamplingParams, TreeConfig
from ray_specdec.engine import NO_TREE, SpeculativeEngine, TargetSession, empty_draft, judge, make_generators
from ray_specdec.serving.api import CompletionRequest
from ray_specdec.serving.drafter_worker import DrafterWorker
from ray_specdec.serving.router import LoadBackoff, PromptTooLong, RouterCore
from tests.deployments.conftest import PROMPTS, greedy_margin


class LocalTarget:
    """The target side in process: TargetSession + judge, one remote-style call per round."""

    def __init__(self, target, fail_at_verify: int | None = None):
        self.target = target
        self.sessions: dict[str, tuple[TargetSession, object]] = {}
        self.verifies = 0
        self.fail_at_verify = fail_at_verify

    async def start(self, request_id, prompt_ids, seed):
        self.sessions[request_id] = (TargetSession(self.target, prompt_ids), make_generators(seed)[1])

    async def verify(self, request_id, draft, params):
        self.verifies += 1
        if self.verifies == self.fail_at_verify:
            raise RuntimeError("target rank died")
        session, generator = self.sessions[request_id]
        verdict = judge(session.forward(draft), draft, params, generator)
        session.commit(verdict)
        await asyncio.sleep(0)  # let other requests interleave, as remote calls do
        return verdict

    async def release(self, request_id):
        self.sessions.pop(request_id, None)


class LocalDrafters:
    """Drafter "replicas" in process; `route(call_number) -> replica index` plays the Serve router."""

    def __init__(self, drafter, vocab_size, replicas=1, route=None, fail_every: int | None = None):
        self.workers = [DrafterWorker(drafter, vocab_size) for _ in range(replicas)]
        self.route = route or (lambda n: 0)
        self.calls = itertools.count()
        self.fail_every = fail_every
        self.failures = 0

    async def draft(self, request_id, commits, config, params, seed, token_ids=None):
        n = next(self.calls)
        if self.fail_every and n % self.fail_every == self.fail_every - 1:
            self.failures += 1
            raise ConnectionError("drafter replica died")
        return self.workers[self.route(n)].draft(request_id, commits, config, params, seed, token_ids)

    async def release(self, request_id):
        for w in self.workers:
            w.release(request_id)

    @property
    def sessions(self) -> int:
        return sum(w.num_sessions for w in self.workers)


def make_core(engine, drafters, target=None, policy=None, **kwargs) -> tuple[RouterCore, LocalTarget]:
    target = target or LocalTarget(engine.target)
    core = RouterCore(target, drafters, engine.tokenizer, engine.target.eos_token_ids, engine.target.max_context,
                      policy or Bandit(seed=0), **kwargs)  # fmt: skip
    return core, target


def run(coro):
    return asyncio.run(coro)


@pytest.fixture(scope="module")
def reference(engine) -> dict[str, list[int]]:
    """Target-alone greedy ids per prompt (40 tokens), on paths without float32 near-ties."""
    alone = SpeculativeEngine(engine.target, None)
    out = {}
    for prompt in PROMPTS:
        ids = engine.encode(prompt)
        out[prompt] = alone.generate(ids, SamplingParams(max_new_tokens=40)).token_ids
        assert greedy_margin(engine.target, ids, out[prompt]) > 1e-3
    return out


@pytest.mark.parametrize("tree, lookup", [(None, 0), (None, 8), ("1,1,1,1", 0), ("3,2,2,1,1", 0), ("1,1+L6", 0),
                                          ("2,1", 8), ("none", 8)])
def test_greedy_equals_target_alone(engine, reference, tree, lookup):
    drafters = LocalDrafters(engine.drafter, engine.target.vocab_size)
    core, target = make_core(engine, drafters, lookup=lookup)
    config = None if tree is None else TreeConfig.parse(tree)

    async def go():
        outs = await asyncio.gather(
            *(core.generate(engine.encode(p), SamplingParams(max_new_tokens=40), config) for p in PROMPTS)
        )
        await core.drain()
        return outs

    for prompt, gen in zip(PROMPTS, run(go())):
        assert gen.token_ids == reference[prompt]
        assert gen.finish_reason == "length"
        assert gen.text == engine.tokenizer.decode(reference[prompt])
        if tree not in (None, "none"):
            assert gen.stats.mean_accepted_length > 2.0  # the pair agrees often: deep paths were accepted
    assert target.sessions == {} and drafters.sessions == 0


@pytest.mark.parametrize("draft_sampling", ["iid", "without_replacement"])
def test_seeded_sampling_equals_engine(engine, draft_sampling):
    """The split into remote sides consumes the same random streams as the in-process engine."""
    params = SamplingParams(temperature=0.9, top_k=50, seed=123, max_new_tokens=30, draft_sampling=draft_sampling)
    tree = TreeConfig((3, 2, 1))
    core, _ = make_core(engine, LocalDrafters(engine.drafter, engine.target.vocab_size))
    ids = engine.encode(PROMPTS[1])
    got = run(core.generate(ids, params, tree))
    assert got.token_ids == engine.generate(ids, params, tree).token_ids
    assert got.token_ids != engine.generate(ids, SamplingParams(**{**params.__dict__, "seed": 124}), tree).token_ids


@pytest.mark.parametrize(
    "replicas, route, fail_every",
    [(2, lambda n: n % 2, None), (3, lambda n: (n * 7) % 3, None), (1, None, 3)],
    ids=["alternating", "scattered", "failing"],
)
def test_lost_drafter_state_changes_nothing(engine, reference, replicas, route, fail_every):
    """Calls that land on replicas without the state (None -> rebuild) or fail outright give the same output."""
    drafters = LocalDrafters(engine.drafter, engine.target.vocab_size, replicas, route, fail_every)
    core, target = make_core(engine, drafters)

    async def go():
        out = await core.generate(engine.encode(PROMPTS[0]), SamplingParams(max_new_tokens=40), TreeConfig((2, 1, 1)))
        await core.drain()
        return out

    gen = run(go())
    assert gen.token_ids == reference[PROMPTS[0]]
    rebuilds = sum(w.rebuilds for w in drafters.workers)
    assert rebuilds > 3 and core.draft_failures == drafters.failures
    assert target.sessions == {}


def test_sticky_drafter_builds_once(engine, reference):
    drafters = LocalDrafters(engine.drafter, engine.target.vocab_size)
    core, _ = make_core(engine, drafters)
    run(core.generate(engine.encode(PROMPTS[2]), SamplingParams(max_new_tokens=40), TreeConfig((2, 1, 1))))
    assert drafters.workers[0].rebuilds == 1


def test_stop_string_equals_engine(engine, reference):
    text = engine.tokenizer.decode(reference[PROMPTS[3]])
    stop = text.split()[5]
    params = SamplingParams(max_new_tokens=40, stop=(stop,))
    core, _ = make_core(engine, LocalDrafters(engine.drafter, engine.target.vocab_size))
    ids = engine.encode(PROMPTS[3])
    got, want = run(core.generate(ids, params)), engine.generate(ids, params)
    assert (got.token_ids, got.text, got.finish_reason) == (want.token_ids, want.text, "stop")
    assert stop not in got.text and len(got.token_ids) < 40


def test_release_on_cancel_and_on_error(engine):
    drafters = LocalDrafters(engine.drafter, engine.target.vocab_size)
    core, target = make_core(engine, drafters)
    ids = engine.encode(PROMPTS[0])

    async def cancel_after_two_chunks():
        stream = core.stream(ids, SamplingParams(max_new_tokens=40), TreeConfig((2, 1)))
        await anext(stream)
        await anext(stream)
        assert target.sessions and drafters.sessions == 1
        await stream.aclose()  # what a client disconnect does to the response generator
        await core.drain()

    run(cancel_after_two_chunks())
    assert target.sessions == {} and drafters.sessions == 0 and core.in_flight == 0

    failing, _ = make_core(engine, drafters, LocalTarget(engine.target, fail_at_verify=3))

    async def fail():
        with pytest.raises(RuntimeError, match="target rank died"):
            await failing.generate(ids, SamplingParams(max_new_tokens=40), TreeConfig((2, 1)))
        await failing.drain()

    run(fail())
    assert failing.target.sessions == {} and drafters.sessions == 0 and failing.in_flight == 0


def test_slow_drafter_times_out_into_plain_rounds(engine, reference):
    class Slow(LocalDrafters):
        async def draft(self, *args, **kwargs):
            if next(self.calls) % 4 == 1:
                await asyncio.sleep(5)
            return self.workers[0].draft(*args, **kwargs)

    core, _ = make_core(engine, Slow(engine.drafter, engine.target.vocab_size), draft_timeout_s=0.2)
    gen = run(core.generate(engine.encode(PROMPTS[1]), SamplingParams(max_new_tokens=40), TreeConfig((2, 1, 1))))
    assert gen.token_ids == reference[PROMPTS[1]]
    assert core.draft_failures > 0 and gen.stats.trees["none"] >= core.draft_failures


@pytest.mark.parametrize(
    "tree, in_flight, expected",
    [
        ((3, 3, 2, 1), 4, (3, 3, 2, 1)),  # at or below full_below: as picked
        ((3, 3, 2, 1), 8, (3, 3, 2)),  # budget int(48 nodes * 24/28) = 41 -> 30 nodes
        ((3, 3, 2, 1), 18, (3, 3)),  # budget int(48 * 14/28) = 24 -> 12 nodes
        ((1, 1, 1, 1), 25, (1,)),  # budget max(1, int(4 * 7/28)) = 1
        ((2, 2, 1, 1), 32, ()),  # from off_at on: no drafting
    ],
)
def test_load_backoff_limit(tree, in_flight, expected):
    assert LoadBackoff(full_below=4, off_at=32).limit(TreeConfig(tree), in_flight) == TreeConfig(expected)


def test_load_backoff_node_budget_for_a_policy_over_arms():
    backoff, arms = LoadBackoff(full_below=4, off_at=32), [TreeConfig((1, 1, 1, 1)), TreeConfig((3, 3, 2, 1))]
    assert backoff.node_budget(arms, 4) is None  # as picked
    assert backoff.node_budget(arms, 8) == 41  # int(48 nodes * 24/28)
    assert backoff.node_budget(arms, 31) == 1  # max(1, int(48 * 1/28))
    assert backoff.node_budget(arms, 32) == 0  # no drafting


def test_backoff_under_load_keeps_outputs(engine, reference):
    drafters = LocalDrafters(engine.drafter, engine.target.vocab_size)
    core, _ = make_core(engine, drafters, backoff=LoadBackoff(full_below=1, off_at=4))
    picks, select = [], core.policy.select

    def spy(context_len, sampled=False, max_nodes=None):
        arm = select(context_len, sampled, max_nodes)
        picks.append((max_nodes, arm))
        return arm

    core.policy.select = spy

    async def go():
        outs = await asyncio.gather(
            *(core.generate(engine.encode(p), SamplingParams(max_new_tokens=40)) for p in PROMPTS * 2)
        )
        await core.drain()
        return outs

    outs = run(go())
    assert [g.token_ids for g in outs] == [reference[p] for p in PROMPTS * 2]
    rounds = sum(g.stats.rounds for g in outs)
    undrafted = sum(g.stats.trees.get("none", 0) for g in outs)
    assert 0 < undrafted < rounds  # 8 in flight: no drafting; as requests finish, drafting resumes
    assert drafters.sessions == 0
    # under load the bandit picks among its arms that fit the node budget, never a cut shape it cannot learn from
    assert any(budget is not None for budget, _ in picks)
    assert all(budget is None or arm.num_nodes <= budget for budget, arm in picks)
    # rounds of no arm remain only where a generation's end shortened the tree; they are counted (GET /v1/stats)
    off_arm = sum(n for g in outs for name, n in g.stats.trees.items()
                  if TreeConfig.parse(name) not in core.policy.arms)
    assert core.rounds_unrecorded == off_arm


def test_prompt_too_long(engine):
    core, _ = make_core(engine, None)
    with pytest.raises(PromptTooLong, match="context length of 256"):
        run(core.generate([5] * 200, SamplingParams(max_new_tokens=57)))


class Alternating:
    """A tree policy that drafts `tree` on every other round and nothing in between (tests the catch-up commits)."""

    def __init__(self, tree: TreeConfig, period: int = 2):
        self.tree, self.period, self.calls, self.recorded = tree, period, 0, []

    def select(self, context_len, sampled=False):
        self.calls += 1
        return self.tree if self.calls % self.period == 1 else NO_TREE

    def record(self, tree, context_len, accepted_tokens, round_time_s, sampled=False, what_if=None):
        self.recorded.append(str(tree))


@pytest.mark.parametrize("period, tree", [(2, "2,2,1,1"), (3, "2,2,1,1"), (2, "1,1+L6")])
def test_rounds_without_a_draft_catch_up_without_rebuilds(engine, reference, period, tree):
    drafters = LocalDrafters(engine.drafter, engine.target.vocab_size)
    policy = Alternating(TreeConfig.parse(tree), period)
    core, _ = make_core(engine, drafters, policy=policy)
    prompt = PROMPTS[1]
    gen = run(core.generate(engine.encode(prompt), SamplingParams(max_new_tokens=40)))
    assert gen.token_ids == reference[prompt]
    assert drafters.workers[0].rebuilds == 1  # built once by the first call; no-draft rounds only queue verdicts
    assert "none" in policy.recorded and tree in policy.recorded  # both kinds of rounds teach the policy


@pytest.mark.parametrize("tree", ["2,1", "1+L6"])
def test_drafter_worker_catch_up_equals_rebuild(engine, tree):
    """A drafted verdict followed by verdicts of rounds without a draft leaves the state a rebuild would make."""
    target, params, tree = engine.target, SamplingParams(), TreeConfig.parse(tree)
    ids = engine.encode(PROMPTS[2])
    session = TargetSession(target, ids)
    worker = DrafterWorker(engine.drafter, target.vocab_size)
    draft = worker.draft("k", [], tree, params, None, ids)
    commits, tokens = [], list(ids)
    for d in (draft, empty_draft(), empty_draft()):
        verdict = judge(session.forward(d), d, params, None)
        session.commit(verdict)
        commits.append(verdict)
        tokens += verdict.new_tokens
    caught_up = worker.draft("k", commits, tree, params, None)
    rebuilt = DrafterWorker(engine.drafter, target.vocab_size).draft("r", [], tree, params, None, tokens)
    assert torch.equal(caught_up.tokens, rebuilt.tokens)
    assert caught_up.paths == rebuilt.paths
    with pytest.raises(ValueError, match="only the first commit"):
        worker.draft("k", [commits[0], Verdict((1,), (7,), 8)], tree, params, None)


def test_drafter_worker_eviction(engine):
    now = [0.0]
    worker = DrafterWorker(engine.drafter, engine.target.vocab_size, max_sessions=2, idle_timeout_s=10,
                           clock=lambda: now[0])  # fmt: skip
    params, tree, ids = SamplingParams(), TreeConfig((2, 1)), engine.encode(PROMPTS[0])
    for key in "abc":
        assert worker.draft(key, [], tree, params, None, ids) is not None
        now[0] += 1
    assert worker.num_sessions == 2 and worker.evictions == 1  # "a", least recently used, went first
    assert worker.draft("a", [], tree, params, None) is None  # lacks it: the router resends token ids
    now[0] += 20
    assert worker.draft("c", [], tree, params, None) is None and worker.num_sessions == 0  # idle: dropped
    draft = worker.draft("d", [], tree, params, None, ids)
    assert worker.draft("d", [], tree, params, None) is None  # a commit is due: out of step -> rebuild
    assert draft.tokens.shape == (4,) and worker.num_sessions == 0


@pytest.mark.parametrize(
    "body, field",
    [
        ({"prompt": "w1", "n": 2}, "n"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": "w1", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "w1", "temperature": -1}, "temperature"),
        ({"prompt": "w1", "top_p": 0}, "top_p"),
        ({"prompt": "w1", "top_k": -2}, "top_k"),
        ({"prompt": "w1", "stop": ["a", ""]}, "stop"),
        ({"prompt": "w1", "tree": "3,x"}, "tree"),
        ({"prompt": "w1", "tree": "8,8,8"}, "tree"),
        ({"prompt": "w1", "stream": "maybe"}, "stream"),
    ],
)
def test_request_validation(body, field):
    with pytest.raises(ValidationError) as info:
        CompletionRequest.model_validate(body)
    assert info.value.errors()[0]["loc"][0] == field


def test_request_to_params():
    req = CompletionRequest(prompt="w1 w2", max_tokens=7, temperature=0.5, top_p=0.9, top_k=3, seed=5, stop="w9",
                            tree="(3, 2)")  # fmt: skip
    assert req.sampling_params() == SamplingParams(0.5, 3, 0.9, 5, 7, ("w9",))
    assert req.tree_config() == TreeConfig((3, 2)) and req.tree == "3,2"
    assert CompletionRequest(prompt="w1", tree="none").tree_config() == NO_TREE
