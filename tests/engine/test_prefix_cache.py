"""Prefix caching (ray_specdec/engine/prefix_cache.py): the index alone, then the scheduler and the target with it on:
the same tokens and log-probabilities as without it, within the KV budget, nothing leaked on the target's side."""

from __future__ import annotations

import pytest
import torch

import ray_specdec.engine.prefix_cache as prefix_cache
from ray_specdec.config import SamplingParams, TreeConfig
from ray_specdec.engine.llm import SpeculativeEngine
from ray_specdec.engine.prefix_cache import ROOT, PrefixIndex
from ray_specdec.engine.scheduler import Scheduler
from ray_specdec.engine.scheduler_config import SchedulerConfig
from ray_specdec.engine.target_backend import LocalTarget, SegmentSpec, StepWork
from ray_specdec.models.target.model import TargetModel
from tests.helpers.configs import NO_LOOKUP, lookup_off
from tests.helpers.inputs import random_prompt
from tests.helpers.models import tiny_gpt_neox, tiny_mamba

CHUNK = 32


def cache_prompt(index: PrefixIndex, tokens: list[int]) -> list[int]:
    """Add every chunk of tokens' prefill (all but the last token) as a prefill would -> their block ids."""
    key, blocks = ROOT, []
    for start, end in index.spans(0, len(tokens) - 1):
        key, block = index.add(key, tokens[start:end])
        blocks.append(block)
    index.sent()
    return blocks


# ---- the index ------------------------------------------------------------------------------------------------------


def test_a_prompt_matches_the_longest_run_of_chunks_it_would_cut_itself():
    index = PrefixIndex(4)
    prompt = list(range(10, 20))  # prefills rows [0, 9): chunks [0, 4), [4, 8), [8, 9)
    assert list(index.spans(0, 9)) == [(0, 4), (4, 8), (8, 9)]
    blocks = cache_prompt(index, prompt)
    assert len(blocks) == 3 and index.rows == 9
    same = index.match(prompt, 9)
    assert (same.block_ids, same.rows) == (blocks, 9)
    longer = index.match(prompt + [7, 7], 11)  # cuts [8, 11): not the cached [8, 9)
    assert (longer.block_ids, longer.rows) == (blocks[:2], 8)
    diverging = index.match(prompt[:5] + [99] * 5, 9)  # differs inside the second chunk
    assert (diverging.block_ids, diverging.rows) == (blocks[:1], 4)
    assert index.match([99] + prompt[1:], 9).rows == 0
    assert index.hit_rows == 9 + 8 + 4
    # a continuation: after the first chunk (its key), the rest of the prompt
    rest = index.match(prompt, 9, start=4, parent=prefix_cache.chunk_key(ROOT, tuple(prompt[:4])))
    assert (rest.block_ids, rest.rows, rest.key) == (blocks[1:], 5, same.key)


def test_a_colliding_key_is_a_miss(monkeypatch):
    """Two prefixes with one key (a hash collision): the tokens and the parent are checked, never trusted."""
    monkeypatch.setattr(prefix_cache, "chunk_key", lambda parent, tokens: 1234)
    index = PrefixIndex(4)
    cache_prompt(index, [1, 2, 3, 4, 5])
    assert index.match([1, 2, 3, 4, 5], 4).rows == 4
    assert index.match([1, 2, 3, 9, 5], 4).rows == 0
    assert index.add(ROOT, [1, 2, 3, 9]) is None  # the key is taken: not cached, and not a wrong hit later


def test_eviction_takes_the_least_recently_used_chunk_and_every_chunk_after_it():
    index = PrefixIndex(4)
    a = cache_prompt(index, list(range(100, 113)))  # 3 chunks of 4 rows
    b = cache_prompt(index, list(range(200, 209)))  # 2 chunks of 4 rows
    index.match(list(range(100, 113)), 12)  # a is now the most recently used
    assert index.evict() == b  # b's first chunk and the chunk after it, which nothing reaches without it
    assert index.rows == 12 and index.match(list(range(200, 209)), 8).rows == 0
    # a chunk saved by the step being planned (and every chunk before it) stays until that step is sent
    leaf = next(k for k, e in index.entries.items() if e.block_id == a[-1])
    new = index.add(leaf, [1, 2, 3, 4])[1]
    assert index.evict() is None
    index.sent()
    assert index.evict() == [a[-1], new]  # least recently used: the match touched a's chunks last one first
    assert index.evict() == [a[1]] and index.evict() == [a[0]] and index.evict() is None
    assert index.rows == 0 and not index.entries


