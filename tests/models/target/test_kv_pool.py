"""The pooled KV path (models/target/kv_pool.py), the GPU's way of batching attention, checked on the CPU in float64:
ranges placed first fit and merged when freed, a pool that grows keeps every cache's rows, and a step's verify rows
attending in one call per layer compute what each request's own attention computes (logits to 1e-10, the same greedy
tokens)."""

from __future__ import annotations

import gc

import pytest
import torch

from ray_specdec.config import SamplingParams, TreeConfig
from ray_specdec.engine.llm import SpeculativeEngine
from ray_specdec.models.target import kv_pool
from ray_specdec.models.target.kv_cache import CacheFull
from ray_specdec.models.target.kv_pool import KVPool, PooledAttention
from ray_specdec.models.target.model import Segment, TargetModel
from ray_specdec.speculation.tree import build_tree
from tests.helpers.inputs import random_prompt
from tests.helpers.models import tiny_gpt_neox, tiny_llama, tiny_mamba, tiny_mistral

TREES = [(), (1,), (2, 2, 1), (3, 2, 1), (1, 1, 1, 1)]


def pool(rows: int = 0) -> KVPool:
    return KVPool(layers=2, kv_heads=2, key_dim=4, value_dim=4, dtype=torch.float64, device="cpu", rows=rows)


def test_ranges_are_placed_first_fit_and_merged_when_freed():
    p = pool(100)
    a, b, c = p.new_cache(30), p.new_cache(30), p.new_cache(30)
    assert (a.pool_offset, b.pool_offset, c.pool_offset) == (0, 30, 60) and p.free_rows == 10
    p.free(b)
    assert p.free_rows == 40
    d = p.new_cache(20)  # the first range that fits: b's
    assert d.pool_offset == 30
    p.free(a)
    p.free(d)
    assert p._free == [(0, 60), (90, 100)]  # a, d and b's rest merged
    p.free(d)  # twice: no-op
    assert p.free_rows == 70
    del c
    gc.collect()
    assert p._free == [(0, 100)] and p.rows == 100  # a collected cache gives its rows back


def test_a_cache_writes_its_own_rows_of_the_pool_and_never_past_them():
    p = pool(64)
    a, b = p.new_cache(8), p.new_cache(8)
    k = torch.randn(1, 2, 5, 4, dtype=torch.float64)
    a.update(k, k + 1, 0)
    b.update(-k, -k, 0)
    assert torch.equal(p.keys[0][0:5], k[0].transpose(0, 1)) and torch.equal(p.keys[0][8:13], -k[0].transpose(0, 1))
    assert torch.equal(a.layers[0].keys, k)
    a.compact(2, [0, 2])  # rows 2 and 4 kept: the cache is rows 0, 1, 2, 4
    assert torch.equal(a.layers[0].keys[0, :, 3], k[0, :, 4]) and a.get_seq_length() == 4
    with pytest.raises(CacheFull):
        a.update(torch.zeros(1, 2, 5, 4, dtype=torch.float64), torch.zeros(1, 2, 5, 4, dtype=torch.float64), 0)
    assert torch.equal(p.keys[0][8:13], -k[0].transpose(0, 1))  # b untouched


def test_a_steps_compactions_together_move_what_each_alone_moves():
    """KVPool.compact over several caches (a step's commits) leaves every layer's keys and values, in every row of
    the pool, and every cache's length as the caches' own compactions one by one do: kept rows that move onto other
    kept rows' places, a cache whose kept rows stay, one that keeps only its root, and a cache of another pool
    refused."""
    moves = [(3, [0, 2, 3, 5]), (1, [0, 1, 2]), (0, [0, 4]), (2, [0])]  # (base, keep) per cache

    def filled() -> tuple[KVPool, list]:
        p = pool(64)
        for rows in p.keys + p.values:
            rows.zero_()  # the pool is allocated uninitialised; every row is compared below
        caches = [p.new_cache(12) for _ in moves]
        g = torch.Generator().manual_seed(3)
        for c, (base, keep) in zip(caches, moves):
            for layer in range(2):
                k = torch.randn(1, 2, base + 6, 4, generator=g, dtype=torch.float64)
                c.update(k, k * 2 - 1, layer)
        return p, caches

    alone, alone_caches = filled()
    for c, (base, keep) in zip(alone_caches, moves):
        c.compact(base, keep)
    together, caches = filled()
    together.compact([(c, base, keep) for c, (base, keep) in zip(caches, moves)])
    for a, b in zip(alone.keys + alone.values, together.keys + together.values):
        assert torch.equal(a, b)
    assert [c.get_seq_length() for c in caches] == [base + len(keep) for base, keep in moves]
    assert [c.get_seq_length() for c in caches] == [c.get_seq_length() for c in alone_caches]
    with pytest.raises(ValueError, match="another pool"):
        together.compact([(alone_caches[0], 0, [0])])


