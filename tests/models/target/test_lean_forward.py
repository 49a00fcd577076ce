"""The lean verify forward (models/target/lean_forward.py): the logits and cache of HF's forward bit for bit, for both
families and every attention the target runs, when the target takes it, and exact greedy output on it."""

from __future__ import annotations

import pytest
import torch
from transformers import GPTNeoXForCausalLM, MambaConfig, MambaForCausalLM, activations

from ray_specdec.models.target import lean_forward
from ray_specdec.models.target.model import TargetModel
from ray_specdec.speculation.tree import build_tree
from tests.helpers.models import tiny_gpt_neox, tiny_llama
from tests.helpers.reference import assert_greedy_speculation_is_the_target_alone


def sequential_neox(dtype=torch.float32, **kwargs):
    """GPTNeoX without the parallel residual (attention, then the MLP on its output) and with rotary on half the
    head (not Pythia's quarter)."""
    model = tiny_gpt_neox(dtype, **kwargs)
    model.config.use_parallel_residual = False
    for layer in model.gpt_neox.layers:
        layer.use_parallel_residual = False
    return model


FAMILIES = {
    "neox": tiny_gpt_neox,
    "neox-sequential": sequential_neox,
    "llama-gqa": tiny_llama,
    "llama-mha": lambda dtype, **kw: tiny_llama(dtype, gqa=False, **kw),
}
TREES = [[(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)], [(0,), (0, 0)], []]  # a tree, a chain, plain decoding


def pair(build, dtype=torch.float32, native_attention=None, **kwargs):
    """Two targets over one model: the lean forward (with the model's own products: batch invariance takes others,
    tests/models/target/test_forward_batch.py) and HF's."""
    model = build(dtype, seed=3, **kwargs)
    lean = TargetModel(model, lean=True, native_attention=native_attention, batch_invariant=False)
    hf = TargetModel(model, lean=False, native_attention=native_attention)
    assert lean._lean is not None and hf._lean is None and hf.lean_why == "lean=False"
    return lean, hf


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("attention", ["native", "sdpa", "eager"])
def test_verify_is_hf_forward_bit_for_bit(family, attention):
    """Rounds of verify and commit (a tree, a chain, a plain step) on both targets: the same logits with
    torch.equal, the same kept K/V, at contexts that grow past the cache's first capacity."""
    dtype = torch.float64 if attention == "eager" and family == "llama-mha" else torch.float32
    kwargs = {"attn_implementation": "eager"} if attention == "eager" else {}
    lean, hf = pair(FAMILIES[family], dtype, native_attention=False if attention == "sdpa" else None, **kwargs)
    assert lean.native_attention == (attention == "native" and dtype == torch.float32)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(1, 128, (230,), generator=g)
    caches = [t.new_cache() for t in (lean, hf)]
    for target, cache in zip((lean, hf), caches):
        target.prefill(cache, prompt)
    for round_ in range(6):
        tree = build_tree(TREES[round_ % 3])
        tokens = torch.randint(1, 128, (tree.num_nodes,), generator=g)
        logits = [t.verify(c, 5 + round_, tree, tokens) for t, c in zip((lean, hf), caches)]
        assert torch.equal(logits[0], logits[1]), f"round {round_}: {(logits[0] - logits[1]).abs().max()}"
        keep = [0, *tree.leaf_paths[0][1:]] if tree.num_nodes else [0]
        for target, cache in zip((lean, hf), caches):
            target.commit(cache, keep)
    for a, b in zip(caches[0].kv.layers, caches[1].kv.layers):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_prefill_stops_at_the_last_layers_keys(family):
    """A prefill needs no logits, so the last layer stops once its K/V are written: its MLP never runs for prefill
    rows (the first layer's does), and every layer's cache is HF's whole forward's bit for bit, after one chunk and
    after a second; a verify after them runs the last layer whole and gives HF's logits."""
    lean, hf = pair(FAMILIES[family])
    layers = lean._lean._layers
    ran = {0: 0, len(layers) - 1: 0}
    for index in ran:
        first = next(m for m in layers[index].mlp.modules() if isinstance(m, torch.nn.Linear))  # the lean loop calls
        first.register_forward_hook(lambda *_, i=index: ran.__setitem__(i, ran[i] + 1))  # the MLP's products
    g = torch.Generator().manual_seed(1)
    caches = [t.new_cache() for t in (lean, hf)]
    for chunk in (torch.randint(1, 128, (70,), generator=g), torch.randint(1, 128, (33,), generator=g)):
        before = dict(ran)
        lean.prefill(caches[0], chunk)
        assert ran == {0: before[0] + 1, len(layers) - 1: before[len(layers) - 1]}
        hf.prefill(caches[1], chunk)  # the same model, so its hooks count too
        for layer, (a, b) in enumerate(zip(caches[0].kv.layers, caches[1].kv.layers)):
            assert a.keys.shape[-2] == b.keys.shape[-2] == caches[1].length
            assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values), f"layer {layer}"
    tree, tokens = build_tree([(0,), (1,)]), torch.tensor([4, 9])
    last = ran[len(layers) - 1]
    logits = [t.verify(c, 3, tree, tokens) for t, c in zip((lean, hf), caches)]
    assert torch.equal(logits[0], logits[1])
    assert ran[len(layers) - 1] == last + 2  # both targets' verifies ran it