def test_a_chunk_is_kept_only_after_its_parent():
    index = PrefixIndex(4)
    assert index.add(prefix_cache.chunk_key(ROOT, (1, 2, 3, 4)), [5, 6, 7, 8]) is None
    key, _ = index.add(ROOT, [1, 2, 3, 4])
    assert index.match([1, 2, 3, 4, 5], 4).rows == 0  # saved by the step being planned: its rows come after it
    index.sent()
    assert index.match([1, 2, 3, 4, 5], 4).rows == 4
    assert index.add(ROOT, [1, 2, 3, 4]) is None  # cached already
    assert index.add(key, [5, 6, 7, 8]) is not None


# ---- the target keeps, copies and drops chunks ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny() -> tuple[TargetModel, object]:
    return TargetModel(tiny_gpt_neox(torch.float32, max_positions=1200)), tiny_mamba(torch.float32)


def test_the_target_copies_kept_rows_into_a_new_cache(tiny):
    target, _ = tiny
    backend = LocalTarget(target)
    prompt = torch.tensor(random_prompt(50, seed=3))
    work = StepWork(allocations=[("a", 80)], segments=[SegmentSpec("a", prompt[:32])], saves=[("a", 0, 32, 1)])
    backend.run(work)
    backend.run(StepWork(segments=[SegmentSpec("a", prompt[32:])], saves=[("a", 32, 50, 2)]))
    backend.run(StepWork(allocations=[("b", 60)], loads=[("b", (1, 2))], drops=[1]))
    a, b = backend.caches["a"].kv, backend.caches["b"].kv
    assert b.get_seq_length() == 50 and set(backend.chunks) == {2}
    for la, lb in zip(a.layers, b.layers):
        assert torch.equal(la.keys, lb.keys) and torch.equal(la.values, lb.values)
    with pytest.raises(KeyError, match="no cached chunk 1"):
        backend.run(StepWork(allocations=[("c", 60)], loads=[("c", (1,))]))
    backend.reset()
    assert not backend.chunks and not backend.caches


# ---- the scheduler with the cache: the same output --------------------------------------------------------------


def run(scheduler: Scheduler, requests) -> dict[str, tuple[list[int], list, int]]:
    """Add all, step until done -> request id: (token ids, log-probabilities, cached tokens); checks after every step
    that cached and reserved rows stay within the budget and that the target keeps exactly the index's chunks."""
    for request_id, prompt, params in requests:
        scheduler.add(request_id, prompt, params)
    out = {r[0]: ([], [], 0) for r in requests}
    while scheduler.has_work:
        for o in scheduler.step():
            tokens, logprobs, _ = out[o.request_id]
            out[o.request_id] = (tokens + o.chunk.token_ids, logprobs + (o.chunk.logprobs or []),
                                 o.chunk.stats.cached_tokens)  # fmt: skip
        index = scheduler.prefix
        if index is not None:
            assert scheduler.reserved + index.rows <= scheduler.config.kv_budget_tokens
            assert set(scheduler.target.chunks) == {e.block_id for e in index.entries.values()}
    return out


def shared_prefix_requests(seed: int) -> list[tuple[str, list[int], SamplingParams]]:
    """Prompts that share 0, 1, 2 or all chunks of a 100-token prompt (chunks of 32), greedy with logprobs."""
    p = random_prompt(100, seed=seed)
    prompts = {
        "same": p, "longer": p + random_prompt(10, seed=seed + 1), "two_chunks": p[:64] + random_prompt(20, seed=2),
        "short_tail": p[:70], "one_token": p[:1], "other": random_prompt(90, seed=seed + 3),
    }  # fmt: skip
    return [(name, prompt, SamplingParams(max_new_tokens=12, ignore_eos=True, logprobs=2))
            for name, prompt in prompts.items()]  # fmt: skip


