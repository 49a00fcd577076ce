"""Mamba (v1) drafter: lean inference over the weights of a HF `MambaForCausalLM`, with per-row recurrent state.

The HF module only supplies weights; the hot path is our own: per layer RMSNorm -> in_proj -> (x, z) -> causal
depthwise conv -> SiLU -> x_proj -> (dt, B, C) -> dt_proj + softplus -> selective scan with A = -exp(A_log)
-> + D * x -> * SiLU(z) -> out_proj -> residual, then norm_f and lm_head. A state row holds, per layer, the last
d_conv conv inputs and the SSM state; rows are independent, so a draft tree is a batch of rows.

Numerics follow HF's: the residual stream is float32 when `residual_in_fp32` (and the model is half precision), the
SSM runs in float32 for half models, logits are float32 (float64 for a float64 model). The SSM state is kept in the
SSM dtype. On CUDA with mamba_ssm and causal_conv1d installed, `step` and `prefill` use their fused kernels; on
CUDA, steps replay CUDA graphs (models/cuda_graphs).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
import functools
import logging

import torch
import torch.nn.functional as F
from transformers import MambaForCausalLM

from kernels.selective_scan import available as scan_kernel_available, selective_scan
from kernels.state_copy import copy_state_rows
from ray_specdec import env
from ray_specdec.models.drafter.cuda_graphs import MAX_GRAPH_TOKENS, StepGraphs
from ray_specdec.models.drafter.mamba_ops import causal_conv, contract_state, rms_norm, scan_block
from ray_specdec.models.drafter.mamba_state import MambaState, MixerWeights
from ray_specdec.models.loading import failure, resolve_dtype, resolve_model_path, resolve_prefill_window
from ray_specdec.models.native import gemm, library, mamba as native_mamba

logger = logging.getLogger(__name__)

try:  # GPU fast path; mamba_ssm fails to import without its CUDA extension
    from causal_conv1d import causal_conv1d_update
    from mamba_ssm.ops.selective_scan_interface import selective_scan_fn
    from mamba_ssm.ops.triton.selective_state_update import selective_state_update
except (ImportError, RuntimeError):
    causal_conv1d_update = selective_scan_fn = selective_state_update = None

# Elements of one prefill scan block ([tokens, d_inner, d_state]): its decay and injection buffers (0.5 MB each in
# float32) stay in cache; blocks of 4M elements were 2-3x slower on CPU (fresh pages, cache misses).
_SCAN_BLOCK_ELEMENTS = 1 << 17
# Longest catch-up (extend) the native forward runs whole; longer sequences (prefills) go through torch's
# multi-threaded GEMMs and the native scan: ~2x faster at 512+ tokens on 2 cores, ~1.5x slower at 8 tokens.
_NATIVE_SEQUENCE_MAX = 64
# Row counts the drafter's GEMM plan is measured at (fast_matmul): its steps' rows, up to a batched step over many
# requests' trees; products of more rows take the largest's path (gemm.GemmPlan). The prefill's sequence products
# do not go through the plan.
_PLANNED_ROWS = (*range(1, 9), 12, 16, 24, 32, 48, 64, 128, 256, 512)


@functools.cache
def _cpu_has_bf16_matmul() -> bool:
    """AVX512-BF16 or AMX: oneDNN's bf16 GEMM beats float32 there; elsewhere it emulates bf16 and is slower."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "").split()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def start_native(drafter, binding, insist: bool):
    """(the drafter's fused native forward, None) where it can run: float32 on CPU with the kernels built; else
    (None, why not). insist: a RuntimeError instead of the reason."""
    if drafter.device.type != "cpu" or drafter.dtype != torch.float32:
        why = f"native kernels run float32 drafters on CPU, not {drafter.dtype} on {drafter.device}"
    elif (lib := library.load()) is None:
        why = library.why_unavailable()
    else:
        return binding(lib, drafter), None
    if insist:
        raise RuntimeError(f"native=True but {why}")
    return None, why


