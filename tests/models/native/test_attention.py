"""Native CPU attention (models/native/attention.py, attention_cpu.c) against float64 softmax attention, its
dispatch (which calls take the kernel, which go to sdpa), and the target on it: verify logits, exact greedy output."""

from __future__ import annotations

import pytest
import torch

from ray_specdec.models.native import attention, library

from ray_specdec.models.target.model import TargetModel
from ray_specdec.speculation.tree import build_tree
from tests.helpers.models import tiny_gpt_neox, tiny_llama
from tests.helpers.reference import assert_greedy_speculation_is_the_target_alone

LOWEST = torch.finfo(torch.float32).min
TOL = dict(rtol=2e-5, atol=2e-6)

pytestmark = pytest.mark.skipif(library.load() is None,
                                reason=f"native kernels unavailable: {library.why_unavailable()}")


def reference(q, k, v, mask, scale):
    """float64 softmax attention: q [1, H, S, D], k / v [1, Hkv, L, D], additive mask [1 or H, S, L] or None."""
    group = q.shape[1] // k.shape[1]
    k, v = (t.double().repeat_interleave(group, dim=1) for t in (k, v))
    scores = q.double() @ k.transpose(-1, -2) * scale
    if mask is not None:
        scores = scores + mask.double()
    return (scores.softmax(-1) @ v).transpose(1, 2)  # [1, S, H, D]


def inputs(heads, kv_heads, rows, length, dim, seed=0, spread=1.0):
    """Strided like the real ones: q a slice of a fused qkv projection, k / v views of larger cache buffers."""
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(1, rows, heads, 3 * dim, generator=g).transpose(1, 2) * spread
    cache = torch.randn(2, 1, kv_heads, length + 37, dim, generator=g)
    return qkv[..., :dim], cache[0, :, :, :length], cache[1, :, :, :length]


@pytest.mark.parametrize("heads, kv_heads, rows, length, dim", [(6, 2, 17, 300, 80), (4, 1, 40, 517, 128)])
def test_kernel_matches_float64_attention_on_every_path(native_isa, heads, kv_heads, rows, length, dim):
    """The same check on every instruction-set path this CPU runs, on shapes that reach the tails of each."""
    _assert_matches_float64_attention(heads, kv_heads, rows, length, dim)


@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (6, 2), (4, 1)])
@pytest.mark.parametrize("rows", [1, 3, 8, 9, 16, 17, 40, 64])  # row groups of 16, ragged and several
@pytest.mark.parametrize("length, dim", [(1, 64), (129, 24), (300, 80), (517, 128)])  # key blocks of 128; 64- and
def test_kernel_matches_float64_attention(heads, kv_heads, rows, length, dim):            # 16-wide value chunks, tails
    _assert_matches_float64_attention(heads, kv_heads, rows, length, dim)


def _assert_matches_float64_attention(heads, kv_heads, rows, length, dim):
    q, k, v = inputs(heads, kv_heads, rows, length, dim)
    g = torch.Generator().manual_seed(1)
    mask = torch.where(torch.rand(1, rows, length, generator=g) < 0.3, LOWEST, 0.0)
    mask[..., 0] = 0.0  # every row sees at least one key
    for m in (None, mask, mask + torch.randn(heads, rows, length, generator=g)):  # none, shared, per head
        out = attention.tree_attention(q, k, v, m, dim**-0.5)
        assert out.shape == (1, rows, heads, dim) and out.is_contiguous()
        torch.testing.assert_close(out.double(), reference(q, k, v, m, dim**-0.5), **TOL)


def test_running_max_rescales_earlier_blocks():
    """Scores that grow block after block (and one row whose max is in the first block): every new maximum must
    rescale what the earlier key blocks summed."""
    q, k, v = inputs(2, 2, 5, 700, 32, spread=3.0)
    ramp = torch.linspace(-30.0, 30.0, 700)
    mask = torch.stack([ramp, -ramp, ramp.flip(0) * 0.1, torch.zeros(700), ramp.abs()])[None]
    torch.testing.assert_close(attention.tree_attention(q, k, v, mask, 0.2).double(),
                               reference(q, k, v, mask, 0.2), **TOL)  # fmt: skip


def test_masked_keys_get_no_weight():
    """Values behind a LOWEST mask are poisoned: any weight on them would show."""
    q, k, v = inputs(3, 3, 6, 260, 64)
    mask = torch.full((1, 6, 260), LOWEST)
    mask[..., 200:] = 0.0
    v = v.clone()
    v[:, :, :200] = 1e30
    out = attention.tree_attention(q, k, v, mask, 0.125)
    torch.testing.assert_close(out.double(), reference(q[..., :], k[:, :, 200:], v[:, :, 200:], None, 0.125), **TOL)


