"""native/decoder.py: a batch-invariant verify forward's decoder layers in one native call. Against the torch ops it
replaces (the same forward with `native_decoder` off): logits and K/V to float32 rounding and the same greedy tokens,
for GPTNeoX (parallel and sequential residual) and Llama (grouped-query, biased projections); rows computed in
parallel are the bits they are alone; weights changed in place are read again; what it does not run falls back."""

from __future__ import annotations

import pytest
import torch

from ray_specdec.config import TreeConfig
from ray_specdec.models.native import decoder, library
from ray_specdec.models.target.model import Segment, TargetModel
from ray_specdec.speculation.tree import build_tree
from tests.helpers.models import tiny_gpt_neox, tiny_llama

pytestmark = pytest.mark.skipif(library.load() is None, reason="native kernels unavailable")


def _model(family: str):
    if family == "neox":
        return tiny_gpt_neox(seed=5)
    if family == "neox_sequential":
        model = tiny_gpt_neox(seed=5)
        model.config.use_parallel_residual = False
        for layer in model.gpt_neox.layers:
            layer.use_parallel_residual = False
        return model
    if family == "llama_gqa":
        return tiny_llama(seed=5)
    model = tiny_llama(seed=5, gqa=False)  # biased q, k, v, o and MLP products
    for layer in model.model.layers:
        for linear in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj, layer.self_attn.o_proj,
                       layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj):  # fmt: skip
            linear.bias = torch.nn.Parameter(torch.randn(linear.out_features, generator=torch.Generator().manual_seed(
                linear.out_features)) * 0.1)  # fmt: skip
    return model


def _tokens(n: int, seed: int) -> torch.Tensor:
    return torch.randint(1, 128, (n,), generator=torch.Generator().manual_seed(seed))


def _tree(shape: tuple[int, ...]):
    return build_tree(TreeConfig(shape).index_paths())


def _rounds(target: TargetModel, native_layers) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """A prefill, a tree verify (two rows kept), a plain verify: every verify's logits and the cache's K/V after."""
    target._lean.native_decoder = native_layers
    cache = target.new_cache()
    target.prefill(cache, _tokens(40, 1))
    tree = _tree((3, 2, 1))
    logits = [target.verify(cache, 7, tree, _tokens(tree.num_nodes, 2))]
    target.commit(cache, [0, 1])
    logits.append(target.verify(cache, 9, _tree(()), torch.empty(0, dtype=torch.long)))
    target.commit(cache, [0])
    kv = [t[..., : cache.length, :].clone() for layer in cache.kv.layers for t in (layer.keys, layer.values)]
    return logits, kv


@pytest.mark.parametrize("family", ["neox", "neox_sequential", "llama_gqa", "llama_biased"])
def test_native_layers_agree_with_the_torch_ops(native_isa, family):
    target = TargetModel(_model(family))
    native_layers = target._lean.native_decoder
    assert native_layers is not None, target._lean.native_decoder_why
    ours, ours_kv = _rounds(target, native_layers)
    theirs, theirs_kv = _rounds(target, None)
    assert len(ours_kv) == len(theirs_kv) > 0
    for a, b in zip(ours + ours_kv, theirs + theirs_kv, strict=True):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=0)
    for a, b in zip(ours, theirs, strict=True):
        assert torch.equal(a.argmax(-1), b.argmax(-1))
    # and it did run: the two paths' bits differ somewhere (the norms' sums and erf / exp are C's)
    assert any(not torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))


@pytest.mark.parametrize("threads", [1, 2])
def test_rows_in_a_big_batch_are_their_bits_alone(native_isa, threads):
    """Enough rows that the elementwise work splits over threads (PARALLEL_MIN_ELEMENTS): each segment's logits and
    K/V are the bits it gets in a forward of its own."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        target = TargetModel(tiny_gpt_neox(seed=6))
        assert target._lean.native_decoder is not None
        shapes = [(3, 2, 1), (1, 1, 1, 1), (), (2, 2, 1), (3, 3)] * 4  # 20 segments, 183 rows of 192 wide q, k, v

        def caches():
            out = []
            for i in range(len(shapes)):
                cache = target.new_cache()
                target.prefill(cache, _tokens(10 + 3 * i, 100 + i))
                out.append(cache)
            return out

        def segments(cs):
            return [Segment(c, _tokens(1 + _tree(s).num_nodes, 200 + i), _tree(s))
                    for i, (c, s) in enumerate(zip(cs, shapes))]  # fmt: skip

        together_caches = caches()
        together = target.forward_batch(segments(together_caches))
        assert sum(t.shape[0] for t in together) * 3 * 64 >= 32768
        alone_caches = caches()
        for i, segment in enumerate(segments(alone_caches)):
            (alone,) = target.forward_batch([segment])
            assert torch.equal(alone, together[i]), i
            for a, b in zip(alone_caches[i].kv.layers, together_caches[i].kv.layers, strict=True):
                assert torch.equal(a.keys[..., : alone_caches[i].length, :], b.keys[..., : alone_caches[i].length, :])
                assert torch.equal(a.values[..., : alone_caches[i].length, :],
                                   b.values[..., : alone_caches[i].length, :])  # fmt: skip
    finally:
        torch.set_num_threads(before)


def test_a_weight_changed_in_place_is_read_again():
    target = TargetModel(tiny_llama(seed=7))
    native_layers = target._lean.native_decoder
    before, _ = _rounds(target, native_layers)
    with torch.no_grad():
        target.model.model.layers[1].mlp.down_proj.weight.mul_(1.5)
    ours, _ = _rounds(target, native_layers)
    theirs, _ = _rounds(target, None)
    assert not torch.allclose(ours[0], before[0], atol=1e-3)
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=0)


def test_what_it_does_not_run_falls_back_to_the_torch_ops(monkeypatch):
    model = tiny_gpt_neox(seed=5)
    model.config.hidden_act = "gelu_new"
    assert "activation" in decoder.why_not(model)
    assert "float32" in decoder.why_not(tiny_llama(torch.float64, seed=5))
    assert "fit" in decoder.why_not(tiny_llama(seed=5), rotary=17 * 2 * 8)
    monkeypatch.setenv("RAY_SPECDEC_NATIVE_DECODER", "0")
    target = TargetModel(tiny_gpt_neox(seed=5))
    assert target._lean.native_decoder is None
    assert target._lean.native_decoder_why == "RAY_SPECDEC_NATIVE_DECODER=0"
    logits, _ = _rounds(target, None)  # the torch ops still verify
    assert logits[0].shape == (1 + _tree((3, 2, 1)).num_nodes, 128)