# what each request finds cached after the 100-token prompt ran alone (prefill rows [0, 99) in chunks of 32)
EXPECTED_CACHED = {"same": 99, "longer": 96, "two_chunks": 64, "short_tail": 64, "one_token": 0, "other": 0}
# all together on a cold cache: "same" computes the shared chunks, the others wait a step for each and copy it
EXPECTED_COLD = EXPECTED_CACHED | {"same": 0}


@pytest.mark.parametrize("tree", [None, TreeConfig((2, 1)), TreeConfig.parse("none")], ids=["policy", "2,1", "none"])
def test_cached_prompts_give_the_tokens_and_logprobs_of_prefilled_ones(tiny, tree):
    target, drafter = tiny
    config = SchedulerConfig(prefill_chunk=CHUNK, step_tokens=96)
    requests = shared_prefix_requests(seed=11)
    cold = Scheduler(LocalTarget(target), drafter, None, TreeConfig((2, 1)), config)
    warm = Scheduler(LocalTarget(target), drafter, None, TreeConfig((2, 1)), config)
    off = Scheduler(LocalTarget(target), drafter, None, TreeConfig((2, 1)),
                    SchedulerConfig(prefill_chunk=CHUNK, step_tokens=96, prefix_cache=False))  # fmt: skip
    run(warm, requests[:1])  # the 100-token prompt alone: its chunks are kept
    with_cache = run(warm, [(f"{n}", p, params) for n, p, params in requests])
    without = run(off, requests)
    first_time = run(cold, requests)  # all together on a cold cache
    for name, _, params in requests:
        tokens, logprobs, cached = with_cache[name]
        assert tokens == without[name][0] == first_time[name][0], name
        assert logprobs == without[name][1], name  # the target's distributions, bit for bit
        assert len(tokens) == params.max_new_tokens
        assert cached == EXPECTED_CACHED[name] and first_time[name][2] == EXPECTED_COLD[name], name
        assert without[name][2] == 0
    plain = SpeculativeEngine(target, None, config=lookup_off(scheduler=config))
    assert with_cache["same"][0] == plain.generate(requests[0][1], requests[0][2]).token_ids


def test_a_prompt_admitted_several_times_at_once_is_prefilled_once(tiny):
    """Four requests of one 100-token prompt (n choices, retries) in one step: the first computes each chunk, the
    others copy it a step later; each gets the tokens it gets alone."""
    target, drafter = tiny
    config = SchedulerConfig(prefill_chunk=CHUNK, step_tokens=256)
    scheduler = Scheduler(LocalTarget(target), drafter, None, TreeConfig((2, 1)), config)
    prompt = random_prompt(100, seed=8)
    params = SamplingParams(max_new_tokens=10, ignore_eos=True)
    prefill_rows = []
    scheduler.target.run, run_target = (lambda work: prefill_rows.append(
        sum(s.tokens.numel() for s in work.segments if s.paths is None)) or run_target(work)), scheduler.target.run
    out = run(scheduler, [(f"c{i}", prompt, params) for i in range(4)])
    assert sorted(o[2] for o in out.values()) == [0, 99, 99, 99]
    assert sum(prefill_rows) == 99  # the prompt's prefill, once
    alone = SpeculativeEngine(target, None, config=lookup_off(prefill_chunk=CHUNK, prefix_cache=False))
    assert all(o[0] == alone.generate(prompt, params).token_ids for o in out.values())


