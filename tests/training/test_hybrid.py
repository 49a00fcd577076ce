"""The Llama -> Mamba2 hybrid builder (training/hybrid.py): what it copies, what the Mamba2 layers take from the
attention, that kept attention computes what the Llama's did, and that the hybrid is served as an SSM target with
HF generate's greedy tokens; so are the shipped target-hybrid and target-mamba2, with their drafters."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, BambaForCausalLM

from ray_specdec.config import SamplingParams, TreeConfig
from ray_specdec.defaults import (DRAFTER_MAMBA2, DRAFTER_MAMBA_HYBRID, TARGET_HYBRID, TARGET_MAMBA2,
                                  default_model_path)
from ray_specdec.engine.llm import SpeculativeEngine
from ray_specdec.models.drafter.kinds import load_drafter_model
from ray_specdec.models.target.kinds import load_target_model
from ray_specdec.models.target.ssm import SSMTargetModel
from ray_specdec.training.corpus import heldout_prompts
from ray_specdec.training.hybrid import MAMBA_LAYERS, build_hybrid, hybrid_config
from tests.helpers.configs import lookup_off
from tests.helpers.inputs import random_prompt
from tests.helpers.models import tiny_llama, tiny_mamba
from tests.helpers.reference import greedy_margin, hf_greedy


@pytest.fixture(scope="module")
def llama():
    return AutoModelForCausalLM.from_pretrained(default_model_path("target-llama"), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def hybrid(llama) -> BambaForCausalLM:
    return build_hybrid(llama)


def test_kept_weights_are_target_llamas(llama, hybrid):
    src, dst = llama.model, hybrid.model
    assert hybrid.config.layers_block_type == ["full_attention", "linear_attention"] * 3 and MAMBA_LAYERS == (1, 3, 5)
    assert torch.equal(dst.embed_tokens.weight, src.embed_tokens.weight)
    assert torch.equal(dst.final_layernorm.weight, src.norm.weight)
    assert torch.equal(hybrid.lm_head.weight, llama.lm_head.weight)
    for i, (s, d) in enumerate(zip(src.layers, dst.layers)):
        assert torch.equal(d.input_layernorm.weight, s.input_layernorm.weight)
        assert torch.equal(d.pre_ff_layernorm.weight, s.post_attention_layernorm.weight)
        for name in ("gate_proj", "up_proj", "down_proj"):
            assert torch.equal(getattr(d.feed_forward, name).weight, getattr(s.mlp, name).weight)
        if i in MAMBA_LAYERS:
            continue
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            assert torch.equal(getattr(d.self_attn, name).weight, getattr(s.self_attn, name).weight), (i, name)
            assert getattr(d.self_attn, name).bias is None


def test_mamba_layers_take_the_attentions_projections(llama, hybrid):
    """x from V, B from K (each K/V head repeated over the query heads that share it), C from Q, out_proj from O;
    z's and dt's projection rows 0; and a second build is the same bits."""
    d, head = 384, 64
    for i in MAMBA_LAYERS:
        attn, mamba = llama.model.layers[i].self_attn, hybrid.model.layers[i].mamba
        w = mamba.in_proj.weight
        for h in range(6):
            kv = slice((h // 3) * head, (h // 3 + 1) * head)
            rows = slice(h * head, (h + 1) * head)
            assert torch.equal(w[d:2 * d][rows], attn.v_proj.weight[kv])
            assert torch.equal(w[2 * d:3 * d][rows], attn.k_proj.weight[kv])
        assert torch.equal(w[3 * d:4 * d], attn.q_proj.weight)
        assert not w[:d].any() and not w[4 * d:].any()
        assert torch.equal(mamba.out_proj.weight, attn.o_proj.weight)
    again = build_hybrid(llama).state_dict()
    assert all(torch.equal(value, again[name]) for name, value in hybrid.state_dict().items())


def test_kept_attention_computes_the_llamas(llama, hybrid):
    """Layer 0 is kept: its output is the Llama's (full rotary, GQA, the same scale); layer 1, a Mamba2 layer now,
    starts near the attention it replaces."""
    ids = torch.tensor([random_prompt(40, seed=3, vocab=4096)])
    with torch.no_grad():
        ours = hybrid(input_ids=ids, output_hidden_states=True).hidden_states
        theirs = llama(input_ids=ids, output_hidden_states=True).hidden_states
    torch.testing.assert_close(ours[1], theirs[1], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(ours[2], theirs[2], atol=1e-3)
    assert hybrid_config(llama.config).rope_parameters["partial_rotary_factor"] == 1.0


def test_hybrid_is_served_with_hf_generates_greedy_tokens(tmp_path):
    """A tiny Llama's hybrid, saved and loaded through the target loader: an SSM target whose greedy tokens, plain and
    drafting trees, are HF generate's."""
    build_hybrid(tiny_llama(torch.float64, layers=4, seed=2), (1, 3)).save_pretrained(tmp_path)
    target = load_target_model(str(tmp_path), dtype=torch.float64)
    assert isinstance(target, SSMTargetModel) and isinstance(target.model, BambaForCausalLM)
    for length in (5, 30):
        prompt = random_prompt(length, seed=length)
        expected = hf_greedy(target, prompt, 16)
        assert greedy_margin(target.model, prompt, expected) > 1e-6
        for drafter, tree in ((None, ()), (tiny_mamba(), (3, 2, 1))):
            engine = SpeculativeEngine(target, drafter, TreeConfig(tree), config=lookup_off())
            assert engine.generate(prompt, SamplingParams(max_new_tokens=16)).token_ids == expected, (length, tree)


@pytest.mark.parametrize("target_name, drafter_name", [(TARGET_HYBRID, DRAFTER_MAMBA_HYBRID),
                                                      (TARGET_MAMBA2, DRAFTER_MAMBA2)])
def test_shipped_ssm_targets_give_hf_generates_greedy_tokens_with_their_drafters(target_name, drafter_name):
    """The embedded names load as SSM targets (the hybrid and the pure Mamba2) and their drafters as Mamba and Mamba2
    drafters; plain, a chain and a tree of the drafts give HF generate's tokens (float32, held-out prompts whose
    greedy paths have no near tie)."""
    target = load_target_model(target_name)
    blocks = {TARGET_HYBRID: ["full_attention", "linear_attention"], TARGET_MAMBA2: None}[target_name]
    assert isinstance(target, SSMTargetModel) and getattr(target.model.config, "layers_block_type", [None])[:2] == (
        blocks or [None])
    drafter = load_drafter_model(drafter_name)
    assert type(drafter).__name__ == {DRAFTER_MAMBA_HYBRID: "MambaDrafter", DRAFTER_MAMBA2: "Mamba2Drafter"}[
        drafter_name]
    for held_out in heldout_prompts(2, 48, 48, 0, target.tokenizer):
        prompt = held_out.token_ids
        expected = hf_greedy(target, prompt, 24)
        assert greedy_margin(target.model, prompt, expected) > 1e-3
        for tree in ((), (1, 1, 1), (2, 2, 1, 1)):
            engine = SpeculativeEngine(target, drafter if tree else None, TreeConfig(tree), config=lookup_off())
            assert engine.generate(prompt, SamplingParams(max_new_tokens=24)).token_ids == expected, tree
