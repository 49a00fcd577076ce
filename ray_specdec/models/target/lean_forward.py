"""The target's verify forward without HF's per-call machinery: GPTNeoX and Llama models, over their own modules.

A verify forward on CPU multiplies a handful of rows by every weight, so a few hundred microseconds of Python per
call matter: at 200 tokens of context a 5-row verify of the default target took ~3.8 ms, ~1.9 of them GEMMs. HF's
model forward spends about 1 ms of that outside the maths (output dataclasses, keyword plumbing, mask preparation,
per-layer module calls and decorators). `LeanForward` runs the same computation as a flat loop over the layers:
it calls the model's own embedding, norms, Linear layers (with their planned GEMM paths), MLPs, rotary embedding and
attention function (HF's attention interface, the native kernel where installed), and does the glue between them
(reshapes, rotary application, the cache write, residual sums) with the same operations in the same order as the
HF code it replaces. The logits are HF's forward's bit for bit (tests/models/target/test_lean_forward.py checks
`torch.equal` for both families, with and without the native attention), which is what lets the target use it:
nothing about the output may change.

One forward can carry the rows of several requests (continuous batching): the rows are concatenated into one
activation, so every product reads each weight once for all of them, and attention runs per `Span` (a request's
rows) over that request's own cache with its own mask. With `batch_invariant=True` the products, activations,
rotary tables and tree attention are models/target/batch_invariant.py's, so a row's result does not depend on the other
rows (a forward of prefill chunks only takes the same operations but attends each chunk through the model's attention);
otherwise they are the model's own calls (HF's logits bit for bit). A forward without logits (prefill chunks, which
need only their K/V) stops at the last layer's K/V: the rest of that layer only feeds the head. A batch-invariant
forward of prefill chunks on CPU rotates their queries and keys and writes their K/V into the caches in one native
pass per layer (native/prefill.py), with the torch path's bits.

`why_unsupported(model)` names what keeps a model on HF's forward: other architectures (a family whose layers do
anything else, e.g. Qwen3's q/k norms, needs its own loop here), training mode and devices other than the CPU and
CUDA. A DeepSpeed AutoTP shard runs here as it is: its Linear layers, called as modules, hold its share of the heads
and all-reduce where HF's forward would, and the head counts come from the tensors' shapes (models/target/tp_shards.py
says how the batch-invariant products go through them). On CUDA the products of all rows
are one cuBLAS call per weight; verify spans over pooled caches (models/target/kv_pool.py, the default there) attend
together in one sdpa call per layer, every other span through the model's sdpa (the target picks its backends); the
batch-invariant operations are CPU-only. A layer is `before` (norm, projections, rotary), the attention, and `after`
(output projection, residuals, MLP): on CUDA, `graphs` (models/target/step_graphs.py) replays the parts around the
attention, or, where every span's cache is pooled, the whole forward with its attention in one Triton launch per layer.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from functools import partial
from typing import Callable, NamedTuple, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GPTNeoXForCausalLM, LlamaForCausalLM, PreTrainedModel
from transformers import activations as hf_activations
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.gpt_neox import modeling_gpt_neox
from transformers.models.llama import modeling_llama

from ray_specdec.models.native import attention as native_attention, decoder, prefill as native_prefill
from ray_specdec.models.target import batch_invariant as invariant, kv_pool
from ray_specdec.models.target.kv_cache import GrowableKVCache

# Exactly these classes: a subclass may change what a layer does.
SUPPORTED = (GPTNeoXForCausalLM, LlamaForCausalLM)


def why_unsupported(model) -> str | None:
    """Why `LeanForward` cannot run this model (None when it can)."""
    if type(model) not in SUPPORTED:
        return f"it runs {', '.join(c.__name__ for c in SUPPORTED)}, not {type(model).__name__}"
    if next(model.parameters()).device.type not in ("cpu", "cuda"):
        return "it runs on CPU and CUDA"
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
    # The attention's mask: [1, 1, S, cache + S] (None: causal; a verify span's rows see every key, which only the
    # batch-invariant path's native attention takes without a mask).
    mask: torch.Tensor | None
    tree: bool  # a verify's rows (tree mask, additive); else a prefill chunk's (causal)
    # A verify's tree [S, S] bool (row i sees row j): where set and the cache is pooled (models/target/kv_pool.py), the
    # span attends with the step's other pooled spans in one call per layer, and `mask` is not read.
    tree_mask: torch.Tensor | None = None
    # A verify's tree [S, S] bool whatever attends how (None for a prefill chunk: causal): what a fused forward over
    # pooled caches (models/target/step_graphs.py) lets each row see of its request's new rows.
    ancestors: torch.Tensor | None = None


def _neox_attention(layer) -> torch.nn.Module:
    return layer.attention


def _llama_attention(layer) -> torch.nn.Module:
    return layer.self_attn


def _call(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return module(x)


class _Ops(NamedTuple):
    """How a forward multiplies by a Linear layer's weight, applies an activation and a norm (fn(module, x))."""

    product: Callable[[torch.nn.Module, torch.Tensor], torch.Tensor]
    activate: Callable[[torch.nn.Module, torch.Tensor], torch.Tensor]
    normalize: Callable[[torch.nn.Module, torch.Tensor], torch.Tensor]


