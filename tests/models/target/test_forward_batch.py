"""TargetModel.forward_batch: one forward over many requests' verify and prefill segments. Batch invariance in float32
on CPU (a segment's logits and K/V are the same bits alone or in any batch; a root row's logits under any tree size),
the kernels it rests on (row invariance of the native GEMM and attention), agreement with `verify` / `prefill` and HF's
forward, and fixed-capacity caches."""

from __future__ import annotations

import pytest
import torch

from ray_specdec.config import TreeConfig
from ray_specdec.defaults import DEFAULT_TARGET
from ray_specdec.models.native import attention, gemm, library
from ray_specdec.models.target import batch_invariant, model as target_module
from ray_specdec.models.target.attention_masks import tree_attention_mask
from ray_specdec.models.target.kv_cache import CacheFull
from ray_specdec.models.target.model import Segment, TargetModel
from ray_specdec.speculation.tree import build_tree
from tests.helpers.models import tiny_gpt_neox, tiny_llama, tiny_mistral

pytestmark = pytest.mark.skipif(library.load() is None, reason="native kernels unavailable")

TREES = {"3,2,1": (3, 2, 1), "2,2,1": (2, 2, 1), "chain4": (1, 1, 1, 1), "one": (1,), "empty": ()}


@pytest.fixture
def threads(request):
    """torch's thread count for one test (the native kernels follow it), restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def shipped():
    return TargetModel.from_pretrained(str(DEFAULT_TARGET))


@pytest.fixture(scope="module", params=["neox", "llama_gqa", "shipped"])
def target(request, shipped):
    if request.param == "shipped":
        return shipped
    build = tiny_gpt_neox if request.param == "neox" else tiny_llama
    return TargetModel(build(torch.float32, seed=3))


def tokens(n: int, seed: int, vocab: int = 128) -> torch.Tensor:
    return torch.randint(1, vocab, (n,), generator=torch.Generator().manual_seed(seed))


def tree(name: str):
    return build_tree(TreeConfig(TREES[name]).index_paths())


def verify_segment(target, cache, name: str, seed: int) -> Segment:
    t = tree(name)
    return Segment(cache, tokens(1 + t.num_nodes, seed, target.vocab_size), t)


def cache_with(target, context: int, seed: int):
    cache = target.new_cache()
    target.prefill(cache, tokens(context, seed, target.vocab_size))
    return cache


def kv(cache) -> list[torch.Tensor]:
    return [t.clone() for layer in cache.kv.layers for t in (layer.keys, layer.values)]


def run_and_commit(target, segments, keep) -> tuple[list, list[list[torch.Tensor]]]:
    """forward_batch, then commit every verify (rows `keep` that exist): logits and every segment's K/V after."""
    logits = target.forward_batch(segments)
    for s in segments:
        if s.tree is not None:
            target.commit(s.cache, [r for r in keep if r <= s.tree.num_nodes])
    return logits, [kv(s.cache) for s in segments]


