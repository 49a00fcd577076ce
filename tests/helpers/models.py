"""Seeded random tiny HF causal LMs, Mamba drafters and a tiny tokenizer for tests: nothing is downloaded.

Builders return a model in eval mode, in the requested dtype, with weights drawn from a fixed seed (the global torch
RNG is left untouched). `initializer_range` is larger than HF's 0.02 so that next-token distributions are peaked
enough for greedy decoding to be non-trivial (not the same token over and over).
"""

from __future__ import annotations

import torch
from transformers import (
    AutoModelForCausalLM,
    BambaConfig,
    BambaForCausalLM,
    GPTNeoXConfig,
    JambaConfig,
    JambaForCausalLM,
    LlamaConfig,
    Mamba2Config,
    Mamba2ForCausalLM,
    MambaConfig,
    MambaForCausalLM,
    MistralConfig,
    PreTrainedModel,
    PreTrainedTokenizerFast,
)

from ray_specdec.models.drafter.mamba import MambaDrafter
from ray_specdec.models.drafter.mamba2 import Mamba2Drafter


def _build(config, dtype: torch.dtype, seed: int) -> PreTrainedModel:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return model.to(dtype).eval()


def tiny_gpt_neox(
    dtype: torch.dtype = torch.float32,
    *,
    vocab: int = 128,
    hidden: int = 64,
    layers: int = 2,
    heads: int = 4,
    max_positions: int = 256,
    attn_implementation: str = "sdpa",
    seed: int = 0,
) -> PreTrainedModel:
    """Pythia-style GPTNeoX: parallel residual, partial rotary (25%), untied embeddings, eos = 0."""
    config = GPTNeoXConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        intermediate_size=4 * hidden,
        max_position_embeddings=max_positions,
        initializer_range=0.1,
        bos_token_id=0,
        eos_token_id=0,
        attn_implementation=attn_implementation,
    )
    return _build(config, dtype, seed)


def tiny_llama(
    dtype: torch.dtype = torch.float32,
    *,
    vocab: int = 128,
    hidden: int = 64,
    layers: int = 2,
    heads: int = 4,
    gqa: bool = True,
    max_positions: int = 256,
    attn_implementation: str = "sdpa",
    seed: int = 0,
) -> PreTrainedModel:
    """Llama with grouped-query attention (2 KV heads for 4 query heads) unless gqa=False; eos = [2, 3]."""
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads // 2 if gqa else heads,
        intermediate_size=2 * hidden,
        max_position_embeddings=max_positions,
        initializer_range=0.1,
        bos_token_id=1,
        eos_token_id=[2, 3],
        attn_implementation=attn_implementation,
    )
    return _build(config, dtype, seed)


def tiny_mistral(
    dtype: torch.dtype = torch.float32,
    *,
    vocab: int = 128,
    hidden: int = 64,
    layers: int = 2,
    heads: int = 4,
    sliding_window: int | None = 8,
    max_positions: int = 256,
    attn_implementation: str = "sdpa",
    seed: int = 0,
) -> PreTrainedModel:
    """Mistral with GQA and a (tiny, so that tests cross it) sliding attention window; eos = 2."""
    config = MistralConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads // 2,
        intermediate_size=2 * hidden,
        max_position_embeddings=max_positions,
        sliding_window=sliding_window,
        initializer_range=0.1,
        bos_token_id=1,
        eos_token_id=2,
        attn_implementation=attn_implementation,
    )
    return _build(config, dtype, seed)


def tiny_tokenizer(texts: list[str] | None = None) -> PreTrainedTokenizerFast:
    """A word-level tokenizer trained on a few strings, wrapped for `save_pretrained` / `AutoTokenizer`."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    texts = texts or ["the quick brown fox jumps over the lazy dog", "a tree of tokens is verified in one pass"]
    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(texts, trainers.WordLevelTrainer(special_tokens=["<eos>", "<unk>"]))
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", unk_token="<unk>")


def tiny_mamba(dtype=torch.float64, vocab=128, seed=0, fast_matmul=False) -> MambaDrafter:
    config = MambaConfig(vocab_size=vocab, hidden_size=32, num_hidden_layers=2, state_size=8, expand=2,
                         conv_kernel=4, initializer_range=0.1)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = MambaForCausalLM(config)
    return MambaDrafter(model.to(dtype).eval(), fast_matmul=fast_matmul)


def perturbed_mamba(config: MambaConfig, seed: int = 0) -> MambaForCausalLM:
    """Seeded random model; every weight is perturbed so that norms, D, biases and A all matter."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = MambaForCausalLM(config)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.2 * torch.randn_like(p))
    return model.eval()