def tree_mask(rows, length):
    """A verify's mask: the cache visible to every row, then a chain among the rows."""
    mask = torch.zeros(1, 1, rows, length)
    mask[..., length - rows:] = torch.triu(torch.full((rows, rows), LOWEST), 1)
    return mask


class Module:
    is_causal = True
    num_key_value_groups = 3


def test_attention_dispatch(monkeypatch):
    calls = []
    real = attention.tree_attention
    monkeypatch.setattr(attention, "tree_attention", lambda *a: calls.append(a[0].shape[2]) or real(*a))
    q, k, v = inputs(6, 2, 12, 90, 16)
    mask = tree_mask(12, 90)
    with torch.inference_mode():
        native_out, _ = attention.attention(Module(), q, k, v, mask, scaling=0.25)
        sdpa_out, _ = attention.sdpa_attention_forward(Module(), q, k, v, mask, scaling=0.25)
        assert calls == [12]
        torch.testing.assert_close(native_out, sdpa_out, rtol=1e-5, atol=1e-6)
        bool_out, _ = attention.attention(Module(), q, k, v, mask == 0, scaling=0.25)  # HF's boolean masks
        assert calls == [12, 12]
        torch.testing.assert_close(bool_out, sdpa_out, rtol=1e-5, atol=1e-6)
        # sdpa: no mask with several rows (causal), too few or too many rows, float64, a batch of two
        attention.attention(Module(), q, k, v, None, scaling=0.25)
        attention.attention(Module(), q[:, :, :2], k, v, mask[:, :, :2], scaling=0.25)
        q65, k65, v65 = inputs(6, 2, 65, 90, 16)
        attention.attention(Module(), q65, k65, v65, tree_mask(65, 90), scaling=0.25)
        attention.attention(Module(), q.double(), k.double(), v.double(), mask.double(), scaling=0.25)
        attention.attention(Module(), q.expand(2, -1, -1, -1), k.expand(2, -1, -1, -1),
                                v.expand(2, -1, -1, -1), mask.expand(2, -1, -1, -1), scaling=0.25)  # fmt: skip
    assert calls == [12, 12]
    attention.attention(Module(), q, k, v, mask, scaling=0.25)  # autograd on: sdpa (the kernel has no backward)
    assert calls == [12, 12]


@pytest.mark.parametrize("build", [tiny_gpt_neox, tiny_llama])
def test_target_verify_on_native_attention(build):
    """The same verify through the kernel and through sdpa: logits agree to float32 rounding."""
    native_target = TargetModel(build(torch.float32, seed=3), planned_gemm=False)
    plain = TargetModel(build(torch.float32, seed=3), planned_gemm=False, native_attention=False)
    assert native_target.native_attention and not plain.native_attention
    assert native_target.model.config._attn_implementation == attention.NAME
    tree = build_tree([(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)])
    tokens = torch.randint(1, 128, (tree.num_nodes,), generator=torch.Generator().manual_seed(0))
    prompt = torch.randint(1, 128, (150,), generator=torch.Generator().manual_seed(1))
    logits = []
    for target in (native_target, plain):
        cache = target.new_cache()
        target.prefill(cache, prompt)
        logits.append(target.verify(cache, 7, tree, tokens))
    torch.testing.assert_close(logits[0], logits[1], rtol=1e-4, atol=1e-5)


def test_greedy_speculation_on_native_attention_is_the_target_alone():
    """float32: plain decoding and tree drafts on the native attention give HF generate's tokens on the model as
    loaded (sdpa), on prompts whose greedy path holds no float32 near-tie."""
    target = TargetModel(tiny_gpt_neox(torch.float32, seed=5), planned_gemm=False)
    assert target.native_attention
    assert_greedy_speculation_is_the_target_alone(tiny_gpt_neox(torch.float32, seed=5), target, prompt_step=17)


