"""decoder_cpu.c bound to one target: every decoder layer of a batch-invariant verify forward in one native call.

`NativeDecoder(model, rotary)` runs a model for which `why_not(model, rotary)` is None: a GPTNeoX target with exact
GELU or a Llama target with SiLU, float32 on CPU, whole (not a tensor-parallel shard: its row-parallel products need
the ranks' sum between them), with the native kernels built. The lean forward keeps its torch ops wherever
`why_not` names a reason, and for prefill chunks (which attend through sdpa, ~3x faster than the ragged kernel for
a chunk's hundreds of causal rows).

RAY_SPECDEC_NATIVE_DECODER=0 (or off / false / no) keeps the torch ops for verify rows too, e.g. to compare.
"""

from __future__ import annotations

import ctypes

import torch
from transformers import GPTNeoXForCausalLM, LlamaForCausalLM

from ray_specdec.models.native import gemm, library



from ray_specdec import env
from ray_specdec.models.target import tp_shards

NORM_LAYER, NORM_RMS = 0, 1  # decoder_cpu.c's norm kinds
MLP_GELU, MLP_SILU_GATED = 0, 1  # and MLP kinds
_POINTERS = ("norm1_w", "norm1_b", "norm2_w", "norm2_b", "q", "k", "v", "q_b", "k_b", "v_b", "o", "o_b",
             "up", "gate", "down", "up_b", "gate_b", "down_b")  # fmt: skip
_FORMATS = ("q_fmt", "k_fmt", "v_fmt", "o_fmt", "up_fmt", "gate_fmt", "down_fmt")


class DecoderLayer(ctypes.Structure):
    """decoder_layer_t of decoder_cpu.c, in its field order."""

    _fields_ = [*[(name, ctypes.c_void_p) for name in _POINTERS], *[(name, ctypes.c_int32) for name in _FORMATS]]


class Decoder(ctypes.Structure):
    """decoder_t of decoder_cpu.c."""

    _fields_ = [
        *[(name, ctypes.c_int32) for name in ("n_layers", "hidden", "heads", "kv_heads", "head_dim", "rotary",
                                              "inter", "norm", "mlp", "fused_qkv", "parallel_residual")],
        ("eps", ctypes.c_float),
        ("scale", ctypes.c_float),
        ("layers", ctypes.POINTER(DecoderLayer)),
    ]  # fmt: skip


def enabled_by_environment() -> bool:
    return env.NATIVE_DECODER.on()


def why_not(model: torch.nn.Module, rotary: int | None = None) -> str | None:
    """Why `NativeDecoder` cannot run `model` (None when it can); rotary: the dims its rotary table covers."""
    if not enabled_by_environment():
        return "RAY_SPECDEC_NATIVE_DECODER=0"
    if library.load() is None:
        return f"no native kernels ({library.why_unavailable()})"
    if not isinstance(model, (GPTNeoXForCausalLM, LlamaForCausalLM)):
        return f"it runs GPTNeoX and Llama targets, not {type(model).__name__}"
    params = list(model.parameters())
    if any(p.dtype != torch.float32 or p.device.type != "cpu" for p in params):
        return "it runs float32 weights on CPU"
    config = model.config
    act = getattr(config, "hidden_act", None)
    if act != ("gelu" if isinstance(model, GPTNeoXForCausalLM) else "silu"):
        return f"its activation {act!r} is not the one the kernel computes"
    layers = model.base_model.layers[: config.num_hidden_layers]
    if tp_shards.is_shard(model):
        return "it is a tensor-parallel shard (its row-parallel products need the ranks' sum between them)"
    if not all(isinstance(m, torch.nn.Linear) for layer in layers for m in _linears(model, layer)):
        return "its layers' products are not Linear layers"
    head_dim = _head_dim(model)
    if rotary is not None and (rotary % 2 or rotary > head_dim):
        return f"its rotary dims {rotary} do not fit its heads of {head_dim}"
    return None


def _head_dim(model) -> int:
    layer = model.base_model.layers[0]
    return layer.attention.head_size if isinstance(model, GPTNeoXForCausalLM) else layer.self_attn.head_dim


def _linears(model, layer) -> list[torch.nn.Module]:
    if isinstance(model, GPTNeoXForCausalLM):
        return [layer.attention.query_key_value, layer.attention.dense, layer.mlp.dense_h_to_4h,
                layer.mlp.dense_4h_to_h]  # fmt: skip
    attn, mlp = layer.self_attn, layer.mlp
    return [attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj]