def tiny_mamba_lm(dtype: torch.dtype = torch.float64, *, vocab: int = 128, hidden: int = 32, layers: int = 2,
                  state: int = 8, conv_kernel: int = 4, eos: int = 0, seed: int = 0) -> MambaForCausalLM:
    """A Mamba causal LM (an SSM target), every weight perturbed so that its greedy continuations do not collapse
    into one repeated token; eos = `eos`."""
    config = MambaConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, state_size=state, expand=2,
                         conv_kernel=conv_kernel, initializer_range=0.1, eos_token_id=eos, bos_token_id=eos,
                         pad_token_id=eos)
    return perturbed_mamba(config, seed).to(dtype)


def tiny_mamba2_lm(dtype: torch.dtype = torch.float64, *, vocab: int = 128, hidden: int = 32, layers: int = 2,
                   heads: int = 8, head_dim: int = 8, groups: int = 2, state: int = 8, eos: int = 0,
                   seed: int = 0) -> Mamba2ForCausalLM:
    """A Mamba2 causal LM (an SSM target) with two groups of heads, every weight perturbed as `tiny_mamba_lm`'s."""
    config = Mamba2Config(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_heads=heads,
                          head_dim=head_dim, n_groups=groups, state_size=state, expand=heads * head_dim // hidden,
                          conv_kernel=4, chunk_size=16, initializer_range=0.1, eos_token_id=eos, bos_token_id=eos,
                          pad_token_id=eos)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Mamba2ForCausalLM(config)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.2 * torch.randn_like(p))
    return model.to(dtype).eval()


def tiny_mamba2(dtype: torch.dtype = torch.float64, vocab: int = 128, seed: int = 0, native: bool | None = None
                ) -> Mamba2Drafter:  # fmt: skip
    """A Mamba2 drafter over `tiny_mamba2_lm` (two groups of heads; widths that fill whole vectors, so that a
    float32 one steps row-invariantly on the native path)."""
    return Mamba2Drafter(tiny_mamba2_lm(dtype, vocab=vocab, seed=seed), native=native)


def tiny_jamba_lm(dtype: torch.dtype = torch.float64, *, vocab: int = 128, hidden: int = 32, eos: int = 0,
                  seed: int = 0) -> JambaForCausalLM:
    """A Jamba causal LM (a hybrid target): Mamba, attention (GQA), Mamba, attention; an MLP after the Mamba layers
    and a mixture of 4 experts (2 per token) after the attention ones; every weight perturbed as `tiny_mamba_lm`'s."""
    config = JambaConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=2 * hidden, mamba_d_state=8, mamba_d_conv=4,
                         mamba_expand=2, mamba_dt_rank=4, attn_layer_period=2, attn_layer_offset=1,
                         expert_layer_period=2, expert_layer_offset=1, num_experts=4, num_experts_per_tok=2,
                         initializer_range=0.1, use_mamba_kernels=False, eos_token_id=eos, bos_token_id=eos,
                         pad_token_id=eos)
    config._experts_implementation = "eager"  # HF's grouped expert products take no float64
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = JambaForCausalLM(config)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.2 * torch.randn_like(p))
    return model.to(dtype).eval()


def tiny_bamba_lm(dtype: torch.dtype = torch.float64, *, vocab: int = 128, hidden: int = 32, eos: int = 0,
                  seed: int = 0) -> BambaForCausalLM:
    """A Bamba causal LM (a Mamba2 hybrid): Mamba2, attention (GQA, rotary over half of each head), Mamba2,
    attention, each with an MLP; two groups of Mamba2 heads; every weight perturbed as `tiny_mamba_lm`'s."""
    config = BambaConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=2 * hidden, attn_layer_indices=[1, 3],
                         mamba_n_heads=8, mamba_d_head=hidden // 4, mamba_n_groups=2, mamba_d_state=8, mamba_d_conv=4,
                         mamba_expand=2, mamba_chunk_size=16, initializer_range=0.1, eos_token_id=eos,
                         bos_token_id=eos, pad_token_id=eos)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = BambaForCausalLM(config)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.2 * torch.randn_like(p))
    return model.to(dtype).eval()


# the SSM and hybrid target classes' tiny builders
SSM_TARGETS = {"mamba": tiny_mamba_lm, "mamba2": tiny_mamba2_lm, "jamba": tiny_jamba_lm, "bamba": tiny_bamba_lm}