@pytest.mark.parametrize("mates", [3, 7])
def test_a_verify_alone_and_in_a_batch_are_bit_identical(target, mates):
    """One verify (tree 3,2,1 at 40 tokens) alone, then with other requests' trees of other shapes at other context
    lengths and prefill chunks (first and later ones): the same logits and the same kept K/V, with torch.equal."""
    assert target.batch_invariant, target.batch_invariant_why
    keep = [0, 1, 4]
    alone_logits, alone_kv = run_and_commit(target, [verify_segment(target, cache_with(target, 40, 1), "3,2,1", 2)],
                                            keep)  # fmt: skip
    others = []
    for i in range(mates):
        if i % 3 == 2:  # a prefill chunk, into an empty cache or after earlier tokens
            cache = target.new_cache() if i % 2 else cache_with(target, 9 + i, 10 + i)
            others.append(Segment(cache, tokens(5 + 11 * i, 20 + i, target.vocab_size)))
        else:
            name = ["2,2,1", "chain4", "empty", "one"][i % 4]
            others.append(verify_segment(target, cache_with(target, 3 + 17 * i, 30 + i), name, 40 + i))
    mine = verify_segment(target, cache_with(target, 40, 1), "3,2,1", 2)
    batch = others[: mates // 2] + [mine] + others[mates // 2 :]
    logits, kvs = run_and_commit(target, batch, keep)
    at = batch.index(mine)
    assert torch.equal(logits[at], alone_logits[0])
    assert all(torch.equal(a, b) for a, b in zip(kvs[at], alone_kv[0], strict=True))
    for segment, out in zip(batch, logits):
        assert (out is None) == (segment.tree is None)


@pytest.mark.parametrize("length, cached", [(37, 0), (10, 0), (9, 30)])
def test_prefill_chunks_alone_and_in_a_batch_are_bit_identical(target, length, cached):
    """A prefill chunk (first, or after cached tokens: masked) alone, then beside a verify and other requests' chunks,
    which run together in one forward (TargetModel._prefill_chunks): the same K/V, torch.equal. 10 rows alone stay
    on the native GEMM's half panels, beside the others' 100 they are widened once per pass (gemm_cpu.c)."""
    alone = cache_with(target, cached, 4) if cached else target.new_cache()
    target.forward_batch([Segment(alone, tokens(length, 5, target.vocab_size))])
    mine = cache_with(target, cached, 4) if cached else target.new_cache()
    batch = [verify_segment(target, cache_with(target, 20, 6), "2,2,1", 7),
             Segment(target.new_cache(), tokens(100, 9, target.vocab_size)),
             Segment(mine, tokens(length, 5, target.vocab_size)),
             Segment(cache_with(target, 15, 3), tokens(12, 8, target.vocab_size))]
    target.forward_batch(batch)
    assert all(torch.equal(a, b) for a, b in zip(kv(mine), kv(alone), strict=True))


def test_long_prefills_run_in_rounds_of_pieces_with_the_bits_of_each_alone(target, monkeypatch):
    """Segments longer than PREFILL_CHUNK are cut into pieces from their start; the pieces of several segments run
    in rounds (every first piece together, then every second one): each cache holds the bits of its own prefill."""
    monkeypatch.setattr(target_module, "PREFILL_CHUNK", 16)
    prompts = [tokens(40, 11, target.vocab_size), tokens(20, 12, target.vocab_size), tokens(7, 13, target.vocab_size)]
    alone = []
    for prompt in prompts:
        alone.append(target.new_cache())
        target.forward_batch([Segment(alone[-1], prompt)])
    together = [target.new_cache() for _ in prompts]
    target.forward_batch([Segment(cache, prompt) for cache, prompt in zip(together, prompts)])
    for a, b, prompt in zip(alone, together, prompts):
        assert b.length == len(prompt)
        assert all(torch.equal(x, y) for x, y in zip(kv(a), kv(b), strict=True))


def test_root_logits_do_not_depend_on_the_tree_size(target):
    """The root row's logits for plain decoding (no tree node) and under trees of 1 to 15 nodes: the same bits."""
    cache = cache_with(target, 150, 3)
    roots = []
    for name in TREES:
        t = tree(name)
        rows = torch.cat([torch.tensor([7]), tokens(t.num_nodes, 4, target.vocab_size)])
        roots.append(target.forward_batch([Segment(cache, rows, t)])[0][0])
        target.commit(cache, [])
    assert all(torch.equal(root, roots[0]) for root in roots[1:])


@pytest.mark.parametrize("family", [tiny_gpt_neox, tiny_llama])
@pytest.mark.parametrize("batch_invariant", [True, False])
def test_forward_batch_is_verify_and_close_to_hf(family, batch_invariant):
    """forward_batch's logits are verify's (one path) for each segment of a batch, and close to HF's own forward
    over the whole history with the tree mask."""
    model = family(torch.float32, seed=3)
    target = TargetModel(model, batch_invariant=batch_invariant)
    contexts, names = [30, 7, 61], ["2,2,1", "empty", "chain4"]
    batch = [verify_segment(target, cache_with(target, n, i), name, 10 + i)
             for i, (n, name) in enumerate(zip(contexts, names))]  # fmt: skip
    logits = target.forward_batch(batch)
    for i, (segment, out) in enumerate(zip(batch, logits)):
        cache = cache_with(target, contexts[i], i)
        one = target.verify(cache, int(segment.tokens[0]), segment.tree, segment.tokens[1:])
        if batch_invariant:
            assert torch.equal(out, one)
        else:
            torch.testing.assert_close(out, one, atol=2e-5, rtol=0)
        history = torch.cat([tokens(contexts[i], i), segment.tokens])
        mask = torch.ones(len(history), len(history)).tril()
        n = contexts[i]
        mask[n:, n:] = segment.tree.attn_mask.float()
        additive = (1 - mask) * torch.finfo(torch.float32).min
        positions = torch.cat([torch.arange(n), segment.tree.position_ids(n)])
        with torch.no_grad():
            hf = model(history[None], attention_mask=additive[None, None], position_ids=positions[None]).logits[0, n:]
        torch.testing.assert_close(out, hf, atol=2e-5, rtol=0)


def test_prefill_through_forward_batch_is_hf_prefill():
    """Prefill chunks keep the model's own products, batch-invariant target or not: HF's forward's K/V bit for bit."""
    model = tiny_llama(torch.float32, seed=3)
    target, hf = TargetModel(model), TargetModel(model, lean=False)
    assert target.batch_invariant and hf.lean_why == "lean=False"
    a, b = hf.new_cache(), target.new_cache()
    hf.prefill(a, tokens(30, 1))
    hf.prefill(a, tokens(9, 2))
    target.forward_batch([Segment(b, tokens(30, 1))])
    target.forward_batch([Segment(b, tokens(9, 2)), verify_segment(target, cache_with(target, 5, 3), "one", 4)])
    assert a.length == b.length == 39 and b.pending_rows == 0
    assert all(torch.equal(x, y) for x, y in zip(kv(a), kv(b), strict=True))


def test_commit_after_a_batched_verify_equals_prefilling_the_kept_tokens():
    target = TargetModel(tiny_gpt_neox(torch.float32, seed=3), batch_invariant=False)
    history = tokens(20, 1)
    caches = [cache_with(target, 20, 1), cache_with(target, 8, 2)]
    seg = verify_segment(target, caches[0], "2,2,1", 3)
    target.forward_batch([seg, verify_segment(target, caches[1], "chain4", 4)])
    keep = list(seg.tree.leaf_paths[-1])
    target.commit(caches[0], keep)
    fresh = target.new_cache()
    target.prefill(fresh, torch.cat([history, seg.tokens[keep]]))
    assert caches[0].length == fresh.length == 20 + len(keep)
    for x, y in zip(kv(caches[0]), kv(fresh), strict=True):
        torch.testing.assert_close(x, y, atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="uncommitted verify rows"):
        target.forward_batch([Segment(caches[1], tokens(2, 5))])


def test_a_prefill_chunk_then_a_verify_of_its_cache_in_one_forward_is_the_two_forwards(target):
    """A prompt's last chunk and its first round in one forward (the scheduler's first round, engine/kv_manager.py),
    among other requests' verifies and chunks: the same logits and K/V, bit for bit, as the chunk in one forward and
    the verify in the next."""
    history, chunk = tokens(21, 11, target.vocab_size), tokens(13, 12, target.vocab_size)
    apart = target.new_cache()
    target.prefill(apart, history)
    target.prefill(apart, chunk)
    first = verify_segment(target, apart, "2,2,1", 13)
    apart_logits, apart_kv = run_and_commit(target, [first], [0, 2])
    mine = target.new_cache()
    target.prefill(mine, history)
    batch = [verify_segment(target, cache_with(target, 30, 14), "chain4", 15), Segment(mine, chunk),
             Segment(target.new_cache(), tokens(9, 16, target.vocab_size)), Segment(mine, first.tokens, first.tree)]
    logits = target.forward_batch(batch)
    target.commit(mine, [0, 2])
    assert logits[1] is None and logits[2] is None and mine.length == apart.length == 21 + 13 + 2
    if target.batch_invariant:
        assert torch.equal(logits[3], apart_logits[0])
        assert all(torch.equal(a, b) for a, b in zip(kv(mine), apart_kv[0], strict=True))
    else:
        torch.testing.assert_close(logits[3], apart_logits[0], atol=1e-5, rtol=0)


def test_misuse_raises_before_anything_runs():
    target = TargetModel(tiny_gpt_neox(torch.float32))
    cache, other = cache_with(target, 10, 1), cache_with(target, 10, 2)
    with pytest.raises(ValueError, match="share a cache"):  # a verify first, then a chunk of its cache
        target.forward_batch([verify_segment(target, cache, "one", 2), Segment(cache, tokens(3, 1))])
    with pytest.raises(ValueError, match="share a cache"):
        target.forward_batch([Segment(cache, tokens(3, 1)), Segment(cache, tokens(3, 2))])
    with pytest.raises(ValueError, match="share a cache"):
        target.forward_batch([verify_segment(target, cache, "one", 2), verify_segment(target, cache, "one", 3)])
    with pytest.raises(ValueError, match="tree has 10 nodes but 1 tokens"):
        target.forward_batch([Segment(other, tokens(4, 1)), Segment(cache, tokens(2, 3), tree("2,2,1"))])
    assert cache.length == other.length == 10


def test_a_fixed_capacity_cache_never_reallocates_and_refuses_to_overflow():
    target = TargetModel(tiny_llama(torch.float32))
    cache = target.new_cache(capacity=40)
    target.prefill(cache, tokens(29, 1))
    pointers = [layer._keys.data_ptr() for layer in cache.kv.layers]
    assert cache.capacity == 40 and all(layer.capacity == 40 for layer in cache.kv.layers)
    target.forward_batch([verify_segment(target, cache, "2,2,1", 2)])  # 29 + 11 rows: full
    target.commit(cache, [0, 1])
    target.prefill(cache, tokens(9, 3))
    assert cache.length == 40 and [layer._keys.data_ptr() for layer in cache.kv.layers] == pointers
    with pytest.raises(ValueError, match="needs 41 cache rows but the cache holds 40"):
        target.forward_batch([Segment(cache, tokens(1, 4))])
    with pytest.raises(CacheFull, match="fixed capacity of 40 rows"):
        cache.kv.layers[0].reserve(41)
    assert cache.length == 40
    with pytest.raises(ValueError, match="at least one row"):
        target.new_cache(capacity=0)


def test_kv_bytes_per_token():
    assert TargetModel(tiny_llama(torch.float32)).kv_bytes_per_token == 2 * 2 * 2 * 16 * 4  # layers, K+V, kv heads
    assert TargetModel(tiny_gpt_neox(torch.float64)).kv_bytes_per_token == 2 * 2 * 64 * 8


def test_when_the_target_is_batch_invariant(monkeypatch):
    assert TargetModel(tiny_gpt_neox()).batch_invariant_why is None
    assert "lean forward is off" in TargetModel(tiny_mistral()).batch_invariant_why
    assert "native attention is off" in TargetModel(tiny_gpt_neox(torch.float64)).batch_invariant_why
    assert TargetModel(tiny_llama(), batch_invariant=False).batch_invariant_why == "batch_invariant=False"
    with pytest.raises(RuntimeError, match="batch_invariant=True but the lean forward is off"):
        TargetModel(tiny_llama(), lean=False, batch_invariant=True)
    odd = tiny_llama()
    odd.model.layers[0].mlp.up_proj = torch.nn.Linear(64, 100)  # the width the activation runs over (a shard's own)
    assert "MLP width 100" in batch_invariant.why_unsupported(odd)
    monkeypatch.setenv("RAY_SPECDEC_BATCH_INVARIANT", "0")
    assert TargetModel(tiny_gpt_neox()).batch_invariant_why == "RAY_SPECDEC_BATCH_INVARIANT=0"
    assert TargetModel(tiny_gpt_neox(), batch_invariant=True).batch_invariant  # an explicit True overrides it


def test_fallback_forward_batch_runs_each_segment_through_hf():
    """A model the lean loop does not run (Mistral) batches nothing but gives each segment verify's logits."""
    target = TargetModel(tiny_mistral(torch.float64))
    batch = [verify_segment(target, cache_with(target, 12, 1), "2,2,1", 2), Segment(target.new_cache(), tokens(5, 3))]
    logits = target.forward_batch(batch)
    one = target.verify(cache_with(target, 12, 1), int(batch[0].tokens[0]), batch[0].tree, batch[0].tokens[1:])
    assert torch.equal(logits[0], one) and logits[1] is None and batch[1].cache.length == 5


@pytest.mark.parametrize("threads", [1, 2], indirect=True)
def test_an_exact_gelu_row_does_not_depend_on_the_rows_beside_it(threads, native_isa):
    """batch_invariant.activate runs an exact GELU through the native row loop on every thread: each row the bits
    it gets alone, for any row count (including counts past the parallel threshold), on every instruction-set path."""
    from transformers.activations import GELUActivation

    x = torch.randn(40, 1536, generator=torch.Generator().manual_seed(5)) * 4
    for fn in (torch.nn.GELU(), GELUActivation()):
        together = batch_invariant.activate(fn, x)
        alone = torch.cat([batch_invariant.activate(fn, x[r : r + 1]) for r in range(40)])
        assert torch.equal(together, alone)
        assert torch.equal(batch_invariant.activate(fn, x[7:30]), together[7:30])
        _assert_exact_gelu(together, x)
    tanh = torch.nn.GELU(approximate="tanh")  # not the exact form: torch's own, on one thread
    torch.testing.assert_close(batch_invariant.activate(tanh, x), tanh(x), rtol=0, atol=1e-6)


def _assert_exact_gelu(y: torch.Tensor, x: torch.Tensor) -> None:
    """y is GELU(x) within half an ulp of float32 where the exact value (float64, with erfc: no cancellation for
    negative x) is a normal float, and within float32's smallest normal of it (flushed to zero) below that."""
    exact = x.double() * 0.5 * torch.special.erfc(-x.double() / 2**0.5)
    error = (y.double() - exact).abs()
    tiny = torch.finfo(torch.float32).tiny
    normal = exact.abs() >= tiny
    ulp = torch.exp2(torch.floor(torch.log2(exact.abs()[normal])) - 23)
    assert (error[normal] / ulp).max() <= 0.5 + 1e-6
    assert (error[~normal] <= tiny).all()


@pytest.mark.parametrize("threads", [1, 2], indirect=True)
def test_the_native_gelu_is_correctly_rounded_on_every_path(threads, native_isa):
    """The bound decoder_cpu.c states: within half an ulp of the exact GELU (correctly rounded but for double erfc's
    own few double ulps), over the whole range where GELU is a normal float, and flushed to zero below it. (torch's
    float GELU, 1 + erf(x / sqrt 2) in float, is off by up to 1e-3 relative at x = -3.5 and worse further out.)"""
    g = torch.Generator().manual_seed(1)
    x = torch.cat([torch.linspace(-14, 14, 280_000), torch.randn(120_000, generator=g) * 4]).view(-1, 1000)
    _assert_exact_gelu(batch_invariant.activate(torch.nn.GELU(), x), x)
    far = torch.tensor([[-20.0, -1e4, -1e30]])
    assert torch.equal(batch_invariant.activate(torch.nn.GELU(), far).abs(), torch.zeros(1, 3))
    big = torch.tensor([[13.0, 100.0, 1e30]])
    assert torch.equal(batch_invariant.activate(torch.nn.GELU(), big), big)


@pytest.mark.parametrize("threads", [1, 2], indirect=True)
@pytest.mark.parametrize("n_out, n_in", [(1152, 384), (100, 64), (37, 50)])
def test_native_gemm_rows_do_not_depend_on_the_row_count(native_isa, threads, n_out, n_in):
    """Each row of a product is the same bits in a product of 1 to 70 rows, across row blocks (6 or 4 rows), thread
    splits and panel formats (float32, and the half panels of a weight that half precision holds exactly)."""
    g = torch.Generator().manual_seed(n_out)
    weight, bias = torch.randn(n_out, n_in, generator=g), torch.randn(n_out, generator=g)
    x = torch.randn(70, n_in, generator=g)
    for w in (weight, weight.half().float()):
        panels = gemm.pack_panels(w, gemm.exact_panel_dtype(w))
        full = gemm.linear(x, panels, bias, n_out)
        for start, rows in [(0, 1), (3, 1), (0, 2), (1, 5), (0, 6), (2, 7), (5, 13), (0, 64)]:
            assert torch.equal(gemm.linear(x[start : start + rows], panels, bias, n_out), full[start : start + rows])


@pytest.mark.parametrize("threads", [1, 2], indirect=True)
@pytest.mark.parametrize("heads, kv_heads, dim", [(6, 6, 64), (4, 2, 16), (4, 4, 20), (4, 4, 16), (2, 1, 40)])
def test_native_attention_rows_do_not_depend_on_the_row_count_or_masked_keys(threads, heads, kv_heads, dim):
    """A query row gives the same bits in any group of rows (groups of 16 and ragged ones included, the rows of the
    query heads that share a key/value head together), and keys masked away change nothing: one row over L keys
    equals that row among 5 over L + 40 keys, the extra 40 masked. (4, 4, 16) and (2, 1, 40) once caught a compiler
    that fused a * b + c in one value loop and not in another.)"""
    g = torch.Generator().manual_seed(dim)
    length = 300
    q = torch.randn(1, heads, 40, dim, generator=g)
    k, v = torch.randn(1, kv_heads, length, dim, generator=g), torch.randn(1, kv_heads, length, dim, generator=g)
    mask = torch.randn(1, 40, length, generator=g)
    full = attention.tree_attention(q, k, v, mask, dim**-0.5)
    for start, rows in [(0, 1), (0, 2), (3, 9), (0, 16), (0, 17), (20, 20)]:
        part = slice(start, start + rows)
        assert torch.equal(attention.tree_attention(q[:, :, part], k, v, mask[:, part], dim**-0.5), full[:, part])
    alone = attention.tree_attention(q[:, :, :1], k[:, :, :260], v[:, :, :260], mask[:, :1, :260], dim**-0.5)
    masked = mask[:, :5].clone()
    masked[:, :, 260:] = torch.finfo(torch.float32).min
    assert torch.equal(attention.tree_attention(q[:, :, :5], k, v, masked, dim**-0.5)[:, :1], alone)


@pytest.mark.parametrize("threads", [1, 2], indirect=True)
@pytest.mark.parametrize("heads, kv_heads, dim", [(6, 2, 64), (4, 4, 20)])
@pytest.mark.parametrize("cached, window", [(100, None), (120, None), (126, None), (250, None), (250, 64)])
def test_native_attention_tree_rows_are_their_rows_decoded_one_by_one(threads, heads, kv_heads, dim, cached, window):
    """A verify's tree row attends over the cache, its ancestors and itself exactly as when those tokens are decoded
    one by one: the bits of one row over exactly those keys laid out one after the other, whatever other rows the tree
    has (so what a request commits does not depend on the tree the controller gave it). Caches of 120 / 126 keys put the
    tree's rows across a key block boundary (128), where keys weighted 0 at shifted places would change the sums."""
    tree = build_tree([(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 1, 0), (0, 0, 0, 0), (0, 0, 0, 0, 0)])
    rows = tree.num_nodes + 1
    g = torch.Generator().manual_seed(cached + dim)
    q = torch.randn(1, heads, rows, dim, generator=g)
    k = torch.randn(1, kv_heads, cached + rows, dim, generator=g)
    v = torch.randn(1, kv_heads, cached + rows, dim, generator=g)
    mask = tree_attention_mask(cached, tree, torch.float32, torch.device("cpu"), window)[0]  # [1, rows, cached + rows]
    verified = attention.tree_attention(q, k, v, mask, dim**-0.5)
    depths = set()
    for row in range(rows):
        seen = (mask[0, row] == 0).nonzero().flatten()  # the cache (in the window), its ancestors, itself
        own = seen[seen >= cached]
        depths.add(own.numel())
        keys = torch.cat([k[:, :, :cached], k[:, :, own]], dim=2)
        values = torch.cat([v[:, :, :cached], v[:, :, own]], dim=2)
        plain_mask = None
        if window is not None:  # the same window over the row's keys, as the plain step's mask has it
            plain_mask = torch.cat([mask[:, row : row + 1, :cached], mask[:, row : row + 1, own]], dim=-1)
        alone = attention.tree_attention(q[:, :, row : row + 1], keys, values, plain_mask, dim**-0.5)
        assert torch.equal(alone[:, 0], verified[:, row]), row
    assert depths == {1, 2, 3, 4, 5, 6}  # rows at every depth of the tree were compared
