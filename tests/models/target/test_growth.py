"""Growth keeps the function: a grown GPTNeoX, Bamba or Mamba2 gives its source's logits (tiny random models at several
factors, the built target-neox-large against target-neox and target-hybrid-large against target-hybrid), and the
speculative engine's greedy output on a grown target is its source's HF generate's."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch
from safetensors import safe_open
from transformers import (AutoConfig, AutoModelForCausalLM, GPTNeoXConfig, GPTNeoXForCausalLM, Mamba2Config,
                          Mamba2ForCausalLM)

from ray_specdec.config import SamplingParams, TreeConfig
from ray_specdec.defaults import (DRAFTER_MAMBA, TARGET_HYBRID, TARGET_HYBRID_LARGE, TARGET_NEOX, TARGET_NEOX_LARGE,
                                  default_model_path, embedded_model_path)
from ray_specdec.engine.llm import SpeculativeEngine
from ray_specdec.models.drafter.mamba import MambaDrafter
from ray_specdec.models.target.growth import (dyadic_shares, ensure_grown, grow_config, grow_state_dict, grow_tensor,
                                              read_growth, split_by_shares)
from ray_specdec.models.target.model import TargetModel
from ray_specdec.models.target.ssm import SSMTargetModel
from tests.helpers.configs import lookup_off
from tests.helpers.inputs import random_prompt
from tests.helpers.models import SSM_TARGETS, tiny_gpt_neox, tiny_mamba
from tests.helpers.reference import greedy_margin

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
    with pytest.raises(ValueError, match="growth knows model types gpt_neox, bamba, mamba2; got 'llama'"):
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


# ----- Bamba (attention, Mamba2 and gated MLPs) and Mamba2 -----

MAMBA2_LITERAL = {"model_type": "mamba2", "hidden_size": 1, "expand": 2, "num_heads": 2, "head_dim": 1, "n_groups": 1,
                  "state_size": 1}


def test_mamba2_mixer_copies_each_segment_so_heads_keep_their_groups():
    # in_proj rows: z (2 heads), x (2 heads), B (1 group), C (1 group), dt (2 heads); hidden 1
    w = torch.arange(1.0, 9.0)[:, None]
    grown = grow_tensor("backbone.layers.0.mixer.in_proj.weight", w, 2, 1, MAMBA2_LITERAL)
    # every segment copied in place: heads 2 and 3 are heads 0 and 1 again, and read group 1 (4 heads / 2 groups), B
    # and C's copy of group 0
    assert grown.sum(dim=1).tolist() == [1, 2, 1, 2, 3, 4, 3, 4, 5, 5, 6, 6, 7, 8, 7, 8]
    assert grown[:, 0].tolist() == grown[:, 1].tolist() == [0.5 * v for v in grown.sum(dim=1).tolist()]
    conv = torch.arange(1.0, 5.0).view(4, 1, 1)  # channels x (2), B, C
    assert grow_tensor("backbone.layers.0.mixer.conv1d.weight", conv, 2, 1, MAMBA2_LITERAL).flatten().tolist() == [
        1, 2, 1, 2, 3, 3, 4, 4]
    config = grow_config(MAMBA2_LITERAL, 2, 1)
    assert (config["hidden_size"], config["num_heads"], config["n_groups"], config["head_dim"]) == (2, 4, 2, 1)


def test_bamba_kv_heads_are_copied_as_the_query_heads_are():
    config = SSM_TARGETS["bamba"]().config.to_dict()  # hidden 32: 4 query heads of 8 dims on 2 K/V heads
    grown = grow_config(config, 3, 2)
    assert (grown["num_attention_heads"], grown["num_key_value_heads"]) == (12, 6)
    assert (grown["mamba_n_heads"], grown["mamba_n_groups"], grown["intermediate_size"]) == (24, 6, 128)
    k = torch.arange(2.0).repeat_interleave(8)[:, None].expand(16, 32)  # every row: its K/V head's index
    heads = grow_tensor("model.layers.1.self_attn.k_proj.weight", k, 3, 2, config).sum(dim=1).view(6, 8) / 32
    assert heads[:, 0].tolist() == [0, 1, 0, 1, 0, 1] and (heads == heads[:, :1]).all()
    # grouped-query attention: query head j reads K/V head j // 2; query copy c * 4 + h is query head h
    assert [heads[j // 2, 0].item() for j in range(12)] == [(j % 4) // 2 for j in range(12)]


def _grown_hf(model, hidden_factor: int, mlp_factor: int, config: dict | None = None):
    config = config or model.config.to_dict()
    grown = AutoModelForCausalLM.from_config(AutoConfig.for_model(**grow_config(config, hidden_factor, mlp_factor)))
    grown = grown.to(model.dtype).eval()
    grown.load_state_dict(grow_state_dict(model.state_dict(), hidden_factor, mlp_factor, config))
    return grown


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("hidden_factor, mlp_factor", [(1, 3), (2, 2), (4, 3), (3, 3), (3, 1)])
@pytest.mark.parametrize("kind", ["bamba", "mamba2"])
def test_grown_tiny_ssm_model_gives_the_same_logits(kind, dtype, hidden_factor, mlp_factor):
    model = SSM_TARGETS[kind](dtype, seed=hidden_factor * 10 + mlp_factor)
    grown = _grown_hf(model, hidden_factor, mlp_factor)
    ids = torch.randint(1, 128, (3, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected, actual = model(ids).logits, grown(ids).logits
    assert expected.abs().max() > 4.0  # logits far from zero: the tolerances below are tight
    # observed max |difference|: float64 <= 5e-15 where hidden_factor is a power of two, float32 <= 1.7e-5. HF's
    # RMSNorms take the mean of squares in float32 whatever the dtype: over 3 copies it rounds unlike over one (float64
    # then <= 6.5e-6 on these logits); over 2 or 4 copies of these widths torch's float32 sum comes out the same.
    if dtype == torch.float64:
        tolerance = 1e-12 if hidden_factor & (hidden_factor - 1) == 0 else 3e-5
    else:
        tolerance = 1e-4
    assert (actual - expected).abs().max().item() < tolerance


def test_a_tied_mamba2_is_built_untied_with_its_function(tmp_path):
    untied = SSM_TARGETS["mamba2"](torch.float64, seed=4)
    config = Mamba2Config.from_dict({**untied.config.to_dict(), "tie_word_embeddings": True})
    tied = Mamba2ForCausalLM(config).to(torch.float64).eval()
    tied.load_state_dict(untied.state_dict(), strict=False)
    tied.tie_weights()
    assert tied.lm_head.weight.data_ptr() == tied.backbone.embeddings.weight.data_ptr()
    tied.save_pretrained(tmp_path / "source")  # the file leaves the tied head out
    out = ensure_grown("grown", tmp_path / "source", tmp_path / "grown", 3, 1)
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is False
    grown = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float64).eval()
    assert grown.lm_head.weight.data_ptr() != grown.backbone.embeddings.weight.data_ptr()
    ids = torch.randint(1, 128, (2, 30), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert (grown(ids).logits - tied(ids).logits).abs().max().item() < 3e-5  # 3 copies: float32 norms, above


def plain_greedy(target: SSMTargetModel, prompt: list[int], n: int) -> list[int]:
    """The target alone, greedy (tests/engine/test_ssm_target.py holds it to HF generate's)."""
    engine = SpeculativeEngine(target, None, TreeConfig(()), config=lookup_off())
    return engine.generate(prompt, SamplingParams(max_new_tokens=n)).token_ids


@pytest.mark.parametrize("kind", ["bamba", "mamba2"])
def test_speculative_greedy_on_a_grown_ssm_target_is_the_sources(kind):
    source = SSM_TARGETS[kind](torch.float64, seed=7)
    target = SSMTargetModel(_grown_hf(source, 3, 2))
    prompt, n = random_prompt(9, seed=9), 13
    expected = plain_greedy(SSMTargetModel(source), prompt, n)
    assert greedy_margin(source, prompt, expected) > 1e-3  # far above the grown model's float32-norm rounding
    for drafter, branching in ((None, ()), (tiny_mamba(), (2, 2, 1))):
        engine = SpeculativeEngine(target, drafter, TreeConfig(branching), config=lookup_off())
        assert engine.generate(prompt, SamplingParams(max_new_tokens=n)).token_ids == expected


@pytest.fixture(scope="module")
def hybrid_large_dir():
    """target-hybrid-large built once into this test run's cache directory (tests/conftest.py)."""
    return embedded_model_path(TARGET_HYBRID_LARGE)


def test_hybrid_large_model_directory(hybrid_large_dir):
    config = json.loads((hybrid_large_dir / "config.json").read_text())
    shape = ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
             "mamba_n_heads", "mamba_n_groups", "mamba_d_head", "mamba_d_state", "mamba_expand")
    assert [config[key] for key in shape] == [768, 12, 4, 64, 2048, 12, 12, 64, 64, 1]
    growth = read_growth(hybrid_large_dir)
    assert (growth["grown_from"], growth["hidden_factor"], growth["mlp_factor"]) == (TARGET_HYBRID, 2, 2)
    assert growth["source_training"]["parameters"] == 13_651_272
    with safe_open(hybrid_large_dir / "model.safetensors", framework="pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"F16"}
        assert sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys()) == growth["parameters"] == 48_255_120
    for file in ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "chat_template.jinja"):
        assert (hybrid_large_dir / file).read_bytes() == (default_model_path(TARGET_HYBRID) / file).read_bytes()