def _activate_in_place(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """module(x), written over x where torch has the same kernel in place (x is a product's fresh output that nothing
    else reads): a prefill chunk's MLP then takes no second buffer of its width per layer (a 512-row chunk of the
    shipped target ~3% faster). The same bits as module(x); any other activation is called as it is."""
    kind = type(module)
    if _FORWARDS.get(kind, False) is not kind.forward or "forward" in vars(module):  # another class, or a kernel's
        return module(x)
    if kind is nn.GELU:
        return torch.ops.aten.gelu_(x, approximate=module.approximate)
    if kind is hf_activations.GELUActivation:
        return torch.ops.aten.gelu_(x) if module.act is F.gelu else module(x)
    return F.silu(x, inplace=True)


# The activations done in place, with the forward each had at import (a kernel library may replace it since).
_FORWARDS = {kind: kind.forward for kind in (nn.GELU, nn.SiLU, hf_activations.GELUActivation,
                                             getattr(hf_activations, "SiLUActivation", nn.SiLU))}


# The model's own calls (its planned GEMM paths): HF's forward bit for bit.
_MODEL_OPS = _Ops(_call, _activate_in_place, _call)
# Verify rows attend through _RaggedAttention.
_INVARIANT_OPS = _Ops(invariant.product, invariant.activate, invariant.normalize)


class _RaggedAttention:
    """The verify spans' attention through `native_attention.tree_attention_table`: the same bits as one native
    `tree_attention` call per span, in one call per layer. Every layer's segment table is built once per
    forward, at the first layer's call (a new cache creates its layers from that layer's K/V shapes): a span's cache
    reserves its rows in all layers and hands out their buffers' addresses (kept by the cache until a buffer is
    replaced), so the per-layer work in Python is one call. `finish` advances every cache by its span's rows."""

    def __init__(self, spans: Sequence[Span], layers: int):
        self._spans, self._layers = spans, layers
        self._tables: torch.Tensor | None = None  # [layers, spans, SEGMENT_FIELDS] int64

    def __call__(self, module, query, key, value) -> torch.Tensor:
        """query [1, H, R, D], key / value [1, Hkv, R, D] -> [1, R, H * D]."""
        if self._tables is None:
            self._tables = self._build(key, value)
        out = native_attention.tree_attention_table(query, key, value, self._tables[module.layer_idx], module.scaling)
        return out.reshape(query.shape[0], query.shape[2], -1)

    def tables(self, kv_heads: int, head_dim: int) -> torch.Tensor:
        """Every layer's segment table [layers, spans, SEGMENT_FIELDS] (built now if not yet), for a caller that
        writes the K/V itself (native.decoder): float32 heads of `kv_heads` x `head_dim`."""
        if self._tables is None:
            empty = torch.empty(1, kv_heads, 0, head_dim, dtype=torch.float32)
            self._tables = self._build(empty, empty)
        return self._tables

    def _build(self, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        buffers, columns = [], []
        for span in self._spans:
            cache, rows = span.cache, span.end - span.start
            for index in range(len(cache.layers), self._layers):  # a cache's first write: create its layers
                cache.update(key[:, :, :0], value[:, :, :0], index)
            length = cache.get_seq_length() + rows
            buffers.append(cache.reserve(length))
            mask = span.mask  # [1, 1, S, length] (None: the rows see every key)
            if mask is not None and mask.shape[-2:] != (rows, length):
                raise ValueError(f"a span of {rows} rows over {length} keys has a mask of shape {tuple(mask.shape)}")
            address, stride = (0, 0) if mask is None else (mask.data_ptr(), mask.stride(-2))
            columns.append((rows, length, span.start, address, stride))
        fields = native_attention
        tables = torch.empty(self._layers, len(self._spans), fields.SEGMENT_FIELDS, dtype=torch.int64)
        tables[:, :, fields.SEG_K : fields.SEG_M] = torch.stack(buffers, dim=1)
        columns = torch.tensor(columns, dtype=torch.int64)
        tables[:, :, : fields.SEG_K] = columns[:, : fields.SEG_K]
        tables[:, :, fields.SEG_M :] = columns[:, fields.SEG_K :]
        return tables

    def finish(self) -> None:
        """Every span's cache holds its rows (each layer wrote them)."""
        if self._tables is not None:
            for span in self._spans:
                span.cache.advance(span.end - span.start)


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
        # A layer is the work before its attention, the attention, and the work after it (models/target/step_graphs.py
        # graphs the two around the attention).
        self.projections = self._neox_projections if neox else self._llama_projections
        self.after = self._neox_after if neox else self._llama_after
        self.attention_of = _neox_attention if neox else _llama_attention
        self._eager = (modeling_gpt_neox if neox else modeling_llama).eager_attention_forward
        self._head = model.get_output_embeddings()
        # What batch invariance changes, resolved once: products, activations, rotary values and, for verify rows,
        # tree attention. Prefill chunks run together with the same products, activations and rotary values, each
        # attending on its own through the model's attention (TargetModel._prefill_chunks).
        self.batch_invariant = batch_invariant
        self._table = None
        # CUDA graphs of the work around each attention (models/target/step_graphs.py), where the target installs them.
        self.graphs = None
        if batch_invariant:
            why = invariant.why_unsupported(model)
            if why is not None:
                raise ValueError(f"LeanForward cannot be batch-invariant for this model: {why}")
            self._table = invariant.RotaryTable(self._rotary, model.config.max_position_embeddings,
                                                next(model.parameters()).dtype)  # fmt: skip
        # Verify rows' decoder layers in one native call (native/decoder.py), where the model is one it runs.
        rotary = self._table.dims if self._table is not None else None
        self.native_decoder_why = (decoder.why_not(model, rotary) if batch_invariant
                                   else "the forward is not batch-invariant")  # fmt: skip
        self.native_decoder = decoder.NativeDecoder(model, rotary) if self.native_decoder_why is None else None

    @property
    def available(self) -> bool:
        """Whether the model is still one this loop runs (it may have been put in training mode since)."""
        return not self.model.training

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, spans: Sequence[Span],
                logits: bool = True, rows: torch.Tensor | None = None) -> torch.Tensor | None:
        """input_ids / position_ids [1, R], spans covering the R rows in order (all verify spans, batch-invariant
        where this loop is, or prefill chunks, or both where it is not); each span's cache grows by its rows.
        -> logits [1, R, V], or [1, len(rows), V] of those rows only, or None (logits=False: prefill chunks need only
        their K/V)."""
        attention = ALL_ATTENTION_FUNCTIONS.get_interface(self.model.config._attn_implementation, self._eager)
        invariant_rows = self.batch_invariant and all(span.tree for span in spans)
        # prefill chunks together (TargetModel._prefill_chunks): each row's products, activations, norms and rotary
        # values the batch-invariant ones, each chunk attending on its own through the model's attention
        invariant_chunks = self.batch_invariant and not any(span.tree for span in spans)
        ops = _INVARIANT_OPS if invariant_rows or invariant_chunks else _MODEL_OPS
        graphs = self.graphs
        if graphs is None or invariant_rows or not graphs.covers(input_ids.shape[1]):
            graphs = None
        fused = None if graphs is None else graphs.fuses(spans)  # the pool that every span lives in, if one does
        ragged = pooled = None
        with contextlib.nullcontext() if graphs is None else graphs.lock:  # its buffers, until the head has run
            # one graph with the attention in it (None: not here, or its capture failed and the graphs stopped fusing)
            hidden = None if fused is None else graphs.run_fused(input_ids, position_ids, spans, fused)
            if hidden is None:
                # Verify spans of the batch-invariant path attend all in one native call per layer.
                ragged = _RaggedAttention(spans, len(self._layers)) if invariant_rows else None
                # Verify spans over pooled caches (the GPU path) attend all in one call per layer.
                pooled = None if invariant_rows else kv_pool.pooled_spans(spans)
                pooled = kv_pool.PooledAttention(pooled) if pooled else None
                attend = (partial(self._attend, spans=spans, attention=attention, pooled=pooled) if ragged is None
                          else ragged)  # fmt: skip
                if graphs is not None:
                    hidden = graphs.run(input_ids, position_ids, attend)
                else:
                    # Without logits the last layer's K/V are all that is left to compute (see _layers_eagerly).
                    keys_only = None if logits or ragged is not None or pooled is not None else spans
                    # The batch-invariant prefill chunks' rotary and cache writes in one native pass per layer.
                    writes = invariant_chunks and pooled is None and native_prefill.available(
                        self._embed.weight.dtype, self._embed.weight.device)
                    hidden = self._layers_eagerly(input_ids, position_ids, attend, ops,
                                                  invariant_rows or invariant_chunks, keys_only,
                                                  prefill=spans if writes else None)  # fmt: skip
            for batched in (ragged, pooled):
                if batched is not None:
                    batched.finish()
            if not logits:
                return None
            if rows is not None:  # the norm and the head work row by row: the rest need neither
                hidden = hidden[:, rows]
            return ops.product(self._head, ops.normalize(self._norm, hidden))

    def _layers_eagerly(self, input_ids, position_ids, attend, ops: _Ops, invariant: bool,
                        keys_only: Sequence[Span] | None = None,
                        prefill: Sequence[Span] | None = None) -> torch.Tensor | None:
        """The layers over all rows (`invariant`: rotary values from the table, and verify rows through the native
        decoder where it runs) -> the last layer's output; keys_only (spans that need no logits: prefill chunks)
        -> None, after the last layer's K/V are in the spans' caches: its attention, output projection and MLP only
        make the hidden states that the head reads, so they are skipped (the caches hold the same bits as after a
        whole forward; a sixth of a prefill chunk's work for the default six-layer target). prefill (with
        `invariant`: the forward's spans, all prefill chunks): their rotary and cache writes through
        native/prefill.py, which attends them as `attend` would (the same bits)."""
        hidden = self._embed(input_ids)
        if invariant:
            cos, sin = self._table(position_ids, int(position_ids.max()) + 1)
            native_layers = self.native_decoder
            if native_layers is not None and isinstance(attend, _RaggedAttention):
                tables = attend.tables(native_layers.kv_heads, native_layers.head_dim)
                return native_layers.run(hidden.contiguous(), cos, sin, tables)
        else:
            cos, sin = self._rotary(hidden, position_ids=position_ids)
        if prefill is not None and invariant:
            return self._prefill_layers(hidden, cos[0], sin[0], prefill, ops, keys_only is not None)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        last = len(self._layers) - 1
        for index, layer in enumerate(self._layers):
            if keys_only is not None and index == last:
                _, key, value = self.before(layer, hidden, cos, sin, ops)
                layer_idx = self.attention_of(layer).layer_idx
                for span in keys_only:
                    rows = slice(span.start, span.end)
                    span.cache.update(key[:, :, rows], value[:, :, rows], layer_idx)
                return None
            attended = attend(self.attention_of(layer), *self.before(layer, hidden, cos, sin, ops))
            hidden = self.after(layer, hidden, attended, ops)
        return hidden

    def _prefill_layers(self, hidden, cos, sin, spans: Sequence[Span], ops: _Ops,
                        keys_only: bool) -> torch.Tensor | None:
        """_layers_eagerly's loop for prefill spans through native_prefill.PrefillWrites (cos / sin [R, rotary])."""
        attention = ALL_ATTENTION_FUNCTIONS.get_interface(self.model.config._attn_implementation, self._eager)
        writes = native_prefill.PrefillWrites(spans, len(self._layers), cos, sin)
        last = len(self._layers) - 1
        for index, layer in enumerate(self._layers):
            module = self.attention_of(layer)
            if keys_only and index == last:
                writes.keys(module, *self.projections(layer, hidden, ops))
                hidden = None
                break
            attended = writes.attend(module, *self.projections(layer, hidden, ops), attention)
            hidden = self.after(layer, hidden, attended, ops)
        writes.finish()
        return hidden

    @staticmethod
    def _attend(module, query, key, value, spans: Sequence[Span], attention,
                pooled: kv_pool.PooledAttention | None = None) -> torch.Tensor:
        """query [1, H, R, D], key / value [1, Hkv, R, D] of all rows -> [1, R, H * D]: the pooled spans attend in
        one call; every other span writes its K/V to its cache and attends over it through the model's attention
        function."""
        together = None if pooled is None else pooled(module, query, key, value)  # [Rp, H * D]
        if together is not None and len(pooled.spans) == len(spans):
            return together[None]  # the spans cover the rows in order
        outs = []
        for span in spans:
            if together is not None and id(span) in pooled.members:
                continue
            rows = slice(span.start, span.end)
            keys, values = span.cache.update(key[:, :, rows], value[:, :, rows], module.layer_idx)
            out, _ = attention(module, query[:, :, rows], keys, values, span.mask, dropout=0.0, scaling=module.scaling)
            outs.append((span, out))
        if together is None:
            out = outs[0][1] if len(outs) == 1 else torch.cat([out for _, out in outs], dim=1)
            return out.reshape(*query.shape[:1], query.shape[2], -1).contiguous()
        out = together.new_empty(query.shape[2], together.shape[-1]).index_copy_(0, pooled.source, together)
        for span, rows in outs:
            out[span.start : span.end] = rows.reshape(span.end - span.start, -1)
        return out[None]

    def before(self, layer, hidden, cos, sin, ops: _Ops):
        """A layer up to its attention -> query [1, H, R, D], key, value [1, Hkv, R, D] (rotated)."""
        query, key, value = self.projections(layer, hidden, ops)
        return _rotate(query, cos, sin), _rotate(key, cos, sin), value

    @staticmethod
    def _neox_projections(layer, hidden, ops: _Ops):
        """A GPTNeoX layer up to its rotary -> query [1, H, R, D], key, value [1, Hkv, R, D]: views of the fused
        QKV product's output."""
        attn = layer.attention
        rows = hidden.shape[:-1]
        qkv = ops.product(attn.query_key_value, ops.normalize(layer.input_layernorm, hidden))
        return qkv.view(*rows, -1, 3 * attn.head_size).transpose(1, 2).chunk(3, dim=-1)

    @staticmethod
    def _neox_after(layer, hidden, attended, ops: _Ops) -> torch.Tensor:
        """A GPTNeoX layer from its attention's output [1, R, H * D] on -> the layer's output."""
        mlp = layer.mlp
        out = ops.product(layer.attention.dense, attended)

        def feed_forward(x):  # GPTNeoXMLP.forward
            return ops.product(mlp.dense_4h_to_h, ops.activate(mlp.act, ops.product(mlp.dense_h_to_4h, x)))

        if layer.use_parallel_residual:
            return feed_forward(ops.normalize(layer.post_attention_layernorm, hidden)) + out + hidden
        out = out + hidden
        return feed_forward(ops.normalize(layer.post_attention_layernorm, out)) + out

    @staticmethod
    def _llama_projections(layer, hidden, ops: _Ops):
        """A Llama layer up to its rotary -> query [1, H, R, D], key, value [1, Hkv, R, D] (views)."""
        attn = layer.self_attn
        rows = hidden.shape[:-1]
        normed = ops.normalize(layer.input_layernorm, hidden)
        shape = (*rows, -1, attn.head_dim)
        query = ops.product(attn.q_proj, normed).view(shape).transpose(1, 2)
        key = ops.product(attn.k_proj, normed).view(shape).transpose(1, 2)
        value = ops.product(attn.v_proj, normed).view(shape).transpose(1, 2)
        return query, key, value

    @staticmethod
    def _llama_after(layer, hidden, attended, ops: _Ops) -> torch.Tensor:
        """A Llama layer from its attention's output [1, R, H * D] on -> the layer's output."""
        attn, mlp = layer.self_attn, layer.mlp
        hidden = hidden + ops.product(attn.o_proj, attended)
        normed = ops.normalize(layer.post_attention_layernorm, hidden)
        gate = ops.activate(mlp.act_fn, ops.product(mlp.gate_proj, normed))  # LlamaMLP.forward (its product in place)
        return hidden + ops.product(mlp.down_proj, gate.mul_(ops.product(mlp.up_proj, normed)))
