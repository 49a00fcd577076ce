"""GrowableKVCache: in-place growth and compaction against torch.cat references, and the target on top of it against
plain HF forwards (float64) with capacities small enough that prefill, verify and commit all cross growth boundaries."""

from __future__ import annotations

import random
import weakref

import pytest
import torch
from transformers import DynamicCache

import ray_specdec.models.target.kv_cache as kv_module
import ray_specdec.models.target.model as target_module
from ray_specdec.config import TreeConfig
from ray_specdec.models.target.kv_cache import GrowableKVCache, GrowableLayer
from ray_specdec.models.target.model import TargetModel
from ray_specdec.speculation.tree import build_tree
from tests.helpers.models import tiny_gpt_neox, tiny_llama, tiny_mistral

HEADS, DK, DV = 2, 3, 5  # different key and value head sizes catch a key/value mix-up


@pytest.fixture
def small_capacity(monkeypatch):
    """First allocation of 4 rows, so a few tokens cross several growth boundaries."""
    monkeypatch.setattr(kv_module, "MIN_CAPACITY", 4)


def states(rows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct random (keys [1, H, rows, DK], values [1, H, rows, DV])."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(1, HEADS, rows, DK, generator=gen), torch.randn(1, HEADS, rows, DV, generator=gen)


def buffer_rows(view: torch.Tensor) -> int:
    """Rows of the buffer a [B, H, rows, D] view lives in."""
    return view.untyped_storage().nbytes() // (view.element_size() * view.shape[0] * view.shape[1] * view.shape[-1])


def buffer_ptr(view: torch.Tensor) -> int:
    """Address of the buffer a view lives in (an empty view's own data_ptr is 0)."""
    return view.untyped_storage().data_ptr()


def compact_ref(kv: torch.Tensor, base: int, keep: list[int]) -> torch.Tensor:
    return torch.cat([kv[:, :, :base], kv[:, :, [base + r for r in keep]]], dim=2)


def test_update_grows_geometrically_in_place(small_capacity):
    layer, ref_k, ref_v = GrowableLayer(), torch.empty(1, HEADS, 0, DK), torch.empty(1, HEADS, 0, DV)
    capacities, pointers = [], []
    for step, rows in enumerate([3, 1, 2, 5, 0, 1, 9, 1]):
        k, v = states(rows, step)
        keys, values = layer.update(k, v)
        ref_k, ref_v = torch.cat([ref_k, k], dim=2), torch.cat([ref_v, v], dim=2)
        assert torch.equal(keys, ref_k) and torch.equal(values, ref_v)
        assert layer.get_seq_length() == ref_k.shape[2] and layer.get_mask_sizes(7) == (ref_k.shape[2] + 7, 0)
        assert buffer_rows(keys) == buffer_rows(values) == layer.capacity
        capacities.append(layer.capacity)
        pointers.append(buffer_ptr(keys))
    # 3 rows -> 4; 4 fit; 6 -> 8; 11 -> 16; 22 -> 32: the buffer moves only when it grows.
    assert capacities == [4, 4, 8, 16, 16, 16, 32, 32]
    assert [p == q for p, q in zip(pointers, pointers[1:])] == [c == d for c, d in zip(capacities, capacities[1:])]


def test_one_write_larger_than_double_fits_exactly(small_capacity):
    layer = GrowableLayer()
    layer.update(*states(3, 0))
    layer.update(*states(20, 1))
    assert (layer.capacity, layer.get_seq_length()) == (23, 23)


def test_max_capacity_caps_growth(small_capacity):
    layer = GrowableLayer(max_capacity=10)
    capacities = [(layer.update(*states(3, i)), layer.capacity)[1] for i in range(4)]
    assert capacities == [4, 8, 10, 12]  # 12: a write the cap cannot hold still gets room (the adapter prevents it)


def test_compact_when_kept_rows_straddle_a_growth(small_capacity):
    layer = GrowableLayer()
    k0, v0 = states(3, 0)
    layer.update(k0, v0)  # capacity 4
    k1, v1 = states(5, 1)
    layer.update(k1, v1)  # verify rows 3..7 straddle the old capacity: the buffer grows to 8 during this write
    assert layer.capacity == 8
    full_k, full_v = torch.cat([k0, k1], dim=2), torch.cat([v0, v1], dim=2)
    pointer = buffer_ptr(layer.keys)

    layer.compact(3, [0, 2, 4])  # rows 3, 5, 7 -> 3, 4, 5; row 7 was written past the old capacity

    assert torch.equal(layer.keys, compact_ref(full_k, 3, [0, 2, 4]))
    assert torch.equal(layer.values, compact_ref(full_v, 3, [0, 2, 4]))
    assert (buffer_ptr(layer.keys), layer.capacity, layer.get_seq_length()) == (pointer, 8, 6)
    k2, v2 = states(2, 2)
    layer.update(k2, v2)  # the next writes land right after the kept rows
    assert torch.equal(layer.keys, torch.cat([compact_ref(full_k, 3, [0, 2, 4]), k2], dim=2))
    assert torch.equal(layer.values, torch.cat([compact_ref(full_v, 3, [0, 2, 4]), v2], dim=2))


@pytest.mark.parametrize("seed", range(4))
def test_random_appends_and_compactions_match_cat(small_capacity, seed):
    """Verify-like writes of 1..9 rows, each followed by a compaction to a random ascending subset (prefix kept)."""
    rng, layer = random.Random(seed), GrowableLayer()
    ref_k, ref_v = torch.empty(1, HEADS, 0, DK), torch.empty(1, HEADS, 0, DV)
    for step in range(25):
        rows = rng.randint(1, 9)
        k, v = states(rows, 100 * seed + step)
        base = ref_k.shape[2]
        layer.update(k, v)
        ref_k, ref_v = torch.cat([ref_k, k], dim=2), torch.cat([ref_v, v], dim=2)
        keep = sorted(rng.sample(range(rows), rng.randint(0, rows)))
        pointer, capacity = buffer_ptr(layer.keys), layer.capacity

        layer.compact(base, keep)

        ref_k, ref_v = compact_ref(ref_k, base, keep), compact_ref(ref_v, base, keep)
        assert torch.equal(layer.keys, ref_k) and torch.equal(layer.values, ref_v), (step, keep)
        assert (buffer_ptr(layer.keys), layer.capacity) == (pointer, capacity)  # compaction never reallocates
    assert layer.capacity > 4


def test_views_in_use_are_never_overwritten(small_capacity):
    """A forward holds the views `update` returned; later writes (in place or after growth) must not change them."""
    layer = GrowableLayer()
    keys, values = layer.update(*states(3, 0))
    expected = keys.clone(), values.clone()
    layer.update(*states(1, 1))  # in place, capacity 4
    layer.update(*states(6, 2))  # grows to 10 rows: the old buffer stays alive for the views
    assert torch.equal(keys, expected[0]) and torch.equal(values, expected[1])
    keys, values = layer.update(*states(2, 3))
    expected = keys.clone(), values.clone()
    layer.update(*states(3, 4))
    layer.compact(12, [2])  # moves row 14 to 12: only rows past the views
    assert torch.equal(keys, expected[0]) and torch.equal(values, expected[1])


def test_cache_api_and_reset(small_capacity):
    cache = GrowableKVCache()
    assert (cache.get_seq_length(), cache.get_mask_sizes(5, 0), len(cache)) == (0, (5, 0), 0)
    for layer_idx in range(3):
        cache.update(*states(6, layer_idx), layer_idx)
    assert (cache.get_seq_length(), cache.get_mask_sizes(5, 2), len(cache)) == (6, (11, 0), 3)
    assert cache.get_max_length() == -1
    assert cache.is_sliding == [False] * 3 and not cache.is_compileable
    cache.compact(2, [1, 3])
    assert [layer.get_seq_length() for layer in cache.layers] == [4, 4, 4]
    cache.reset()
    k, v = states(2, 9)
    assert torch.equal(cache.update(k, v, 1)[0], k) and cache.get_seq_length(1) == 2


def test_buffers_are_freed_on_growth_and_release(small_capacity):
    """No reference cycles: dropping the cache (as TargetWorker.release does) frees every buffer at once."""
    cache = GrowableKVCache()
    cache.update(*states(3, 0), 0)
    outgrown = weakref.ref(cache.layers[0]._keys)
    cache.update(*states(3, 1), 0)
    assert outgrown() is None
    buffers = [weakref.ref(buf) for layer in cache.layers for buf in (layer._keys, layer._values)]
    del cache
    assert all(buf() is None for buf in buffers)


# -- the target adapter over the growable cache ------------------------------------------------------------------

FAMILIES = {"gpt_neox": tiny_gpt_neox, "llama_gqa": tiny_llama, "mistral_window8": tiny_mistral}
VOCAB = 128


@pytest.fixture(scope="module", params=list(FAMILIES))
def model(request):
    return FAMILIES[request.param](torch.float64)


def tokens(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def test_rounds_across_growth_boundaries_match_hf(model, small_capacity, monkeypatch):
    """Chunked prefill, then verify + commit rounds whose rows straddle capacity boundaries: every round's tree logits
    equal a plain forward over the kept history, and the final K/V equal a DynamicCache prefill of that history."""
    monkeypatch.setattr(target_module, "PREFILL_CHUNK", 5)
    target, tree = TargetModel(model), build_tree(TreeConfig((2, 2, 1)).index_paths())
    cache, history = target.new_cache(), tokens(11, 0)
    target.prefill(cache, history)
    assert cache.kv.layers[0].capacity == 20  # chunks of 5: 5 -> 10 -> 20 rows
    straddles = 0
    # (leaf, accepted) per round; round 0 keeps row 10 of a verify that grew the buffer from 20 to 40 rows at row 9.
    for round_, (leaf, accepted) in enumerate([(-1, 3), (0, 0), (-1, 1), (0, 2), (-1, 3), (0, 0)]):
        rows = tokens(1 + tree.num_nodes, 10 + round_)  # [root, *nodes]
        base, capacity = cache.length, cache.kv.layers[0].capacity
        logits = target.verify(cache, int(rows[0]), tree, rows[1:])
        for path in map(list, tree.leaf_paths):
            expected = model(torch.cat([history, rows[path]])[None]).logits[0, len(history) :]
            torch.testing.assert_close(logits[path], expected, atol=1e-12, rtol=0)
        keep = list(tree.leaf_paths[leaf][: 1 + accepted])
        straddles += base < capacity < base + 1 + tree.num_nodes and base + keep[-1] >= capacity
        target.commit(cache, keep)
        history = torch.cat([history, rows[keep]])
        assert cache.length == len(history)
    assert straddles >= 1  # some commit moved rows written past the capacity the round started with

    reference = DynamicCache()
    model(history[None], past_key_values=reference, use_cache=True)
    for ours, theirs in zip(cache.kv.layers, reference.layers, strict=True):
        torch.testing.assert_close(ours.keys, theirs.keys, atol=1e-12, rtol=0)
        torch.testing.assert_close(ours.values, theirs.values, atol=1e-12, rtol=0)


def test_new_cache_never_grows_past_the_context(model, small_capacity):
    target = TargetModel(model)  # max_context 256
    cache = target.new_cache()
    target.prefill(cache, tokens(200, 1))
    target.verify(cache, 1, build_tree(TreeConfig.chain(5).index_paths()), tokens(5, 2))
    assert [layer.capacity for layer in cache.kv.layers] == [256] * len(cache.kv.layers)


def test_reserve_hands_out_every_layers_buffers_and_advance_grows_them(small_capacity):
    """reserve: room in every layer and their addresses / strides, the same tensor while no buffer is replaced (a new
    one after growth or an update's write); advance: every layer holds the rows written meanwhile; get_seq_length."""
    cache = GrowableKVCache()
    assert cache.get_seq_length() == 0
    for index in range(3):
        cache.update(*states(2, index), index)
    table = cache.reserve(4)
    for layer, row in zip(cache.layers, table.tolist()):
        k, v = layer.buffers
        assert layer.capacity >= 4
        assert row == [k.data_ptr(), k.stride(1), k.stride(2), v.data_ptr(), v.stride(1), v.stride(2)]
    assert cache.reserve(3) is table and cache.reserve(4) is table
    for layer, (k, v) in zip(cache.layers, [states(2, 10 + i) for i in range(3)]):
        keys, values = layer.buffers
        keys[:, :, 2:4], values[:, :, 2:4] = k, v
    cache.advance(2)
    assert [layer.length for layer in cache.layers] == [4, 4, 4] and cache.get_seq_length(1) == 4
    grown = cache.reserve(9)
    assert grown is not table and all(layer.capacity >= 9 for layer in cache.layers)
    assert grown[0, 0] == cache.layers[0].buffers[0].data_ptr()
    cache.update(*states(1, 20), 0)
    assert cache.reserve(9) is not grown


@pytest.mark.parametrize("keep", [[0], [0, 1], [0, 2, 3], [1, 3], []])
def test_cache_compact_is_every_layers_compact(keep):
    """GrowableKVCache.compact (one index for all layers) moves each layer's rows as GrowableLayer.compact does."""
    cache, layers = GrowableKVCache(), [GrowableLayer() for _ in range(2)]
    for index, layer in enumerate(layers):
        k, v = states(9, index)
        cache.update(k, v, index)
        layer.update(k, v)
        layer.compact(5, keep)
    cache.compact(5, keep)
    for ours, ref in zip(cache.layers, layers):
        assert torch.equal(ours.keys, ref.keys) and torch.equal(ours.values, ref.values)
