"""Growth keeps the function: a grown GPTNeoX gives its source's logits (tiny random models at several factors, and the
built target-neox-large against target-neox), and the speculative engine's greedy output on the large target is HF
generate's."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, GPTNeoXConfig, GPTNeoXForCausalLM

from ray_specdec.config import SamplingParams, TreeConfig
from ray_specdec.defaults import DRAFTER_MAMBA, TARGET_NEOX, TARGET_NEOX_LARGE, default_model_path, embedded_model_path
from ray_specdec.engine.llm import SpeculativeEngine
from ray_specdec.models.drafter.mamba import MambaDrafter
from ray_specdec.models.target.growth import (dyadic_shares, ensure_grown, grow_config, grow_state_dict, grow_tensor,
                                              read_growth, split_by_shares)
from ray_specdec.models.target.model import TargetModel
from tests.helpers.models import tiny_gpt_neox

PROMPTS = [[17, 400, 9, 3000, 12, 77, 5], list(range(100, 160, 3))]


def test_dyadic_shares_are_powers_of_two_that_sum_to_one():
    assert dyadic_shares(1) == [1.0]
    assert dyadic_shares(2) == [0.5, 0.5]
    assert dyadic_shares(3) == [0.5, 0.25, 0.25]
    assert dyadic_shares(4) == [0.25] * 4
    assert dyadic_shares(5) == [0.25, 0.25, 0.25, 0.125, 0.125]
    assert dyadic_shares(6) == [0.25, 0.25, 0.125, 0.125, 0.125, 0.125]
    for copies in range(1, 20):
        assert sum(dyadic_shares(copies)) == 1.0 and len(dyadic_shares(copies)) == copies


def test_shares_of_float16_weights_sum_back_bit_for_bit():
    # normal values, values whose quarter is subnormal, and the smallest subnormals
    w = torch.tensor([0.1, -1.5, 3.0e-5, -2.4e-4, 1.2e-4, 6.0e-8, -1.8e-7], dtype=torch.float16)
    assert (w * 0.25).double().mul(4).ne(w.double()).any()  # a plain quarter loses bits here
    for copies in (2, 3, 5):
        parts = split_by_shares(w, copies)
        assert all(p.dtype == torch.float16 for p in parts)
        assert torch.equal(sum(p.double() for p in parts), w.double())


def test_fused_qkv_copies_whole_heads():
    # 2 heads of head_dim 1 over hidden 1: rows q0 k0 v0 q1 k1 v1
    w = torch.tensor([[1.0], [2.0], [3.0], [4.0], [5.0], [6.0]])
    grown = grow_tensor("gpt_neox.layers.0.attention.query_key_value.weight", w, hidden_factor=2, mlp_factor=1)
    rows = [[1.0], [2.0], [3.0], [4.0], [5.0], [6.0]] * 2
    assert grown.tolist() == [[0.5 * r[0], 0.5 * r[0]] for r in rows]
    # heads as GPTNeoXAttention reads them: [heads, 3 * head_dim]; head 2 is head 0 again, head 3 is head 1
    assert grown.sum(dim=1).view(4, 3).tolist() == [[1, 2, 3], [4, 5, 6], [1, 2, 3], [4, 5, 6]]


def test_unknown_tensor_has_no_rule():
    with pytest.raises(ValueError, match="no growth rule"):
        grow_tensor("gpt_neox.layers.0.attention.rotary_emb.inv_freq", torch.ones(4), 2, 2)
    with pytest.raises(ValueError, match="GPTNeoX only"):
        grow_config({"model_type": "llama"}, 2, 2)


def _randomized(model: GPTNeoXForCausalLM, seed: int) -> GPTNeoXForCausalLM:
    """Every parameter random (HF initializes biases to 0 and LayerNorms to 1, which would hide a wrong rule)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64).to(p.dtype) * 0.3)
    return model


def _grown(model: GPTNeoXForCausalLM, hidden_factor: int, mlp_factor: int) -> GPTNeoXForCausalLM:
    config = GPTNeoXConfig.from_dict(grow_config(model.config.to_dict(), hidden_factor, mlp_factor))
    grown = GPTNeoXForCausalLM(config).to(model.dtype).eval()
    grown.load_state_dict(grow_state_dict(model.state_dict(), hidden_factor, mlp_factor))
    return grown


