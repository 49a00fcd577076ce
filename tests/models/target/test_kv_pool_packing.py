"""A KV pool under a memory limit (models/target/kv_pool.py): ranges extended in place, free rows in pieces packed into
one range instead of growing the pool, growth by just what fits where doubling does not, and through all of it every
cache's rows kept, no two ranges overlapping, and no request refused while the caches' capacities fit the limit.
Checked on the CPU (the pool is the GPU's path, where growing past the device's memory raises OutOfMemoryError)."""

from __future__ import annotations

import random
import weakref

import pytest
import torch

from ray_specdec.config import SamplingParams, TreeConfig
from ray_specdec.engine.scheduler import Scheduler
from ray_specdec.engine.scheduler_config import SchedulerConfig
from ray_specdec.engine.target_backend import LocalTarget, SegmentSpec, StepWork
from ray_specdec.models.target import kv_pool
from ray_specdec.models.target.kv_pool import KVPool
from ray_specdec.models.target.model import TargetModel
from ray_specdec.serving import metrics
from ray_specdec.serving.engine_loop import EngineLoop
from tests.helpers.engine_loop import collect, run, wait_until
from tests.helpers.kv_grow import decode_pooled, requests
from tests.helpers.metrics import parse
from tests.helpers.models import tiny_gpt_neox


def limited(rows: int, limit: int, layers: int = 2, kv_heads: int = 2, head_dim: int = 3) -> KVPool:
    """A pool of `rows` rows that cannot grow past `limit` (a device out of memory past it)."""
    pool = KVPool(layers, kv_heads, head_dim, head_dim, dtype=torch.float64, device="cpu", rows=rows)
    grow = pool._grow

    def grow_within(new_rows: int) -> None:
        if new_rows > limit:
            raise torch.OutOfMemoryError(f"no memory for {new_rows} rows")
        grow(new_rows)

    pool._grow = grow_within
    return pool


def fill(cache, rows: int, seed: int) -> list[torch.Tensor]:
    """Append `rows` rows of numbers of its own to every layer of the cache; returns them per layer."""
    g = torch.Generator().manual_seed(seed)
    written = []
    for layer in range(len(cache.layers)):
        k = torch.randn(1, 2, rows, 3, generator=g, dtype=torch.float64)
        cache.update(k, -k, layer)
        written.append(k)
    return written


def check(pool: KVPool, caches: dict) -> None:
    """Every live cache holds the rows written to it, at its own range of the pool; ranges and free rows tile the
    pool without overlap."""
    spans = [(c.pool_offset, c.pool_offset + c.fixed_capacity) for c, _ in caches.values()] + pool._free
    covered = sorted(spans)
    assert covered[0][0] == 0 and covered[-1][1] == pool.rows
    assert all(a[1] == b[0] for a, b in zip(covered, covered[1:])), covered
    for cache, written in caches.values():
        for layer, parts in enumerate(zip(*written)):
            keys = torch.cat(parts, dim=2)
            assert torch.equal(cache.layers[layer].keys, keys) and torch.equal(cache.layers[layer].values, -keys)
            start = cache.pool_offset
            assert torch.equal(pool.keys[layer][start:start + keys.shape[2]], keys[0].transpose(0, 1))


def test_a_range_with_free_rows_after_it_grows_in_place():
    pool = limited(64, limit=64)
    a, b = pool.new_cache(8), pool.new_cache(8)
    written = fill(a, 6, seed=1)
    pool.free(b)
    pool.resize(a, 40)  # b's rows and the rest after them: a keeps its offset
    assert (a.pool_offset, a.fixed_capacity, pool._free, pool.packs) == (0, 40, [(40, 64)], 0)
    check(pool, {"a": (a, [written])})
    pool.resize(a, 10)  # a smaller grant gives its tail back
    assert a.fixed_capacity == 10 and pool._free == [(10, 64)]


