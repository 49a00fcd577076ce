"""End to end on Mamba, Mamba2, Jamba and Bamba targets (models/target/ssm.py): greedy output is HF generate's for every
tree shape, batch composition and prefill chunking; the prefix cache, a target reset and the KV budget's state charge
keep it so; and sampled output has the target's distribution."""

from __future__ import annotations

import pytest
import torch

from ray_specdec.config import SamplingParams, TreeConfig
from ray_specdec.engine.llm import SpeculativeEngine
from ray_specdec.engine.request import RequestTooLarge
from ray_specdec.engine.scheduler import Scheduler
from ray_specdec.engine.scheduler_config import SchedulerConfig
from ray_specdec.engine.target_backend import LocalTarget
from ray_specdec.models.target.ssm import SSMTargetModel
from tests.helpers.configs import NO_LOOKUP, lookup_off
from tests.helpers.drafters import TargetEchoDrafter
from tests.helpers.inputs import random_prompt
from tests.helpers.models import SSM_TARGETS, tiny_mamba
from tests.helpers.reference import (ENUMERATED_VOCAB, assert_emitted_distribution, enumerate_target, greedy_margin,
                                     hf_greedy, seeded_generations)

TREES = [(), (1, 1, 1), (1,) * 6, (4,), (3, 2, 1), (2, 2, 2, 1)]
N = 17  # odd, so that rounds end mid-tree


@pytest.fixture(scope="module", params=sorted(SSM_TARGETS))
def target(request) -> SSMTargetModel:
    return SSMTargetModel(SSM_TARGETS[request.param]())


@pytest.fixture(scope="module")
def cases(target) -> list[tuple[list[int], list[int]]]:
    """(prompt, HF generate's greedy tokens) for prompts of several lengths, none whose greedy path sits on a near
    tie (HF's float64 Mamba rounds parts of its step to float32: a tie closer than that may flip either way)."""
    out = []
    for length in (1, 6, 23, 70):
        prompt = random_prompt(length, seed=length)
        expected = hf_greedy(target, prompt, N)
        assert greedy_margin(target.model, prompt, expected) > 1e-4, "pick another seed: a near tie"
        out.append((prompt, expected))
    return out


@pytest.mark.parametrize("branching", TREES, ids=lambda b: ",".join(map(str, b)) or "none")
def test_greedy_is_hf_generate_for_every_tree(target, cases, branching):
    drafters = [tiny_mamba(), TargetEchoDrafter(target.model, noise=1.0)] if branching else [None]
    for drafter in drafters:
        engine = SpeculativeEngine(target, drafter, TreeConfig(branching), config=lookup_off())
        for prompt, expected in cases:
            if isinstance(drafter, TargetEchoDrafter) and len(prompt) > 30:
                continue  # the echo drafter re-runs the whole context every step
            result = engine.generate(prompt, SamplingParams(max_new_tokens=N))
            assert result.token_ids == expected, (branching, type(drafter).__name__, len(prompt))


def test_deep_acceptance_commits_the_accepted_nodes_state(target, cases):
    """A drafter that agrees with the target: rounds accept whole paths, so commits of deep nodes (and of leaves)
    are exercised, and what follows them is still HF's."""
    prompt, expected = cases[1]
    engine = SpeculativeEngine(target, TargetEchoDrafter(target.model, noise=0.0), TreeConfig((2, 1, 1, 1)),
                               config=lookup_off())  # fmt: skip
    result = engine.generate(prompt, SamplingParams(max_new_tokens=N))
    assert result.token_ids == expected
    assert result.stats.mean_accepted_length > 3.0


@pytest.mark.parametrize("chunk, step_tokens", [(4, 12), (16, 1024), (512, 1024)])
def test_batches_of_requests_and_prefill_chunks_give_hf_generate(target, cases, chunk, step_tokens):
    """All prompts at once, each with its own tree (none among them), prompts cut into chunks that run beside other
    requests' rounds over several steps, lookup on: every request's tokens are HF's."""
    engine = SpeculativeEngine(target, tiny_mamba(), config=lookup_off(prefill_chunk=chunk, step_tokens=step_tokens,
                                                                       lookup=2, plain_lookup=3))  # fmt: skip
    prompts = [p for p, _ in cases] * 2
    trees = [TreeConfig(t) for t in ((3, 2, 1), (), (1, 1, 1), (2, 2, 2, 1))] * 2
    results = engine.generate_many(prompts, SamplingParams(max_new_tokens=N), trees)
    assert [r.token_ids for r in results] == [e for _, e in cases] * 2


def run(scheduler: Scheduler, prompts: list[list[int]], reset_at: int | None = None) -> tuple[dict, dict, int]:
    """Add the prompts one step apart and step until done, resetting the target after `reset_at` steps -> (tokens,
    cached tokens per request, tokens generated before the reset)."""
    params = SamplingParams(max_new_tokens=N)
    tokens, cached, before_reset, steps = {i: [] for i in range(len(prompts))}, {}, 0, 0
    while steps < len(prompts) or scheduler.has_work:
        if steps < len(prompts):
            scheduler.add(steps, prompts[steps], params)
        for out in scheduler.step():
            tokens[out.request_id] += out.chunk.token_ids
            cached[out.request_id] = out.chunk.stats.cached_tokens
        steps += 1
        if steps == reset_at:
            before_reset = sum(map(len, tokens.values()))
            scheduler.reset_target()
    return tokens, cached, before_reset


