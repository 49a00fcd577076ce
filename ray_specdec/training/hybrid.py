"""Turn a Llama into a Mamba2-attention hybrid (HF `BambaForCausalLM`) the way "Mamba in the Llama" does: some
attention layers become Mamba2 layers initialized from the attention's own weights; everything else is copied.

Why Bamba: its decoder layer is Llama's (RMSNorm, mixer, RMSNorm, SwiGLU MLP of gate/up/down projections, no
biases), its attention is Llama's grouped-query attention with the 1/sqrt(head_dim) scale, and rotary embeddings
cover the whole head when the config's `rope_parameters` say `partial_rotary_factor: 1.0` (Bamba's default is half),
so a kept attention layer computes exactly what it did in the Llama. Jamba's attention has no position encoding and
its Mamba1 layers have no grouped B/C to take K and Q.

A Mamba2 layer read as linear attention: y_t = sum_{s<=t} C_t . (prod a) dt B_s x_s, with per-head decay a = exp(dt
A). So x takes V's rows, B takes K's, C takes Q's and out_proj takes o_proj, head for head:

- heads = the Llama's query heads (6 of 64 channels), expand 1 (d_inner = heads x head_dim = the hidden size);
- n_groups = query heads, d_state = head_dim: head h's C is query head h's projection, and its x and B are the
  projections of the K/V head it shares in the Llama (h // (heads / kv_heads)), repeated as grouped-query attention
  repeats them;
- the conv is the identity (last tap 1, bias 0), so x, B and C enter the scan as silu of the projections;
- dt's projection rows are 0 and dt_bias gives head h a constant dt = 1 / (4 * 2^h), A = -1 (A_log 0): head h forgets
  over 4 * 2^h tokens (4 .. 128); D = 0 (attention has no skip term);
- the gate z: its projection rows are 0 and its bias (`mamba_proj_bias`) is 1, so silu(z) is the same constant on
  every channel and the gated RMSNorm, taken per head (one group per head), only normalizes each head's output;
- the norm's weights are 1. (Setting them to the RMS of the attention's output per channel, measured on train
  text, made the start worse: held-out perplexity 234 against 230 with ones, target-llama's being 210.)

Softmax is what the Mamba layer cannot copy (and rotary); distillation from the Llama (train.py, --init-from the
directory this writes) closes the gap.

    python -m ray_specdec.training.hybrid --out runs/target-hybrid-init
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, BambaConfig, BambaForCausalLM, LlamaForCausalLM

# Layers of target-llama that become Mamba2 layers: every other one, attention kept at 0, 2 and 4 (Mamba2 at 0, 2 and
# 4 instead starts at held-out perplexity 285.6 against 230.9, on the held-out split's first 4 windows of 256 tokens).
MAMBA_LAYERS = (1, 3, 5)
GATE_BIAS = 1.0
DECAY_WINDOW_FIRST = 4  # head h forgets over DECAY_WINDOW_FIRST * 2**h tokens


def hybrid_config(llama_config, mamba_layers: tuple[int, ...] = MAMBA_LAYERS) -> BambaConfig:
    """The Bamba config of a Llama with `mamba_layers` replaced (every shape the Llama's)."""
    c = llama_config
    heads, kv_heads = c.num_attention_heads, c.num_key_value_heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
    if heads * head_dim != c.hidden_size:
        raise ValueError(f"heads x head_dim ({heads} x {head_dim}) must be the hidden size {c.hidden_size}")
    if c.attention_bias or c.mlp_bias:
        raise ValueError("only a Llama without biases maps onto Bamba's layers")
    bad = sorted(set(mamba_layers) - set(range(c.num_hidden_layers)))
    if bad or not mamba_layers:
        raise ValueError(f"mamba_layers {mamba_layers}: expected layer indices in [0, {c.num_hidden_layers})")
    rope = dict(c.rope_parameters or {"rope_type": "default", "rope_theta": 10000.0})
    if rope.get("rope_type", "default") != "default":
        raise ValueError(f"rope type {rope['rope_type']!r}: only the default rotary embedding maps onto Bamba's")
    rope["partial_rotary_factor"] = 1.0
    return BambaConfig(
        vocab_size=c.vocab_size, tie_word_embeddings=c.tie_word_embeddings, hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size, num_hidden_layers=c.num_hidden_layers, num_attention_heads=heads,
        num_key_value_heads=kv_heads, head_dim=head_dim, hidden_act=c.hidden_act, rms_norm_eps=c.rms_norm_eps,
        max_position_embeddings=c.max_position_embeddings, rope_parameters=rope, attention_bias=False, mlp_bias=False,
        attn_layer_indices=[i for i in range(c.num_hidden_layers) if i not in mamba_layers],
        mamba_n_heads=heads, mamba_d_head=head_dim, mamba_n_groups=heads, mamba_d_state=head_dim, mamba_d_conv=4,
        mamba_expand=1, mamba_chunk_size=256, mamba_conv_bias=True, mamba_proj_bias=True,
        bos_token_id=c.bos_token_id, eos_token_id=c.eos_token_id, pad_token_id=c.pad_token_id,
    )


@torch.no_grad()
def build_hybrid(llama: LlamaForCausalLM, mamba_layers: tuple[int, ...] = MAMBA_LAYERS) -> BambaForCausalLM:
    """The hybrid of `llama` (float32): kept attention layers, norms, MLPs, embeddings and LM head copied, the
    `mamba_layers` initialized from their attention (module docstring). Deterministic: no random draw reaches a
    weight."""
    llama = llama.float().eval()
    config = hybrid_config(llama.config, tuple(mamba_layers))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        hybrid = BambaForCausalLM(config).float().eval()
    src, dst = llama.model, hybrid.model
    dst.embed_tokens.weight.copy_(src.embed_tokens.weight)
    dst.final_layernorm.weight.copy_(src.norm.weight)
    hybrid.lm_head.weight.copy_(llama.lm_head.weight)
    for i, (s, d) in enumerate(zip(src.layers, dst.layers)):
        d.input_layernorm.weight.copy_(s.input_layernorm.weight)
        d.pre_ff_layernorm.weight.copy_(s.post_attention_layernorm.weight)
        d.feed_forward.load_state_dict(s.mlp.state_dict())
        if i in mamba_layers:
            _mamba_from_attention(d.mamba, s.self_attn, config)
        else:
            d.self_attn.load_state_dict(s.self_attn.state_dict())
    return hybrid


def _mamba_from_attention(mamba, attn, config: BambaConfig) -> None:
    heads, kv_heads, head_dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    d = heads * head_dim
    per_kv = heads // kv_heads

    def by_query_head(weight: torch.Tensor) -> torch.Tensor:  # [kv_heads * head_dim, in] -> [heads * head_dim, in]
        return weight.view(kv_heads, head_dim, -1).repeat_interleave(per_kv, dim=0).flatten(0, 1)

    w = torch.zeros_like(mamba.in_proj.weight)  # rows: z [d], x [d], B [groups * state], C [groups * state], dt [heads]
    w[d:2 * d] = by_query_head(attn.v_proj.weight)
    w[2 * d:3 * d] = by_query_head(attn.k_proj.weight)
    w[3 * d:4 * d] = attn.q_proj.weight
    mamba.in_proj.weight.copy_(w)
    bias = torch.zeros_like(mamba.in_proj.bias)
    bias[:d] = GATE_BIAS
    mamba.in_proj.bias.copy_(bias)
    conv = torch.zeros_like(mamba.conv1d.weight)  # [conv_dim, 1, d_conv]
    conv[:, 0, -1] = 1.0
    mamba.conv1d.weight.copy_(conv)
    mamba.conv1d.bias.zero_()
    dt = torch.tensor([1.0 / (DECAY_WINDOW_FIRST * 2 ** h) for h in range(heads)])
    mamba.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))  # softplus^-1(dt)
    mamba.A_log.zero_()
    mamba.D.zero_()
    mamba.norm.weight.fill_(1.0)
    mamba.out_proj.weight.copy_(attn.o_proj.weight)
    mamba.out_proj.bias.zero_()


def main() -> None:
    from ray_specdec.models.loading import resolve_model_path

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", default="target-llama", help="Llama model directory or embedded name")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--mamba-layers", default=",".join(map(str, MAMBA_LAYERS)))
    args = parser.parse_args()
    source = resolve_model_path(args.source)
    tokenizer = AutoTokenizer.from_pretrained(source)
    llama = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    layers = tuple(int(x) for x in args.mamba_layers.split(","))
    hybrid = build_hybrid(llama, layers)
    hybrid.save_pretrained(args.out, safe_serialization=True)
    tokenizer.save_pretrained(args.out)
    record = {"source": args.source, "mamba_layers": list(layers),
              "gate_bias": GATE_BIAS, "decay_windows": [DECAY_WINDOW_FIRST * 2 ** h
                                                        for h in range(llama.config.num_attention_heads)]}
    (args.out / "hybrid.json").write_text(json.dumps(record, indent=1) + "\n")
    params = sum(p.numel() for p in hybrid.parameters())
    print(f"{args.out}: {params / 1e6:.2f}M parameters, Mamba2 layers {list(layers)}")


if __name__ == "__main__":
    main()