def test_when_the_target_takes_native_attention(monkeypatch):
    assert not TargetModel(tiny_gpt_neox(torch.float64)).native_attention  # float64: sdpa
    with pytest.raises(RuntimeError, match="native_attention=True but .*float32"):
        TargetModel(tiny_gpt_neox(torch.float64), native_attention=True)
    eager = TargetModel(tiny_gpt_neox(torch.float32, attn_implementation="eager"))
    assert not eager.native_attention and "sdpa" in eager.native_attention_why
    monkeypatch.setenv("RAY_SPECDEC_NATIVE", "0")
    library.load.cache_clear()
    try:
        off = TargetModel(tiny_gpt_neox(torch.float32))
        assert not off.native_attention and "RAY_SPECDEC_NATIVE=0" in off.native_attention_why
        assert off.model.config._attn_implementation == "sdpa"
    finally:
        library.load.cache_clear()


@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (6, 2)])
@pytest.mark.parametrize("threads", [1, 2])
def test_ragged_call_is_each_segments_own_call_bit_for_bit(native_isa, heads, kv_heads, threads):
    """One ragged call over segments of 1-40 rows and 0-300 cached keys writes each segment's new K/V into its cache
    buffer and gives every row exactly what `tree_attention` gives its segment alone."""
    g = torch.Generator().manual_seed(3)
    dim, sizes, cached = 16, [1, 5, 17, 40, 3], [0, 300, 12, 129, 64]
    rows = sum(sizes)
    qkv = torch.randn(1, rows, heads + 2 * kv_heads, dim, generator=g).transpose(1, 2)
    query, key, value = qkv[:, :heads], qkv[:, heads : heads + kv_heads], qkv[:, heads + kv_heads :]
    segments, expected, start = [], [], 0
    for size, length in zip(sizes, cached):
        buffers = torch.randn(2, 1, kv_heads, length + size + 7, dim, generator=g)
        mask = torch.where(torch.rand(size, length + size, generator=g) < 0.3, LOWEST, 0.0)
        keys = torch.cat([buffers[0, :, :, :length], key[:, :, start : start + size]], dim=2)
        values = torch.cat([buffers[1, :, :, :length], value[:, :, start : start + size]], dim=2)
        expected.append((attention.tree_attention(query[:, :, start : start + size], keys, values, mask[None],
                                                      0.25), keys, values))  # fmt: skip
        segments.append((start, size, buffers[0], buffers[1], mask))
        start += size
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = attention.tree_attention_ragged(query, key, value, segments, 0.25)
    finally:
        torch.set_num_threads(before)
    for (row, size, k_buf, v_buf, _), (alone, keys, values) in zip(segments, expected):
        assert torch.equal(out[:, row : row + size], alone)
        assert torch.equal(k_buf[:, :, : keys.shape[2]], keys) and torch.equal(v_buf[:, :, : values.shape[2]], values)


@pytest.mark.parametrize("threads", [1, 2])
def test_a_table_segment_without_a_mask_is_an_all_zero_mask_bit_for_bit(threads):
    """tree_attention_table: a segment whose mask address is 0 gets the bits of an all-zero mask (its rows see every
    key), next to masked segments; rows 1 and 4, 300 cached keys (scores of both signs, zeros among them)."""
    g = torch.Generator().manual_seed(5)
    heads, kv_heads, dim = 6, 2, 16
    sizes, cached = [1, 4, 1], [300, 40, 0]
    rows = sum(sizes)
    qkv = torch.randn(1, rows, heads + 2 * kv_heads, dim, generator=g).transpose(1, 2)
    qkv[:, :, 0, :3] = 0.0
    query, key, value = qkv[:, :heads], qkv[:, heads : heads + kv_heads], qkv[:, heads + kv_heads :]
    buffers = [torch.randn(2, 1, kv_heads, length + size, dim, generator=g) for size, length in zip(sizes, cached)]
    masks = [torch.zeros(size, length + size) for size, length in zip(sizes, cached)]
    masks[1][:, -3:] = LOWEST
    segments = [(sum(sizes[:i]), size, b[0], b[1], m) for i, (size, b, m) in enumerate(zip(sizes, buffers, masks))]
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with_masks = attention.tree_attention_ragged(query, key, value, segments, 0.25)
        table = torch.tensor([
            (size, b.shape[-2], row, b[0].data_ptr(), b[0].stride(1), b[0].stride(2), b[1].data_ptr(),
             b[1].stride(1), b[1].stride(2), *((0, 0) if size == 1 else (m.data_ptr(), m.stride(0))))
            for (row, size, _, _, m), b in zip(segments, buffers)
        ], dtype=torch.int64)  # fmt: skip
        without = attention.tree_attention_table(query, key, value, table, 0.25)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(without, with_masks)
    with pytest.raises(ValueError, match="contiguous int64"):
        attention.tree_attention_table(query, key, value, table.int(), 0.25)
