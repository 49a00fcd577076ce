"""The Mamba, Mamba2, Jamba and Bamba target: scores a whole token tree in one forward pass through its SSM layers
(and a hybrid's attention layers), one fixed-size state per request.

The same interface as `TargetModel` (forward_batch over prefill chunks and verify segments, commit of the accepted
path, caches with a capacity), so the scheduler and `engine/target_backend.py` drive both alike. What differs is the
cache: an SSM layer has no rows to mask or compact, only a state. A request's state (per layer the last `d_conv - 1`
conv inputs and the SSM state) lives in a slot of `SSMStatePool`; it is the same size at any context.

A forward's rows are each request's prefill chunk (a chain) and/or its verify rows (`[root, *tree nodes]`, the root's
parent being the state after the chunk, or the request's state). Every layer runs its products over all rows of all
requests at once; its conv and scan follow each row's parent (models/target/ssm_scan.py): a node's conv window is its
ancestors' inputs and its SSM state is its parent's, advanced by its token. Only the verify rows get logits. On CPU in
float32 the conv and the scan are native kernels, one call each per layer (native/ssm_scan.py: `native_scan_why`
says why not), and so is the elementwise work, fused per step: the norms, dt's softplus, the gate
(native/ssm_rows.py); torch ops otherwise.

After acceptance the request's state must be the accepted node's, never a rejected branch's. The scan advances
states where they lie: each layer's kernel reads a request's state from its slot and writes back the one row's state
the request keeps for sure, a prefill chunk's last row, or else a verify's root (every commit keeps the root), and no
other row's. The verify keeps, per layer, every row's conv window and every row's scan inputs (dt, x, B, C)
(`PendingStates`); `commit` copies the kept path's last conv window into the slot, and where the path goes below the
root, runs the scan again along it from the slot's state (activation replay: at most depth rows, one call per layer
for every commit of a forward, each row the same instructions as in the verify; a verify that followed a prefill chunk
in its forward replays its root too). A forward's state traffic is then one read and one write of each request's
state per layer, as plain decoding's. docs/DESIGN.md compares it with keeping every row's state and with a second
forward.

Mamba2 differs inside the mixer only: x, B and C are convolved together, A is one scalar per head, B and C are
shared by a group of heads, and a gated RMSNorm precedes the output projection; its heads' states are channels of the
same scan (`Mamba2Weights`).

The hybrids interleave SSM layers and attention layers, each followed by an MLP or a mixture of experts (HF's modules,
run as they are): Jamba's Mamba layers (with RMSNorms on dt, B and C) and attention without position encoding,
Bamba's Mamba2 layers and attention with rotary embeddings. An attention layer keeps K and V per token in the
request's cache: a group's rows attend over the cached ones and over their own ancestors and themselves (a chunk
causally, a tree by its mask: the same parent structure the scan follows), at position committed tokens + depth, and
the commit appends the kept path's rows.

Numerics follow HF's: RMSNorm normalizes in float32, a layer's skip connection is rounded to float32 where
`residual_in_fp32`, the SSM runs in float32 for half-precision models (the model's dtype otherwise), logits are float32
(float64 for a float64 model).

Products: on float32 CPU every one takes the native GEMM (`native_gemm`; a hybrid's HF MLPs through copies of its
feed-forward blocks that share the weights), over exact half panels of half-checkpoint weights: half the bytes a step
reads, and rows past the first nearly free.

Batch invariance (float32 pure SSMs on CPU, `batch_invariant`): the products go through the native GEMM, which sums
every output in one fixed order whatever the row count, and the conv, the scan and the elementwise kernels compute a
row whole on one thread, the same instructions whatever the other rows or the thread count (they run on all of
torch's threads, at any width). So a request's logits and states are the same bits whatever shares its forward, and
a root's under a tree of any size. With the native kernels off (native_scan=False), the elementwise work runs in
torch on one thread over widths that fill whole vectors (`_elementwise`). Elsewhere (float64, half precision, the
hybrids' attention) a row's results can depend on the others in the last bits, and greedy output can change only at
near-ties.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Sequence

import torch
import torch.nn.functional as F
from transformers import (AutoModelForCausalLM, BambaForCausalLM, JambaForCausalLM, Mamba2ForCausalLM,
                          MambaForCausalLM)

from ray_specdec import env
from ray_specdec.models.drafter.mamba_state import MixerWeights
from ray_specdec.models.loading import eos_token_ids, load_tokenizer, resolve_dtype, resolve_model_path
from ray_specdec.models.native import gemm, library, ssm_rows as native_rows, ssm_scan as native_ssm_scan
from ray_specdec.models.target.batch_invariant import VECTOR_MULTIPLE, one_thread
from ray_specdec.models.target.fast_path_switches import switch_why
from ray_specdec.models.target.forward_layout import Segment
from ray_specdec.models.target.ssm_scan import RowTrees, tree_conv, tree_scan
from ray_specdec.models.target.ssm_state import PendingStates, SSMCache, SSMStatePool, StateSnapshot
from ray_specdec.speculation.tree import TreeTensors

# An SSM has no position limit; prompt + max_tokens is capped here where the config names none (a chat request
# without max_tokens reserves up to it against the KV budget).
SSM_MAX_CONTEXT = 1 << 14


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's MambaRMSNorm: normalized in float32 whatever the dtype, scaled in the weight's."""
    x = x.to(weight.dtype)
    x32 = x.to(torch.float32)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


