"""KV granted as requests decode (SchedulerConfig.kv_grow, kv_manager.PrefillPlan): the banker's check, caches and
pool ranges that grow keeping their rows, and a scheduler that admits on what requests hold, makes some wait a round
where their growth does not fit, never exceeds its budget, and gives every request the tokens it gets alone."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from ray_specdec.config import SamplingParams, TreeConfig
from ray_specdec.engine.kv_manager import PrefillPlan
from ray_specdec.engine.llm import SpeculativeEngine
from ray_specdec.engine.scheduler import Scheduler
from ray_specdec.engine.scheduler_config import SchedulerConfig
from ray_specdec.engine.target_backend import LocalTarget, StepWork
from ray_specdec.models.target.kv_cache import CacheFull, GrowableKVCache
from ray_specdec.models.target.kv_pool import KVPool
from ray_specdec.models.target.model import Segment, TargetModel
from tests.helpers.configs import NO_LOOKUP
from tests.helpers.inputs import random_prompt
from tests.helpers.kv_grow import decode_pooled, requests, run_within_budget
from tests.helpers.models import tiny_gpt_neox, tiny_mamba


def held(request_id: str, granted: int, reserved: int) -> SimpleNamespace:
    return SimpleNamespace(request_id=request_id, granted=granted, reserved=reserved)


def plan(budget: int, *requests: SimpleNamespace) -> PrefillPlan:
    p = PrefillPlan(budget, chunk=32, prefix_cache=False)
    p.reserved = sum(r.granted for r in requests)
    return p


def test_the_bankers_check_asks_for_an_order_in_which_every_request_finishes():
    a, b = held("a", 30, 60), held("b", 30, 60)
    assert plan(100, a, b).safe([a, b])  # 40 free: either grows to 60 (needs 30), frees it, then the other
    c = held("c", 30, 60)
    assert not plan(100, a, b, c).safe([a, b, c])  # 10 free, every need is 30: none could finish
    d = held("d", 40, 40)  # 30 + 30 + 40 held, and d needs nothing more: it finishes, then a, then b
    assert plan(100, a, b, d).safe([a, b, d]) and not plan(100, a, b, d).safe([a, b, d], held("e", 1, 2))
    assert not plan(100, a, b).safe([a, b], held("e", 20, 100))  # 20 free: nobody's need (30, 30, 80) fits
    assert plan(100, a, b).safe([a, b], held("e", 10, 100))  # 30 free: a, then b, then e's 90


def test_a_grant_is_made_only_where_every_request_can_still_finish():
    a, b = held("a", 30, 60), held("b", 45, 60)
    p, work = plan(100, a, b), StepWork()
    assert p.grow(a, [50, 35], [a, b], work)  # 50 would leave 5 free for needs of 10 and 15; 35 leaves b room
    assert (a.granted, b.granted, p.reserved, work.resizes) == (35, 45, 80, [("a", 35)])
    assert not p.grow(a, [50], [a, b], work)  # 0 free, needs 10 and 15
    assert (a.granted, p.reserved, work.resizes) == (35, 80, [("a", 35)])
    assert p.grow(b, [60], [a, b], work)  # b whole: it finishes, then a
    assert (b.granted, p.reserved, work.resizes[-1]) == (60, 95, ("b", 60))


def test_a_resized_cache_keeps_its_rows_and_refuses_past_its_new_size():
    cache = GrowableKVCache(max_capacity=8, preallocate=True)
    keys, values = torch.randn(1, 2, 6, 4), torch.randn(1, 2, 6, 4)
    cache.update(keys, values, 0)
    cache.update(keys + 1, values + 1, 1)
    with pytest.raises(CacheFull):
        cache.update(torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4), 0)
    with pytest.raises(ValueError, match="below the 6 rows"):
        cache.resize(5)
    cache.resize(20)
    assert [layer.capacity for layer in cache.layers] == [20, 20] and cache.fixed_capacity == 20
    assert torch.equal(cache.layers[0].keys, keys) and torch.equal(cache.layers[1].values, values + 1)
    more = torch.randn(1, 2, 14, 4)
    k, v = cache.update(more, more, 0)
    assert torch.equal(k[:, :, :6], keys) and torch.equal(k[:, :, 6:], more) and k.shape[-2] == 20
    with pytest.raises(CacheFull):
        cache.update(more[:, :, :1], more[:, :, :1], 0)
    with pytest.raises(ValueError, match="preallocated"):
        GrowableKVCache().resize(10)


def test_a_pooled_cache_moves_to_a_larger_range_with_its_rows():
    pool = KVPool(layers=2, kv_heads=2, key_dim=4, value_dim=4, dtype=torch.float64, device="cpu", rows=64)
    a, b = pool.new_cache(16), pool.new_cache(16)
    rows = torch.randn(1, 2, 10, 4, dtype=torch.float64)
    for i in range(2):
        a.update(rows + i, rows - i, i)
        b.update(rows * 2, rows * 3, i)
    pool.resize(a, 24)  # 32 rows free after b: a moves there, its old range is free again
    assert (a.pool_offset, a.fixed_capacity, pool.free_rows) == (32, 24, 64 - 16 - 24)
    assert torch.equal(a.layers[1].keys, rows + 1) and torch.equal(a.layers[0].values, rows)
    assert torch.equal(b.layers[0].keys, rows * 2)
    pool.resize(b, 100)  # no range fits: the pool grows, every cache keeps its rows
    assert pool.rows >= 24 + 100 + 16 and b.fixed_capacity == 100
    assert torch.equal(a.layers[1].keys, rows + 1) and torch.equal(b.layers[1].values, rows * 3)
    k, _ = b.update(rows, rows, 0)
    assert k.shape[-2] == 20 and torch.equal(k[:, :, 10:], rows)
    pool.free(a)
    pool.free(b)
    assert pool.free_rows == pool.rows
    with pytest.raises(ValueError, match="below"):
        pool.resize(pool.new_cache(16), 0)


@pytest.fixture(scope="module")
def tiny() -> tuple[TargetModel, object]:
    return TargetModel(tiny_gpt_neox(torch.float32, max_positions=600)), tiny_mamba(torch.float32)


@pytest.mark.parametrize("tree", [TreeConfig((2, 1)), TreeConfig((1,), lookup=2)])
def test_requests_admitted_on_what_they_hold_finish_with_their_own_tokens(tiny, tree):
    """Each reserves prompt + 120 + its verify (~150 rows); 400 rows reserved whole run two at a time. Grown
    as they decode, all six start at once, some wait rounds where growth does not fit, none is preempted, and each
    gets the tokens it gets alone."""
    target, drafter = tiny
    reqs = requests(6, 120)
    alone = SpeculativeEngine(target, None)
    expected = {request_id: alone.generate(prompt, params).token_ids for request_id, prompt, params in reqs}
    config = SchedulerConfig(kv_budget_tokens=400, prefill_chunk=32)
    grown, seen = run_within_budget(Scheduler(LocalTarget(target), drafter, None, tree, config,
                                              speculation=NO_LOOKUP), reqs)
    assert grown == expected
    assert seen["running"] == 6 and seen["waits"] > 0
    whole, seen = run_within_budget(Scheduler(LocalTarget(target), drafter, None, tree,
                                SchedulerConfig(kv_budget_tokens=400, prefill_chunk=32, kv_grow=False),
                                              speculation=NO_LOOKUP), reqs)
    assert whole == expected and seen["running"] == 2 and seen["waits"] == 0


def test_nothing_is_admitted_while_a_running_request_waits_for_kv(tiny):
    target, drafter = tiny
    scheduler = Scheduler(LocalTarget(target), drafter, None, TreeConfig((1,)),
                          SchedulerConfig(kv_budget_tokens=260, prefill_chunk=32), speculation=NO_LOOKUP)  # fmt: skip
    reqs = requests(8, 100)
    for request_id, prompt, params in reqs[:4]:
        scheduler.add(request_id, prompt, params)
    while scheduler.has_work and not scheduler.kv_waits:
        scheduler.step()
    assert scheduler.kv_waits
    running = scheduler.num_running
    for request_id, prompt, params in reqs[4:]:
        scheduler.add(request_id, prompt, params)
    assert scheduler.num_running == running and scheduler.num_waiting == 4
    while scheduler.has_work:
        scheduler.step()
        assert scheduler.reserved <= 260


@pytest.mark.parametrize("drafted", [False, True])
def test_a_target_reset_while_a_grant_is_short_of_its_next_round_loses_no_request(tiny, drafted):
    """After a fault the requests are prefilled again from their tokens (reset_target), and a prompt's last chunk
    takes its next round in the same step. A grant short of that round (its tokens filled it: kv_grow passes through
    that on each doubling, and grows it only at the next round) then overflowed: every step after the reset failed
    as a new fault, for ever."""
    target, drafter = tiny
    reqs = requests(3, 80)
    alone = SpeculativeEngine(target, None)
    expected = {request_id: alone.generate(prompt, params).token_ids for request_id, prompt, params in reqs}
    scheduler = Scheduler(LocalTarget(target), drafter if drafted else None, None, TreeConfig((2, 1)),
                          SchedulerConfig(kv_budget_tokens=300, prefill_chunk=32), speculation=NO_LOOKUP)  # fmt: skip
    for request_id, prompt, params in reqs:
        scheduler.add(request_id, prompt, params)
    tokens = {r[0]: [] for r in reqs}
    short = lambda: [r for r in scheduler.running.values() if r.decoding and r.granted < PrefillPlan.needed(r)]  # noqa
    while scheduler.has_work and not short():
        for out in scheduler.step():
            tokens[out.request_id] += out.chunk.token_ids
    assert short(), "no grant was ever short of the next round: the test no longer reaches the case"
    scheduler.reset_target()
    while scheduler.has_work:
        for out in scheduler.step():
            tokens[out.request_id] += out.chunk.token_ids
        assert scheduler.reserved <= 300
    assert tokens == expected


def test_pooled_caches_grow_as_their_requests_decode():
    """The pooled path (the GPU's, checked on the CPU in float64): ranges move as grants grow; greedy tokens as
    alone."""
    pooled, tokens, expected, seen = decode_pooled(requests(5, 60), 240)
    assert tokens == expected and seen["running"] == 5 and seen["waits"] > 0
    assert pooled._pool.free_rows == pooled._pool.rows


def test_a_resized_cache_decodes_as_one_that_was_large_from_the_start(tiny):
    target, _ = tiny
    prompt = torch.tensor(random_prompt(40, seed=3))
    small, large = target.new_cache(41), target.new_cache(80)
    for cache in (small, large):
        target.forward_batch([Segment(cache, prompt[:-1], None)])
    target.resize(small, 80)
    tokens = torch.tensor(random_prompt(30, seed=4))
    a = target.forward_batch([Segment(small, tokens, None)])
    b = target.forward_batch([Segment(large, tokens, None)])
    assert small.kv.get_seq_length() == large.kv.get_seq_length() == 69
    for layer_s, layer_l in zip(small.kv.layers, large.kv.layers):
        assert torch.equal(layer_s.keys, layer_l.keys) and torch.equal(layer_s.values, layer_l.values)
    assert (a[0] is None) == (b[0] is None)


def test_a_pooled_cache_that_the_pool_cannot_grow_for_leaves_it_with_its_rows(monkeypatch):
    model = tiny_gpt_neox(torch.float64, max_positions=600)
    pooled = TargetModel(model, lean=True, batch_invariant=False, kv_pool=True)
    cache, other = pooled.new_cache(24), pooled.new_cache(24)
    prompt = torch.tensor(random_prompt(20, seed=5))
    pooled.forward_batch([Segment(cache, prompt, None)])
    pool = pooled._pool
    rows = [(layer.keys.clone(), layer.values.clone()) for layer in cache.kv.layers]

    def no_memory(rows: int) -> None:
        raise torch.OutOfMemoryError("no memory for a larger pool")

    monkeypatch.setattr(pool, "_grow", no_memory)
    free = pool.free_rows
    pooled.resize(cache, pool.rows + 1)  # no range fits and the pool cannot grow
    assert getattr(cache.kv, "pool", None) is None and cache.capacity == pool.rows + 1
    assert pool.free_rows == free + 24 and other.kv.pool is pool  # its old range is free again
    for layer, (keys, values) in zip(cache.kv.layers, rows):
        assert torch.equal(layer.keys, keys) and torch.equal(layer.values, values)
    pooled.release(cache)
    pooled.release(other)


def test_first_grants_and_what_a_round_needs():
    params = SamplingParams(max_new_tokens=100)
    r = SimpleNamespace(request_id="r", tokens=list(range(30)), prompt_len=30, params=params, reserved=30 + 100 + 6,
                        granted=0)  # fmt: skip
    grows, whole = PrefillPlan(1000, 32, False), PrefillPlan(1000, 32, False, grow=False)
    assert PrefillPlan.needed(r) == 29 + 6  # the prompt's rows but its last (the first root), and one verify
    assert grows.first_grants(r) == (70, 35) and whole.first_grants(r) == (136,)
    r.tokens = list(range(128))  # near its end: never past its reservation
    assert PrefillPlan.needed(r) == 133 and grows.first_grants(r) == (136, 133)
    r.granted = 70
    work = StepWork()
    assert grows.room(r, [r], work) and r.granted == 136 and work.resizes == [("r", 136)]
    assert grows.room(r, [r], work) and len(work.resizes) == 1  # it holds its next round: nothing to grow
