"""The Transformer target: scores a whole token tree in one forward pass over a per-request KV cache.

A verify forward takes ``[root, *tree nodes]`` (root = the previous bonus token, not yet in the cache) with position
ids ``cache length + depth`` and a 4D mask: causal over everything cached plus the tree's ancestor mask. HF's masking
code uses a caller-supplied 4D mask as-is (eager and sdpa alike), so this adapter relies only on the model's forward
(``past_key_values`` / ``attention_mask`` / ``position_ids``). That keeps it working when DeepSpeed AutoTP has
replaced the Linear layers: every rank runs the same calls and keeps its own shard of the cache. On CPU, GPTNeoX and
Llama verifies run `lean_forward.LeanForward` instead: the same computation over the same modules (HF's logits bit
for bit) without the model forward's per-call overhead.

After acceptance, ``commit`` keeps the root and the accepted path and drops the other tree rows, compacting each
layer's K/V so the cache is again one contiguous prefix. The K/V live in a `GrowableKVCache` (kv_cache.py): rows are
written in place into preallocated buffers, so a round costs O(new rows), not a copy of the whole context.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Sequence

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import AutoModelForCausalLM, PreTrainedModel

from ray_specdec.models import cpu_attention, cpu_gemm, lean_forward, native
from ray_specdec.models.kv_cache import GrowableKVCache
from ray_specdec.models.loading import load_tokenizer, resolve_dtype, resolve_model_path, switched_on
from ray_specdec.tree import TreeTensors

# sdpa takes an arbitrary float mask, is exact against eager (float64 agrees to ~1e-15) and is faster on CPU.
ATTN_IMPLEMENTATION = "sdpa"
# Implementations whose attention honours a caller-supplied 4D additive mask (flash-attention kernels do not).
_MASKABLE_ATTENTION = ("eager", "sdpa", cpu_attention.NAME)
# Long prompts are prefilled in chunks of this many tokens, so one forward's activations stay bounded. A prompt that
# fits one chunk runs as one causal forward without a mask; a chunk after the first carries a [chunk, cache] mask,
# which sdpa's CPU kernel reads for every head and layer: a 4,096-token prompt in chunks of 512 took ~1.2x as long
# as in one forward (the default target on 2 cores).
PREFILL_CHUNK = 4096
# Eager attention materialises [heads, chunk, cache + chunk] scores: smaller chunks there.
EAGER_PREFILL_CHUNK = 512
# sdpa backends for our forwards on CUDA: not cuDNN's, which builds an execution plan per new shape (every verify of
# a growing cache is one): on an H200 in bfloat16 that cost ~7 ms of host time per attention call, against ~0.25 ms
# for the memory-efficient kernel, which takes the same masks.
CUDA_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


@dataclass
class TargetCache:
    """Per-request KV cache. `pending_rows` counts rows of the last verify that are not committed yet."""

    kv: GrowableKVCache
    pending_rows: int = 0

    @property
    def length(self) -> int:
        """Tokens held, uncommitted verify rows included."""
        return self.kv.get_seq_length()


class TargetModel:
    """Adapter around an HF causal LM (GPTNeoX, Llama, Mistral, ... including grouped-query attention)."""

    @classmethod
    def from_pretrained(
        cls,
        name_or_path: str,
        *,
        dtype: str | torch.dtype | None = None,
        device: str = "cpu",
        planned_gemm: bool | None = None,
        native_attention: bool | None = None,
        lean: bool | None = None,
    ) -> "TargetModel":
        """Load from a hub id or a local directory; float32 on CPU unless `dtype` says otherwise."""
        path = resolve_model_path(name_or_path)
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=resolve_dtype(dtype, device), attn_implementation=ATTN_IMPLEMENTATION
        )
        return cls(model.to(device).eval(), load_tokenizer(path), planned_gemm=planned_gemm,
                   native_attention=native_attention, lean=lean)

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer=None,
        *,
        planned_gemm: bool | None = None,
        native_attention: bool | None = None,
        lean: bool | None = None,
    ):
        """planned_gemm: the Linear layers take the fastest measured GEMM path per row count (models/cpu_gemm.py).
        None: on for a float32 model on CPU (not for a DeepSpeed engine's shard), unless the environment sets
        RAY_SPECDEC_PLANNED_GEMM=0; True insists (an error where unsupported); False leaves the model as loaded.
        native_attention: verify rows attend through the C kernel (models/cpu_attention.py). None: on for a float32
        sdpa model on CPU (not a shard) where the native kernels build (RAY_SPECDEC_NATIVE=0 turns them off);
        True insists; False leaves the model's attention as loaded. `native_attention_why` says why it is off.
        lean: verify forwards run as models/lean_forward.py's loop over the model's modules (the same logits, bit
        for bit, without HF's per-call machinery). None: on where it supports the model (GPTNeoX and Llama on CPU,
        not a shard) unless RAY_SPECDEC_LEAN=0; True insists; False keeps HF's forward. `lean_why` says why it is
        off."""
        sharded = not isinstance(model, PreTrainedModel)
        # A DeepSpeed InferenceEngine keeps the (AutoTP-sharded) HF model as `.module`; call that one directly.
        self.model = model.module if sharded else model
        self.tokenizer = tokenizer
        config = self.model.config.get_text_config(decoder=True)
        attn = self.model.config._attn_implementation
        if attn not in _MASKABLE_ATTENTION:
            raise ValueError(
                f"tree verification needs a 4D attention mask; use one of {_MASKABLE_ATTENTION}, not {attn!r}"
            )
        param = next(self.model.parameters())
        self.device: torch.device = param.device
        self.dtype: torch.dtype = param.dtype
        self.vocab_size: int = int(config.vocab_size)
        self.max_context: int = int(config.max_position_embeddings)
        self.eos_token_ids: frozenset[int] = _eos_token_ids(self.model)
        self._window = _sliding_window(config)
        self._eager = attn == "eager"
        self._logits_dtype = torch.float64 if self.dtype == torch.float64 else torch.float32
        if planned_gemm is None:
            planned_gemm = not sharded and cpu_gemm.supported(self.model) and cpu_gemm.enabled_by_environment()
        self.gemm_plan: cpu_gemm.GemmPlan | None = cpu_gemm.install(self.model) if planned_gemm else None
        self.native_attention_why: str | None = _native_attention_why(self.model, sharded)
        if native_attention and self.native_attention_why is not None:
            raise RuntimeError(f"native_attention=True but {self.native_attention_why}")
        if native_attention is False:
            self.native_attention_why = "native_attention=False"
        if self.native_attention_why is None:
            cpu_attention.install(self.model)
        self.lean_why: str | None = (
            "the model is a DeepSpeed shard" if sharded
            else "RAY_SPECDEC_LEAN=0" if lean is None and not switched_on("RAY_SPECDEC_LEAN")
            else "lean=False" if lean is False
            else lean_forward.why_unsupported(self.model)
        )  # fmt: skip
        if lean and self.lean_why is not None:
            raise RuntimeError(f"lean=True but {self.lean_why}")
        self._lean = lean_forward.LeanForward(self.model) if self.lean_why is None else None

    @property
    def native_attention(self) -> bool:
        """Whether verify rows attend through the native CPU kernel."""
        return self.native_attention_why is None

    def new_cache(self) -> TargetCache:
        # Full-attention layers that keep every position (sliding windows are applied by the mask); buffers never
        # grow past the context, which _check_length enforces.
        return TargetCache(GrowableKVCache(max_capacity=self.max_context))

    @torch.inference_mode()
    def prefill(self, cache: TargetCache, input_ids: torch.Tensor) -> None:
        """Append input_ids [S] (S >= 0) to the cache."""
        self._check_committed(cache)
        input_ids = input_ids.reshape(-1).to(self.device, torch.long)
        self._check_length(cache.length + input_ids.numel(), f"prefill of {input_ids.numel()} tokens")
        size = min(PREFILL_CHUNK, EAGER_PREFILL_CHUNK) if self._eager else PREFILL_CHUNK
        for start in range(0, input_ids.numel(), size):
            chunk = input_ids[start : start + size]
            # Default mask and positions: HF derives both from the cache length, which commit keeps exact.
            with self._sdpa_backends():
                self.model(input_ids=chunk[None], past_key_values=cache.kv, use_cache=True, logits_to_keep=1)

    @torch.inference_mode()
    def verify(self, cache: TargetCache, root_token: int, tree: TreeTensors, tree_tokens: torch.Tensor) -> torch.Tensor:
        """Logits [1 + n, V] at the root and every tree node; the cache grows by 1 + n rows until commit.

        tree_tokens: [n] token of every tree node, BFS order (row i + 1 of the forward).
        """
        self._check_committed(cache)
        tree_tokens = tree_tokens.reshape(-1).to(self.device, torch.long)
        if tree_tokens.numel() != tree.num_nodes:
            raise ValueError(f"tree has {tree.num_nodes} nodes but {tree_tokens.numel()} tokens were given")
        cache_len = cache.length
        self._check_length(cache_len + tree.depth + 1, f"verify of a depth-{tree.depth} tree")
        root = torch.tensor([root_token], dtype=torch.long, device=self.device)
        input_ids = torch.cat([root, tree_tokens])[None]
        mask = tree_attention_mask(cache_len, tree, self.dtype, self.device, self._window)
        position_ids = tree.position_ids(cache_len).to(self.device)[None]
        if self._lean is not None and self._lean.available:
            logits = self._lean.forward(input_ids, position_ids, mask, cache.kv)
        else:
            with self._sdpa_backends():
                logits = self.model(input_ids=input_ids, attention_mask=mask, position_ids=position_ids,
                                    past_key_values=cache.kv, use_cache=True).logits
        cache.pending_rows = 1 + tree.num_nodes
        return logits[0].to(self._logits_dtype)

    @torch.inference_mode()
    def commit(self, cache: TargetCache, keep_rows: Sequence[int]) -> None:
        """Keep rows `keep_rows` (ascending) of the last verify input and drop the other tree rows."""
        if cache.pending_rows == 0:
            raise ValueError("commit without a verify to commit")
        keep = [int(r) for r in keep_rows]
        if any(b <= a for a, b in zip(keep, keep[1:])) or (keep and not 0 <= keep[0] <= keep[-1] < cache.pending_rows):
            raise ValueError(f"keep_rows must be ascending rows in [0, {cache.pending_rows}), got {keep}")
        base = cache.length - cache.pending_rows
        cache.kv.compact(base, keep)
        cache.pending_rows = 0

    def _sdpa_backends(self):
        """The sdpa backends our forwards may take (CUDA_SDPA_BACKENDS on CUDA; torch's choice elsewhere)."""
        return sdpa_kernel(CUDA_SDPA_BACKENDS) if self.device.type == "cuda" else contextlib.nullcontext()

    def _check_committed(self, cache: TargetCache) -> None:
        if cache.pending_rows:
            raise ValueError(f"the cache holds {cache.pending_rows} uncommitted verify rows; call commit first")

    def _check_length(self, needed: int, what: str) -> None:
        if needed > self.max_context:
            raise ValueError(
                f"{what} needs {needed} positions but the target's context is {self.max_context} "
                "(max_position_embeddings); shorten the prompt or max_tokens"
            )


def tree_attention_mask(
    cache_len: int, tree: TreeTensors, dtype: torch.dtype, device: torch.device, window: int | None = None
) -> torch.Tensor:
    """Additive mask [1, 1, 1 + n, cache_len + 1 + n]: 0 where a verify row may attend, dtype's min elsewhere.

    Every row sees the whole cache and its tree ancestors and itself; with a sliding window, only keys whose position
    is within `window` of the row's position.
    """
    rows = 1 + tree.num_nodes
    visible = torch.cat([torch.ones(rows, cache_len, dtype=torch.bool), tree.attn_mask], dim=1)
    if window is not None:
        q_pos = tree.position_ids(cache_len)
        k_pos = torch.cat([torch.arange(cache_len), q_pos])
        visible &= (q_pos[:, None] - k_pos[None, :]) < window
    mask = torch.zeros(visible.shape, dtype=dtype).masked_fill_(~visible, torch.finfo(dtype).min)
    return mask.to(device)[None, None]


def _native_attention_why(model: PreTrainedModel, sharded: bool) -> str | None:
    """Why the native attention cannot serve this model, or None when it can."""
    if sharded:
        return "the model is a DeepSpeed shard"
    if not cpu_attention.supported(model):
        return "it takes a float32 model on CPU with sdpa attention"
    if native.load() is None:
        return f"native kernels unavailable: {native.why_unavailable()}"
    return None


def _eos_token_ids(model: PreTrainedModel) -> frozenset[int]:
    gen = getattr(model, "generation_config", None)
    eos = getattr(gen, "eos_token_id", None)
    if eos is None:
        eos = getattr(model.config.get_text_config(decoder=True), "eos_token_id", None)
    if eos is None:
        return frozenset()
    return frozenset(int(t) for t in (eos if isinstance(eos, (list, tuple)) else [eos]))


def _sliding_window(config) -> int | None:
    """The attention window every layer uses, or None for full attention; mixed layer kinds cannot share one mask."""
    window = getattr(config, "sliding_window", None)
    kinds = set(getattr(config, "layer_types", None) or ["sliding_attention" if window else "full_attention"])
    if kinds == {"full_attention"}:
        return None
    if kinds == {"sliding_attention"} and window:
        return int(window)
    raise ValueError(f"layer kinds {sorted(kinds)} need per-layer masks, which the tree verifier does not build")
