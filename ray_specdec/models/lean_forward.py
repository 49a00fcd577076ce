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

One forward can carry the rows of several requests (continuous batching): the rows are concatenated into one
activation, so every product reads each weight once for all of them, and attention runs per `Span` (a request's
rows) over that request's own cache with its own mask. With `batch_invariant=True` the products, activations,
rotary tables and tree attention are batch_invariant.py's, so a row's result does not depend on the other rows;
otherwise they are the model's own calls (HF's logits bit for bit).

`why_unsupported(model)` names what keeps a model on HF's forward: other architectures (a family whose layers do
anything else, e.g. Qwen3's q/k norms, needs its own loop here), training mode, DeepSpeed shards (their Linear layers
all-reduce and hold a shard of the heads) and devices other than the CPU (CUDA has its graphs: models/cuda_graphs.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from transformers import GPTNeoXForCausalLM, LlamaForCausalLM, PreTrainedModel
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.gpt_neox import modeling_gpt_neox
from transformers.models.llama import modeling_llama

from ray_specdec.models import batch_invariant as invariant
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


@dataclass
class Span:
    """One request's rows `[start, end)` of a batched forward: they attend over `cache` (which grows by them)."""

    start: int
    end: int
    cache: GrowableKVCache
    mask: torch.Tensor | None  # the attention's mask: [1, 1, S, cache + S] (None: causal, or one row)
    tree: bool  # a verify's rows (tree mask, additive); else a prefill chunk's (causal)


def _call(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return module(x)


class LeanForward:
    """`forward(input_ids, position_ids, spans)` -> logits of every row, as `model(...)` returns them for one span."""

    def __init__(self, model: PreTrainedModel, batch_invariant: bool = False):
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
        # What batch invariance changes, resolved once: products, activations, rotary values, tree attention.
        self.batch_invariant = batch_invariant
        if batch_invariant:
            why = invariant.why_unsupported(model)
            if why is not None:
                raise ValueError(f"LeanForward cannot be batch-invariant for this model: {why}")
            self._product, self._activate = invariant.product, invariant.activate
            self._table = invariant.RotaryTable(self._rotary, model.config.max_position_embeddings,
                                                next(model.parameters()).dtype)  # fmt: skip
        else:
            self._product, self._activate, self._table = _call, _call, None

    @property
    def available(self) -> bool:
        """Whether the model is still one this loop runs (it may have been put in training mode since)."""
        return not self.model.training

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, spans: Sequence[Span],
                logits: bool = True) -> torch.Tensor | None:
        """input_ids / position_ids [1, R], spans covering the R rows in order; each span's cache grows by its rows.
        -> logits [1, R, V], or None (logits=False: prefill chunks need only their K/V)."""
        attention = ALL_ATTENTION_FUNCTIONS.get_interface(self.model.config._attn_implementation, self._eager)
        hidden = self._embed(input_ids)
        if self._table is not None:
            cos, sin = self._table(position_ids, int(position_ids.max()) + 1)
        else:
            cos, sin = self._rotary(hidden, position_ids=position_ids)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        for layer in self._layers:
            hidden = self._step(layer, hidden, cos, sin, spans, attention)
        return self._product(self._head, self._norm(hidden)) if logits else None

    def _attend(self, module, query, key, value, spans: Sequence[Span], attention) -> torch.Tensor:
        """query [1, H, R, D], key / value [1, Hkv, R, D] of all rows -> [1, R, H * D]: each span writes its K/V to
        its cache and attends over it."""
        outs = []
        for span in spans:
            rows = slice(span.start, span.end)
            keys, values = span.cache.update(key[:, :, rows], value[:, :, rows], module.layer_idx)
            if span.tree and self.batch_invariant:
                out = invariant.tree_attention(query[:, :, rows], keys, values, span.mask, module.scaling)
            else:
                out, _ = attention(module, query[:, :, rows], keys, values, span.mask, dropout=0.0,
                                   scaling=module.scaling)  # fmt: skip
            outs.append(out)
        out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
        return out.reshape(*query.shape[:1], query.shape[2], -1).contiguous()

    def _neox_layer(self, layer, hidden, cos, sin, spans, attention) -> torch.Tensor:
        """GPTNeoXLayer.forward (eval: its dropouts are identities)."""
        attn, mlp = layer.attention, layer.mlp
        rows = hidden.shape[:-1]
        qkv = self._product(attn.query_key_value, layer.input_layernorm(hidden))
        query, key, value = qkv.view(*rows, -1, 3 * attn.head_size).transpose(1, 2).chunk(3, dim=-1)
        query, key = _rotate(query, cos, sin), _rotate(key, cos, sin)
        out = self._product(attn.dense, self._attend(attn, query, key, value, spans, attention))

        def feed_forward(x):  # GPTNeoXMLP.forward
            return self._product(mlp.dense_4h_to_h, self._activate(mlp.act, self._product(mlp.dense_h_to_4h, x)))

        if layer.use_parallel_residual:
            return feed_forward(layer.post_attention_layernorm(hidden)) + out + hidden
        out = out + hidden
        return feed_forward(layer.post_attention_layernorm(out)) + out

    def _llama_layer(self, layer, hidden, cos, sin, spans, attention) -> torch.Tensor:
        """LlamaDecoderLayer.forward."""
        attn, mlp = layer.self_attn, layer.mlp
        rows = hidden.shape[:-1]
        normed = layer.input_layernorm(hidden)
        shape = (*rows, -1, attn.head_dim)
        query = self._product(attn.q_proj, normed).view(shape).transpose(1, 2)
        key = self._product(attn.k_proj, normed).view(shape).transpose(1, 2)
        value = self._product(attn.v_proj, normed).view(shape).transpose(1, 2)
        query, key = _rotate(query, cos, sin), _rotate(key, cos, sin)
        hidden = hidden + self._product(attn.o_proj, self._attend(attn, query, key, value, spans, attention))
        normed = layer.post_attention_layernorm(hidden)
        gate = self._activate(mlp.act_fn, self._product(mlp.gate_proj, normed))
        return hidden + self._product(mlp.down_proj, gate * self._product(mlp.up_proj, normed))  # LlamaMLP.forward