class MambaDrafter:
    """Prefill a prompt into one state row, step batches of rows one token each, copy rows by parent index."""

    @classmethod
    def from_pretrained(
        cls,
        name_or_path: str,
        *,
        dtype: str | torch.dtype | None = None,
        device: str = "cpu",
        fast_matmul: bool | None = None,
        prefill_window: int | str | None = "auto",
        native: bool | None = None,
        cuda_graphs: bool | None = None,
    ) -> "MambaDrafter":
        """fast_matmul None: on for a float32 model on CPU (see __init__), off elsewhere."""
        torch_dtype = resolve_dtype(dtype, device)
        model = MambaForCausalLM.from_pretrained(resolve_model_path(name_or_path), dtype=torch_dtype)
        if fast_matmul is None:
            fast_matmul = torch.device(device).type == "cpu" and torch_dtype == torch.float32
        return cls(model.to(device), fast_matmul=fast_matmul, prefill_window=prefill_window, native=native,
                   cuda_graphs=cuda_graphs)

    def __init__(
        self,
        model: MambaForCausalLM,
        *,
        fast_matmul: bool = False,
        prefill_window: int | str | None = "auto",
        native: bool | None = None,
        cuda_graphs: bool | None = None,
    ):
        """fast_matmul: steps of few rows take the fastest of several matrix-product paths, measured at load.

        A drafter step is memory- and overhead-bound on CPU. The paths: F.linear, the float32 ones of
        `native.gemm` (weight as the left operand, oneDNN), and half-precision copies of the projection weights
        (float16, whose GEMV accumulates in float32 and reads half the bytes; the shipped weights are float16
        anyway; bfloat16 where the CPU has bf16 matrix instructions). A low-precision path rounds activations on
        the way in, so drafts can differ from the float32 drafter's in near ties. That changes acceptance, never
        the output: the target verifies every token.

        prefill_window: a request's drafter state starts from its last this many tokens (None or "all": all of
        them; "auto": the window the model's config names under `ray_specdec_prefill_window`, else all). The
        drafter's prefill is a sequential scan, linear in the prompt; a drafter trained on short windows gains
        nothing from further back (the shipped one names 512, the longest windows it was trained on;
        docs/BENCHMARKS.md), and drafts never change the output.

        native: steps and the prefill's scan run in the fused C kernels of models/native (compiled on first use).
        None: on for a float32 drafter on CPU where they build (else the torch path, `native_why` says why; off with
        RAY_SPECDEC_NATIVE=0); True insists (an error where they cannot run); False: the torch path.

        cuda_graphs: steps of up to 64 rows and catch-ups of up to 32 tokens replay CUDA graphs (models/cuda_graphs),
        all captured here. None: on for CUDA devices unless RAY_SPECDEC_CUDA_GRAPHS=0 (eager where a capture fails,
        `graphs_why` says why); True insists (an error where they cannot run); False: eager.
        """
        self.prefill_window: int | None = resolve_prefill_window(prefill_window, model.config)
        config = model.config
        if config.hidden_act != "silu":
            raise ValueError(f"only silu Mamba models are supported, got hidden_act={config.hidden_act!r}")
        self.model = model.eval()
        backbone = model.backbone
        self.device = backbone.embeddings.weight.device
        self.dtype = backbone.embeddings.weight.dtype
        self.vocab_size: int = model.lm_head.out_features
        self.n_layers: int = config.num_hidden_layers
        self.d_inner: int = config.intermediate_size
        self.d_conv: int = config.conv_kernel
        self.d_state: int = config.state_size
        self.dt_rank: int = int(config.time_step_rank)
        self.eps: float = config.layer_norm_epsilon
        # Half models scan and (with residual_in_fp32) accumulate the residual in float32, as HF and mamba_ssm do.
        self.ssm_dtype = torch.promote_types(self.dtype, torch.float32)
        self.residual_dtype = self.ssm_dtype if config.residual_in_fp32 else self.dtype
        self._layers = [MixerWeights.from_block(block, self.ssm_dtype) for block in backbone.layers]
        self._embed = backbone.embeddings.weight.detach()  # [V, d_model]
        self._norm_f = backbone.norm_f.weight.detach()  # [d_model]
        self._lm_head = model.lm_head.weight.detach()  # [V, d_model], may be the embedding (tied)
        self._low_precision = self._low_precision_copies() if fast_matmul else {}
        self._gemm_paths = self._step_paths() if fast_matmul else {}
        self.gemm_plan: gemm.GemmPlan | None = None
        if fast_matmul:
            weights = [(w, None) for w in self._low_precision]
            self.gemm_plan = gemm.plan_for(weights, _PLANNED_ROWS, self._gemm_paths, tag="mamba-step")
        # The CUDA kernels take float32 and half precision, not float64.
        self._use_kernels = (
            selective_state_update is not None and self.device.type == "cuda" and self.dtype != torch.float64
        )
        self.native: native_mamba.NativeMamba | None = None
        self.native_why: str | None = None  # why the native kernels are off, when they are
        if native is not False:
            self._start_native(insist=native is True)
        self.graphs: StepGraphs | None = None
        self.extend_graphs: StepGraphs | None = None
        self.graphs_why: str | None = None  # why a CUDA drafter steps eagerly, when it does
        if cuda_graphs is None:
            cuda_graphs = self.device.type == "cuda" and env.CUDA_GRAPHS.on()
            if cuda_graphs:
                self._start_graphs(insist=False)
        elif cuda_graphs:
            self._start_graphs(insist=True)

    @property
    def steps_row_invariant(self) -> bool:
        """Whether a step gives each row the same logits and state, bit for bit, whatever other rows step with it:
        then the rows of several requests may step together and each gets what it would alone (drafting.draft_many).

        True for the native C step: every output of its products is one chain of multiply-adds over the inputs in a
        fixed order (threads split outputs, not sums), and its norms, conv and scan run row by row. Not for the
        torch step, whose products depend on the row count (oneDNN and MKL pick kernels and blockings by shape, and
        the GEMM plan picks a path per row count), nor on CUDA (cuBLAS picks kernels by shape; a graph is captured
        per row count). tests/speculation/test_draft_batch.py checks the native step.
        """
        return self.native is not None

    def _start_graphs(self, insist: bool) -> None:
        """Capture every step and catch-up graph now (~0.5 s; none in any request). A capture that fails leaves the
        drafter eager (graphs_why says why) unless graphs were asked for explicitly."""
        try:
            graphs = StepGraphs(self._step_eager, self._new_buffers, self.device)
            extend = None
            if not self._use_kernels:  # (mamba_ssm's catch-up steps token by token, through `graphs`)
                extend = StepGraphs(self._extend_eager, lambda n: self._new_buffers(1), self.device,
                                    max_tokens=MAX_GRAPH_TOKENS)
                extend.capture(range(2, MAX_GRAPH_TOKENS + 1))  # (one token: a step)
            graphs.capture(range(1, graphs.max_tokens + 1))
        except (RuntimeError, ValueError) as exc:
            if insist:
                raise
            self.graphs_why = f"CUDA graph capture failed: {failure(exc)}"
            logger.warning("drafter steps run eagerly: %s", self.graphs_why)
            return
        self.graphs, self.extend_graphs = graphs, extend

    def _start_native(self, insist: bool) -> None:
        self.native, self.native_why = start_native(self, native_mamba.NativeMamba, insist)

    def _low_precision_copies(self) -> dict[torch.Tensor, tuple[torch.Tensor, torch.Tensor | None]]:
        """weight -> (float16 copy, bfloat16 copy or None) for every projection a step multiplies by."""
        if self.dtype != torch.float32 or self.device.type != "cpu":
            raise ValueError("fast_matmul is for float32 drafters on CPU")
        weights = [w for layer in self._layers for w in (layer.in_proj, layer.x_proj, layer.out_proj)]
        bf16 = _cpu_has_bf16_matmul()
        return {
            w: (w.to(torch.float16), w.to(torch.bfloat16) if bf16 else None) for w in [*weights, self._lm_head]
        }

    def _step_paths(self) -> dict[str, Callable]:
        """name -> fn(x, weight, bias) for every product path the plan may pick (see __init__)."""

        def low(which: int):
            def product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
                copy = self._low_precision[weight][which]
                out = F.linear(x.to(copy.dtype), copy).to(x.dtype)
                return out if bias is None else out + bias

            return product

        paths = {name: gemm.PATHS[name] for name in gemm.available_paths()}
        paths["float16"] = low(0)
        if _cpu_has_bf16_matmul():
            paths["bfloat16"] = low(1)
        return paths

    def _linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """F.linear, or the path the GEMM plan names for this many rows when fast_matmul is on."""
        if self.gemm_plan is None or weight not in self._low_precision:
            return F.linear(x, weight, bias)
        return self._gemm_paths[self.gemm_plan.path_for(x.shape[0])](x, weight, bias)

    def new_state(self, rows: int) -> MambaState:
        """Zero state: the state before any token."""
        return MambaState(
            conv=torch.zeros(self.n_layers, rows, self.d_inner, self.d_conv, dtype=self.dtype, device=self.device),
            ssm=torch.zeros(
                self.n_layers, rows, self.d_inner, self.d_state, dtype=self.ssm_dtype, device=self.device
            ),
        )

    def _new_buffers(self, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        state = self.new_state(rows)
        return state.conv, state.ssm

    @torch.inference_mode()
    def copy_rows(
        self, src: MambaState, index: torch.Tensor | Sequence[int], out: MambaState | None = None
    ) -> MambaState:
        """out.row[i] = src.row[index[i]] for every layer's conv and SSM state (kernels.state_copy.copy_state_rows:
        one Triton launch on CUDA for big states, two gathers otherwise)."""
        index = torch.as_tensor(index, dtype=torch.long)  # [rows_out]
        checked = index.device.type == "cpu"  # checked here, on the host: no device sync for it in the launcher
        if checked and index.numel() and not (0 <= int(index.min()) and int(index.max()) < src.rows):
            raise ValueError(f"index out of range for {src.rows} source rows")
        index = self._as_ids(index)
        if out is None:
            out = MambaState(
                conv=src.conv.new_empty(self.n_layers, index.shape[0], self.d_inner, self.d_conv),
                ssm=src.ssm.new_empty(self.n_layers, index.shape[0], self.d_inner, self.d_state),
            )
        copy_state_rows(src.conv, src.ssm, index, out.conv, out.ssm, index_checked=checked)
        return out

    @torch.inference_mode()
    def prefill(self, input_ids: torch.Tensor | Sequence[int]) -> tuple[MambaState, torch.Tensor]:
        """input_ids [S] (S >= 1) -> (state with 1 row after the last token, logits [V] for the next token)."""
        ids = self._as_ids(input_ids)  # [S]
        if ids.shape[0] == 0:
            raise ValueError("prefill needs at least one token")
        state = self.new_state(1)
        return state, self._advance(state, ids)

    @torch.inference_mode()
    def extend(self, state: MambaState, input_ids: torch.Tensor | Sequence[int]) -> torch.Tensor:
        """Advance a 1-row state by input_ids [S] (S >= 1) in place -> logits [V] for the token after them.

        Equals S calls of `step` (up to float rounding) in one sequence pass: the drafter's commit catches up on
        several tokens (a long accepted lookup branch, queued verdicts) for about the cost of one step.
        """
        ids = self._as_ids(input_ids)
        if ids.shape[0] == 0:
            raise ValueError("extend needs at least one token")
        if state.rows != 1:
            raise ValueError(f"extend advances a 1-row state, got {state.rows} rows")
        if self._runs_native(state) and ids.shape[0] <= _NATIVE_SEQUENCE_MAX:
            return self.native.forward(state.conv, state.ssm, ids[None])[0]
        if self._use_kernels or ids.shape[0] == 1:
            # mamba_ssm's fused scan starts from a zero state: step token by token through its update kernel
            for token in ids:
                logits = self.step(state, token[None])
            return logits[0]
        if self.extend_graphs is not None and self.extend_graphs.covers(ids.shape[0]):
            return self.extend_graphs.step(state.conv, state.ssm, ids)
        return self._advance(state, ids, linear=self._linear)

    @torch.inference_mode()
    def extend_rows(self, states: Sequence[MambaState], input_ids: Sequence[torch.Tensor | Sequence[int]]
                    ) -> torch.Tensor:  # fmt: skip
        """`extend` of several 1-row states, each by its own ids -> logits [len(states), V], row i the logits
        extend(states[i], input_ids[i]) returns, bit for bit where the native kernels run: there every state advances
        in one call (the weights are read once for all of them: a commit of 32 requests' tokens took ~12 ms one by
        one on the 2-core CPU, ~5 ms together). Elsewhere the states extend one after the other."""
        ids = [self._as_ids(i) for i in input_ids]
        if len(ids) != len(states):
            raise ValueError(f"{len(ids)} token sequences for {len(states)} states")
        if any(i.shape[0] == 0 for i in ids):
            raise ValueError("extend needs at least one token")
        if any(state.rows != 1 for state in states):
            raise ValueError("extend_rows advances 1-row states")
        together = [k for k, (s, i) in enumerate(zip(states, ids))
                    if self._runs_native(s) and i.shape[0] <= _NATIVE_SEQUENCE_MAX]  # fmt: skip
        if len(together) < 2:
            together = []
        rows: list[torch.Tensor | None] = [None] * len(states)
        if together:
            logits = self.native.forward_rows([(states[k].conv, states[k].ssm) for k in together],
                                              [ids[k] for k in together])  # fmt: skip
            for k, row in zip(together, logits):
                rows[k] = row
        for k, row in enumerate(rows):
            if row is None:
                rows[k] = self.extend(states[k], ids[k])
        if not rows:
            return torch.empty(0, self.vocab_size, device=self.device)
        return torch.stack(rows)

    def _extend_eager(self, conv: torch.Tensor, ssm: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return self._advance(MambaState(conv, ssm), ids, linear=self._linear)

    def _advance(self, state: MambaState, ids: torch.Tensor, linear=F.linear) -> torch.Tensor:
        """Run ids [S] through every layer from `state` (1 row, updated in place) -> logits [V] after the last.

        linear: F.linear (prefill: float32 throughout) or self._linear (extend: a few rows, like a step).
        """
        residual = F.embedding(ids, self._embed).to(self.residual_dtype)  # [S, d_model]
        for layer, w in enumerate(self._layers):
            h = rms_norm(residual, w.norm, self.eps)
            residual = residual + self._mix_sequence(h, w, state.conv[layer, 0], state.ssm[layer, 0], linear)
        return self._logits(residual[-1:])[0]

    @torch.inference_mode()
    def step(self, state: MambaState, tokens: torch.Tensor | Sequence[int]) -> torch.Tensor:
        """tokens [rows], one per state row -> logits [rows, V]; the state advances by one token in place."""
        tokens = self._as_ids(tokens)  # [rows]
        if tokens.shape[0] != state.rows:
            raise ValueError(f"{tokens.shape[0]} tokens for a state of {state.rows} rows")
        if self._runs_native(state):
            return self.native.forward(state.conv, state.ssm, tokens[:, None])
        if self.graphs is not None and self.graphs.covers(tokens.shape[0]):
            return self.graphs.step(state.conv, state.ssm, tokens)
        return self._step_eager(state.conv, state.ssm, tokens)

    def _step_eager(self, conv: torch.Tensor, ssm: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        mix = self._mix_step_kernels if self._use_kernels else self._mix_step
        residual = F.embedding(tokens, self._embed).to(self.residual_dtype)  # [rows, d_model]
        for layer, w in enumerate(self._layers):
            h = rms_norm(residual, w.norm, self.eps)
            residual = residual + mix(h, w, conv[layer], ssm[layer])
        return self._logits(residual)

    def _runs_native(self, state: MambaState) -> bool:
        return self.native is not None and state.conv.is_contiguous() and state.ssm.is_contiguous()

    def _as_ids(self, ids: torch.Tensor | Sequence[int]) -> torch.Tensor:
        ids = torch.as_tensor(ids, dtype=torch.long, device=self.device)
        if ids.dim() != 1:
            raise ValueError(f"expected a 1-D tensor of token ids, got shape {tuple(ids.shape)}")
        return ids

    def _logits(self, residual: torch.Tensor) -> torch.Tensor:
        h = rms_norm(residual, self._norm_f, self.eps)  # [n, d_model]
        return self._linear(h, self._lm_head).to(self.ssm_dtype)  # [n, V]

    def _mix_step(
        self,
        h: torch.Tensor,  # [rows, d_model]
        w: MixerWeights,
        conv_state: torch.Tensor,  # [rows, d_inner, d_conv], updated in place
        ssm_state: torch.Tensor,  # [rows, d_inner, d_state], updated in place
    ) -> torch.Tensor:  # [rows, d_model]
        x, z = self._linear(h, w.in_proj, w.in_proj_bias).chunk(2, dim=-1)  # [rows, d_inner] each
        window = torch.cat((conv_state[:, :, 1:], x.unsqueeze(-1)), dim=-1)  # [rows, d_inner, d_conv]
        conv_state.copy_(window)
        x = torch.linalg.vecdot(window, w.conv)
        if w.conv_bias is not None:
            x = x + w.conv_bias
        x = F.silu(x)

        sd = self.ssm_dtype
        dt, B, C = self._linear(x, w.x_proj).split([self.dt_rank, self.d_state, self.d_state], dim=-1)
        dt = F.softplus(F.linear(dt, w.dt_proj, w.dt_bias).to(sd))  # [rows, d_inner]
        x = x.to(sd)
        decay = torch.exp(dt.unsqueeze(-1) * w.A)  # [rows, d_inner, d_state]
        inject = (dt * x).unsqueeze(-1) * B.to(sd).unsqueeze(1)  # [rows, d_inner, d_state]
        torch.addcmul(inject, decay, ssm_state, out=ssm_state)
        y = contract_state(ssm_state, C.to(sd))  # [rows, d_inner]
        y = torch.addcmul(y, x, w.D) * F.silu(z.to(sd))
        return self._linear(y.to(self.dtype), w.out_proj, w.out_proj_bias)

    def _mix_step_kernels(
        self,
        h: torch.Tensor,  # [rows, d_model]
        w: MixerWeights,
        conv_state: torch.Tensor,  # [rows, d_inner, d_conv], updated in place
        ssm_state: torch.Tensor,  # [rows, d_inner, d_state], updated in place
    ) -> torch.Tensor:  # [rows, d_model]
        x, z = F.linear(h, w.in_proj, w.in_proj_bias).chunk(2, dim=-1)
        x = causal_conv1d_update(x, conv_state, w.conv, w.conv_bias, "silu")
        dt, B, C = F.linear(x, w.x_proj).split([self.dt_rank, self.d_state, self.d_state], dim=-1)
        dt = F.linear(dt, w.dt_proj)  # the kernel adds dt_bias and applies softplus in float32
        y = selective_state_update(ssm_state, x, dt, w.A, B, C, w.D, z=z, dt_bias=w.dt_bias, dt_softplus=True)
        return F.linear(y, w.out_proj, w.out_proj_bias)

    def _mix_sequence(
        self,
        h: torch.Tensor,  # [S, d_model]
        w: MixerWeights,
        conv_state: torch.Tensor,  # [d_inner, d_conv], carried in and out (zero for a prefill)
        ssm_state: torch.Tensor,  # [d_inner, d_state], carried in and out (zero for a prefill)
        linear=F.linear,
    ) -> torch.Tensor:  # [S, d_model]
        x, z = linear(h, w.in_proj, w.in_proj_bias).chunk(2, dim=-1)  # [S, d_inner] each
        inputs = torch.cat((conv_state.t().to(x.dtype), x))  # [d_conv + S, d_inner]: the window's inputs, then x
        conv_state.copy_(inputs[-self.d_conv :].t())
        x = F.silu(causal_conv(x, w.conv, w.conv_bias, history=inputs[1 : self.d_conv]))  # [S, d_inner]
        dt, B, C = linear(x, w.x_proj).split([self.dt_rank, self.d_state, self.d_state], dim=-1)
        scan = self._scan_kernel if self._use_kernels else self._scan
        y = scan(x, z, dt, B, C, w, ssm_state)  # [S, d_inner]
        return linear(y.to(self.dtype), w.out_proj, w.out_proj_bias)

    def _scan(
        self,
        x: torch.Tensor,  # [S, d_inner]
        z: torch.Tensor,  # [S, d_inner]
        dt: torch.Tensor,  # [S, dt_rank], before dt_proj
        B: torch.Tensor,  # [S, d_state]
        C: torch.Tensor,  # [S, d_state]
        w: MixerWeights,
        ssm_state: torch.Tensor,  # [d_inner, d_state], carried in and out
    ) -> torch.Tensor:  # [S, d_inner], ssm dtype
        sd = self.ssm_dtype
        dt = F.softplus(F.linear(dt, w.dt_proj, w.dt_bias).to(sd))  # [S, d_inner]
        x, B, C = x.to(sd), B.to(sd), C.to(sd)
        if self.native is not None:
            y = self.native.scan(dt, x, B, C, w.A, ssm_state)
        elif x.is_cuda and sd == torch.float32 and ssm_state.is_contiguous() and scan_kernel_available(x.device):
            y = selective_scan(dt, x, B, C, w.A, ssm_state)  # one launch, not one per token (kernels/)
        else:
            y = torch.empty_like(x)  # [S, d_inner]
            block = max(1, _SCAN_BLOCK_ELEMENTS // (self.d_inner * self.d_state))
            for start in range(0, x.shape[0], block):
                t = slice(start, start + block)
                y[t] = scan_block(dt[t], x[t], B[t], C[t], w.A, ssm_state)
        return torch.addcmul(y, x, w.D) * F.silu(z.to(sd))

    def _scan_kernel(self, x, z, dt, B, C, w: MixerWeights, ssm_state: torch.Tensor) -> torch.Tensor:
        """`_scan` through mamba_ssm's fused selective scan (channels-first layout, one batch row)."""

        def channels_first(t: torch.Tensor) -> torch.Tensor:  # [S, n] -> [1, n, S]
            return t.t().unsqueeze(0)

        dt = F.linear(dt, w.dt_proj)  # the kernel adds dt_bias and applies softplus in float32
        y, last_state = selective_scan_fn(
            channels_first(x),
            channels_first(dt),
            w.A,
            channels_first(B),
            channels_first(C),
            w.D,
            z=channels_first(z),
            delta_bias=w.dt_bias.float(),
            delta_softplus=True,
            return_last_state=True,
        )
        ssm_state.copy_(last_state[0])
        return y[0].t()