def test_a_growing_pool_keeps_every_caches_rows():
    p = pool(16)
    a = p.new_cache(10)
    k = torch.randn(1, 2, 7, 4, dtype=torch.float64)
    for layer in range(2):
        a.update(k * (layer + 1), k - layer, layer)
    b = p.new_cache(40)  # no room: the pool grows
    assert p.rows >= 50 and b.pool_offset >= 10
    for layer in range(2):
        assert torch.equal(a.layers[layer].keys, k * (layer + 1)) and torch.equal(a.layers[layer].values, k - layer)
        assert a.layers[layer].keys.data_ptr() == p.keys[layer].data_ptr()  # views of the new pool


def targets(make, **kwargs) -> tuple[TargetModel, TargetModel]:
    """The same float64 model as a pooled target and as one whose caches are their own."""
    model = make(torch.float64, max_positions=1024, seed=4, **kwargs)
    pooled = TargetModel(model, lean=True, batch_invariant=False, kv_pool=True)
    own = TargetModel(model, lean=True, batch_invariant=False, kv_pool=False)
    assert pooled.kv_pool_why is None and own.kv_pool_why == "kv_pool=False"
    return pooled, own


def count_pooled_calls(monkeypatch) -> list[int]:
    calls = []
    original = PooledAttention.__call__

    def counted(self, *args):
        calls.append(len(self.spans))
        return original(self, *args)

    monkeypatch.setattr(PooledAttention, "__call__", counted)
    return calls


@pytest.mark.parametrize("make", [tiny_gpt_neox, tiny_llama], ids=["neox", "llama_gqa"])
@pytest.mark.parametrize("one_forward", [False, True], ids=["verify", "with_prefill"])
def test_pooled_verify_rows_compute_what_each_requests_attention_computes(make, one_forward, monkeypatch):
    pooled, own = targets(make)
    pooled.one_forward = one_forward  # the CUDA path: prefill chunks in the verify rows' forward, attending alone
    trees = [build_tree(TreeConfig(b).index_paths()) for b in TREES]
    contexts = [1, 17, 64, 150, 300]
    caches = [pooled.new_cache(400) for _ in contexts]
    mine = [own.new_cache(400) for _ in contexts]
    assert all(kv_pool.pool_of(c.kv) is pooled._pool for c in caches)
    assert all(kv_pool.pool_of(c.kv) is None for c in mine)
    for i, (context, cache, other) in enumerate(zip(contexts, caches, mine)):
        prompt = torch.tensor(random_prompt(context, seed=i))
        pooled.prefill(cache, prompt)
        own.prefill(other, prompt)
    late, late_own = pooled.new_cache(400), own.new_cache(400)  # a prompt that prefills during the verifies
    calls = count_pooled_calls(monkeypatch)
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        segments = [torch.randint(4, 128, (1 + t.num_nodes,), generator=g) for t in trees]
        chunk = torch.randint(4, 128, (40,), generator=g)
        got = pooled.forward_batch([Segment(c, s, t) for c, s, t in zip(caches, segments, trees)]
                                   + [Segment(late, chunk)])  # fmt: skip
        want = own.forward_batch([Segment(c, s, t) for c, s, t in zip(mine, segments, trees)]
                                 + [Segment(late_own, chunk)])  # fmt: skip
        assert calls == [len(trees)] * 2 * (step + 1)  # one call per layer for all five requests
        assert got[-1] is None and late.length == late_own.length == 40 * (step + 1)
        for cache, other, tree, a, b in zip(caches, mine, trees, got, want):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
            assert torch.equal(a.argmax(-1), b.argmax(-1))
            keep = [0] + ([1 + step % tree.num_nodes] if tree.num_nodes else [])  # commits move rows
            pooled.commit(cache, keep)
            own.commit(other, keep)
            for x, y in zip(cache.kv.layers, other.kv.layers):
                torch.testing.assert_close(x.keys, y.keys, rtol=1e-12, atol=1e-12)
                torch.testing.assert_close(x.values, y.values, rtol=1e-12, atol=1e-12)


