"""The native Mamba and Mamba2 drafter forwards (mamba_cpu.c, mamba2_cpu.c) and the Mamba scan, bound to one
drafter's float32 weights."""

from __future__ import annotations

import ctypes
import itertools
import math
from typing import Sequence

import torch

from ray_specdec.models.native import gemm
from ray_specdec.models.native.library import Layer, Mamba2Layer, Mamba2Model, Model, match_torch_threads


class _Weights:
    """Float32 CPU tensors whose pointers the C side holds, kept alive here; matrices packed as GEMM panels."""

    def __init__(self) -> None:
        self._keep: list[torch.Tensor] = []
        self.formats: set[torch.dtype] = set()

    def ptr(self, t: torch.Tensor | None) -> int | None:
        if t is None:
            return None
        if t.dtype != torch.float32 or t.device.type != "cpu":
            raise ValueError(f"native kernels take float32 CPU tensors, got {t.dtype} on {t.device}")
        t = t.contiguous()
        self._keep.append(t)
        return t.data_ptr()

    def panels(self, weight: torch.Tensor) -> tuple[int, int]:
        """(pointer, format) of the weight's panels: half precision where it holds the weight exactly (the products
        are the float32 panels' bit for bit)."""
        self.ptr(weight)  # checks dtype and device
        packed = gemm.pack_panels(weight, gemm.exact_panel_dtype(weight))
        self._keep.append(packed)
        self.formats.add(packed.dtype)
        return packed.data_ptr(), gemm.PANEL_FORMATS[packed.dtype]

    @property
    def panel_formats(self) -> list[str]:
        return sorted(str(dtype).removeprefix("torch.") for dtype in self.formats)


class _FusedForward:
    """A drafter's whole forward in one C call: `forward` over the rows of one state, `forward_rows` over one-row
    states anywhere. Subclasses bind the weights (`_model`) and name the C functions."""

    lib: ctypes.CDLL
    vocab_size: int
    _model: ctypes.Structure
    _name = "Mamba"

    def _call(self, R: int, S: int, tokens: int, conv: int, ssm: int, logits: int) -> int:
        raise NotImplementedError

    def _call_rows(self, R: int, offsets: int, tokens: int, conv_rows: int, ssm_rows: int, conv_stride: int,
                   ssm_stride: int, logits: int) -> int:  # fmt: skip
        raise NotImplementedError

    def forward(self, conv: torch.Tensor, ssm: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [R, S] (int64): S tokens for each of the R state rows -> logits [R, V] after each row's last
        token; conv / ssm ([n_layers, R, ...], contiguous float32) advance by S tokens in place."""
        R, S = tokens.shape
        tokens = tokens.contiguous()
        logits = torch.empty(R, self.vocab_size, dtype=torch.float32)
        if R == 0 or S == 0:
            return logits
        if int(tokens.min()) < 0 or int(tokens.max()) >= self.vocab_size:  # the C side indexes the embedding
            raise IndexError(f"token ids must be in [0, {self.vocab_size}), got {tokens.flatten().tolist()}")
        match_torch_threads(self.lib)
        if self._call(R, S, tokens.data_ptr(), conv.data_ptr(), ssm.data_ptr(), logits.data_ptr()) != 0:
            raise MemoryError(f"the native {self._name} forward could not allocate its buffers")
        return logits

    def forward_rows(self, states: Sequence[tuple[torch.Tensor, torch.Tensor]],
                     tokens: Sequence[torch.Tensor]) -> torch.Tensor:  # fmt: skip
        """One-row states (conv [n_layers, 1, conv channels, d_conv], ssm [n_layers, 1, d_inner, d_state]; contiguous
        float32, anywhere: slots of a pool, states of their own), each advanced in place by its own tokens (int64
        [S_r], S_r >= 1) -> logits [R, V] after each one's last token. Row r gets the bits `forward` gives it alone."""
        R = len(states)
        if len(tokens) != R:
            raise ValueError(f"{len(tokens)} token sequences for {R} states")
        logits = torch.empty(R, self.vocab_size, dtype=torch.float32)
        if R == 0:
            return logits
        lengths = [int(t.numel()) for t in tokens]
        if min(lengths) < 1:
            raise ValueError("every state needs at least one token")
        flat = torch.cat([t.reshape(-1) for t in tokens]).to(torch.int64).contiguous()
        if int(flat.min()) < 0 or int(flat.max()) >= self.vocab_size:  # the C side indexes the embedding
            raise IndexError(f"token ids must be in [0, {self.vocab_size}), got {flat.tolist()}")
        offsets = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int64)
        conv0, ssm0 = states[0]
        for conv, ssm in states:
            if (conv.shape != conv0.shape or ssm.shape != ssm0.shape or conv.shape[1] != 1
                    or not (conv.is_contiguous() and ssm.is_contiguous())
                    or conv.dtype != torch.float32 or ssm.dtype != torch.float32):  # fmt: skip
                raise ValueError("forward_rows takes contiguous one-row float32 states of one shape")
        pointers = (ctypes.c_void_p * (2 * R))(*[c.data_ptr() for c, _ in states], *[s.data_ptr() for _, s in states])
        row = ctypes.sizeof(ctypes.c_void_p) * R
        match_torch_threads(self.lib)
        if self._call_rows(R, offsets.data_ptr(), flat.data_ptr(), ctypes.addressof(pointers),
                           ctypes.addressof(pointers) + row, conv0[0].numel(), ssm0[0].numel(),
                           logits.data_ptr()) != 0:  # fmt: skip
            raise MemoryError(f"the native {self._name} forward could not allocate its buffers")
        return logits


