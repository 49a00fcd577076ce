"""Mamba2 drafter: lean inference over the weights of a HF `Mamba2ForCausalLM`, with per-row recurrent state.

Per layer: RMSNorm -> in_proj -> (z, xBC, dt) -> causal depthwise conv of x, B and C together -> SiLU -> dt + dt_bias
-> softplus (clamped to the config's time_step_limit) -> selective scan with one A = -exp(A_log) per head, B and C
shared by a group of heads -> + D * x -> gated RMSNorm with z -> out_proj -> residual; then norm_f and lm_head.

The state is `MambaState`'s: conv [layers, rows, conv_dim, d_conv] (the last d_conv inputs of x, B and C, oldest
first) and ssm [layers, rows, d_inner, d_state], a head's state being its head_dim channels (the layout of the SSM
target's `Mamba2Weights`, whose weights this reuses). So state copies, slots and the drafting code are the Mamba
drafter's.

Two paths:
- native (float32 on CPU where models/native builds): products through the native GEMM and the scan through the SSM
  target's native scan (native/ssm_scan.py: a step's rows are segments of one row, a prefill a chain), dt and A per
  channel; norms, conv and gates in torch. Every row's logits and state are then the bits it gets alone, whatever
  rows step with it (`steps_row_invariant`, where the widths allow: see `_invariance_blocker`).
- torch elsewhere (float64, half precision, CUDA): a step is a few batched ops per layer with the decay per head; a
  prefill scans its tokens sequentially in blocks, so memory stays bounded for prompts of any length.

Numerics follow HF's torch path: RMSNorms normalise in float32, the residual is float32 where `residual_in_fp32`, the
scan runs in float32 for half-precision models, logits are float32 (float64 for a float64 model). No GPU kernels: on
CUDA the steps run eagerly in torch (mamba_ssm's Mamba2 state update and CUDA graphs are not wired in).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from transformers import Mamba2ForCausalLM

from kernels.state_copy import copy_state_rows
from ray_specdec.models.drafter.mamba_ops import causal_conv, rms_norm
from ray_specdec.models.drafter.mamba_state import MambaState
from ray_specdec.models.loading import resolve_dtype, resolve_model_path, resolve_prefill_window
from ray_specdec.models.native import gemm, library, ssm_scan as native_ssm_scan
from ray_specdec.models.target.batch_invariant import VECTOR_MULTIPLE, one_thread
from ray_specdec.models.target.ssm import Mamba2Weights
from ray_specdec.models.target.ssm_scan import RowTrees

# Tokens per block of the torch prefill scan: its decays and injections ([tokens, d_inner, d_state]) stay small.
_SCAN_BLOCK_ELEMENTS = 1 << 17
# Elements of an elementwise op from which torch splits it over threads (ATen's GRAIN_SIZE): below it, a step's
# elementwise work runs on one thread anyway and needs no `one_thread` for row invariance.
_GRAIN = 32768


@functools.lru_cache(maxsize=64)
def _one_row_segments(rows: int, d_conv: int) -> RowTrees:
    """A step's layout for the native scan: every row a segment of its own."""
    return RowTrees.build([torch.tensor([-1])] * rows, d_conv)


@functools.lru_cache(maxsize=16)
def _chain(length: int, d_conv: int) -> RowTrees:
    """A sequence pass's layout: one segment, each token's parent the one before."""
    return RowTrees.build([torch.arange(-1, length - 1)], d_conv)