def test_float64_greedy_is_the_same_pooled_in_a_mixed_batch_as_alone(monkeypatch):
    """A mixed batch through the scheduler (prompts of 3-700 tokens, max_tokens 9-40, trees of several shapes and
    none), on a pool that starts too small and grows mid-run: every request's tokens are its plain greedy decoding."""
    monkeypatch.setattr(kv_pool, "MIN_POOL_ROWS", 64)
    pooled, own = targets(tiny_llama)
    drafter = tiny_mamba(torch.float64, seed=5)
    prompts = [random_prompt(n, seed=40 + n) for n in (3, 40, 700, 120, 9, 260, 55, 31)]
    params = [SamplingParams(max_new_tokens=n) for n in (9, 40, 17, 33, 24, 12, 40, 20)]
    trees = [TreeConfig((2, 2, 1)), None, TreeConfig.parse("none"), TreeConfig((1, 1, 1, 1)), TreeConfig((3, 2, 1)),
             TreeConfig((2, 2, 1)), None, TreeConfig((4,))]  # fmt: skip
    calls = count_pooled_calls(monkeypatch)
    together = SpeculativeEngine(pooled, drafter, TreeConfig((2, 2, 1))).generate_many(prompts, params, trees)
    assert max(calls) > 1  # steps batched several requests' verify rows
    assert pooled._pool.rows > 64  # and the pool grew
    for prompt, p, gen in zip(prompts, params, together):
        alone = SpeculativeEngine(own, None).generate(prompt, p).token_ids
        assert gen.token_ids == alone
    gc.collect()
    assert pooled._pool.free_rows == pooled._pool.rows  # every request's rows came back


def test_where_the_pool_is_off():
    neox = tiny_gpt_neox(torch.float32, seed=1)
    assert TargetModel(neox).kv_pool_why.startswith("the forward is batch-invariant")
    assert TargetModel(neox, batch_invariant=False).kv_pool_why.startswith("on the CPU")
    assert TargetModel(neox, lean=False).kv_pool_why.startswith("the lean forward is off")
    mistral = tiny_mistral(torch.float64, seed=1)  # a family the lean loop does not run
    with pytest.raises(RuntimeError, match="kv_pool=True but the lean forward is off"):
        TargetModel(mistral, batch_invariant=False, kv_pool=True)
    # a cache without a capacity grows on its own, pool or not
    pooled, _ = targets(tiny_gpt_neox)
    assert kv_pool.pool_of(pooled.new_cache().kv) is None


def test_a_verify_alone_attends_over_its_pooled_rows_without_the_gather(monkeypatch):
    pooled, own = targets(tiny_llama)
    calls = count_pooled_calls(monkeypatch)
    tree = build_tree(TreeConfig((2, 1)).index_paths())
    cache, other = pooled.new_cache(300), own.new_cache(300)
    prompt = torch.tensor(random_prompt(90, seed=2))
    pooled.prefill(cache, prompt)
    own.prefill(other, prompt)
    tokens = torch.tensor([5, 6, 7, 8, 9])
    got = pooled.forward_batch([Segment(cache, tokens, tree)])[0]
    want = own.forward_batch([Segment(other, tokens, tree)])[0]
    assert calls == [] and kv_pool.pool_of(cache.kv) is pooled._pool  # its own sdpa call, over the pool's rows
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


def test_released_requests_give_their_rows_back_at_once():
    """TargetCaches (the scheduler's target side) frees a released request's rows in the same step, not when the
    garbage collector gets to its cache; a reset (a restarted target) frees them all."""
    from ray_specdec.engine.target_backend import StepWork, TargetCaches

    pooled, _ = targets(tiny_gpt_neox)
    caches = TargetCaches(pooled)
    caches.run(StepWork(allocations=[("a", 100), ("b", 200), ("c", 50)]))
    pool = pooled._pool
    assert pool.rows - pool.free_rows == 350
    gc.disable()
    try:
        caches.run(StepWork(releases=["b"]))
        assert pool.rows - pool.free_rows == 150
        caches.reset()
        assert pool.free_rows == pool.rows and caches.caches == {}
    finally:
        gc.enable()