def test_prefix_cache_keeps_the_states_at_chunk_ends(target, cases):
    """A prompt that starts with another's first chunks continues from the cached states at those chunks' ends."""
    prompt, expected = cases[3]
    later = prompt[:40] + random_prompt(20, seed=99)
    scheduler = Scheduler(LocalTarget(target), tiny_mamba(), None, TreeConfig((2, 1)),
                          SchedulerConfig(prefill_chunk=16, step_tokens=64), speculation=NO_LOOKUP)  # fmt: skip
    tokens, cached, _ = run(scheduler, [prompt, later])
    assert tokens == {0: expected, 1: hf_greedy(target, later, N)}
    assert cached == {0: 0, 1: 32}  # its chunks [0, 16) and [16, 32): the third differs


def test_a_target_reset_prefills_every_request_again(target, cases):
    """A fault midway (the target loses every state): the running requests are prefilled again from their tokens
    and go on with HF's."""
    scheduler = Scheduler(LocalTarget(target), tiny_mamba(), None, TreeConfig((3, 1)),
                          SchedulerConfig(prefill_chunk=16, step_tokens=64), speculation=NO_LOOKUP)  # fmt: skip
    tokens, _, before_reset = run(scheduler, [p for p, _ in cases], reset_at=7)
    assert 0 < before_reset < len(cases) * N
    assert tokens == {i: expected for i, (_, expected) in enumerate(cases)}


def test_the_kv_budget_counts_each_requests_state(target):
    """A request is charged its state's rows beside its tokens: one that fits without them is refused, and a budget
    for one request's tokens and state runs requests one at a time, each with HF's tokens."""
    scheduler = Scheduler(LocalTarget(target), None, None, TreeConfig(()), SchedulerConfig(), speculation=NO_LOOKUP)
    assert scheduler.state_rows == target.state_rows > 0
    params = SamplingParams(max_new_tokens=8)
    rows = scheduler.check(10, params)
    assert rows == 10 + 8 + 1 + target.state_rows
    tight = SchedulerConfig(kv_budget_tokens=rows, kv_grow=False)
    scheduler = Scheduler(LocalTarget(target), None, None, TreeConfig(()), tight, speculation=NO_LOOKUP)
    with pytest.raises(RequestTooLarge, match="its state"):
        scheduler.check(11, params)
    prompts = [random_prompt(10, seed=s) for s in (1, 2)]
    for i, prompt in enumerate(prompts):
        scheduler.add(i, prompt, params)
    tokens = {0: [], 1: []}
    while scheduler.has_work:
        assert scheduler.num_running <= 1
        for out in scheduler.step():
            tokens[out.request_id] += out.chunk.token_ids
    assert tokens == {i: hf_greedy(target, p, 8) for i, p in enumerate(prompts)}


@pytest.mark.parametrize("kind, branching, draft_sampling", [("mamba", (2, 1), "iid"),
                                                             ("mamba2", (3, 2), "without_replacement"),
                                                             ("jamba", (3, 2), "iid"),
                                                             ("bamba", (2, 1), "without_replacement")])
def test_sampled_generation_has_the_targets_distribution(kind, branching, draft_sampling):
    target = SSMTargetModel(SSM_TARGETS[kind](vocab=ENUMERATED_VOCAB, seed=5))
    target.eos_token_ids = frozenset()
    drafter = tiny_mamba(vocab=ENUMERATED_VOCAB, seed=6)
    prompt, n_tokens, n_samples = [1, 4, 2], 2, 2000
    base = SamplingParams(temperature=0.9, max_new_tokens=n_tokens, draft_sampling=draft_sampling)
    exact = enumerate_target(target, prompt, base, n_tokens)
    engine = SpeculativeEngine(target, drafter, TreeConfig(branching), config=lookup_off())
    counts, multi = dict.fromkeys(exact, 0), 0
    for result in seeded_generations(engine, prompt, base, n_samples):
        counts[tuple(result.token_ids)] += 1
        multi += result.stats.rounds < n_tokens
    assert multi > 0, "no round accepted a draft token: drafting was not tested"
    assert_emitted_distribution(counts, exact, n_samples, ENUMERATED_VOCAB)


@pytest.mark.parametrize("kind", ["mamba", "mamba2"])
def test_float32_greedy_tokens_do_not_depend_on_the_batch_or_the_tree(kind):
    """Batch invariance end to end (float32 on CPU, the native GEMM): a greedy request gets the same tokens alone and
    undrafted, drafting trees, and beside other requests with other trees and prompt chunks (no reference model
    involved: the bits, not HF's float64 path; test_ssm.py checks the logits themselves bit for bit)."""
    from ray_specdec.models.native import library

    if library.load() is None:
        pytest.skip(library.why_unavailable())
    build = {"mamba": lambda: SSM_TARGETS["mamba"](torch.float32, hidden=256, state=16),
             "mamba2": lambda: SSM_TARGETS["mamba2"](torch.float32, hidden=256, heads=16, head_dim=32, state=32)}[kind]
    target = SSMTargetModel(build())
    assert target.batch_invariant
    prompt, params = random_prompt(20, seed=7), SamplingParams(max_new_tokens=N, ignore_eos=True)
    alone = SpeculativeEngine(target, None, TreeConfig(()), config=lookup_off()).generate(prompt, params).token_ids
    engine = SpeculativeEngine(target, tiny_mamba(torch.float32), config=lookup_off(prefill_chunk=8))
    for tree in ((1, 1, 1), (3, 2, 1)):
        assert engine.generate(prompt, params, TreeConfig(tree)).token_ids == alone
    others = [random_prompt(n, seed=n) for n in (5, 33, 12)]
    trees = [TreeConfig(t) for t in ((2, 2, 1), (), (4,), (1,) * 5)]
    results = engine.generate_many([prompt] + others, params, trees)
    assert results[0].token_ids == alone