# observed max |difference| on logits up to ~8: float64 <= 9e-7 (HF's float32 RMSNorm sums 768 squares in another
# order than 384), float32 <= 4e-6
@pytest.mark.parametrize("dtype, tolerance", [(torch.float64, 1e-5), (torch.float32, 5e-5)])
def test_hybrid_large_model_gives_target_hybrid_logits(hybrid_large_dir, dtype, tolerance):
    source = AutoModelForCausalLM.from_pretrained(default_model_path(TARGET_HYBRID), dtype=dtype).eval()
    large = AutoModelForCausalLM.from_pretrained(hybrid_large_dir, dtype=dtype).eval()
    with torch.no_grad():
        for prompt in PROMPTS:
            ids = torch.tensor([prompt])
            expected = source(ids).logits
            assert expected.abs().max() > 5.0
            assert (large(ids).logits - expected).abs().max().item() < tolerance


def test_speculative_greedy_on_hybrid_large_is_target_hybrids(hybrid_large_dir):
    source = SSMTargetModel.from_pretrained(str(default_model_path(TARGET_HYBRID)))
    prompt, n = source.tokenizer.encode("def read_file(path):\n"), 8
    expected = plain_greedy(source, prompt, n)
    assert greedy_margin(source.model, prompt, expected) > 1e-3  # far above float32 rounding: no near tie
    large = SSMTargetModel.from_pretrained(str(hybrid_large_dir))
    drafter = MambaDrafter.from_pretrained(str(default_model_path(DRAFTER_MAMBA)))
    result = SpeculativeEngine(large, drafter, TreeConfig((2, 2, 1)), config=lookup_off()).generate(
        prompt, SamplingParams(max_new_tokens=n))
    assert result.token_ids == expected
    assert result.stats.mean_accepted_length > 1.0