def test_a_range_with_free_rows_around_it_slides_down_over_them():
    pool = limited(100, limit=100)
    a, b, c = pool.new_cache(20), pool.new_cache(20), pool.new_cache(20)
    written = {"b": (b, [fill(b, 15, seed=5)]), "c": (c, [fill(c, 3, seed=6)])}
    pool.free(a)
    moved = pool.moved_rows
    pool.resize(b, 35)  # 20 free below it: it slides down to row 0 (its 15 rows copied, overlapping their place)
    assert (b.pool_offset, b.fixed_capacity, pool._free, pool.packs) == (0, 35, [(35, 40), (60, 100)], 0)
    assert pool.moved_rows == moved + 15
    check(pool, written)
    pool.resize(c, 45)  # 5 free below it, 40 above: it slides down by 5
    assert (c.pool_offset, c.fixed_capacity, pool._free) == (35, 45, [(80, 100)])
    with pytest.raises(torch.OutOfMemoryError):
        pool.resize(b, 66)  # 20 free, 35 held: no room even packed, and the pool cannot grow
    assert b.fixed_capacity == 35  # packed on the way (after c), its rows with it
    check(pool, written)


def test_a_range_goes_to_the_smallest_free_range_that_fits():
    pool = limited(100, limit=100)
    caches = [pool.new_cache(n) for n in (10, 30, 10, 20, 20, 10)]  # offsets 0, 10, 40, 50, 70, 90
    pool.free(caches[1])
    pool.free(caches[4])  # free: 30 rows at 10, 20 at 70
    assert pool.new_cache(15).pool_offset == 70 and pool.new_cache(25).pool_offset == 10


def test_free_rows_in_pieces_are_packed_rather_than_the_pool_grown():
    pool = limited(100, limit=100)
    caches = {i: pool.new_cache(20) for i in range(5)}  # the pool is full
    written = {i: [fill(c, 5 + i, seed=i)] for i, c in caches.items()}
    pool.free(caches.pop(1))
    pool.free(caches.pop(3))  # 40 rows free, in two ranges of 20
    big = pool.new_cache(30)
    assert big is not None and pool.rows == 100 and pool.packs == 1
    big_rows = [fill(big, 12, seed=9)]
    live = {i: (c, written[i]) for i, c in caches.items()} | {"big": (big, big_rows)}
    check(pool, live)
    assert [c.pool_offset for c in caches.values()] == [0, 20, 40] and big.pool_offset == 60
    pool.free(caches.pop(2))  # 20 rows free between 0's and 4's, 10 after big's
    pool.resize(big, 40)  # the 10 after it are free: in place
    assert (big.pool_offset, pool.packs, pool._free) == (60, 1, [(20, 40)])
    pool.resize(big, 45)  # packed last, it extends into the free rows after the others
    assert pool.packs == 2 and (big.pool_offset, big.fixed_capacity, pool._free) == (40, 45, [(85, 100)])
    live = {i: (c, written[i]) for i, c in caches.items()} | {"big": (big, big_rows)}
    check(pool, live)


def test_a_pool_that_cannot_double_grows_by_what_fits():
    pool = limited(32, limit=50)
    a = pool.new_cache(30)
    written = fill(a, 30, seed=2)
    b = pool.new_cache(20)  # 64 rows do not fit under 50: 30 + 20 do
    assert b is not None and pool.rows == 50
    assert pool.new_cache(1) is None  # nothing left, not even packed
    with pytest.raises(torch.OutOfMemoryError):
        pool.resize(b, 21)
    check(pool, {"a": (a, [written]), "b": (b, [])})


def test_a_cache_collected_while_the_pool_packs_gives_back_only_its_own_rows():
    """A cache the garbage collector has taken, whose range goes back (its finalizer waiting for the pool's lock)
    after a packing has already handed its rows to others, frees nothing twice."""
    pool = limited(60, limit=60)
    a, b, c = pool.new_cache(20), pool.new_cache(20), pool.new_cache(20)
    written = {"a": [fill(a, 4, seed=3)], "c": [fill(c, 7, seed=4)]}
    del pool._caches[b.pool_key]  # as the dictionary sees a collected cache
    pool._pack(0)
    assert (a.pool_offset, c.pool_offset, pool._free) == (0, 20, [(40, 60)])
    b.pool_release()  # its finalizer runs late
    assert pool._free == [(40, 60)]
    check(pool, {"a": (a, written["a"]), "c": (c, written["c"])})