class NativeMamba(_FusedForward):
    """The fused forward and the scan of mamba_cpu.c bound to one Mamba drafter's float32 weights (which it keeps
    alive)."""

    def __init__(self, lib: ctypes.CDLL, drafter) -> None:
        self.lib = lib
        d = drafter
        self._weights = weights = _Weights()
        ptr, panels = weights.ptr, weights.panels
        layers = []
        for w in d._layers:
            (in_p, in_f), (x_p, x_f), (dt_p, dt_f), (out_p, out_f) = map(
                panels, (w.in_proj, w.x_proj, w.dt_proj, w.out_proj))
            layers.append(Layer(ptr(w.norm), in_p, ptr(w.in_proj_bias), ptr(w.conv), ptr(w.conv_bias), x_p, dt_p,
                                ptr(w.dt_bias), ptr(w.A), ptr(w.D), out_p, ptr(w.out_proj_bias),
                                in_f, x_f, dt_f, out_f))  # fmt: skip
        self._layers = (Layer * d.n_layers)(*layers)
        head, head_format = panels(d._lm_head)
        self._model = Model(
            d.n_layers, d.model.config.hidden_size, d.d_inner, d.d_conv, d.d_state, d.dt_rank, d.vocab_size,
            d.eps, ptr(d._embed), ptr(d._norm_f), head, self._layers, head_format,
        )
        self.panel_formats = weights.panel_formats  # for reports
        self.vocab_size = d.vocab_size

    def _call(self, R, S, tokens, conv, ssm, logits):
        return self.lib.mamba_forward(ctypes.byref(self._model), R, S, tokens, conv, ssm, logits)

    def _call_rows(self, R, offsets, tokens, conv_rows, ssm_rows, conv_stride, ssm_stride, logits):
        return self.lib.mamba_forward_rows(ctypes.byref(self._model), R, offsets, tokens, conv_rows, ssm_rows,
                                           conv_stride, ssm_stride, logits)  # fmt: skip

    def scan(self, dt, x, B, C, A, state: torch.Tensor) -> torch.Tensor:
        """The selective scan of `mamba_ops.scan_block` (C . state per token, before the D skip and the gate) over
        all of dt / x [S, d_inner] and B / C [S, N]; state [d_inner, N] carried in and out."""
        S, d_inner = x.shape
        N = B.shape[1]
        dt, x, B, C, A = (t.contiguous() for t in (dt, x, B, C, A))
        carried = state if state.is_contiguous() else state.contiguous()
        y = torch.empty(S, d_inner, dtype=torch.float32)
        match_torch_threads(self.lib)
        self.lib.mamba_scan(S, d_inner, N, dt.data_ptr(), x.data_ptr(), B.data_ptr(), C.data_ptr(),
                            A.data_ptr(), carried.data_ptr(), y.data_ptr())  # fmt: skip
        if carried is not state:
            state.copy_(carried)
        return y


class NativeMamba2(_FusedForward):
    """The fused forward of mamba2_cpu.c bound to one Mamba2 drafter's float32 weights (which it keeps alive)."""

    _name = "Mamba2"

    def __init__(self, lib: ctypes.CDLL, drafter) -> None:
        self.lib = lib
        d = drafter
        self._weights = weights = _Weights()
        ptr, panels = weights.ptr, weights.panels
        layers = []
        for norm, w, A in zip(d._norms, d._layers, d._A_heads):
            (in_p, in_f), (out_p, out_f) = panels(w.in_proj), panels(w.out_proj)
            layers.append(Mamba2Layer(ptr(norm), in_p, ptr(w.in_proj_bias), ptr(w.conv), ptr(w.conv_bias),
                                      ptr(w.dt_bias), ptr(A), ptr(w.D[:: d.head_dim]), ptr(w.gate_norm), out_p,
                                      ptr(w.out_proj_bias), in_f, out_f))  # fmt: skip
        self._layers = (Mamba2Layer * d.n_layers)(*layers)
        head, head_format = panels(d._lm_head)
        low, high = d.dt_limit or (0.0, math.inf)
        self._model = Mamba2Model(
            d.n_layers, d.model.config.hidden_size, d.d_inner, d.d_conv, d.d_state, d.heads, d.groups, d.vocab_size,
            d.eps, d._layers[0].gate_eps, low, min(high, torch.finfo(torch.float32).max), ptr(d._embed),
            ptr(d._norm_f), head, self._layers, head_format,
        )
        self.panel_formats = weights.panel_formats  # for reports
        self.vocab_size = d.vocab_size

    def _call(self, R, S, tokens, conv, ssm, logits):
        return self.lib.mamba2_forward(ctypes.byref(self._model), R, S, tokens, conv, ssm, logits)

    def _call_rows(self, R, offsets, tokens, conv_rows, ssm_rows, conv_stride, ssm_stride, logits):
        return self.lib.mamba2_forward_rows(ctypes.byref(self._model), R, offsets, tokens, conv_rows, ssm_rows,
                                            conv_stride, ssm_stride, logits)  # fmt: skip