def test_a_model_put_in_training_mode_goes_back_to_hf_forward(monkeypatch):
    """The lean loop skips the dropouts, so a model in training mode verifies through HF's forward (dropout 0 here,
    so the logits still match); back in eval mode, through the loop again."""
    lean, hf = pair(tiny_gpt_neox)
    calls = []
    original = lean_forward.LeanForward.forward
    monkeypatch.setattr(lean_forward.LeanForward, "forward",
                        lambda self, *a, **kw: calls.append(1) or original(self, *a, **kw))
    tree, tokens = build_tree([(0,), (1,)]), torch.tensor([4, 9])
    caches = [t.new_cache() for t in (lean, hf)]
    for target, cache in zip((lean, hf), caches):
        target.prefill(cache, torch.arange(1, 20))
    calls.clear()  # the prefill's
    for training in (True, False):
        lean.model.train(training)
        assert lean._lean.available is not training
        logits = [t.verify(c, 3, tree, tokens) for t, c in zip((lean, hf), caches)]
        assert torch.equal(logits[0], logits[1])
        for target, cache in zip((lean, hf), caches):
            target.commit(cache, [0])
        assert calls == ([] if training else [1])


def test_why_unsupported():
    assert lean_forward.why_unsupported(tiny_gpt_neox()) is None
    assert lean_forward.why_unsupported(tiny_llama()) is None
    mamba = MambaForCausalLM(MambaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1)).eval()
    assert "MambaForCausalLM" in lean_forward.why_unsupported(mamba)
    assert "training" in lean_forward.why_unsupported(tiny_gpt_neox().train())

    class Custom(GPTNeoXForCausalLM):  # a subclass may change what its layers do
        pass

    custom = Custom(tiny_gpt_neox().config).eval()
    assert "Custom" in lean_forward.why_unsupported(custom)
    with pytest.raises(ValueError, match="cannot run this model"):
        lean_forward.LeanForward(custom)


def test_when_the_target_takes_the_lean_forward(monkeypatch):
    assert TargetModel(tiny_llama()).lean_why is None
    assert TargetModel(tiny_gpt_neox(torch.float64)).lean_why is None  # any dtype: the ops are HF's own
    custom = type("Custom", (GPTNeoXForCausalLM,), {})(tiny_gpt_neox().config).eval()
    assert "Custom" in TargetModel(custom).lean_why
    with pytest.raises(RuntimeError, match="lean=True but it runs"):
        TargetModel(custom, lean=True)
    monkeypatch.setenv("RAY_SPECDEC_LEAN", "0")
    assert TargetModel(tiny_gpt_neox()).lean_why == "RAY_SPECDEC_LEAN=0"
    assert TargetModel(tiny_gpt_neox(), lean=True).lean_why is None  # an explicit True overrides the environment


def test_greedy_speculation_on_the_lean_forward_is_the_target_alone():
    """Plain decoding and tree drafts on the lean forward give HF generate's tokens on the model as loaded."""
    target = TargetModel(tiny_llama(torch.float32, seed=5), lean=True)
    assert_greedy_speculation_is_the_target_alone(tiny_llama(torch.float32, seed=5), target, prompt_step=17)


@pytest.mark.parametrize("make", [
    lambda: torch.nn.GELU(), lambda: torch.nn.GELU(approximate="tanh"), lambda: torch.nn.SiLU(),
    lambda: activations.GELUActivation(), lambda: activations.SiLUActivation(),
], ids=["gelu", "gelu-tanh", "silu", "hf-gelu", "hf-silu"])
def test_an_activation_in_place_has_the_modules_bits(make):
    module = make()
    x = torch.randn(37, 96) * 4
    expected = module(x)
    out = lean_forward._activate_in_place(module, x)
    assert out.data_ptr() == x.data_ptr()  # written over the product's output, no new buffer
    assert torch.equal(out, expected)


@pytest.mark.parametrize("make", [
    lambda: activations.GELUActivation(use_gelu_python=True), lambda: torch.nn.ReLU(),
    lambda: activations.NewGELUActivation(),
], ids=["hf-gelu-python", "relu", "gelu-new"])
def test_other_activations_are_called_as_they_are(make):
    module = make()
    x = torch.randn(37, 96) * 4
    before = x.clone()
    assert torch.equal(lean_forward._activate_in_place(module, x), module(before))
    assert torch.equal(x, before)  # its input untouched


def test_an_activation_whose_forward_was_replaced_is_called_as_it_is():
    module = torch.nn.GELU()
    module.forward = lambda x: x + 1  # as a kernel library swaps an instance's forward
    x = torch.zeros(4, 8)
    assert torch.equal(lean_forward._activate_in_place(module, x), torch.ones(4, 8))
    assert torch.equal(x, torch.zeros(4, 8))