@pytest.mark.parametrize("dtype, tolerance", [(torch.float64, 1e-13), (torch.float32, 1e-5)])
@pytest.mark.parametrize("hidden_factor, mlp_factor", [(1, 3), (2, 2), (3, 3), (3, 1), (5, 2)])
def test_grown_tiny_model_gives_the_same_logits(dtype, tolerance, hidden_factor, mlp_factor):
    model = _randomized(tiny_gpt_neox(dtype, hidden=32, heads=2), seed=hidden_factor * 10 + mlp_factor)
    grown = _grown(model, hidden_factor, mlp_factor)
    assert grown.config.hidden_size == 32 * hidden_factor and grown.config.num_attention_heads == 2 * hidden_factor
    assert grown.config.intermediate_size == 128 * mlp_factor
    ids = torch.randint(1, 128, (3, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected, actual = model(ids).logits, grown(ids).logits
    assert expected.abs().max() > 1.0  # logits far from zero: the tolerance below is tight
    # observed max |difference| on logits up to ~2.6: float64 <= 2.7e-15, float32 <= 1.5e-6
    assert (actual - expected).abs().max().item() < tolerance


@pytest.fixture(scope="module")
def large_dir():
    """target-neox-large built once into this test run's cache directory (tests/conftest.py)."""
    return embedded_model_path(TARGET_NEOX_LARGE)


def test_large_model_directory(large_dir):
    config = json.loads((large_dir / "config.json").read_text())
    assert (config["hidden_size"], config["num_attention_heads"], config["intermediate_size"]) == (1152, 18, 4608)
    growth = read_growth(large_dir)
    assert (growth["grown_from"], growth["hidden_factor"], growth["mlp_factor"]) == (TARGET_NEOX, 3, 3)
    assert growth["source_training"]["parameters"] == 13_793_280
    with safe_open(large_dir / "model.safetensors", framework="pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"F16"}  # the source's precision
    for file in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (large_dir / file).read_bytes() == (default_model_path(TARGET_NEOX) / file).read_bytes()
    model = AutoModelForCausalLM.from_pretrained(large_dir, dtype=torch.float32)
    assert sum(p.numel() for p in model.parameters()) == growth["parameters"] == 105_080_832


@pytest.mark.parametrize("dtype, tolerance", [(torch.float64, 1e-10), (torch.float32, 1e-4)])
def test_large_model_gives_target_neox_logits(large_dir, dtype, tolerance):
    # observed max |difference| on logits up to ~12: float64 ~2e-14, float32 ~1e-5
    source = AutoModelForCausalLM.from_pretrained(default_model_path(TARGET_NEOX), dtype=dtype).eval()
    large = AutoModelForCausalLM.from_pretrained(large_dir, dtype=dtype).eval()
    with torch.no_grad():
        for prompt in PROMPTS:
            ids = torch.tensor([prompt])
            assert (large(ids).logits - source(ids).logits).abs().max().item() < tolerance


def test_build_is_kept_and_rebuilt_when_stale(tmp_path):
    source = default_model_path(TARGET_NEOX)
    out = ensure_grown("grown", source, tmp_path / "grown", 2, 1)
    weights = out / "model.safetensors"
    built_at = weights.stat().st_mtime_ns
    assert ensure_grown("grown", source, out, 2, 1) == out and weights.stat().st_mtime_ns == built_at
    record = read_growth(out)
    (out / "growth.json").write_text(json.dumps({**record, "fingerprint": "stale"}))
    ensure_grown("grown", source, out, 2, 1)
    assert read_growth(out) == record and weights.stat().st_mtime_ns != built_at
    assert sorted(os.listdir(tmp_path)) == [".grown.lock", "grown"]  # no staging directory left behind


@pytest.fixture(scope="module")
def large_target(large_dir):
    return TargetModel.from_pretrained(str(large_dir), dtype="float64")


@pytest.mark.parametrize("branching", [(1, 1, 1), (2, 2, 1)])
def test_speculative_greedy_on_large_target_is_hf_generate(large_target, branching):
    prompt = large_target.tokenizer.encode("def read_file(path):\n")
    n = 6
    out = large_target.model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None,
                                      pad_token_id=0, attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    expected = out[0, len(prompt):].tolist()
    drafter = MambaDrafter.from_pretrained(str(default_model_path(DRAFTER_MAMBA)), dtype="float64")
    result = SpeculativeEngine(large_target, drafter, TreeConfig(branching)).generate(
        prompt, SamplingParams(max_new_tokens=n, ignore_eos=True))
    assert result.token_ids == expected
    assert result.stats.mean_accepted_length > 1.0  # the shipped drafter agrees with the grown target at times