def test_the_budget_evicts_cached_chunks_before_requests_wait(tiny):
    """A budget for two requests at a time: kept chunks fill what is free and make way for every admission; each
    request still gets its own tokens, and the target never holds a chunk the index forgot."""
    target, drafter = tiny
    params = SamplingParams(max_new_tokens=16, ignore_eos=True)
    reserved = 70 + 16 + 1 + TreeConfig((2, 1)).num_nodes  # prompt, max_new_tokens, the largest verify
    config = SchedulerConfig(prefill_chunk=CHUNK, step_tokens=96, kv_budget_tokens=2 * reserved + 80, max_running=2)
    scheduler = Scheduler(LocalTarget(target), drafter, None, TreeConfig((2, 1)), config, speculation=NO_LOOKUP)
    assert scheduler.check(70, params) == reserved
    # room for about one prompt's chunks (69 rows) beside two requests: hits, and evictions for new prompts
    prompts = [random_prompt(70, seed=20 + i) for i in (0, 0, 0, 1, 1, 1, 0, 2, 2, 2, 1, 0)]
    requests = [(f"q{i}", p, params) for i, p in enumerate(prompts)]
    out = run(scheduler, requests)
    plain = SpeculativeEngine(target, None, config=lookup_off(prefill_chunk=CHUNK, prefix_cache=False))
    for (name, prompt, _), expected in zip(requests, plain.generate_many(prompts, params)):
        assert out[name][0] == expected.token_ids, name
    assert sum(o[2] for o in out.values()) > 0  # some requests found their prompt cached
    assert scheduler.prefix.hit_rows == sum(o[2] for o in out.values())
    assert scheduler.reserved == 0 and not scheduler.target.caches


def test_a_target_reset_forgets_the_cached_chunks(tiny):
    target, drafter = tiny
    scheduler = Scheduler(LocalTarget(target), drafter, None, TreeConfig((2, 1)), SchedulerConfig(prefill_chunk=CHUNK))
    prompt = random_prompt(80, seed=5)
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    first = run(scheduler, [("a", prompt, params)])
    assert scheduler.prefix.entries and scheduler.target.chunks
    scheduler.reset_target()
    assert not scheduler.prefix.entries and scheduler.prefix.rows == 0 and not scheduler.target.chunks
    again = run(scheduler, [("b", prompt, params)])
    assert again["b"][0] == first["a"][0] and again["b"][2] == 0


def test_a_step_that_fails_on_the_target_caches_none_of_its_chunks(tiny):
    """The chunks a failed step was to keep are not in the index after it (their rows were never saved); those of
    earlier steps are."""
    target, drafter = tiny
    scheduler = Scheduler(LocalTarget(target), None, None, TreeConfig((1,)), SchedulerConfig(prefill_chunk=CHUNK))
    params = SamplingParams(max_new_tokens=2, ignore_eos=True)
    run(scheduler, [("a", random_prompt(40, seed=1), params)])
    kept = dict(scheduler.prefix.entries)
    scheduler.add("b", random_prompt(70, seed=2), params)
    real_run = scheduler.target.run

    def failing(work):
        assert work.saves  # the step planned to keep b's first chunk
        raise RuntimeError("rank lost")
    scheduler.target.run = failing
    with pytest.raises(RuntimeError, match="rank lost"):
        scheduler.step()
    assert scheduler.prefix.entries == kept and not scheduler.prefix.pending
    assert scheduler.prefix.rows == sum(e.rows for e in kept.values())
    scheduler.target.run = real_run
    scheduler.reset_target()  # what the serving loop does after a failed step: b is prefilled again and finishes
    while scheduler.has_work:
        scheduler.step()
    assert not scheduler.target.caches and scheduler.reserved == 0


def test_an_aborted_request_loads_nothing(tiny):
    """A request admitted with a hit and aborted before the next step: its copy is not sent to the target."""
    target, drafter = tiny
    scheduler = Scheduler(LocalTarget(target), drafter, None, TreeConfig((2, 1)), SchedulerConfig(prefill_chunk=CHUNK))
    prompt = random_prompt(80, seed=6)
    params = SamplingParams(max_new_tokens=4, ignore_eos=True)
    run(scheduler, [("a", prompt, params)])
    scheduler.add("b", prompt, params)
    assert scheduler._work.loads and scheduler.running["b"].prefilled == 79
    scheduler.add("c", random_prompt(10, seed=7), params)
    assert scheduler.abort("b")
    assert not scheduler._work.loads
    tokens = []
    while scheduler.has_work:
        tokens += [t for o in scheduler.step() for t in o.chunk.token_ids]
    assert tokens == SpeculativeEngine(target, None).generate(random_prompt(10, seed=7), params).token_ids
    assert not scheduler.target.caches and scheduler.reserved == 0
