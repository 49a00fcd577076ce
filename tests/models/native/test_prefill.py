"""native/prefill.py: a step's prefill chunks' rotary and cache writes in one native pass per layer, against the
torch path they replace (lean_forward._rotate and the caches' own update): the same bits, torch.equal."""

from __future__ import annotations

import pytest
import torch

from ray_specdec.config import TreeConfig
from ray_specdec.models.native import library, prefill
from ray_specdec.models.target.lean_forward import _rotate
from ray_specdec.models.target.model import Segment, TargetModel
from ray_specdec.speculation.tree import build_tree
from tests.helpers.models import tiny_gpt_neox, tiny_llama

pytestmark = pytest.mark.skipif(library.load() is None, reason=f"no native kernels: {library.why_unavailable()}")

FILL = 7.0  # what cache rows hold before a write: rows the kernel must not touch keep it


def random_qkv(rows: int, heads: int, kv_heads: int, dim: int, fused: bool, seed: int):
    """q / k / v as the projections leave them: views of GPTNeoX's fused product (per head q, k, v) or of Llama's
    three products."""
    g = torch.Generator().manual_seed(seed)
    if fused:
        qkv = torch.randn(1, rows, heads * 3 * dim, generator=g)
        return qkv.view(1, rows, heads, 3 * dim).transpose(1, 2).chunk(3, dim=-1)
    q, k, v = (torch.randn(1, rows, n * dim, generator=g) for n in (heads, kv_heads, kv_heads))
    return (t.view(1, rows, -1, dim).transpose(1, 2) for t in (q, k, v))