@dataclass(frozen=True)
class Mamba2Weights:
    """One Mamba2 mixer's weights, detached from the HF module (each head's A and D repeated over its channels: the
    scan takes them per channel)."""

    in_proj: torch.Tensor  # [d_inner + conv_dim + heads, d_model]: z, then x B C, then dt
    in_proj_bias: torch.Tensor | None
    conv: torch.Tensor  # [conv_dim, d_conv]
    conv_bias: torch.Tensor | None  # [conv_dim]
    dt_bias: torch.Tensor  # [heads]
    A: torch.Tensor  # [d_inner, d_state], ssm dtype: -exp(A_log) of each channel's head
    D: torch.Tensor  # [d_inner], ssm dtype
    gate_norm: torch.Tensor  # [d_inner]
    gate_group: int  # channels per group of the gated norm
    gate_eps: float
    out_proj: torch.Tensor  # [d_model, d_inner]
    out_proj_bias: torch.Tensor | None

    @classmethod
    def from_block(cls, block, ssm_dtype: torch.dtype) -> "Mamba2Weights":
        mixer = block.mixer
        head_dim, state = mixer.head_dim, mixer.ssm_state_size

        def param(p):
            return None if p is None else p.detach().contiguous()

        A = -torch.exp(mixer.A_log.detach().to(ssm_dtype)).repeat_interleave(head_dim)
        return cls(in_proj=param(mixer.in_proj.weight),
                   in_proj_bias=param(mixer.in_proj.bias), conv=param(mixer.conv1d.weight[:, 0, :]),
                   conv_bias=param(mixer.conv1d.bias), dt_bias=param(mixer.dt_bias),
                   A=A[:, None].expand(-1, state).contiguous(),
                   D=mixer.D.detach().to(ssm_dtype).repeat_interleave(head_dim), gate_norm=param(mixer.norm.weight),
                   gate_group=mixer.norm.group_size, gate_eps=mixer.norm.variance_epsilon,
                   out_proj=param(mixer.out_proj.weight), out_proj_bias=param(mixer.out_proj.bias))  # fmt: skip

    def gated_norm(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """HF's MambaRMSNormGated: y * silu(z), normalized per group in float32, scaled in y's dtype."""
        g = (y.to(torch.float32) * F.silu(z.to(torch.float32))).unflatten(-1, (-1, self.gate_group))
        g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + self.gate_eps)
        return self.gate_norm * g.flatten(-2).to(y.dtype)