@pytest.mark.parametrize("seed", range(4))
def test_random_requests_under_a_limit_keep_their_rows_and_are_never_refused_while_they_fit(seed):
    """Requests come, decode (their grants doubling as they fill) and go, as under kv_grow, with their capacities
    kept within the limit as the scheduler keeps them within its budget: no new cache is refused, no resize fails,
    and every cache holds its rows after every operation."""
    rnd, limit = random.Random(seed), 400
    pool = limited(64, limit=limit)
    caches: dict[int, tuple] = {}
    ends: dict[int, int] = {}
    for n in range(300):
        held = sum(c.fixed_capacity for c, _ in caches.values())
        if len(caches) < 8 and rnd.random() < 0.4:
            prompt = rnd.randint(1, 40)
            capacity = 2 * prompt
            if held + capacity <= limit:
                cache = pool.new_cache(capacity)
                assert cache is not None, (held, capacity, pool.rows, pool._free)
                caches[n], ends[n] = (cache, [fill(cache, prompt, seed=n)]), prompt + rnd.randint(1, 80)
        for key in list(caches):
            cache, written = caches[key]
            length = cache.get_seq_length()
            if length >= ends[key] or rnd.random() < 0.02:
                if rnd.random() < 0.5:
                    pool.free(cache)
                del caches[key], cache  # else its range goes back as it is collected
                continue
            step = rnd.randint(1, 6)
            if length + step > cache.fixed_capacity:
                grant = 2 * (length + step)
                if sum(c.fixed_capacity for c, _ in caches.values()) - cache.fixed_capacity + grant > limit:
                    continue  # the scheduler would have it wait
                pool.resize(cache, grant)
            written.append(fill(cache, step, seed=1000 * n + key))
        check(pool, caches)
    assert pool.rows <= limit and pool.packs > 0


def test_greedy_tokens_are_the_same_when_the_pool_packs_under_a_limit():
    """The pooled path with the pool's growth capped below the scheduler's budget's need for doubling: the pool packs
    and grows by what fits while requests decode, and every request gets the tokens it gets alone."""
    pooled, tokens, expected, seen = decode_pooled(requests(6, 50), 260, lambda t: limited(64, 260, *t._kv_shape))
    assert tokens == expected and seen["running"] >= 4 and seen["waits"] > 0
    assert pooled._pool.rows <= 260 and pooled._pool.packs > 0
    assert pooled._pool.free_rows == pooled._pool.rows


def tracked_allocations(monkeypatch, fail_at: int | None = None) -> dict:
    """kv_pool's allocations counted: bytes alive now and at most, calls (the `fail_at`-th raises OutOfMemoryError)."""
    seen = {"live": 0, "peak": 0, "calls": 0}

    def allocate(rows, heads, dim, dtype, device):
        seen["calls"] += 1
        if seen["calls"] == fail_at:
            raise torch.OutOfMemoryError("no memory for another layer")
        tensor = torch.empty(rows, heads, dim, dtype=dtype, device=device)
        size = tensor.numel() * tensor.element_size()
        seen["live"] += size
        seen["peak"] = max(seen["peak"], seen["live"])
        weakref.finalize(tensor, lambda: seen.__setitem__("live", seen["live"] - size))
        return tensor

    monkeypatch.setattr(kv_pool, "_allocate", allocate)
    return seen


def test_a_pool_grows_a_layer_at_a_time_never_holding_two_pools(monkeypatch):
    seen = tracked_allocations(monkeypatch)
    pool = KVPool(layers=4, kv_heads=2, key_dim=3, value_dim=3, dtype=torch.float64, device="cpu", rows=64)
    caches = {i: pool.new_cache(16) for i in range(4)}
    live = {i: (c, [fill(c, 5 + i, seed=i)]) for i, c in caches.items()}
    tensor = 2 * 3 * 8  # bytes of a row of one layer's keys (or values)
    assert seen["live"] == 8 * 64 * tensor
    seen["peak"] = seen["live"]
    pool._grow(128)
    check(pool, live)
    assert seen["live"] == 8 * 128 * tensor
    # the new pool and one old layer's tensor at most (the old pool and a whole new one before: 8 * 64 more)
    assert seen["peak"] == 8 * 128 * tensor + 64 * tensor


