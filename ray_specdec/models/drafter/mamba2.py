"""Mamba2 drafter: lean inference over the weights of a HF `Mamba2ForCausalLM`, with per-row recurrent state.

Per layer: RMSNorm -> in_proj -> (z, xBC, dt) -> causal depthwise conv of x, B and C together -> SiLU -> dt + dt_bias
-> softplus (clamped to the config's time_step_limit) -> selective scan with one A = -exp(A_log) per head, B and C
shared by a group of heads -> + D * x -> gated RMSNorm with z -> out_proj -> residual; then norm_f and lm_head.

The state is `MambaState`'s: conv [layers, rows, conv_dim, d_conv] (the last d_conv inputs of x, B and C, oldest
first) and ssm [layers, rows, d_inner, d_state], a head's state being its head_dim channels (the layout of the SSM
target's `Mamba2Weights`, whose weights this reuses). So state copies, slots and the drafting code are the Mamba
drafter's.

Paths, as MambaDrafter's: on float32 CPU drafters where models/native builds, steps and catch-ups of up to 64
tokens run in one fused C call (native/mamba2_cpu.c: every (row, channel) on its own, so a row's logits and state are
the bits it gets alone: `steps_row_invariant`), and a longer sequence (a prefill) takes torch's GEMMs and the SSM
target's native scan (native/ssm_scan.py, the sequence as one chain of rows, dt and A per channel). Elsewhere (float64,
half precision, CUDA) a step is a few batched torch ops per layer with the decay per head, and a sequence pass scans
its tokens sequentially in blocks, so memory stays bounded for prompts of any length.

Numerics follow HF's torch path: RMSNorms normalise in float32, the residual is float32 where `residual_in_fp32`, the
scan runs in float32 for half-precision models, logits are float32 (float64 for a float64 model). No GPU kernels: on
CUDA the steps run eagerly in torch (mamba_ssm's Mamba2 state update and CUDA graphs are not wired in).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from transformers import Mamba2ForCausalLM

from kernels.state_copy import copy_state_rows
from ray_specdec.models.drafter.mamba import start_native
from ray_specdec.models.drafter.mamba_ops import causal_conv, rms_norm
from ray_specdec.models.drafter.mamba_state import MambaState
from ray_specdec.models.loading import resolve_dtype, resolve_model_path, resolve_prefill_window
from ray_specdec.models.native import mamba as native_mamba, ssm_scan as native_ssm_scan
from ray_specdec.models.target.ssm import Mamba2Weights
from ray_specdec.models.target.ssm_scan import RowTrees

# Elements of one block of the torch sequence scan ([tokens, d_inner, d_state]): its injections and states stay small.
_SCAN_BLOCK_ELEMENTS = 1 << 17
# Longest catch-up (extend) the fused native forward runs whole; longer sequences (prefills) take torch's
# multi-threaded GEMMs and the native scan, as MambaDrafter's do.
_NATIVE_SEQUENCE_MAX = 64


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
        """prefill_window: as MambaDrafter's. native: the fused C forward and the native scan (module docstring).
        None: on for a float32 drafter on CPU where they build (else torch, `native_why` says why; off with
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
        # -exp(A_log) per head (the torch step's decay, the fused forward's) and per channel (the native scan's)
        self._A_heads = [w.A[:: self.head_dim, 0].contiguous() for w in self._layers]  # [heads]
        self._A_channels = [w.A[:, 0].contiguous() for w in self._layers]  # [d_inner]
        self._gate_norms = [w.gate_norm.to(self.ssm_dtype) for w in self._layers]  # [d_inner]: the norm runs there
        self._embed = backbone.embeddings.weight.detach()  # [V, d_model]
        self._norm_f = backbone.norm_f.weight.detach()  # [d_model]
        self._lm_head = model.lm_head.weight.detach()  # [V, d_model], may be the embedding (tied)
        self.native: native_mamba.NativeMamba2 | None = None
        self.native_why: str | None = None  # why the native kernels are off, when they are
        if native is not False:
            self._start_native(insist=native is True)
        self.graphs = None
        self.graphs_why: str | None = ("CUDA graphs capture Mamba (v1) drafters only; Mamba2 steps run eagerly"
                                       if self.device.type == "cuda" else None)  # fmt: skip

    def _start_native(self, insist: bool) -> None:
        self.native, self.native_why = start_native(self, native_mamba.NativeMamba2, insist)

    @property
    def steps_row_invariant(self) -> bool:
        """Whether a step gives each row the same logits and state, bit for bit, whatever other rows step with it
        (drafting.draft_many steps several requests' rows together only then): true for the fused C forward (every
        (row, channel) computed on its own, products that sum in one fixed order), not for torch's, whose products
        pick kernels by shape (tests/models/drafter/test_mamba2.py checks it)."""
        return self.native is not None

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
        if self._runs_native(state) and ids.shape[0] <= _NATIVE_SEQUENCE_MAX:
            return self.native.forward(state.conv, state.ssm, ids[None])[0]
        if ids.shape[0] == 1:
            return self.step(state, ids)[0]
        return self._advance(state, ids)

    @torch.inference_mode()
    def extend_rows(self, states: Sequence[MambaState], input_ids: Sequence[torch.Tensor | Sequence[int]]
                    ) -> torch.Tensor:  # fmt: skip
        """`extend` of several 1-row states, each by its own ids -> logits [len(states), V], row i the logits
        extend(states[i], input_ids[i]) returns, bit for bit where the native forward runs: there the states advance in
        one call (the weights read once for all of them); elsewhere one after the other."""
        ids = [self._as_ids(i) for i in input_ids]
        if len(ids) != len(states):
            raise ValueError(f"{len(ids)} token sequences for {len(states)} states")
        if any(i.shape[0] == 0 for i in ids):
            raise ValueError("extend needs at least one token")
        if any(state.rows != 1 for state in states):
            raise ValueError("extend_rows advances 1-row states")
        together = [k for k, (s, i) in enumerate(zip(states, ids))
                    if self._runs_native(s) and i.shape[0] <= _NATIVE_SEQUENCE_MAX]  # fmt: skip
        rows: list[torch.Tensor | None] = [None] * len(states)
        if len(together) > 1:
            logits = self.native.forward_rows([(states[k].conv, states[k].ssm) for k in together],
                                              [ids[k] for k in together])  # fmt: skip
            for k, row in zip(together, logits):
                rows[k] = row
        for k, row in enumerate(rows):
            if row is None:
                rows[k] = self.extend(states[k], ids[k])
        if not rows:
            return torch.empty(0, self.vocab_size, dtype=self.ssm_dtype, device=self.device)
        return torch.stack(rows)

    @torch.inference_mode()
    def step(self, state: MambaState, tokens: torch.Tensor | Sequence[int]) -> torch.Tensor:
        """tokens [rows], one per state row -> logits [rows, V]; the state advances by one token in place."""
        tokens = self._as_ids(tokens)  # [rows]
        rows = tokens.shape[0]
        if rows != state.rows:
            raise ValueError(f"{rows} tokens for a state of {state.rows} rows")
        if self._runs_native(state):
            return self.native.forward(state.conv, state.ssm, tokens[:, None])
        residual = F.embedding(tokens, self._embed).to(self.residual_dtype)  # [rows, d_model]
        for layer, w in enumerate(self._layers):
            h = rms_norm(residual, self._norms[layer], self.eps)
            z, xbc, dt = F.linear(h, w.in_proj, w.in_proj_bias).split([self.d_inner, self.conv_dim, self.heads],
                                                                       dim=-1)  # fmt: skip
            conv = state.conv[layer]  # [rows, conv_dim, d_conv]
            window = torch.cat((conv[:, :, 1:], xbc.unsqueeze(-1)), dim=-1)  # [rows, conv_dim, d_conv]
            conv.copy_(window)
            xbc = torch.linalg.vecdot(window, w.conv)
            xbc = F.silu(xbc if w.conv_bias is None else xbc + w.conv_bias)
            x, B, C = xbc.to(self.ssm_dtype).split([self.d_inner, self.groups * self.d_state,
                                                    self.groups * self.d_state], dim=-1)  # fmt: skip
            y = self._scan_step(self._dt(dt + w.dt_bias), x, B, C, layer, state.ssm[layer])
            y = self._gated_norm(torch.addcmul(y, x, w.D), z, layer)
            residual = residual + F.linear(y.to(self.dtype), w.out_proj, w.out_proj_bias)
        return self._logits(residual)

    def _advance(self, state: MambaState, ids: torch.Tensor) -> torch.Tensor:
        """Run ids [S] through every layer from `state` (1 row, updated in place) -> logits [V] after the last."""
        residual = F.embedding(ids, self._embed).to(self.residual_dtype)  # [S, d_model]
        chain = _chain(ids.shape[0], self.d_conv) if self._runs_native(state) else None
        for layer, w in enumerate(self._layers):
            h = rms_norm(residual, self._norms[layer], self.eps)
            z, xbc, dt = F.linear(h, w.in_proj, w.in_proj_bias).split([self.d_inner, self.conv_dim, self.heads],
                                                                       dim=-1)  # fmt: skip
            conv_state = state.conv[layer, 0]  # [conv_dim, d_conv]
            inputs = torch.cat((conv_state.t().to(xbc.dtype), xbc))  # [d_conv + S, conv_dim]
            conv_state.copy_(inputs[-self.d_conv:].t())
            xbc = F.silu(causal_conv(xbc, w.conv, w.conv_bias, history=inputs[1:self.d_conv]))  # [S, conv_dim]
            x, B, C = xbc.to(self.ssm_dtype).split([self.d_inner, self.groups * self.d_state,
                                                    self.groups * self.d_state], dim=-1)  # fmt: skip
            if chain is not None:
                dt = self._dt((dt + w.dt_bias).repeat_interleave(self.head_dim, dim=1))  # per channel: the kernel's
                y = self._native_scan(dt, x, B, C, layer, state.ssm[layer], chain)
            else:
                y = self._scan_sequence(self._dt(dt + w.dt_bias), x, B, C, layer, state.ssm[layer, 0])
            y = self._gated_norm(torch.addcmul(y, x, w.D), z, layer)
            residual = residual + F.linear(y.to(self.dtype), w.out_proj, w.out_proj_bias)
        return self._logits(residual[-1:])[0]

    def _runs_native(self, state: MambaState) -> bool:
        return self.native is not None and state.conv.is_contiguous() and state.ssm.is_contiguous()

    def _gated_norm(self, y: torch.Tensor, z: torch.Tensor, layer: int) -> torch.Tensor:
        """HF's MambaRMSNormGated: y * silu(z), RMS-normalised per group of channels, scaled (in the SSM dtype)."""
        gated = (y * F.silu(z.to(y.dtype))).unflatten(-1, (self.groups, -1))  # [R, groups, d_inner / groups]
        normed = F.rms_norm(gated, gated.shape[-1:], eps=self._layers[layer].gate_eps)
        return normed.flatten(-2) * self._gate_norms[layer]

    def _dt(self, dt: torch.Tensor) -> torch.Tensor:
        """softplus(dt) in the SSM dtype (dt with its bias added), clamped to the config's time_step_limit where it
        sets one."""
        dt = F.softplus(dt.to(self.ssm_dtype))
        return dt if self.dt_limit is None else dt.clamp(*self.dt_limit)

    def _native_scan(
        self,
        dt: torch.Tensor,  # [R, d_inner] per channel, after softplus
        x: torch.Tensor,  # [R, d_inner]
        B: torch.Tensor,  # [R, groups * d_state]
        C: torch.Tensor,  # [R, groups * d_state]
        layer: int,
        ssm_state: torch.Tensor,  # [1, d_inner, d_state] contiguous, read and written in place
        layout: RowTrees,  # the sequence as one chain of rows (`_chain`)
    ) -> torch.Tensor:  # [R, d_inner]: C . state, before the D skip and the gate
        rows, n = x.shape[0], self.d_state
        keep = layout.native_tables[0][1:] - 1  # the last row
        # (the kernel reads the starting state before it writes the last row's state over it)
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
        carried = ssm_state if ssm_state.is_contiguous() else ssm_state.contiguous()  # (a strided view of rows)
        state = carried.view(rows, g, per_group, self.head_dim, n)
        decay = torch.exp(dt * self._A_heads[layer]).view(rows, g, per_group, 1, 1)
        dx = (x.view(rows, self.heads, self.head_dim) * dt.unsqueeze(-1)).view(rows, g, per_group, self.head_dim, 1)
        torch.addcmul(dx * B.view(rows, g, 1, 1, n), state, decay, out=state)
        y = carried.view(rows, g, per_group * self.head_dim, n) @ C.view(rows, g, n, 1)
        if carried is not ssm_state:
            ssm_state.copy_(carried)
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
        prev = ssm_state.reshape(g, per_group, hd, n)
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

    def _logits(self, residual: torch.Tensor) -> torch.Tensor:
        h = rms_norm(residual, self._norm_f, self.eps)  # [n, d_model]
        return F.linear(h, self._lm_head).to(self.ssm_dtype)  # [n, V]

    def _as_ids(self, ids: torch.Tensor | Sequence[int]) -> torch.Tensor:
        ids = torch.as_tensor(ids, dtype=torch.long, device=self.device)
        if ids.dim() != 1:
            raise ValueError(f"expected a 1-D tensor of token ids, got shape {tuple(ids.shape)}")
        return ids