class NativeDecoder:
    """The decoder layers of one float32 CPU target as decoder_cpu.c runs them (`layers`). It holds the weights'
    packed panels (gemm.py's, shared with the torch path's native products) and rebuilds its tables when a weight
    has changed in place since."""

    def __init__(self, model: torch.nn.Module, rotary: int):
        self.lib = library.load()
        self.model, self.rotary = model, rotary
        self.layers = model.base_model.layers[: model.config.num_hidden_layers]
        self._params = [p for layer in self.layers for p in layer.parameters()]
        self._versions: tuple[int, ...] | None = None
        self._struct: Decoder | None = None
        self._keep: list = []

    def _decoder(self) -> Decoder:
        versions = tuple(p._version for p in self._params)
        if versions != self._versions:
            self._struct, self._versions = self._pack(), versions
        return self._struct

    def _pack(self) -> Decoder:
        model, config = self.model, self.model.config
        neox = isinstance(model, GPTNeoXForCausalLM)
        keep: list = []

        def vector(t: torch.Tensor | None) -> int | None:
            if t is None:
                return None
            t = t.detach().contiguous()
            keep.append(t)
            return t.data_ptr()

        def matrix(linear: torch.nn.Linear) -> tuple[int, int, int | None]:
            panels = gemm.native_panels(linear.weight)
            keep.append(panels)
            return panels.data_ptr(), gemm.PANEL_FORMATS[panels.dtype], vector(linear.bias)

        layers = []
        for layer in self.layers:
            if neox:
                attn, mlp = layer.attention, layer.mlp
                norms = (layer.input_layernorm, layer.post_attention_layernorm)
                (q, qf, qb), (o, of, ob) = matrix(attn.query_key_value), matrix(attn.dense)
                (k, kf, kb) = (v, vf, vb) = (None, 0, None)
                (up, uf, ub), (down, df, db) = matrix(mlp.dense_h_to_4h), matrix(mlp.dense_4h_to_h)
                gate, gf, gb = None, 0, None
            else:
                attn, mlp = layer.self_attn, layer.mlp
                norms = (layer.input_layernorm, layer.post_attention_layernorm)
                (q, qf, qb), (k, kf, kb), (v, vf, vb) = map(matrix, (attn.q_proj, attn.k_proj, attn.v_proj))
                (o, of, ob) = matrix(attn.o_proj)
                (up, uf, ub), (gate, gf, gb) = matrix(mlp.up_proj), matrix(mlp.gate_proj)
                (down, df, db) = matrix(mlp.down_proj)
            n1, n2 = norms
            layers.append(DecoderLayer(vector(n1.weight), vector(getattr(n1, "bias", None)), vector(n2.weight),
                                       vector(getattr(n2, "bias", None)), q, k, v, qb, kb, vb, o, ob, up, gate, down,
                                       ub, gb, db, qf, kf, vf, of, uf, gf, df))  # fmt: skip
        array = (DecoderLayer * len(layers))(*layers)
        keep.append(array)
        first = self.layers[0]
        attention = first.attention if neox else first.self_attn
        heads, kv_heads = config.num_attention_heads, self.kv_heads
        norm = first.input_layernorm
        eps = norm.eps if hasattr(norm, "eps") else norm.variance_epsilon
        inter = (first.mlp.dense_h_to_4h if neox else first.mlp.up_proj).weight.shape[0]
        self._keep = keep
        return Decoder(len(layers), config.hidden_size, heads, kv_heads, self.head_dim, self.rotary, inter,
                       NORM_LAYER if neox else NORM_RMS, MLP_GELU if neox else MLP_SILU_GATED, int(neox),
                       int(bool(getattr(config, "use_parallel_residual", False)) and neox), eps,
                       float(attention.scaling), array)  # fmt: skip

    @property
    def kv_heads(self) -> int:
        config = self.model.config
        return config.num_attention_heads if isinstance(self.model, GPTNeoXForCausalLM) else config.num_key_value_heads

    @property
    def head_dim(self) -> int:
        return _head_dim(self.model)

    def run(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
        """hidden [1, R, E] (the embeddings; float32, contiguous: it is overwritten), cos / sin [1, R, rotary] of the
        rows' positions, tables [layers, spans, SEGMENT_FIELDS] (int64: the attention's segment table per layer)
        -> hidden after every layer (the same tensor)."""
        decoder = self._decoder()
        rows = hidden.shape[1]
        cos, sin, tables = cos.contiguous(), sin.contiguous(), tables.contiguous()
        library.match_torch_threads(self.lib)
        if self.lib.decoder_layers(ctypes.byref(decoder), rows, hidden.data_ptr(), cos.data_ptr(), sin.data_ptr(),
                                   tables.shape[1], tables.data_ptr(), torch.get_num_threads()) != 0:  # fmt: skip
            raise MemoryError("the native decoder layers could not allocate their buffers")
        return hidden
