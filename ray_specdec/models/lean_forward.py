"""The target's verify forward without HF's per-call machinery: GPTNeoX and Llama models, over their own modules.

A verify forward on CPU multiplies a handful of rows by every weight, so a few hundred microseconds of Python per
call matter: at 200 tokens of context a 5-row verify of the default target took ~3.8 ms, ~1.9 of them GEMMs. HF's
model forward spends about 1 ms of that outside the maths (output dataclasses, keyword plumbing, mask preparation,
per-layer module calls and decorators). `LeanForward` runs the same computation as a flat loop over the layers:
it calls the model's own embedding, norms, Linear layers (with their planned GEMM paths), MLPs, rotary embedding and
attention function (HF's attention interface, the native kernel where installed), and does the glue between them
(reshapes, rotary application, the cache write, residual sums) with the same operations in the same order as the
HF code it replaces. The logits are HF's forward's bit for bit (tests/models/test_lean_forward.py checks
`torch.equal` for both families, with and without the native attention), which is what lets the target use it:
nothing about the output may change.

`why_unsupported(model)` names what keeps a model on HF's forward: other architectures (a family whose layers do
anything else, e.g. Qwen3's q/k norms, needs its own loop here), training mode, DeepSpeed shards (their Linear layers
all-reduce and hold a shard of the heads) and devices other than the CPU (CUDA has its graphs: models/cuda_graphs.py).
"""

from __future__ import annotations

import torch
from transformers import GPTNeoXForCausalLM, LlamaForCausalLM, PreTrainedModel
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.gpt_neox import modeling_gpt_neox
from transformers.models.llama import modeling_llama

from ray_specdec.models.kv_cache import GrowableKVCache

# Exactly these classes: a subclass may change what a layer does.
SUPPORTED = (GPTNeoXForCausalLM, LlamaForCausalLM)


def why_unsupported(model) -> str | None:
    """Why `LeanForward` cannot run this model (None when it can)."""
    if type(model) not in SUPPORTED:
        return f"it runs {', '.join(c.__name__ for c in SUPPORTED)}, not {type(model).__name__}"
    if next(model.parameters()).device.type != "cpu":
        return "it runs on CPU"
    if model.training:
        return "the model is in training mode"
    return None


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF's apply_rotary_pos_emb for one tensor [1, H, S, D], with cos / sin [1, 1, S, R] for its first R dims,
    operation for operation (so bit for bit)."""
    rotary = cos.shape[-1]
    if rotary == x.shape[-1]:  # Llama's form: every dimension rotates
        x1, x2 = x[..., : rotary // 2], x[..., rotary // 2 :]
        return (x * cos) + (torch.cat((-x2, x1), dim=-1) * sin)
    rot, rest = x[..., :rotary], x[..., rotary:]  # GPTNeoX's partial rotary: the rest passes through
    x1, x2 = rot[..., : rotary // 2], rot[..., rotary // 2 :]
    embedded = (rot * cos) + (torch.cat((-x2, x1), dim=-1) * sin)
    return torch.cat([embedded, rest], dim=-1)


class LeanForward:
    """`forward(input_ids, position_ids, mask, cache)` -> logits, as `model(...)` returns them."""

    def __init__(self, model: PreTrainedModel):
        why = why_unsupported(model)
        if why is not None:
            raise ValueError(f"LeanForward cannot run this model: {why}")
        self.model = model
        neox = isinstance(model, GPTNeoXForCausalLM)
        body = model.gpt_neox if neox else model.model
        # What differs between the families, resolved once: embedding, layers, final norm, layer step, eager attention.
        self._embed = body.embed_in if neox else body.embed_tokens
        self._rotary = body.rotary_emb
        self._layers = body.layers if neox else body.layers[: model.config.num_hidden_layers]
        self._norm = body.final_layer_norm if neox else body.norm
        self._step = self._neox_layer if neox else self._llama_layer
        self._eager = (modeling_gpt_neox if neox else modeling_llama).eager_attention_forward
        self._head = model.get_output_embeddings()

    @property
    def available(self) -> bool:
        """Whether the model is still one this loop runs (it may have been put in training mode since)."""
        return not self.model.training

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, mask: torch.Tensor | None,
                cache: GrowableKVCache) -> torch.Tensor:
        """input_ids / position_ids [1, S]; mask: additive [1, 1 or H, S, cache + S] (a verify's; None is for one
        row); the cache grows by S rows. -> logits [1, S, V]."""
        attention = ALL_ATTENTION_FUNCTIONS.get_interface(self.model.config._attn_implementation, self._eager)
        hidden = self._embed(input_ids)
        cos, sin = self._rotary(hidden, position_ids=position_ids)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        for layer in self._layers:
            hidden = self._step(layer, hidden, cos, sin, mask, cache, attention)
        return self._head(self._norm(hidden))

    @staticmethod
    def _neox_layer(layer, hidden, cos, sin, mask, cache, attention) -> torch.Tensor:
        """GPTNeoXLayer.forward (eval: its dropouts are identities)."""
        attn = layer.attention
        rows = hidden.shape[:-1]
        qkv = attn.query_key_value(layer.input_layernorm(hidden)).view(*rows, -1, 3 * attn.head_size).transpose(1, 2)
        query, key, value = qkv.chunk(3, dim=-1)
        query, key = _rotate(query, cos, sin), _rotate(key, cos, sin)
        key, value = cache.update(key, value, attn.layer_idx)
        out, _ = attention(attn, query, key, value, mask, scaling=attn.scaling, dropout=0.0)
        out = attn.dense(out.reshape(*rows, -1).contiguous())
        if layer.use_parallel_residual:
            return layer.mlp(layer.post_attention_layernorm(hidden)) + out + hidden
        out = out + hidden
        return layer.mlp(layer.post_attention_layernorm(out)) + out

    @staticmethod
    def _llama_layer(layer, hidden, cos, sin, mask, cache, attention) -> torch.Tensor:
        """LlamaDecoderLayer.forward."""
        attn = layer.self_attn
        rows = hidden.shape[:-1]
        normed = layer.input_layernorm(hidden)
        shape = (*rows, -1, attn.head_dim)
        query = attn.q_proj(normed).view(shape).transpose(1, 2)
        key = attn.k_proj(normed).view(shape).transpose(1, 2)
        value = attn.v_proj(normed).view(shape).transpose(1, 2)
        query, key = _rotate(query, cos, sin), _rotate(key, cos, sin)
        key, value = cache.update(key, value, attn.layer_idx)
        out, _ = attention(attn, query, key, value, mask, dropout=0.0, scaling=attn.scaling)
        hidden = hidden + attn.o_proj(out.reshape(*rows, -1).contiguous())
        return hidden + layer.mlp(layer.post_attention_layernorm(hidden))
