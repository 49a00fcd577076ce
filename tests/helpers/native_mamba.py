"""Mamba shapes that cross every block boundary of the native C GEMM (64- and 16-wide output blocks, a ragged tail,
row groups of 4), as perturbed random models."""

from __future__ import annotations

from transformers import MambaConfig, MambaForCausalLM

from tests.helpers.models import perturbed_mamba

VOCAB = 93  # 5 x 16 + a tail of 13 logits
# in_proj 2 x 80 = 2 x 64 + 2 x 16 outputs; out_proj 40 = 2 x 16 + 8; x_proj 5 + 2 x 6 = 17 = 16 + 1
CONFIGS = {
    "ragged": dict(hidden_size=40, state_size=6, num_hidden_layers=3, expand=2, conv_kernel=4, time_step_rank=5),
    "biases": dict(hidden_size=24, state_size=16, num_hidden_layers=2, expand=3, conv_kernel=3, time_step_rank=4,
                   use_bias=True, use_conv_bias=False, tie_word_embeddings=False),
}


def mamba(name: str, seed: int = 0) -> MambaForCausalLM:
    return perturbed_mamba(MambaConfig(vocab_size=VOCAB, **CONFIGS[name]), seed)
