"""Architectures of the default model family (HF configs; all share the 4096-token corpus tokenizer).

Sizes follow the CPU budget: a target decode step must cost >= 8x a drafter step, and everything trains in about
an hour on 2 cores. Rotary positions need no learned table, so the targets accept 8k-token contexts although they
are trained on short windows.
"""

from __future__ import annotations

import math

from transformers import (AutoModelForCausalLM, GPTNeoXConfig, LlamaConfig, Mamba2Config, MambaConfig, PretrainedConfig,
                          PreTrainedModel)

MAX_CONTEXT = 8192


def _special_ids(eos_id: int | None) -> dict:
    return {"bos_token_id": eos_id, "eos_token_id": eos_id, "pad_token_id": eos_id}


def target_neox(vocab_size: int, eos_id: int) -> PretrainedConfig:
    # Pythia-style: parallel residual, rotary on a quarter of each head.
    return GPTNeoXConfig(
        vocab_size=vocab_size, hidden_size=384, num_hidden_layers=6, num_attention_heads=6,
        intermediate_size=1536, rotary_pct=0.25, use_parallel_residual=True, max_position_embeddings=MAX_CONTEXT,
        tie_word_embeddings=False, **_special_ids(eos_id),
    )


def target_llama(vocab_size: int, eos_id: int) -> PretrainedConfig:
    # RMSNorm, SwiGLU, full rotary, grouped-query attention (6 query heads share 2 K/V heads).
    return LlamaConfig(
        vocab_size=vocab_size, hidden_size=384, num_hidden_layers=6, num_attention_heads=6, num_key_value_heads=2,
        intermediate_size=1024, max_position_embeddings=MAX_CONTEXT, tie_word_embeddings=False, **_special_ids(eos_id),
    )


def target_hybrid(vocab_size: int, eos_id: int) -> PretrainedConfig:
    # target-llama with layers 1, 3 and 5 as Mamba2 layers (Bamba), built by training/hybrid.py: train it with
    # --init-from the directory `python -m ray_specdec.training.hybrid` writes.
    from ray_specdec.training.hybrid import hybrid_config

    return hybrid_config(target_llama(vocab_size, eos_id))


def target_mamba2(vocab_size: int, eos_id: int) -> PretrainedConfig:
    # A pure SSM target of target-neox's size class (10.7M parameters): 8 Mamba2 layers x 384, 12 heads of 64, one
    # group of B and C, d_state 64; no position limit of its own (MAX_CONTEXT as the family's).
    return Mamba2Config(
        vocab_size=vocab_size, hidden_size=384, num_hidden_layers=8, expand=2, head_dim=64, num_heads=12, n_groups=1,
        state_size=64, conv_kernel=4, tie_word_embeddings=False, max_position_embeddings=MAX_CONTEXT,
        **_special_ids(eos_id),
    )


# Mamba drafter sizes (hidden size, layers); the names give the parameter count at the family's 4096-token vocabulary
# (tied embeddings: a larger vocabulary adds vocab x hidden).
DRAFTER_SIZES = {"0.7m": (128, 2), "2.8m": (256, 4), "11m": (512, 5)}


def mamba_drafter_config(vocab_size: int, eos_id: int | None, hidden_size: int, layers: int) -> PretrainedConfig:
    return MambaConfig(
        vocab_size=vocab_size, hidden_size=hidden_size, num_hidden_layers=layers, state_size=16, expand=2,
        conv_kernel=4, tie_word_embeddings=True, **_special_ids(eos_id),
    )


def mamba2_drafter_config(vocab_size: int, eos_id: int | None, hidden_size: int, layers: int) -> PretrainedConfig:
    # The Mamba drafter's hidden size and layers give about its parameter count (2.78M against 2.80M at "2.8m": no
    # x_proj / dt_proj, a wider in_proj). Heads of 64 channels (fewer where the width is not a multiple), one group of
    # B and C, d_state 64 as in Mamba2's own configs.
    head_dim = math.gcd(64, 2 * hidden_size)
    return Mamba2Config(
        vocab_size=vocab_size, hidden_size=hidden_size, num_hidden_layers=layers, expand=2, head_dim=head_dim,
        num_heads=2 * hidden_size // head_dim, n_groups=1, state_size=64, conv_kernel=4, tie_word_embeddings=True,
        **_special_ids(eos_id),
    )


# train-drafter --arch: the drafter's family -> its config at a size
DRAFTER_CONFIGS = {"mamba": mamba_drafter_config, "mamba2": mamba2_drafter_config}


def drafter_mamba(vocab_size: int, eos_id: int) -> PretrainedConfig:
    return mamba_drafter_config(vocab_size, eos_id, *DRAFTER_SIZES["2.8m"])


def drafter_mamba2(vocab_size: int, eos_id: int) -> PretrainedConfig:
    return mamba2_drafter_config(vocab_size, eos_id, *DRAFTER_SIZES["2.8m"])


def drafter_neox_small(vocab_size: int, eos_id: int) -> PretrainedConfig:
    # About the Mamba drafter's parameter count: the baseline drafter for HF assisted generation.
    return GPTNeoXConfig(
        vocab_size=vocab_size, hidden_size=256, num_hidden_layers=3, num_attention_heads=4,
        intermediate_size=1024, rotary_pct=0.25, use_parallel_residual=True, max_position_embeddings=MAX_CONTEXT,
        tie_word_embeddings=True, **_special_ids(eos_id),
    )


ARCHITECTURES = {
    "target-neox": target_neox,
    "target-llama": target_llama,
    "target-hybrid": target_hybrid,
    "target-mamba2": target_mamba2,
    "drafter-mamba": drafter_mamba,
    "drafter-mamba2": drafter_mamba2,
    "drafter-neox-small": drafter_neox_small,
}


def build_config(arch: str, vocab_size: int, eos_id: int) -> PretrainedConfig:
    if arch not in ARCHITECTURES:
        raise ValueError(f"unknown architecture {arch!r}; expected one of {sorted(ARCHITECTURES)}")
    return ARCHITECTURES[arch](vocab_size, eos_id)


def build_model(config: PretrainedConfig) -> PreTrainedModel:
    return AutoModelForCausalLM.from_config(config)