def table_for(segments, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """(first row, rows, first cache row) per segment, all into one [1, Hkv, capacity, D] pair of buffers."""
    return torch.tensor([(first, rows, dest, keys.data_ptr(), keys.stride(1), keys.stride(2), values.data_ptr(),
                          values.stride(1), values.stride(2)) for first, rows, dest in segments],
                        dtype=torch.int64).reshape(-1, prefill.FIELDS)  # fmt: skip


@pytest.mark.parametrize("fused, heads, kv_heads, dim, rotary", [
    (True, 6, 6, 64, 16),   # the shipped target: GPTNeoX, a quarter of each head rotates
    (False, 8, 2, 32, 32),  # Llama with grouped KV heads, every dimension rotates
    (False, 4, 4, 16, 8),
])  # fmt: skip
@pytest.mark.parametrize("threads", [1, 2])
def test_the_writes_are_the_torch_rotary_and_cache_update_bit_for_bit(fused, heads, kv_heads, dim, rotary, threads):
    rows = 301
    q, k, v = random_qkv(rows, heads, kv_heads, dim, fused, seed=1)
    g = torch.Generator().manual_seed(2)
    cos, sin = torch.randn(rows, rotary, generator=g), torch.randn(rows, rotary, generator=g)
    keys = torch.full((1, kv_heads, 700, dim), FILL)
    values = torch.full_like(keys, FILL)
    segments = [(0, 100, 5), (100, 1, 0), (101, 200, 400)]  # the second's one row lands before the first's
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = prefill.write(q, k, v, cos, sin, table_for(segments, keys, values))
    finally:
        torch.set_num_threads(before)
    c, s = cos[None, None], sin[None, None]
    assert torch.equal(out, _rotate(q, c, s))
    rotated = _rotate(k, c, s)
    written = torch.zeros(700, dtype=torch.bool)
    for first, n, dest in segments:
        assert torch.equal(keys[:, :, dest : dest + n], rotated[:, :, first : first + n])
        assert torch.equal(values[:, :, dest : dest + n], v[:, :, first : first + n])
        written[dest : dest + n] = True
    assert bool((keys[:, :, ~written] == FILL).all()) and bool((values[:, :, ~written] == FILL).all())


def test_without_queries_only_the_caches_are_written():
    q, k, v = random_qkv(10, 2, 2, 8, True, seed=3)
    cos, sin = torch.ones(10, 4), torch.zeros(10, 4)  # the identity rotation
    keys, values = torch.zeros(1, 2, 10, 8), torch.zeros(1, 2, 10, 8)
    assert prefill.write(q, k, v, cos, sin, table_for([(0, 10, 0)], keys, values), with_queries=False) is None
    assert torch.equal(keys, k) and torch.equal(values, v)


def test_bad_input_is_refused_before_anything_is_written():
    q, k, v = random_qkv(10, 2, 2, 8, True, seed=4)
    cos, sin = torch.ones(10, 4), torch.zeros(10, 4)
    keys, values = torch.zeros(1, 2, 20, 8), torch.zeros(1, 2, 20, 8)
    with pytest.raises(ValueError, match="outside"):
        prefill.write(q, k, v, cos, sin, table_for([(5, 6, 0)], keys, values))  # rows 5..10 of 10
    with pytest.raises(ValueError, match="cos / sin"):
        prefill.write(q, k, v, cos[:9], sin[:9], table_for([(0, 10, 0)], keys, values))
    with pytest.raises(ValueError, match="float32"):
        prefill.write(q.double(), k, v, cos, sin, table_for([(0, 10, 0)], keys, values))
    with pytest.raises(ValueError, match="rotary"):
        prefill.write(q, k, v, torch.ones(10, 10), torch.ones(10, 10), table_for([(0, 10, 0)], keys, values))
    with pytest.raises(ValueError, match="segment table"):
        prefill.write(q, k, v, cos, sin, torch.zeros(1, 5, dtype=torch.int64))
    assert not keys.any() and not values.any()


def test_the_switch_and_where_it_runs(monkeypatch):
    assert prefill.available(torch.float32, torch.device("cpu"))
    assert not prefill.available(torch.float64, torch.device("cpu"))
    assert not prefill.available(torch.float32, torch.device("meta"))
    monkeypatch.setenv("RAY_SPECDEC_NATIVE_PREFILL", "0")
    assert not prefill.available(torch.float32, torch.device("cpu"))


@pytest.mark.parametrize("build", [tiny_gpt_neox, tiny_llama], ids=["neox", "llama_gqa"])
def test_a_steps_prefill_chunks_leave_the_torch_paths_caches_and_logits(build, monkeypatch):
    """The same prefill chunks (fresh caches and a cached prefix, one piece of 1 row) and a verify after them, once
    through the native writes and once through torch: every cache row and every logit torch.equal, and the native
    writes ran once per layer and the longer chunks called torch's sdpa directly (the test would notice either path
    not being taken)."""
    target = TargetModel(build(torch.float32, seed=3))
    assert target.batch_invariant
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(1, target.vocab_size, (n,), generator=g) for n in (37, 1, 90, 12)]
    follow = torch.randint(1, target.vocab_size, (9,), generator=g)
    calls, direct = [], []
    real, real_sdpa = prefill.write, prefill.sdpa_heads_first

    def counted(*args, **kwargs):
        calls.append(kwargs.get("with_queries", True))
        return real(*args, **kwargs)

    def run(switch: str):
        monkeypatch.setenv("RAY_SPECDEC_NATIVE_PREFILL", switch)
        caches = [target.new_cache() for _ in prompts]
        target.prefill(caches[3], prompts[0][:20])  # a cached prefix: the next chunk attends over it, masked
        target.forward_batch([Segment(c, p) for c, p in zip(caches, prompts)])
        tree = build_tree(TreeConfig((2, 1)).index_paths())  # a verify over the prefilled cache
        logits = target.forward_batch([Segment(caches[2], follow[: 1 + tree.num_nodes], tree)])[0]
        return [t.clone() for c in caches for layer in c.kv.layers for t in (layer.keys, layer.values)], logits

    monkeypatch.setattr(prefill, "write", counted)
    monkeypatch.setattr(prefill, "sdpa_heads_first", lambda *args: direct.append(1) or real_sdpa(*args))
    native_kv, native_logits = run("1")
    layers = target.model.config.num_hidden_layers
    # the prefix's forward and the step's, each last layer keys only
    assert len(calls) >= 2 * layers and calls.count(False) >= 1
    assert direct  # the chunks of 37 and 90 rows call torch's sdpa themselves
    calls.clear()
    torch_kv, torch_logits = run("0")
    assert not calls
    assert len(native_kv) == len(torch_kv) == 2 * layers * len(prompts)
    assert all(torch.equal(a, b) for a, b in zip(native_kv, torch_kv))
    assert torch.equal(native_logits, torch_logits)


@pytest.mark.parametrize("groups", [1, 4])
@pytest.mark.parametrize("rows, cached, masked", [(9, 0, False), (9, 20, True), (1, 20, False), (1, 20, True)])
def test_sdpa_heads_first_is_hfs_sdpa_function_before_its_transpose(groups, rows, cached, masked):
    """The chunk's own sdpa call against HF's sdpa_attention_forward: the same bits, or None where HF would pack one
    grouped query row's heads under a mask."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    class Module(torch.nn.Module):
        is_causal = True
        num_key_value_groups = groups

    g = torch.Generator().manual_seed(6)
    kv_heads, dim, length = 2, 16, cached + rows
    query = torch.randn(1, kv_heads * groups, rows, dim, generator=g)
    key, value = (torch.randn(1, kv_heads, length, dim, generator=g) for _ in range(2))
    mask = None
    if masked:
        mask = torch.zeros(1, 1, rows, length)
        mask[..., cached:] = torch.triu(torch.full((rows, rows), torch.finfo(torch.float32).min), diagonal=1)
    ours = prefill.sdpa_heads_first(Module(), query, key, value, mask, 0.25)
    if groups > 1 and rows == 1 and masked:
        assert ours is None
        return
    hf, _ = sdpa_attention_forward(Module(), query, key, value, mask, dropout=0.0, scaling=0.25)
    assert torch.equal(ours.transpose(1, 2), hf)