@dataclass(frozen=True)
class AttentionWeights:
    """A hybrid's attention layer: grouped-query; Jamba's without position encoding, Bamba's with rotary embeddings
    over part of each head (`rotary`: the model's rotary module)."""

    q_proj: torch.Tensor  # [heads * head_dim, d_model]
    k_proj: torch.Tensor  # [kv_heads * head_dim, d_model]
    v_proj: torch.Tensor
    o_proj: torch.Tensor  # [d_model, heads * head_dim]
    heads: int
    kv_heads: int
    head_dim: int
    biases: tuple[torch.Tensor | None, ...] = (None, None, None, None)  # q, k, v, o
    rotary: torch.nn.Module | None = None

    @classmethod
    def from_module(cls, attn, config, rotary: torch.nn.Module | None = None) -> "AttentionWeights":
        def param(p):
            return None if p is None else p.detach()

        projections = (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj)
        return cls(*(param(p.weight) for p in projections), config.num_attention_heads, config.num_key_value_heads,
                   attn.head_dim, tuple(param(p.bias) for p in projections), rotary)  # fmt: skip


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of x [R, heads, head_dim] over its first cos.shape[-1] dims (cos, sin [R, rot])."""
    rot = cos.shape[-1]
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    half = x_rot.shape[-1] // 2
    rotated = torch.cat([-x_rot[..., half:], x_rot[..., :half]], dim=-1)
    return torch.cat([x_rot * cos[:, None] + rotated * sin[:, None], x_pass], dim=-1)


@dataclass(frozen=True)
class Layer:
    """One decoder layer as the forward runs it: a norm, a mixer (an SSM's or attention), and for a hybrid a feed-
    forward block after a norm of its own."""

    norm: torch.Tensor  # [d_model]
    weights: MixerWeights | Mamba2Weights | AttentionWeights
    index: int  # its state's layer in the pool (SSM), or its K/V's in a cache (attention)
    ffn_norm: torch.Tensor | None = None
    ffn: torch.nn.Module | None = None  # HF's MLP or mixture of experts, run as it is
    bcdt_norms: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # Jamba's RMSNorms of dt, B and C

    @property
    def attention(self) -> bool:
        return isinstance(self.weights, AttentionWeights)


@dataclass(frozen=True)
class KeptRows:
    """What a forward's rows leave behind: `conv` rows their conv states (a chunk's last row, every verify row),
    `states` rows their SSM states, written into their requests' slots (a chunk's last row, else a verify's root; at
    most one row of a request), `inputs` rows their scan inputs (every verify row: the commit replays the kept path's
    SSM state from them)."""

    conv: torch.Tensor  # [Kc] long
    states: torch.Tensor  # [Ks] long
    inputs: torch.Tensor  # [Ki] long


class SSMTargetModel:
    """Adapter around an HF `MambaForCausalLM`, `Mamba2ForCausalLM`, `JambaForCausalLM` or `BambaForCausalLM`: tree
    verification through its SSM layers (and a hybrid's attention layers)."""

    @classmethod
    def from_pretrained(cls, name_or_path: str, *, dtype: str | torch.dtype | None = None,
                        device: str = "cpu") -> "SSMTargetModel":
        """Load from a hub id or a local directory; float32 on CPU unless `dtype` says otherwise."""
        path = resolve_model_path(name_or_path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=resolve_dtype(dtype, device))
        return cls(model.to(device).eval(), load_tokenizer(path))

    def __init__(self, model: MambaForCausalLM | Mamba2ForCausalLM | JambaForCausalLM | BambaForCausalLM,
                 tokenizer=None, *, slots: int = 8, batch_invariant: bool | None = None,
                 native_scan: bool | None = None, native_gemm: bool | None = None):
        """slots: states the pool preallocates (it doubles when every one is taken). batch_invariant: the products
        take the native GEMM, so that a request's logits and states are the same bits whatever shares its forward.
        None: on for a float32 pure SSM on CPU where the native kernels build, unless RAY_SPECDEC_BATCH_INVARIANT=0;
        True insists; False: torch's products. `batch_invariant_why` says why it is off. native_scan: the SSM layers'
        tree scan in one native call per layer (native/ssm_scan.py) where the scan runs in float32 on CPU and the
        kernels build (for a float32 model the conv and the elementwise work too: native/ssm_rows.py), unless
        RAY_SPECDEC_NATIVE=0; True insists; False: torch's. `native_scan_why` says why it is off. native_gemm: every
        product (a hybrid's MLPs too) takes the native GEMM (native/gemm.py: register-blocked, over exact
        half-precision panels of weights loaded from a half checkpoint, so half the bytes a step reads), on float32
        CPU models where the kernels build, unless RAY_SPECDEC_NATIVE=0; True insists; False: F.linear (then
        batch_invariant is off too). `native_gemm_why` says why it is off."""
        if not isinstance(model, (MambaForCausalLM, Mamba2ForCausalLM, JambaForCausalLM, BambaForCausalLM)):
            raise TypeError(f"SSMTargetModel takes a MambaForCausalLM, Mamba2ForCausalLM, JambaForCausalLM or "
                            f"BambaForCausalLM, not {type(model).__name__}")  # fmt: skip
        config = model.config
        if config.hidden_act != "silu":
            raise ValueError(f"only silu Mamba models are supported, got hidden_act={config.hidden_act!r}")
        self.model = model.eval()
        self.tokenizer = tokenizer
        hybrid = isinstance(model, (JambaForCausalLM, BambaForCausalLM))
        core = model.model if hybrid else model.backbone
        embed = core.embed_tokens if hybrid else core.embeddings
        self.device: torch.device = embed.weight.device
        self.dtype: torch.dtype = embed.weight.dtype
        self.vocab_size: int = int(model.lm_head.out_features)
        self.max_context: int = int(getattr(config, "max_position_embeddings", None) or SSM_MAX_CONTEXT)
        self.eos_token_ids: frozenset[int] = eos_token_ids(model)
        self.ssm_dtype = torch.promote_types(self.dtype, torch.float32)
        self.residual_in_fp32 = bool(getattr(config, "residual_in_fp32", False))
        self.native_gemm_why: str | None = switch_why("native_gemm", native_gemm, env.NATIVE,
                                                      self._native_gemm_blocker)  # fmt: skip
        self._logits_dtype = torch.float64 if self.dtype == torch.float64 else torch.float32
        if isinstance(model, MambaForCausalLM):
            self.d_conv, self.d_state, self.eps = config.conv_kernel, config.state_size, config.layer_norm_epsilon
            self.d_inner, self.dt_rank = config.intermediate_size, int(config.time_step_rank)
            self._layers = [Layer(block.norm.weight.detach(), MixerWeights.from_block(block, self.ssm_dtype), i)
                            for i, block in enumerate(core.layers)]  # fmt: skip
            self._mix, conv_channels = self._mix_mamba, self.d_inner
        elif isinstance(model, Mamba2ForCausalLM):
            self.d_conv, self.d_state, self.eps = config.conv_kernel, config.state_size, config.layer_norm_epsilon
            mixer = core.layers[0].mixer
            self.d_inner = mixer.intermediate_size
            self.heads, self.head_dim, self.groups = mixer.num_heads, mixer.head_dim, mixer.n_groups
            self.dt_limit: tuple[float, float] = tuple(config.time_step_limit)
            self._layers = [Layer(block.norm.weight.detach(), Mamba2Weights.from_block(block, self.ssm_dtype), i)
                            for i, block in enumerate(core.layers)]  # fmt: skip
            self._mix, conv_channels = self._mix_mamba2, mixer.conv_dim
        elif isinstance(model, BambaForCausalLM):
            self.d_conv, self.d_state, self.eps = config.mamba_d_conv, config.mamba_d_state, config.rms_norm_eps
            mixer = next(layer.mamba for layer in core.layers if hasattr(layer, "mamba"))
            self.d_inner = mixer.intermediate_size
            self.heads, self.head_dim, self.groups = mixer.num_heads, mixer.head_dim, mixer.n_groups
            self.dt_limit = tuple(mixer.time_step_limit)
            kinds = [hasattr(layer, "self_attn") for layer in core.layers]
            self._layers = [self._bamba_layer(layer, config, core.rotary_emb, sum(k == kind for k in kinds[:i]))
                            for i, (layer, kind) in enumerate(zip(core.layers, kinds))]  # fmt: skip
            self._mix, conv_channels = self._mix_mamba2, mixer.conv_dim
        else:
            if getattr(config, "sliding_window", None):
                raise ValueError("Jamba targets with a sliding attention window are not supported")
            if self.dtype == torch.float64:  # HF's grouped expert products take no float64
                config._experts_implementation = "eager"
            self.d_conv, self.d_state, self.eps = config.mamba_d_conv, config.mamba_d_state, config.rms_norm_eps
            self.d_inner, self.dt_rank = config.mamba_expand * config.hidden_size, int(config.mamba_dt_rank)
            kinds = [hasattr(layer, "self_attn") for layer in core.layers]
            self._layers = [self._jamba_layer(layer, config, sum(k == kind for k in kinds[:i]))
                            for i, (layer, kind) in enumerate(zip(core.layers, kinds))]  # fmt: skip
            self._mix, conv_channels = self._mix_mamba, self.d_inner
        self._attention_layers = sum(layer.attention for layer in self._layers)
        ssm_layers = len(self._layers) - self._attention_layers
        self._embed = embed.weight.detach()
        self._norm_f = (core.final_layernorm if hybrid else core.norm_f).weight.detach()
        self._lm_head = model.lm_head.weight.detach()
        self._pool = SSMStatePool((ssm_layers, self.d_conv - 1, conv_channels),
                                  (ssm_layers, self.d_inner, self.d_state), self.dtype, self.ssm_dtype, self.device,
                                  slots)  # fmt: skip
        self.native_scan_why: str | None = switch_why("native_scan", native_scan, env.NATIVE,
                                                      self._native_scan_blocker)  # fmt: skip
        # the conv and the elementwise work run in the model's dtype (the scan in float32 for a half-precision model
        # too): natively for a float32 model (native/ssm_rows.py), where the scan is native
        self._native_rows = self.native_scan_why is None and self.dtype == torch.float32
        self.batch_invariant_why: str | None = switch_why("batch_invariant", batch_invariant, env.BATCH_INVARIANT,
                                                          self._invariance_blocker)  # fmt: skip

    def _bamba_layer(self, layer, config, rotary: torch.nn.Module, index: int) -> Layer:
        """A Bamba decoder layer (the index-th of its kind): its attention (rotary) or Mamba2 mixer, then its MLP."""
        if hasattr(layer, "self_attn"):
            weights = AttentionWeights.from_module(layer.self_attn, config, rotary)
        else:
            weights = Mamba2Weights.from_block(SimpleNamespace(mixer=layer.mamba), self.ssm_dtype)
        return Layer(layer.input_layernorm.weight.detach(), weights, index, layer.pre_ff_layernorm.weight.detach(),
                     self._ffn(layer.feed_forward))

    def _jamba_layer(self, layer, config, index: int) -> Layer:
        """A Jamba decoder layer (the index-th of its kind): its attention or Mamba mixer (with the RMSNorms of dt, B
        and C), then its feed-forward block (an MLP or a mixture of experts)."""
        if hasattr(layer, "self_attn"):
            weights, norms = AttentionWeights.from_module(layer.self_attn, config), None
        else:
            mamba = layer.mamba
            weights = MixerWeights.from_block(SimpleNamespace(norm=layer.input_layernorm, mixer=mamba), self.ssm_dtype)
            norms = (mamba.dt_layernorm.weight.detach(), mamba.b_layernorm.weight.detach(),
                     mamba.c_layernorm.weight.detach())
        return Layer(layer.input_layernorm.weight.detach(), weights, index, layer.pre_ff_layernorm.weight.detach(),
                     self._ffn(layer.feed_forward), norms)  # fmt: skip

    def _ffn(self, module: torch.nn.Module) -> torch.nn.Module:
        """A hybrid's feed-forward block as the forward runs it: with native_gemm a copy whose nn.Linear layers take
        the native GEMM, sharing the weights (the HF model itself stays as loaded: it is the reference), else the
        module itself."""
        if self.native_gemm_why is not None:
            return module
        return gemm.native_copy(module)

    # ----- what the engine reads -----

    @property
    def batch_invariant(self) -> bool:
        """Whether a segment's logits and states are the same bits whatever shares its forward."""
        return self.batch_invariant_why is None

    def _native_gemm_blocker(self) -> str | None:
        """Why the products cannot take the native GEMM (None: they can)."""
        if self.device.type != "cpu" or self.dtype != torch.float32:
            return "it takes a float32 model on CPU"
        if library.load() is None:
            return f"native kernels unavailable: {library.why_unavailable()}"
        return None

    def _invariance_blocker(self) -> str | None:
        """Why the products (the native GEMM: every row's sums in one fixed order, whatever the row count) do not
        make a request's results independent of the others; None: they do."""
        if self.native_gemm_why is not None:
            return f"the products do not take the native GEMM ({self.native_gemm_why})"
        if self._attention_layers:
            return "a hybrid's attention runs sdpa per request (its kernel depends on the rows)"
        if self._native_rows:  # row kernels: every row the same instructions, at any width
            return None
        widths = {"hidden size": self.model.config.hidden_size, "inner width": self.d_inner}
        odd = [f"{name} {width}" for name, width in widths.items() if width % VECTOR_MULTIPLE]
        if odd:
            return (f"its {', '.join(odd)} is not a multiple of {VECTOR_MULTIPLE} (elementwise ops in torch would "
                    "take scalar tails)")
        return None

    def _native_scan_blocker(self) -> str | None:
        """Why the SSM layers' scan cannot take the native kernel (None: it can)."""
        if not native_ssm_scan.available(self.ssm_dtype, self.device):
            if library.load() is None:
                return f"native kernels unavailable: {library.why_unavailable()}"
            return "it takes a float32 scan on CPU"
        return None

    def _linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [R, in] @ weight^T (+ bias): the native GEMM (a row's result does not depend on the other rows) where
        native_gemm is on, else F.linear."""
        if self.native_gemm_why is None:
            return gemm.PATHS[gemm.NATIVE](x, weight, bias)
        return F.linear(x, weight, bias)

    @property
    def kv_bytes_per_token(self) -> int:
        """The bytes one row of the KV budget stands for: a hybrid's attention layers' K and V of one token. A pure
        SSM keeps nothing per token, so its rows are a nominal unit: the K and V one attention layer of the model's
        width would keep per token. A request is charged its tokens at a row each (conservative for a pure SSM) and
        its state at `state_rows`."""
        return self.attention_bytes_per_token or 2 * self.model.config.hidden_size * self.dtype.itemsize

    @property
    def attention_bytes_per_token(self) -> int:
        """Bytes the attention layers keep per token of context: a hybrid's K and V, 0 for a pure SSM."""
        return sum(2 * layer.weights.kv_heads * layer.weights.head_dim for layer in self._layers
                   if layer.attention) * self.dtype.itemsize

    @property
    def state_bytes(self) -> int:
        """Bytes of one request's state (all layers' conv and SSM states): the same at any context."""
        return self._pool.bytes_per_slot

    @property
    def state_rows(self) -> int:
        """The request's fixed state in rows of the KV budget (`kv_bytes_per_token`)."""
        return -(-self.state_bytes // self.kv_bytes_per_token)

    kv_pool_stats = None  # no KV pool (the engine's /v1/stats and metrics read this of every target)

    @property
    def state_pool_stats(self) -> dict[str, int]:
        """The state pool's slots, slots in use and bytes per slot."""
        return {"slots": self._pool.slots, "used": self._pool.used, "state_bytes": self.state_bytes}

    # ----- caches -----

    def new_cache(self, capacity: int | None = None) -> SSMCache:
        """A request's state, in a zeroed slot. capacity: the rows the scheduler granted (checked like a KV cache's,
        so that the budget's accounting is the same for every target; the state's size does not depend on it)."""
        if capacity is not None and capacity < 1:
            raise ValueError(f"a cache needs a capacity of at least one row, got {capacity}")
        return SSMCache(self._pool.acquire(), capacity)

    def resize(self, cache: SSMCache, capacity: int) -> None:
        cache.capacity = capacity

    def release(self, cache: SSMCache) -> None:
        if cache.slot >= 0:
            self._pool.release(cache.slot)
            cache.slot = -1

    def save_chunk(self, cache: SSMCache, start: int, end: int) -> StateSnapshot:
        """The state after the prompt chunk [start, end) that this step's forward ran (the prefix cache keeps it)."""
        if cache.pending is not None and cache.pending.root_in_slot:
            raise ValueError("the state holds an uncommitted verify's root, not a chunk's end")
        if end != cache.committed:
            raise ValueError(f"the state holds {cache.committed} tokens, not the chunk's end {end}")
        kv = tuple((k[start:end].clone(), v[start:end].clone()) for k, v in cache.kv)  # (buffers: rows past end unset)
        return StateSnapshot(self._pool.conv[cache.slot].clone(), self._pool.ssm[cache.slot].clone(), start, end, kv)

    def load_chunk(self, cache: SSMCache, snapshot: StateSnapshot) -> None:
        """Continue the cache from a kept chunk's state: the chunk must start where the cache ends."""
        self._check_committed(cache)
        if snapshot.start != cache.committed:
            raise ValueError(f"a cached chunk from token {snapshot.start} cannot continue a state of "
                             f"{cache.committed} tokens")  # fmt: skip
        self._pool.conv[cache.slot].copy_(snapshot.conv)
        self._pool.ssm[cache.slot].copy_(snapshot.ssm)
        self._write_kv(cache, cache.committed, list(snapshot.kv))
        cache.committed = snapshot.end

    # ----- the forward -----

    @torch.inference_mode()
    def forward_batch(self, segments: Sequence[Segment]) -> list[torch.Tensor | None]:
        """One forward for all segments (of distinct caches, except that a prefill chunk may precede a verify of its
        cache). A verify segment -> its logits [S, V], its rows' states pending until `commit`; a prefill segment ->
        None, the state advances over its tokens. Every segment is checked before anything runs."""
        groups: dict[int, dict] = {}  # cache -> its chunk and verify in this forward
        for i, segment in enumerate(segments):
            group = groups.setdefault(id(segment.cache), {"cache": segment.cache, "chunk": None, "verify": None})
            kind = "chunk" if segment.tree is None else "verify"
            if group[kind] is not None or (kind == "chunk" and group["verify"] is not None):
                raise ValueError("two segments of one forward share a cache (only a prefill chunk, then a verify, may)")
            tokens = segment.tokens.reshape(-1).to(dtype=torch.long)
            if segment.tree is not None and tokens.numel() != 1 + segment.tree.num_nodes:
                raise ValueError(f"tree has {segment.tree.num_nodes} nodes but {tokens.numel() - 1} tokens were given")
            group[kind] = (i, tokens, segment.tree)
        work = [g for g in groups.values() if self._check(g)]
        out: list[torch.Tensor | None] = [None] * len(segments)
        if work:
            self._forward(work, out)
        return out

    def prefill(self, cache: SSMCache, input_ids: torch.Tensor) -> None:
        """Advance the state over input_ids [S] (S >= 0)."""
        self.forward_batch([Segment(cache, input_ids)])

    def verify(self, cache: SSMCache, root_token: int, tree: TreeTensors, tree_tokens: torch.Tensor) -> torch.Tensor:
        """Logits [1 + n, V] at the root and every tree node; their states wait for `commit`."""
        root = torch.tensor([root_token], dtype=torch.long)
        tokens = torch.cat([root, tree_tokens.reshape(-1).to(torch.long).cpu()])
        return self.forward_batch([Segment(cache, tokens, tree)])[0]

    @torch.inference_mode()
    def commit(self, cache: SSMCache, keep_rows: Sequence[int]) -> None:
        """Keep rows `keep_rows` (the root and the accepted path, ascending) of the last verify: the state becomes
        that of its last row."""
        self.commit_many([(cache, keep_rows)])

    @torch.inference_mode()
    def commit_many(self, commits: Sequence[tuple[SSMCache, Sequence[int]]]) -> None:
        """`commit` for several caches: every one is checked first."""
        checked = []
        for cache, keep_rows in commits:
            pending = cache.pending
            if pending is None:
                raise ValueError("commit without a verify to commit")
            keep = [int(r) for r in keep_rows]
            parents = pending.parents.tolist()
            if not keep:
                raise ValueError("an SSM target's commit keeps at least the verify's root (row 0): its state may "
                                 "already be the request's")
            if (keep[0] != 0 or not all(0 < r < len(parents) for r in keep[1:])
                    or any(parents[b] != a for a, b in zip(keep, keep[1:]))):
                raise ValueError(f"an SSM state keeps a path from the root of the verify (rows 0, a child of 0, ...), "
                                 f"got {keep}")  # fmt: skip
            checked.append((cache, keep))
        by_forward: dict[int, list[tuple[SSMCache, list[int]]]] = {}  # the rows to replay, by verify forward
        for cache, keep in checked:
            replay = keep[1:] if cache.pending.root_in_slot else keep
            if replay:
                by_forward.setdefault(id(cache.pending.scan), []).append((cache, replay))
        for replays in by_forward.values():
            self._replay_states(replays)
        for cache, keep in checked:
            self._pool.conv[cache.slot].copy_(cache.pending.conv[:, keep[-1]])
            rows = torch.tensor(keep, device=self.device)
            self._write_kv(cache, cache.committed,
                           [(pk.index_select(0, rows), pv.index_select(0, rows)) for pk, pv in cache.pending.kv])
            cache.committed += len(keep)
            cache.pending = None

    def _replay_states(self, replays: list[tuple[SSMCache, list[int]]]) -> None:
        """Each kept path's SSM state into its slot: every layer's scan run again along the kept rows past the state
        the slot holds (the root's, or the one before it where the verify followed a prefill chunk), from that state,
        over the scan inputs the verify left (verifies of one forward: they share its inputs' tensors). One scan call
        per layer for all of them; a row's work is the same as in the verify, so are its bits."""
        layout = RowTrees.build([torch.arange(-1, len(rows) - 1) for _, rows in replays], self.d_conv, self.device)
        slots = torch.tensor([cache.slot for cache, _ in replays], device=self.device)
        rows = torch.tensor([cache.pending.scan_first + r for cache, kept in replays for r in kept], device=self.device)
        inputs = replays[0][0].pending.scan
        none = torch.empty(0, dtype=torch.long, device=self.device)
        ends = KeptRows(none, torch.tensor(layout.starts[1:], device=self.device) - 1, none)
        for layer in self._layers:
            if not layer.attention:
                dt, x, B, C = (t.index_select(0, rows) for t in inputs[layer.index])
                self._scan(dt, x, B, C, layer, slots, layout, ends, [])

    def _check(self, group: dict) -> bool:
        """Checks a cache's part of a forward (committed, within its context and capacity) -> whether it has rows."""
        cache: SSMCache = group["cache"]
        self._check_committed(cache)
        if cache.slot < 0:
            raise ValueError("the cache was released")
        rows = sum(part[1].numel() for part in (group["chunk"], group["verify"]) if part is not None)
        needed = cache.committed + rows
        if group["verify"] is not None:
            tree = group["verify"][2]
            what = f"verify of a depth-{tree.depth} tree"
            needed_positions = needed - tree.num_nodes + tree.depth
        else:
            what, needed_positions = f"prefill of {rows} tokens", needed
        if needed_positions > self.max_context:
            raise ValueError(f"{what} needs {needed_positions} positions but the target's context is "
                             f"{self.max_context}; shorten the prompt or max_tokens")  # fmt: skip
        if cache.capacity is not None and needed > cache.capacity:
            raise ValueError(f"{what} needs {needed} cache rows but the cache holds {cache.capacity} "
                             "(new_cache(capacity=...))")  # fmt: skip
        return rows > 0

    def _forward(self, groups: list[dict], out: list[torch.Tensor | None]) -> None:
        """Every group's rows through the model in one forward: chunk rows as a chain, then verify rows as the tree
        (its root a child of the chunk's last row); slots advance over the chunks, verifies' states wait."""
        tokens, parents, kept, verify_rows = [], [], [], []
        # the only rows whose SSM states the forward writes, each into its request's slot: a chunk's last row, or a
        # verify's root where no chunk precedes it (the commit keeps the root: it replays the path below it)
        state_rows = []
        row = 0
        for g in groups:
            chunk, verify = g["chunk"], g["verify"]
            n_chunk = 0 if chunk is None else chunk[1].numel()
            p = [torch.arange(-1, n_chunk - 1)]
            tokens.append(torch.empty(0, dtype=torch.long) if chunk is None else chunk[1].cpu())
            if n_chunk:
                kept.append(row + n_chunk - 1)
                state_rows.append(row + n_chunk - 1)
            if verify is not None:
                tree_parents = verify[2].parents.clone()
                p.append(torch.where(tree_parents >= 0, tree_parents + n_chunk, n_chunk - 1))
                tokens.append(verify[1].cpu())
                n_verify = verify[1].numel()
                verify_rows.append((row + n_chunk, n_verify))
                if not n_chunk:
                    state_rows.append(row)
                kept.extend(range(row + n_chunk, row + n_chunk + n_verify))
            parents.append(torch.cat(p))
            row += parents[-1].numel()
        layout = RowTrees.build(parents, self.d_conv, self.device)
        slots = torch.tensor([g["cache"].slot for g in groups], device=self.device)
        verify_index = [torch.arange(start, start + n) for start, n in verify_rows]
        keep = KeptRows(*(torch.tensor(rows, dtype=torch.long, device=self.device) for rows in (kept, state_rows)),
                        torch.cat(verify_index).to(self.device) if verify_index else
                        torch.empty(0, dtype=torch.long, device=self.device))  # fmt: skip
        conv_start = self._pool.conv.index_select(0, slots)  # [G, L, d_conv - 1, d_inner]
        ids = torch.cat(tokens).to(self.device)
        residual = F.embedding(ids, self._embed)  # [R, d_model]
        new_kv = []
        # each SSM layer's conv writes its kept rows' conv states [L, Kc, d_conv - 1, conv channels], its scan the
        # `keep.states` rows' SSM states into their slots, and its verify rows' scan inputs go to `scan_inputs`
        conv = torch.empty(self._pool.conv.shape[1], len(kept), *self._pool.conv.shape[2:], dtype=self.dtype,
                           device=self.device)  # fmt: skip
        scan_inputs: list[tuple[torch.Tensor, ...]] = []
        attending = self._attending(groups, layout) if self._attention_layers else None
        rotary = next((layer.weights.rotary for layer in self._layers if layer.attention and layer.weights.rotary),
                      None)  # fmt: skip
        cos_sin = None
        if rotary is not None:
            cos, sin = rotary(residual, self._positions(groups, layout)[None])
            cos_sin = (cos[0], sin[0])  # [R, rotary dims] each
        for layer in self._layers:
            h = self._rms_norm(residual, layer.norm)
            if layer.attention:
                mixed, k, v = self._attend(h, layer, attending, cos_sin)
                new_kv.append((k, v))  # [R, kv heads, head_dim] each
            else:
                mixed = self._mix(h, layer, conv_start[:, layer.index], slots, layout, keep, conv[layer.index],
                                  scan_inputs)
            residual = (residual.to(torch.float32) if self.residual_in_fp32 else residual) + mixed
            if layer.ffn is not None:
                residual = residual + layer.ffn(self._rms_norm(residual, layer.ffn_norm)[None])[0]
        logits = (self._logits(residual[keep.inputs]).split([n for _, n in verify_rows]) if verify_rows
                  else [])  # fmt: skip
        k, v, i = 0, 0, 0  # kept conv states, verifies, verify rows so far
        for g, start in zip(groups, layout.starts):
            cache: SSMCache = g["cache"]
            chunk, verify = g["chunk"], g["verify"]
            n_chunk = 0 if chunk is None else chunk[1].numel()
            if n_chunk:
                self._pool.conv[cache.slot].copy_(conv[:, k])
                self._write_kv(cache, cache.committed,
                               [(nk[start:start + n_chunk], nv[start:start + n_chunk]) for nk, nv in new_kv])
                cache.committed += n_chunk
                k += 1
            if verify is not None:
                n, first = verify[1].numel(), start + n_chunk
                cache.pending = PendingStates(conv[:, k:k + n], not n_chunk, scan_inputs, i,
                                              verify[2].parents.clone(),
                                              [(nk[first:first + n], nv[first:first + n]) for nk, nv in new_kv])
                out[verify[0]] = logits[v].to(self._logits_dtype)
                k, v, i = k + n, v + 1, i + n

    def _write_kv(self, cache: SSMCache, at: int, rows: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Write each attention layer's K and V rows [n, kv heads, head_dim] at row `at` of the cache's buffers,
        which hold its granted capacity (allocated on the first write, again when the grant grows; doubling for a
        cache without a capacity)."""
        if not rows or not rows[0][0].shape[0]:
            return
        end = at + rows[0][0].shape[0]
        held = cache.kv[0][0].shape[0] if cache.kv else 0
        if end > held:
            size = max(end, cache.capacity) if cache.capacity else max(end, 2 * held)
            grown = []
            for i, w in enumerate(layer.weights for layer in self._layers if layer.attention):
                k, v = (torch.empty(size, w.kv_heads, w.head_dim, dtype=self.dtype, device=self.device)
                        for _ in range(2))  # fmt: skip
                if cache.kv:
                    k[:at].copy_(cache.kv[i][0][:at])
                    v[:at].copy_(cache.kv[i][1][:at])
                grown.append((k, v))
            cache.kv = grown
        for (k, v), (new_k, new_v) in zip(cache.kv, rows):
            k[at:end].copy_(new_k)
            v[at:end].copy_(new_v)

    def _attending(self, groups: list[dict], layout: RowTrees) -> list[tuple[SSMCache, int, int, torch.Tensor]]:
        """Per group: its cache, its rows [start, end) in the forward, and which of the cached tokens and its own rows
        each row sees ([n, committed + n] bool: every cached token, and its ancestors and itself among its rows)."""
        out = []
        for g, start, end in zip(groups, layout.starts, layout.starts[1:]):
            cache, n = g["cache"], end - start
            parents = (layout.parents[start:end] - start).tolist()
            own = torch.zeros(n, n, dtype=torch.bool)
            for i, p in enumerate(parents):  # parents precede their rows
                if p >= 0:
                    own[i] = own[p]
                own[i, i] = True
            seen = torch.cat([torch.ones(n, cache.committed, dtype=torch.bool), own], dim=1)
            out.append((cache, start, end, seen.to(self.device)))
        return out

    def _positions(self, groups: list[dict], layout: RowTrees) -> torch.Tensor:
        """[R] each row's position: its request's committed tokens plus its depth in its group (a verify's root
        after its chunk sits at the chunk's end)."""
        committed = torch.tensor([g["cache"].committed for g in groups], dtype=torch.long)
        counts = torch.tensor([e - s for s, e in zip(layout.starts, layout.starts[1:])], dtype=torch.long)
        return (committed.repeat_interleave(counts) + layout.depths).to(self.device)

    def _attend(self, h: torch.Tensor, layer: Layer, attending, cos_sin) -> tuple[torch.Tensor, torch.Tensor,
                                                                                torch.Tensor]:
        """A hybrid's attention layer over every row: each group's rows attend over its cached K/V and its own rows
        by their ancestry (a chunk causally, a tree by its mask) -> (output [R, d_model], the rows' K and V, rotated
        where the model rotates them)."""
        w: AttentionWeights = layer.weights
        rows = h.shape[0]
        q = self._linear(h, w.q_proj, w.biases[0]).view(rows, w.heads, w.head_dim)
        k = self._linear(h, w.k_proj, w.biases[1]).view(rows, w.kv_heads, w.head_dim)
        v = self._linear(h, w.v_proj, w.biases[2]).view(rows, w.kv_heads, w.head_dim)
        if w.rotary is not None:
            q, k = rotate(q, *cos_sin), rotate(k, *cos_sin)
        out = torch.empty_like(q)
        repeat = w.heads // w.kv_heads
        for cache, start, end, seen in attending:
            cached_k, cached_v = ((t[:cache.committed] for t in cache.kv[layer.index]) if cache.kv else
                                  (k[:0], v[:0]))  # fmt: skip
            keys = torch.cat([cached_k, k[start:end]]).repeat_interleave(repeat, dim=1).transpose(0, 1)
            values = torch.cat([cached_v, v[start:end]]).repeat_interleave(repeat, dim=1).transpose(0, 1)
            out[start:end] = F.scaled_dot_product_attention(q[start:end].transpose(0, 1), keys, values,
                                                            attn_mask=seen).transpose(0, 1)  # fmt: skip
        return self._linear(out.reshape(rows, -1), w.o_proj, w.biases[3]), k, v

    def _conv(self, x: torch.Tensor, conv_start: torch.Tensor, layout: RowTrees, weight: torch.Tensor,
              bias: torch.Tensor | None, kept: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """SiLU of `tree_conv` -> [R, channels], the `kept` rows' conv states (their windows' last d_conv - 1 inputs)
        written to `out` [K, d_conv - 1, channels]: natively where `_native_rows` (on torch's threads: a row's bits do
        not depend on them), else in torch (`_elementwise`)."""
        if self._native_rows:
            return native_ssm_scan.tree_conv(x, conv_start, layout, weight, bias, kept, out, silu=True)
        with self._elementwise():
            x, inputs = tree_conv(x, conv_start, layout, weight, bias)
            torch.index_select(inputs, 0, layout.windows[kept, 1:].reshape(-1), out=out.view(-1, out.shape[-1]))
            return F.silu(x)

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """`rms_norm` of x [R, d]: natively where `_native_rows`, else in torch (`_elementwise`)."""
        if self._native_rows:
            return native_rows.rms_norm(x, weight, self.eps)
        with self._elementwise():
            return rms_norm(x, weight, self.eps)

    def _scan(self, dt, x, B, C, layer: Layer, slots: torch.Tensor, layout: RowTrees, keep: KeptRows,
              inputs: list[tuple[torch.Tensor, ...]]) -> torch.Tensor:
        """`tree_scan` from each segment's state in its slot (`slots`) -> y; the `keep.states` rows' SSM states (at
        most one per segment) replace their segments' in the slots, and the `keep.inputs` rows' (dt, x, B, C) are
        appended to `inputs`: natively where `native_scan_why` is None (Mamba2's A as one value per channel; on
        torch's threads; the states advanced where they lie), else in torch (`_elementwise`)."""
        if keep.inputs.numel():
            inputs.append(tuple(t.index_select(0, keep.inputs) for t in (dt, x, B, C)))
        weights, states = layer.weights, self._pool.ssm[:, layer.index]  # [slots, d_inner, d_state]
        if self.native_scan_why is None:
            A = weights.A[:, 0] if isinstance(weights, Mamba2Weights) else weights.A
            return native_ssm_scan.tree_scan(dt, x, B, C, A, states, layout, keep.states, start_rows=slots,
                                             in_place=True)[0]  # fmt: skip
        with self._elementwise():
            y, rows = tree_scan(dt, x, B, C, weights.A, states.index_select(0, slots), layout)
            segment_of = layout.segment_of[keep.states.cpu()].to(slots.device)
            states.index_copy_(0, slots[segment_of], rows.index_select(0, keep.states))
        return y

    def _mix_mamba(self, h: torch.Tensor, layer: Layer, conv_start: torch.Tensor, slots: torch.Tensor,
                   layout: RowTrees, keep: KeptRows, conv_out: torch.Tensor,
                   inputs: list[tuple[torch.Tensor, ...]]) -> torch.Tensor:
        """One Mamba mixer over every row: h [R, d_model], conv_start [G, d_conv - 1, d_inner], each group's SSM state
        in its slot (`slots` [G]) -> its output [R, d_model]; the kept rows' conv states go to conv_out [Kc, d_conv -
        1, d_inner], the `keep.states` rows' SSM states to their slots (`_scan`), the verify rows' scan inputs to
        `inputs`."""
        w: MixerWeights = layer.weights
        x, z = self._linear(h, w.in_proj, w.in_proj_bias).chunk(2, dim=-1)  # [R, d_inner] each
        x = self._conv(x, conv_start, layout, w.conv, w.conv_bias, keep.conv, conv_out)
        sd = self.ssm_dtype
        dt, B, C = self._linear(x, w.x_proj).split([self.dt_rank, self.d_state, self.d_state], dim=-1)
        if layer.bcdt_norms is not None:  # Jamba
            dt, B, C = (self._rms_norm(t, norm) for t, norm in zip((dt, B, C), layer.bcdt_norms))
        dt = self._linear(dt, w.dt_proj, w.dt_bias)
        if self._native_rows:
            dt = native_rows.dt(dt, None, 1)  # [R, d_inner]
        else:
            with self._elementwise():
                dt = F.softplus(dt.to(sd))
                x = x.to(sd)
        y = self._scan(dt, x, B.to(sd), C.to(sd), layer, slots, layout, keep, inputs)
        if self._native_rows:
            y = native_rows.gate(y, x, w.D, z, out=y)
        else:
            with self._elementwise():
                y = torch.addcmul(y, x, w.D) * F.silu(z.to(sd))
        return self._linear(y.to(self.dtype), w.out_proj, w.out_proj_bias)

    def _mix_mamba2(self, h: torch.Tensor, layer: Layer, conv_start: torch.Tensor, slots: torch.Tensor,
                    layout: RowTrees, keep: KeptRows, conv_out: torch.Tensor,
                    inputs: list[tuple[torch.Tensor, ...]]) -> torch.Tensor:
        """One Mamba2 mixer over every row, as `_mix_mamba` (conv_start [G, d_conv - 1, conv_dim]: x, B and C are
        convolved together); a head's state is its head_dim channels of [d_inner, d_state]."""
        w: Mamba2Weights = layer.weights
        rows, sd, n = h.shape[0], self.ssm_dtype, self.d_state
        z, xbc, dt = self._linear(h, w.in_proj, w.in_proj_bias).split(
            [self.d_inner, w.conv.shape[0], self.heads], dim=-1)
        x, B, C = self._conv(xbc, conv_start, layout, w.conv, w.conv_bias, keep.conv, conv_out).split(
            [self.d_inner, self.groups * n, self.groups * n], dim=-1)
        if self._native_rows:  # dt per head, written over its channels
            dt = native_rows.dt(dt, w.dt_bias, self.head_dim, self.dt_limit)  # [R, d_inner]
        else:
            with self._elementwise():
                # per channel before softplus: a row's elements then fill whole vectors (heads alone may not)
                dt = dt.repeat_interleave(self.head_dim, dim=1) + w.dt_bias.repeat_interleave(self.head_dim)
                dt = F.softplus(dt.to(sd)).clamp(*self.dt_limit)
                x = x.to(sd)
        B, C = B.reshape(rows, self.groups, n).to(sd), C.reshape(rows, self.groups, n).to(sd)
        y = self._scan(dt, x, B, C, layer, slots, layout, keep, inputs)
        if self._native_rows:
            y = native_rows.gate(y, x, w.D, z, w.gate_norm, w.gate_group, w.gate_eps, out=y)
        else:
            with self._elementwise():
                y = w.gated_norm(torch.addcmul(y, x, w.D), z)
        return self._linear(y.to(self.dtype), w.out_proj, w.out_proj_bias)

    def _logits(self, residual: torch.Tensor) -> torch.Tensor:
        return self._linear(self._rms_norm(residual, self._norm_f), self._lm_head)

    def _elementwise(self):
        """Where batch-invariant: the elementwise and per-row work that runs in torch (the native kernels off) on
        one thread. torch splits a large elementwise op's elements over its threads, and the elements at the ends of
        each thread's range take a scalar path whose transcendentals round otherwise; on one thread every row of a
        width that fills whole vectors takes the vector path (`_invariance_blocker` checks the widths)."""
        return one_thread() if self.batch_invariant_why is None else contextlib.nullcontext()

    def _check_committed(self, cache: SSMCache) -> None:
        if cache.pending is not None:
            raise ValueError(f"the cache holds {cache.pending_rows} uncommitted verify rows; call commit first")