class Mamba2Drafter:
    """Prefill a prompt into one state row, step batches of rows one token each, copy rows by parent index: the
    interface of `MambaDrafter`, over a Mamba2 model."""

    @classmethod
    def from_pretrained(
        cls,
        name_or_path: str,
        *,
        dtype: str | torch.dtype | None = None,
        device: str = "cpu",
        prefill_window: int | str | None = "auto",
        native: bool | None = None,
    ) -> "Mamba2Drafter":
        torch_dtype = resolve_dtype(dtype, device)
        model = Mamba2ForCausalLM.from_pretrained(resolve_model_path(name_or_path), dtype=torch_dtype)
        return cls(model.to(device), prefill_window=prefill_window, native=native)

    def __init__(self, model: Mamba2ForCausalLM, *, prefill_window: int | str | None = "auto",
                 native: bool | None = None):
        """prefill_window: as MambaDrafter's. native: the native GEMM and scan (module docstring). None: on for a
        float32 drafter on CPU where the kernels build (else torch, `native_why` says why; off with
        RAY_SPECDEC_NATIVE=0); True insists (an error where they cannot run); False: torch."""
        config = model.config
        if config.hidden_act != "silu":
            raise ValueError(f"only silu Mamba2 models are supported, got hidden_act={config.hidden_act!r}")
        self.prefill_window: int | None = resolve_prefill_window(prefill_window, config)
        self.model = model.eval()
        backbone = model.backbone
        mixer = backbone.layers[0].mixer
        self.device = backbone.embeddings.weight.device
        self.dtype = backbone.embeddings.weight.dtype
        self.vocab_size: int = model.lm_head.out_features
        self.n_layers: int = config.num_hidden_layers
        self.d_inner: int = mixer.intermediate_size
        self.conv_dim: int = mixer.conv_dim
        self.d_conv: int = config.conv_kernel
        self.d_state: int = config.state_size
        self.heads, self.head_dim, self.groups = mixer.num_heads, mixer.head_dim, mixer.n_groups
        if mixer.in_proj.out_features != self.d_inner + self.conv_dim + self.heads:
            raise ValueError(f"in_proj gives {mixer.in_proj.out_features} outputs, not z, xBC and dt "
                             f"({self.d_inner + self.conv_dim + self.heads})")  # fmt: skip
        low, high = (float(v) for v in config.time_step_limit)
        self.dt_limit: tuple[float, float] | None = None if (low, high) == (0.0, float("inf")) else (low, high)
        self.eps: float = config.layer_norm_epsilon
        self.ssm_dtype = torch.promote_types(self.dtype, torch.float32)
        self.residual_dtype = self.ssm_dtype if config.residual_in_fp32 else self.dtype
        self._norms = [block.norm.weight.detach() for block in backbone.layers]  # [d_model] each
        self._layers = [Mamba2Weights.from_block(block, self.ssm_dtype) for block in backbone.layers]
        # per head (the torch step's decay) and per channel (the native scan's): -exp(A_log), dt_bias
        self._A_heads = [w.A[:: self.head_dim, 0].contiguous() for w in self._layers]  # [heads]
        self._A_channels = [w.A[:, 0].contiguous() for w in self._layers]  # [d_inner]
        self._dt_bias_heads = [w.dt_bias.unsqueeze(-1) for w in self._layers]  # [heads, 1]
        self._gate_norms = [w.gate_norm.to(self.ssm_dtype) for w in self._layers]  # [d_inner]: the norm runs there
        self._embed = backbone.embeddings.weight.detach()  # [V, d_model]
        self._norm_f = backbone.norm_f.weight.detach()  # [d_model]
        self._lm_head = model.lm_head.weight.detach()  # [V, d_model], may be the embedding (tied)
        self.native = False  # the native path (module docstring); MambaDrafter's is its fused C model
        self.native_why: str | None = None  # why the native path is off, when it is
        if native is not False:
            self._start_native(insist=native is True)
        self.graphs = None
        self.graphs_why: str | None = ("CUDA graphs capture Mamba (v1) drafters only; Mamba2 steps run eagerly"
                                       if self.device.type == "cuda" else None)  # fmt: skip
        self._invariance_why = self._invariance_blocker()

    def _start_native(self, insist: bool) -> None:
        if self.device.type != "cpu" or self.dtype != torch.float32:
            self.native_why = f"native kernels run float32 drafters on CPU, not {self.dtype} on {self.device}"
        elif library.load() is None:
            self.native_why = library.why_unavailable()
        else:
            self.native = True
        if insist and not self.native:
            raise RuntimeError(f"native=True but {self.native_why}")

    def _invariance_blocker(self) -> str | None:
        """Why steps are not row-invariant, or None. The native path's products and scan are row-invariant; its
        elementwise ops too where every row's widths fill whole vectors (torch's scalar tail loops round otherwise)."""
        if not self.native:
            return f"the torch path's products depend on the row count ({self.native_why})"
        widths = {"d_model": self._embed.shape[1], "d_inner": self.d_inner, "conv_dim": self.conv_dim}
        odd = {name: w for name, w in widths.items() if w % VECTOR_MULTIPLE}
        return f"widths {odd} are not multiples of {VECTOR_MULTIPLE}" if odd else None

    @property
    def steps_row_invariant(self) -> bool:
        """Whether a step gives each row the same logits and state, bit for bit, whatever other rows step with it
        (drafting.draft_many steps several requests' rows together only then): on the native path where the widths
        fill whole vectors (tests/models/drafter/test_mamba2.py checks it)."""
        return self._invariance_why is None

    def new_state(self, rows: int) -> MambaState:
        """Zero state: the state before any token."""
        return MambaState(
            conv=torch.zeros(self.n_layers, rows, self.conv_dim, self.d_conv, dtype=self.dtype, device=self.device),
            ssm=torch.zeros(self.n_layers, rows, self.d_inner, self.d_state, dtype=self.ssm_dtype,
                            device=self.device),  # fmt: skip
        )

    @torch.inference_mode()
    def copy_rows(self, src: MambaState, index: torch.Tensor | Sequence[int], out: MambaState | None = None
                  ) -> MambaState:  # fmt: skip
        """out.row[i] = src.row[index[i]] for every layer's conv and SSM state (kernels.state_copy)."""
        index = torch.as_tensor(index, dtype=torch.long)  # [rows_out]
        checked = index.device.type == "cpu"
        if checked and index.numel() and not (0 <= int(index.min()) and int(index.max()) < src.rows):
            raise ValueError(f"index out of range for {src.rows} source rows")
        index = self._as_ids(index)
        if out is None:
            out = MambaState(src.conv.new_empty(self.n_layers, index.shape[0], *src.conv.shape[2:]),
                             src.ssm.new_empty(self.n_layers, index.shape[0], *src.ssm.shape[2:]))  # fmt: skip
        copy_state_rows(src.conv, src.ssm, index, out.conv, out.ssm, index_checked=checked)
        return out

    @torch.inference_mode()
    def prefill(self, input_ids: torch.Tensor | Sequence[int]) -> tuple[MambaState, torch.Tensor]:
        """input_ids [S] (S >= 1) -> (state with 1 row after the last token, logits [V] for the next token)."""
        ids = self._as_ids(input_ids)
        if ids.shape[0] == 0:
            raise ValueError("prefill needs at least one token")
        state = self.new_state(1)
        return state, self._advance(state, ids)

    @torch.inference_mode()
    def extend(self, state: MambaState, input_ids: torch.Tensor | Sequence[int]) -> torch.Tensor:
        """Advance a 1-row state by input_ids [S] (S >= 1) in place -> logits [V] for the token after them (S steps in
        one sequence pass; equal up to float rounding)."""
        ids = self._as_ids(input_ids)
        if ids.shape[0] == 0:
            raise ValueError("extend needs at least one token")
        if state.rows != 1:
            raise ValueError(f"extend advances a 1-row state, got {state.rows} rows")
        if ids.shape[0] == 1:
            return self.step(state, ids)[0]
        return self._advance(state, ids)

    @torch.inference_mode()
    def extend_rows(self, states: Sequence[MambaState], input_ids: Sequence[torch.Tensor | Sequence[int]]
                    ) -> torch.Tensor:  # fmt: skip
        """`extend` of several 1-row states, each by its own ids -> logits [len(states), V] (one after the other)."""
        if len(input_ids) != len(states):
            raise ValueError(f"{len(input_ids)} token sequences for {len(states)} states")
        if not states:
            return torch.empty(0, self.vocab_size, dtype=self.ssm_dtype, device=self.device)
        return torch.stack([self.extend(state, ids) for state, ids in zip(states, input_ids)])

    @torch.inference_mode()
    def step(self, state: MambaState, tokens: torch.Tensor | Sequence[int]) -> torch.Tensor:
        """tokens [rows], one per state row -> logits [rows, V]; the state advances by one token in place."""
        tokens = self._as_ids(tokens)  # [rows]
        rows = tokens.shape[0]
        if rows != state.rows:
            raise ValueError(f"{rows} tokens for a state of {state.rows} rows")
        native = self.native and state.ssm.is_contiguous()
        residual = F.embedding(tokens, self._embed).to(self.residual_dtype)  # [rows, d_model]
        for layer, w in enumerate(self._layers):
            with self._elementwise(rows):
                h = rms_norm(residual, self._norms[layer], self.eps)
            z, xbc, dt = self._linear(h, w.in_proj, w.in_proj_bias).split([self.d_inner, self.conv_dim, self.heads],
                                                                          dim=-1)  # fmt: skip
            conv = state.conv[layer]  # [rows, conv_dim, d_conv]
            with self._elementwise(rows):
                window = torch.cat((conv[:, :, 1:], xbc.unsqueeze(-1)), dim=-1)  # [rows, conv_dim, d_conv]
                conv.copy_(window)
                # one multiply-add per tap, in tap order: every element the same operations whatever the row count
                out = window[:, :, 0] * w.conv[:, 0]
                for k in range(1, self.d_conv):
                    out = torch.addcmul(out, window[:, :, k], w.conv[:, k])
                xbc = F.silu(out if w.conv_bias is None else out + w.conv_bias)
                x, B, C = xbc.to(self.ssm_dtype).split([self.d_inner, self.groups * self.d_state,
                                                        self.groups * self.d_state], dim=-1)  # fmt: skip
                if native:  # per channel: a row's elements then fill whole vectors (heads alone may not)
                    dt = self._dt(torch.add(dt.unsqueeze(-1), self._dt_bias_heads[layer]).expand(
                        rows, self.heads, self.head_dim).reshape(rows, self.d_inner))
            if native:
                y = self._native_scan(dt, x, B, C, layer, state.ssm[layer], _one_row_segments(rows, self.d_conv))
            else:
                y = self._scan_step(self._dt(dt + w.dt_bias), x, B, C, layer, state.ssm[layer])
            with self._elementwise(rows):
                y = self._gated_norm(torch.addcmul(y, x, w.D), z, layer)
            residual = residual + self._linear(y.to(self.dtype), w.out_proj, w.out_proj_bias)
        return self._logits(residual)

    def _advance(self, state: MambaState, ids: torch.Tensor) -> torch.Tensor:
        """Run ids [S] through every layer from `state` (1 row, updated in place) -> logits [V] after the last."""
        residual = F.embedding(ids, self._embed).to(self.residual_dtype)  # [S, d_model]
        chain = _chain(ids.shape[0], self.d_conv) if self.native and state.ssm.is_contiguous() else None
        for layer, w in enumerate(self._layers):
            h = rms_norm(residual, self._norms[layer], self.eps)
            z, xbc, dt = self._linear(h, w.in_proj, w.in_proj_bias).split([self.d_inner, self.conv_dim, self.heads],
                                                                          dim=-1)  # fmt: skip
            conv_state = state.conv[layer, 0]  # [conv_dim, d_conv]
            inputs = torch.cat((conv_state.t().to(xbc.dtype), xbc))  # [d_conv + S, conv_dim]
            conv_state.copy_(inputs[-self.d_conv:].t())
            xbc = F.silu(causal_conv(xbc, w.conv, w.conv_bias, history=inputs[1:self.d_conv]))  # [S, conv_dim]
            x, B, C = xbc.to(self.ssm_dtype).split([self.d_inner, self.groups * self.d_state,
                                                    self.groups * self.d_state], dim=-1)  # fmt: skip
            if chain is not None:
                dt = self._dt(torch.add(dt.unsqueeze(-1), self._dt_bias_heads[layer]).expand(
                    -1, self.heads, self.head_dim).reshape(-1, self.d_inner))
                y = self._native_scan(dt, x, B, C, layer, state.ssm[layer], chain)
            else:
                y = self._scan_sequence(self._dt(dt + w.dt_bias), x, B, C, layer, state.ssm[layer, 0])
            y = self._gated_norm(torch.addcmul(y, x, w.D), z, layer)
            residual = residual + self._linear(y.to(self.dtype), w.out_proj, w.out_proj_bias)
        return self._logits(residual[-1:])[0]

    def _gated_norm(self, y: torch.Tensor, z: torch.Tensor, layer: int) -> torch.Tensor:
        """HF's MambaRMSNormGated: y * silu(z), RMS-normalised per group of channels, scaled (in the SSM dtype)."""
        gated = (y * F.silu(z.to(y.dtype))).unflatten(-1, (self.groups, -1))  # [R, groups, d_inner / groups]
        normed = F.rms_norm(gated, gated.shape[-1:], eps=self._layers[layer].gate_eps)
        return normed.flatten(-2) * self._gate_norms[layer]

    def _dt(self, dt: torch.Tensor) -> torch.Tensor:
        """softplus(dt + bias) in the SSM dtype, clamped to the config's time_step_limit where it sets one."""
        dt = F.softplus(dt.to(self.ssm_dtype))
        return dt if self.dt_limit is None else dt.clamp(*self.dt_limit)

    def _native_scan(
        self,
        dt: torch.Tensor,  # [R, d_inner] per channel, after softplus
        x: torch.Tensor,  # [R, d_inner]
        B: torch.Tensor,  # [R, groups * d_state]
        C: torch.Tensor,  # [R, groups * d_state]
        layer: int,
        ssm_state: torch.Tensor,  # [segments, d_inner, d_state] contiguous, read and written in place
        layout: RowTrees,  # the segments' rows: one row each (a step) or one chain (a sequence pass)
    ) -> torch.Tensor:  # [R, d_inner]: C . state, before the D skip and the gate
        rows, n = x.shape[0], self.d_state
        keep = layout.native_tables[0][1:] - 1  # each segment's last row
        # (the kernel reads each segment's starting state before it writes its last row's state over it)
        return native_ssm_scan.tree_scan(dt, x, B.view(rows, self.groups, n), C.view(rows, self.groups, n),
                                         self._A_channels[layer], ssm_state, layout, keep, ssm_state)[0]  # fmt: skip

    def _scan_step(
        self,
        dt: torch.Tensor,  # [rows, heads], after softplus
        x: torch.Tensor,  # [rows, d_inner]
        B: torch.Tensor,  # [rows, groups * d_state]
        C: torch.Tensor,  # [rows, groups * d_state]
        layer: int,
        ssm_state: torch.Tensor,  # [rows, d_inner, d_state], updated in place
    ) -> torch.Tensor:  # [rows, d_inner]
        rows, g, n = x.shape[0], self.groups, self.d_state
        per_group = self.heads // g
        state = ssm_state.view(rows, g, per_group, self.head_dim, n)
        decay = torch.exp(dt * self._A_heads[layer]).view(rows, g, per_group, 1, 1)
        dx = (x.view(rows, self.heads, self.head_dim) * dt.unsqueeze(-1)).view(rows, g, per_group, self.head_dim, 1)
        torch.addcmul(dx * B.view(rows, g, 1, 1, n), state, decay, out=state)
        y = ssm_state.view(rows, g, per_group * self.head_dim, n) @ C.view(rows, g, n, 1)
        return y.view(rows, self.d_inner)

    def _scan_sequence(
        self,
        dt: torch.Tensor,  # [S, heads], after softplus
        x: torch.Tensor,  # [S, d_inner]
        B: torch.Tensor,  # [S, groups * d_state]
        C: torch.Tensor,  # [S, groups * d_state]
        layer: int,
        ssm_state: torch.Tensor,  # [d_inner, d_state], carried in and out
    ) -> torch.Tensor:  # [S, d_inner]
        # sequential over tokens in blocks, vectorised over heads: each block's decays and injections are batched ops
        # and its states overwrite the injections as the scan goes
        seq, g, n = x.shape[0], self.groups, self.d_state
        per_group, hd = self.heads // g, self.head_dim
        block = max(1, _SCAN_BLOCK_ELEMENTS // (self.d_inner * n))
        y = torch.empty_like(x)
        prev = ssm_state.view(g, per_group, hd, n)
        for start in range(0, seq, block):
            t = slice(start, start + block)
            T = x[t].shape[0]
            decay = torch.exp(dt[t] * self._A_heads[layer]).view(T, g, per_group, 1, 1)
            dx = (x[t].view(T, self.heads, hd) * dt[t].unsqueeze(-1)).view(T, g, per_group, hd, 1)
            states = dx * B[t].view(T, g, 1, 1, n)  # [T, g, per_group, hd, n]: injections, then states
            for i in range(T):
                prev = torch.addcmul(states[i], prev, decay[i], out=states[i])
            y[t] = (states.view(T, g, per_group * hd, n) @ C[t].view(T, g, n, 1)).view(T, self.d_inner)
        ssm_state.copy_(prev.view(self.d_inner, n))
        return y

    def _linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [R, in] @ weight^T: the native GEMM on the native path (a row's result whatever the other rows), else
        F.linear."""
        if self.native:
            return gemm.PATHS[gemm.NATIVE](x, weight, bias)
        return F.linear(x, weight, bias)

    def _logits(self, residual: torch.Tensor) -> torch.Tensor:
        with self._elementwise(residual.shape[0]):
            h = rms_norm(residual, self._norm_f, self.eps)  # [n, d_model]
        return self._linear(h, self._lm_head).to(self.ssm_dtype)  # [n, V]

    def _elementwise(self, rows: int):
        """One thread for a native step's elementwise work where torch would split it over threads (the ends of each
        thread's range take a scalar path that rounds otherwise): a row's bits then do not depend on the others."""
        if self.native and rows * self.conv_dim >= _GRAIN:
            return one_thread()
        return contextlib.nullcontext()

    def _as_ids(self, ids: torch.Tensor | Sequence[int]) -> torch.Tensor:
        ids = torch.as_tensor(ids, dtype=torch.long, device=self.device)
        if ids.dim() != 1:
            raise ValueError(f"expected a 1-D tensor of token ids, got shape {tuple(ids.shape)}")
        return ids