def test_a_growth_that_runs_out_of_memory_part_way_keeps_every_cache_and_resumes(monkeypatch):
    seen = tracked_allocations(monkeypatch, fail_at=8 + 5)  # the pool's 8 tensors, then the growth's fifth
    pool = KVPool(layers=4, kv_heads=2, key_dim=3, value_dim=3, dtype=torch.float64, device="cpu", rows=64)
    caches = {i: pool.new_cache(16) for i in range(4)}
    live = {i: (c, [fill(c, 7, seed=10 + i)]) for i, c in caches.items()}
    with pytest.raises(torch.OutOfMemoryError):
        pool._grow(128)
    assert pool.rows == 64 and pool.free_rows == 0 and [k.shape[0] for k in pool.keys] == [128, 128, 64, 64]
    check(pool, live)
    for i, c in caches.items():
        live[i][1].append(fill(c, 2, seed=20 + i))  # the caches go on decoding over the half-grown pool
    check(pool, live)
    pool._grow(128)
    assert seen["calls"] == 8 + 5 + 4 and pool.rows == 128 and pool._free == [(64, 128)]  # the grown four kept
    check(pool, live)


def test_the_pools_state_reaches_the_engines_stats():
    model = tiny_gpt_neox(torch.float64, max_positions=600)
    pooled = TargetModel(model, lean=True, batch_invariant=False, kv_pool=True)
    scheduler = Scheduler(LocalTarget(pooled), None, None, TreeConfig(()), SchedulerConfig(kv_budget_tokens=260))
    loop = EngineLoop(scheduler)
    try:
        assert loop.stats()["kv_pool"] is None  # no cache yet, no pool
        scheduler.target.run(StepWork(allocations=[("a", 100)]))
        stats = loop.stats()["kv_pool"]
        assert stats == {"rows": pooled._pool.rows, "free_rows": pooled._pool.rows - 100, "packs": 0, "moved_rows": 0}
    finally:
        loop.stop()
    assert LocalTarget(TargetModel(model)).kv_pool is None  # caches of their own (the CPU's default)


def test_the_pools_state_reaches_the_metrics():
    """A served request over a pool that packed: /metrics gives the pool's rows and free rows (gauges of the replica)
    and its packs and moved rows (counters), as the pool counts them once the work ran out."""
    model = tiny_gpt_neox(torch.float64, max_positions=600)
    pooled = TargetModel(model, lean=True, batch_invariant=False, kv_pool=True)
    scheduler = Scheduler(LocalTarget(pooled), None, None, TreeConfig(()), SchedulerConfig(kv_budget_tokens=600))
    loop = EngineLoop(scheduler)
    try:
        target = scheduler.target
        target.run(StepWork(allocations=[("a", 100), ("b", 200), ("c", 200)]))
        target.run(StepWork(releases=["b"], segments=[SegmentSpec("c", torch.arange(1, 51))]))  # c holds 50 rows
        target.run(StepWork(allocations=[("d", 560)]))  # more than either free range, less than both: packed
        pool = pooled._pool
        assert pool.packs == 1 and pool.moved_rows == 50
        run(collect(loop, "r", list(range(1, 40)), SamplingParams(max_new_tokens=4, ignore_eos=True)))

        def reported() -> dict:
            snapshot = loop.metrics.snapshot()
            return {name: snapshot.get(name, {}).get(()) for name in (metrics.KV_POOL_ROWS, metrics.KV_POOL_FREE,
                                                                      metrics.KV_POOL_PACKS, metrics.KV_POOL_MOVED)}

        stats = pool.stats()
        wait_until(lambda: reported()[metrics.KV_POOL_FREE] == stats["free_rows"])
        samples = parse(metrics.render({"engine/x": loop.metrics.snapshot()}))
        mine = (("replica", "engine/x"),)
        assert samples[(metrics.KV_POOL_ROWS, mine)] == stats["rows"] == 1024
        assert samples[(metrics.KV_POOL_FREE, mine)] == stats["free_rows"] == 1024 - 860
        assert samples[(f"{metrics.KV_POOL_PACKS}_total", ())] == stats["packs"] == 1
        assert samples[(f"{metrics.KV_POOL_MOVED}_total", ())] == stats["moved_rows"] == 50
    finally:
        loop.stop()
