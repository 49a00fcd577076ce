"""The Transformer target: scores a whole token tree in one forward pass over a per-request KV cache.

A verify forward takes ``[root, *tree nodes]`` (root = the previous bonus token, not yet in the cache) with position
ids ``cache length + depth`` and a 4D mask: causal over everything cached plus the tree's ancestor mask. HF's masking
code uses a caller-supplied 4D mask as-is (eager and sdpa alike), so this adapter relies only on the model's forward
(``past_key_values`` / ``attention_mask`` / ``position_ids``). That keeps it working when DeepSpeed AutoTP has
replaced the Linear layers: every rank runs the same calls and keeps its own shard of the cache. On CPU and CUDA,
GPTNeoX and Llama forwards run `lean_forward.LeanForward` instead: the same computation over the same modules without
the model forward's per-call overhead (HF's logits bit for bit, except that batch invariance takes other products for
verify rows).

`forward_batch` runs one forward over the segments of many requests (continuous batching): each request's verify
rows (``[root, *tree nodes]`` with its tree mask) or prefill chunk. On the lean loop all verify rows share every
product (each weight is read once per step) and attend per request over their own caches; on CPU the step's prefill
chunks run together in one forward before it (`_prefill_chunks`: batch-invariant products, each chunk attending on its
own, so a chunk's K/V are the bits it gets alone), and on CUDA they ride in its verify forward (`one_forward`). Where
the lean loop does not run (other architectures, training mode) every segment runs its own HF forward inside
`forward_batch`: correct, not batched. A DeepSpeed AutoTP shard runs the lean loop too, over its share of the heads
(models/target/tp_shards.py), eagerly and over caches of its own. `verify` and `prefill` are `forward_batch` over one
segment. Where each segment's rows sit in a forward, at which positions and over which mask, is
models/target/forward_layout.py's.

Batch invariance (float32 on CPU with the native kernels and the lean loop, on by default there, tensor-parallel shards
included: their row-parallel products are summed over the ranks in rank order): a segment's logits
and K/V are the same bits whatever shares its forward, and a verify's root row gives the same logits under a tree of
any size (models/target/batch_invariant.py says how). Elsewhere what holds instead: in the per-segment fallback a
segment's results depend on its own rows only, not on the other segments, but a root row's logits depend on its tree's
size (products of different row counts); with `batch_invariant=False` (planned GEMM paths by total row count) and for
float64 models (F.linear) a row's logits depend on the batch in the last bits (~1e-7 relative in float32, ~1e-16 in
float64), so a greedy argmax can change only at such near-ties.

After acceptance, ``commit`` keeps the root and the accepted path and drops the other tree rows, compacting each
layer's K/V so the cache is again one contiguous prefix. The K/V live in a `GrowableKVCache`
(models/target/kv_cache.py): rows are written in place into preallocated buffers, so a round costs O(new rows), not a
copy of the whole context. On CUDA those buffers are views of one pool per layer (models/target/kv_pool.py), so that a
step's verify rows attend in one call per layer, and the forward replays CUDA graphs (models/target/step_graphs.py): the
whole of it, attention included, where every cache is pooled.
"""

from __future__ import annotations

import contextlib
from typing import Sequence

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import AutoModelForCausalLM, PreTrainedModel

from ray_specdec import env
from ray_specdec.models.native import attention, gemm


from ray_specdec.models.target import fast_path_switches, kv_pool, lean_forward, tp_shards



from ray_specdec.models.loading import eos_token_ids, load_tokenizer, resolve_dtype, resolve_model_path, sliding_window
from ray_specdec.models.target.attention_masks import TreeMasks
from ray_specdec.models.target.forward_layout import (Rows, Segment, all_spans, prefill_rounds, prefill_spans,
                                                      verify_positions, verify_spans)
from ray_specdec.models.target.kv_cache import GrowableKVCache, TargetCache
from ray_specdec.speculation.tree import TreeTensors

# sdpa takes an arbitrary float mask, is exact against eager (float64 agrees to ~1e-15) and is faster on CPU.
ATTN_IMPLEMENTATION = "sdpa"
# Implementations whose attention honours a caller-supplied 4D additive mask (flash-attention kernels do not).
_MASKABLE_ATTENTION = ("eager", "sdpa", attention.NAME)
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
        batch_invariant: bool | None = None,
        kv_pool: bool | None = None,
        cuda_graphs: bool | None = None,
    ) -> "TargetModel":
        """Load from a hub id or a local directory; float32 on CPU unless `dtype` says otherwise."""
        path = resolve_model_path(name_or_path)
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=resolve_dtype(dtype, device), attn_implementation=ATTN_IMPLEMENTATION
        )
        return cls(model.to(device).eval(), load_tokenizer(path), planned_gemm=planned_gemm,
                   native_attention=native_attention, lean=lean, batch_invariant=batch_invariant,
                   kv_pool=kv_pool, cuda_graphs=cuda_graphs)

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer=None,
        *,
        planned_gemm: bool | None = None,
        native_attention: bool | None = None,
        lean: bool | None = None,
        batch_invariant: bool | None = None,
        kv_pool: bool | None = None,
        cuda_graphs: bool | None = None,
    ):
        """planned_gemm: the Linear layers take the fastest measured GEMM path per row count (models/native/gemm.py).
        None: on for a float32 model on CPU (not for a DeepSpeed shard, whose Linear layers are DeepSpeed's), unless
        the environment sets RAY_SPECDEC_PLANNED_GEMM=0; True insists (an error where unsupported); False leaves the
        model as loaded.
        native_attention: verify rows attend through the C kernel (models/native/attention.py). None: on for a float32
        sdpa model on CPU (a shard's heads too) where the native kernels build (RAY_SPECDEC_NATIVE=0 turns them off);
        True insists; False leaves the model's attention as loaded. `native_attention_why` says why it is off.
        lean: verify forwards run as models/target/lean_forward.py's loop over the model's modules (the same logits, bit
        for bit, without HF's per-call machinery), one forward for the verify rows of all requests of a step. None:
        on where it supports the model (GPTNeoX and Llama on CPU and CUDA, their AutoTP shards too) unless
        RAY_SPECDEC_LEAN=0; True insists; False keeps HF's forward, one per request. `lean_why` says why it is off.
        (Without batch invariance, e.g. on CUDA, a request's rows may round differently with other rows beside them:
        cuBLAS picks its kernel by the row count.)
        batch_invariant: verify rows take models/target/batch_invariant.py's operations, so a segment's results do not
        depend on what shares its forward (prefill chunks' too: `_prefill_chunks`). None: on where the lean
        loop and the native attention are (float32 on CPU) unless RAY_SPECDEC_BATCH_INVARIANT=0; True insists; False
        keeps the planned paths. `batch_invariant_why` says why it is off.
        kv_pool: caches with a capacity (a KV budget's share) live in one pool per layer and a step's verify rows
        attend in one call per layer (models/target/kv_pool.py). None: on where the lean loop runs without batch
        invariance and without a sliding window (CUDA) unless RAY_SPECDEC_KV_POOL=0; True insists; False: a cache of its
        own per request. `kv_pool_why` says why it is off.
        cuda_graphs: the lean forward's work around each attention replays CUDA graphs, one set per padded row count,
        captured here (models/target/step_graphs.py). None: on for CUDA devices where the lean loop runs unless
        RAY_SPECDEC_CUDA_GRAPHS=0 (eager where a capture fails); True insists; False: eager. `cuda_graphs_why` says
        why it is off. The graphs hold the weights' addresses: move or replace no weight after loading. A forward
        whose caches all live in the KV pool replays one graph with the attention in it (kernels/pooled_attention.py;
        captured on first use per bucket, again after the pool grows) unless RAY_SPECDEC_FUSED_ATTENTION=0."""
        # A DeepSpeed InferenceEngine keeps the (AutoTP-sharded) HF model as `.module`; call that one directly.
        self.model = model if isinstance(model, PreTrainedModel) else model.module
        sharded = tp_shards.is_shard(self.model)
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
        self.eos_token_ids: frozenset[int] = eos_token_ids(self.model)
        self._config = config
        self._window = sliding_window(config)
        self._masks = TreeMasks(self.dtype, self.device, self._window)
        self._eager = attn == "eager"
        self._logits_dtype = torch.float64 if self.dtype == torch.float64 else torch.float32
        if planned_gemm is None:
            planned_gemm = not sharded and gemm.supported(self.model) and gemm.enabled_by_environment()
        self.gemm_plan: gemm.GemmPlan | None = gemm.install(self.model) if planned_gemm else None
        self.sharded = sharded
        self.native_attention_why: str | None = fast_path_switches.native_attention_why(self.model)
        if native_attention and self.native_attention_why is not None:
            raise RuntimeError(f"native_attention=True but {self.native_attention_why}")
        if native_attention is False:
            self.native_attention_why = "native_attention=False"
        if self.native_attention_why is None:
            attention.install(self.model)
        self.lean_why: str | None = fast_path_switches.switch_why("lean", lean, env.LEAN,
                                                          lambda: lean_forward.why_unsupported(self.model))
        self.batch_invariant_why: str | None = fast_path_switches.switch_why(
            "batch_invariant", batch_invariant, env.BATCH_INVARIANT,
            lambda: fast_path_switches.batch_invariance_blocker(self))
        self._lean = (
            lean_forward.LeanForward(self.model, batch_invariant=self.batch_invariant_why is None)
            if self.lean_why is None else None
        )  # fmt: skip
        # One forward per step for prefill segments and verify rows together, where nothing is batch-invariant anyway
        # (CUDA): on CPU the chunks run together before the verify rows (`_prefill_chunks`), whose native decoder
        # attends ragged (sdpa's blocked kernel is ~3x faster for a chunk's hundreds of causal rows).
        self.one_forward = self._lean is not None and not self.batch_invariant and not self._eager and (
            self.device.type == "cuda")
        self.kv_pool_why: str | None = fast_path_switches.switch_why(
            "kv_pool", kv_pool, env.KV_POOL,
            lambda: fast_path_switches.kv_pool_blocker(self, insisted=kv_pool is True))
        self._pool: kv_pool.KVPool | None = None  # made on the first cache with a capacity
        self.cuda_graphs_why: str | None = fast_path_switches.switch_why(
            "cuda_graphs", cuda_graphs, env.CUDA_GRAPHS, lambda: fast_path_switches.cuda_graphs_blocker(self))
        if self.cuda_graphs_why is None:
            fast_path_switches.start_graphs(self, insisted=cuda_graphs is True)

    @property
    def native_attention(self) -> bool:
        """Whether verify rows attend through the native CPU kernel."""
        return self.native_attention_why is None

    @property
    def batch_invariant(self) -> bool:
        """Whether a segment's logits and K/V are the same bits whatever shares its forward."""
        return self.batch_invariant_why is None

    @property
    def native_decoder_why(self) -> str | None:
        """Why verify rows' decoder layers do not run as one native call (models/native/decoder.py); None: they do."""
        if self._lean is None:
            return f"no lean forward ({self.lean_why})"
        return self._lean.native_decoder_why if self._lean.native_decoder is None else None

    @property
    def kv_bytes_per_token(self) -> int:
        """K + V bytes one cached token takes over all layers (the whole model's: a tensor-parallel rank holds its
        share of the heads), for sizing a KV budget."""
        layers, kv_heads, head_dim = self._kv_shape
        return 2 * layers * kv_heads * head_dim * self.dtype.itemsize

    @property
    def _kv_shape(self) -> tuple[int, int, int]:
        """(layers, key / value heads, head size) of the whole model's cache."""
        c = self._config
        kv_heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        return c.num_hidden_layers, kv_heads, head_dim

    def new_cache(self, capacity: int | None = None) -> TargetCache:
        """A request's cache. capacity: rows allocated on its first forward and never grown past (a request's share
        of a KV budget; a forward that needs more raises before it runs). None: buffers grow as needed, never past
        the context (full-attention layers that keep every position: sliding windows are applied by the mask)."""
        if capacity is None:
            return TargetCache(GrowableKVCache(max_capacity=self.max_context))
        if capacity < 1:
            raise ValueError(f"a cache needs a capacity of at least one row, got {capacity}")
        if self.kv_pool_why is None:
            if self._pool is None:
                layers, kv_heads, head_dim = self._kv_shape
                self._pool = kv_pool.KVPool(layers, kv_heads, head_dim, head_dim, self.dtype, self.device)
            kv = self._pool.new_cache(capacity)
            if kv is not None:  # else the device had no memory to grow the pool: a cache of its own
                return TargetCache(kv)
        return TargetCache(GrowableKVCache(max_capacity=capacity, preallocate=True))

    def resize(self, cache: TargetCache, capacity: int) -> None:
        """A request's cache (of `new_cache(capacity)`) holds `capacity` rows from now on, its rows kept: the
        scheduler grants a request's KV as it decodes (kv_manager.PrefillPlan.grow)."""
        pool = kv_pool.pool_of(cache.kv)
        if pool is None:
            cache.kv.resize(capacity)
            return
        try:
            pool.resize(cache.kv, capacity)
        except torch.OutOfMemoryError:  # the pool cannot grow: the cache leaves it for buffers of its own
            own = GrowableKVCache(max_capacity=capacity, preallocate=True)
            own.append_rows([(layer.keys, layer.values) for layer in cache.kv.layers])
            pool.free(cache.kv)
            cache.kv = own

    @property
    def kv_pool_stats(self) -> dict[str, int] | None:
        """The KV pool's rows, free rows, packs and rows moved (None: no pool, caches of their own)."""
        return None if self._pool is None else self._pool.stats()

    def release(self, cache: TargetCache) -> None:
        """The request is done with the cache: a pooled one's rows are free at once (else when it is collected)."""
        if self._pool is not None:
            self._pool.free(cache.kv)

    def save_chunk(self, cache: TargetCache, start: int, end: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Copies of the cache's rows [start, end) per layer (a prompt chunk the prefix cache keeps)."""
        return cache.kv.copy_rows(start, end)

    def load_chunk(self, cache: TargetCache, rows: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Append a kept chunk's rows (of `save_chunk`) to the cache."""
        cache.kv.append_rows(rows)

    @torch.inference_mode()
    def forward_batch(self, segments: Sequence[Segment]) -> list[torch.Tensor | None]:
        """One forward for all segments (of distinct caches, except that a prefill chunk may precede a verify of its
        cache: a prompt's last chunk and its first round). A verify segment -> its logits [S, V] (float32; float64
        for float64 models), its cache grows by S pending rows until `commit`; a prefill segment -> None, its cache
        grows by S committed rows. Every segment is checked before anything runs."""
        rows, ahead = [], {}  # cache -> rows a prefill chunk of this forward adds before its verify (None: verified)
        for segment in segments:
            before = ahead.get(id(segment.cache), 0)
            if before is None or (id(segment.cache) in ahead and segment.tree is None):
                raise ValueError("two segments of one forward share a cache (only a prefill chunk, then a verify, may)")
            rows.append(self._checked(segment, before))
            ahead[id(segment.cache)] = rows[-1].tokens.numel() if segment.tree is None else None
        verify = [r for r in rows if r.verify]
        if self.one_forward and self._lean.available:
            work = [r for r in rows if r.tokens.numel()]  # an empty prefill appends nothing
            logits = dict(zip(map(id, verify), self._all_rows(work))) if work else {}
        else:  # the chunks first: a verify of the same cache attends over its chunk
            self._prefill_chunks([r for r in rows if not r.verify])
            logits = dict(zip(map(id, verify), self._verify_rows(verify))) if verify else {}
        for r in verify:
            r.segment.cache.pending_rows = r.tokens.numel()
        return [logits[id(r)].to(self._logits_dtype) if r.verify else None for r in rows]

    def prefill(self, cache: TargetCache, input_ids: torch.Tensor) -> None:
        """Append input_ids [S] (S >= 0) to the cache."""
        self.forward_batch([Segment(cache, input_ids)])

    def verify(self, cache: TargetCache, root_token: int, tree: TreeTensors, tree_tokens: torch.Tensor) -> torch.Tensor:
        """Logits [1 + n, V] at the root and every tree node; the cache grows by 1 + n rows until commit.

        tree_tokens: [n] token of every tree node, BFS order (row i + 1 of the forward).
        """
        tree_tokens = tree_tokens.reshape(-1).to(self.device, torch.long)
        root = torch.tensor([root_token], dtype=torch.long, device=self.device)
        return self.forward_batch([Segment(cache, torch.cat([root, tree_tokens]), tree)])[0]

    @torch.inference_mode()
    def commit(self, cache: TargetCache, keep_rows: Sequence[int]) -> None:
        """Keep rows `keep_rows` (ascending) of the last verify input and drop the other tree rows."""
        self.commit_many([(cache, keep_rows)])

    @torch.inference_mode()
    def commit_many(self, commits: Sequence[tuple[TargetCache, Sequence[int]]]) -> None:
        """`commit` for several caches (a step's): every one is checked first, then those in the KV pool move their
        rows together (`KVPool.compact`)."""
        checked = []
        for cache, keep_rows in commits:
            if cache.pending_rows == 0:
                raise ValueError("commit without a verify to commit")
            keep = [int(r) for r in keep_rows]
            if any(b <= a for a, b in zip(keep, keep[1:])) or (
                keep and not 0 <= keep[0] <= keep[-1] < cache.pending_rows
            ):
                raise ValueError(f"keep_rows must be ascending rows in [0, {cache.pending_rows}), got {keep}")
            checked.append((cache, cache.length - cache.pending_rows, keep))
        pooled = []
        for cache, base, keep in checked:
            if self._pool is not None and kv_pool.pool_of(cache.kv) is self._pool:
                pooled.append((cache.kv, base, keep))
            else:
                cache.kv.compact(base, keep)
            cache.pending_rows = 0
        if pooled:
            self._pool.compact(pooled)

    def _checked(self, segment: Segment, ahead: int = 0) -> Rows:
        """The segment's rows, after checking that it fits (context, capacity) and that its cache is committed;
        `ahead`: rows a prefill chunk of the same forward adds to the cache first."""
        cache, tree = segment.cache, segment.tree
        self._check_committed(cache)
        tokens = segment.tokens.reshape(-1).to(dtype=torch.long)
        cache_len = cache.length + ahead
        if tree is None:
            what = f"prefill of {tokens.numel()} tokens"
            self._check_length(cache_len + tokens.numel(), what)
        else:
            if tokens.numel() != 1 + tree.num_nodes:
                raise ValueError(f"tree has {tree.num_nodes} nodes but {tokens.numel() - 1} tokens were given")
            what = f"verify of a depth-{tree.depth} tree"
            self._check_length(cache_len + tree.depth + 1, what)
        if cache.capacity is not None and cache_len + tokens.numel() > cache.capacity:
            raise ValueError(f"{what} needs {cache_len + tokens.numel()} cache rows but the cache holds "
                             f"{cache.capacity} (new_cache(capacity=...))")  # fmt: skip
        return Rows(segment, tokens, cache_len)

    def _input_ids(self, rows: list[Rows]) -> torch.Tensor:
        """[1, sum S_i]: the rows' tokens in order on the device, in one copy where they are on the host (a copy per
        segment cost a device synchronisation each)."""
        if all(r.tokens.device.type == "cpu" for r in rows):
            return torch.cat([r.tokens for r in rows]).to(self.device)[None]
        return torch.cat([r.tokens.to(self.device) for r in rows])[None]

    def _verify_rows(self, verify: list[Rows]) -> list[torch.Tensor]:
        """Logits [S_i, V] of every verify segment: one lean forward over all their rows, or HF's per segment."""
        if self._lean is None or not self._lean.available:
            return [self._hf_forward(r.tokens.to(self.device),
                                     r.segment.tree.position_ids(r.cache_len).to(self.device),
                                     self._masks(r.cache_len, r.segment.tree), r.segment.cache).logits[0]
                    for r in verify]  # fmt: skip
        # A root alone sees every key: the batch-invariant path's native attention takes it without a mask (the same
        # bits: adding 0.0 changes no score); the model's attention functions keep theirs (another kernel without).
        spans = verify_spans(verify, self._masks, self._lean.batch_invariant and self._window is None)
        input_ids = self._input_ids(verify)
        with self._sdpa_backends():
            logits = self._lean.forward(input_ids, verify_positions(verify).to(self.device)[None], spans)[0]
        return list(logits.to(self._logits_dtype).split([r.tokens.numel() for r in verify]))

    def _all_rows(self, rows: list[Rows]) -> list[torch.Tensor]:
        """`one_forward`: every segment's rows in one lean forward, each attending over its own cache (a prefill
        segment causally, whole: its mask covers all its rows); -> logits [S_i, V] of the verify segments only."""
        # a chunk's mask additive and aligned off the CPU: a bool mask would be converted and padded at every layer
        spans, positions, keep = all_spans(rows, self._masks, self._window,
                                           None if self.device.type == "cpu" else self.dtype)  # fmt: skip
        input_ids = self._input_ids(rows)
        keep = None if keep is None else keep.to(self.device)
        with self._sdpa_backends():
            logits = self._lean.forward(input_ids, positions.to(self.device)[None], spans,
                                        logits=keep is not None, rows=keep)  # fmt: skip
        if logits is None:
            return []
        # cast once for the whole forward (forward_batch's cast of each segment is then a no-op)
        return list(logits[0].to(self._logits_dtype).split([r.tokens.numel() for r in rows if r.verify]))

    def _prefill_chunks(self, chunks: list[Rows]) -> None:
        """Append every prefill segment's tokens, each cut into pieces of PREFILL_CHUNK from its start
        (EAGER_PREFILL_CHUNK for eager attention). On the batch-invariant lean loop the pieces of all segments run
        together, one forward per round of pieces (a segment's second piece in the second, ...): the products,
        activations, norms and rotary values of a row do not depend on the rows beside it there, and each piece
        attends alone, so its K/V are the bits it gets in a forward of its own. Elsewhere each piece runs its own
        forward (the model's products, whose rounding depends on the row count: a piece's K/V then depend on its own
        rows only)."""
        size = min(PREFILL_CHUNK, EAGER_PREFILL_CHUNK) if self._eager else PREFILL_CHUNK
        together = self._lean is not None and self._lean.available and self._lean.batch_invariant
        for work in prefill_rounds(chunks, size, together):
            self._prefill_pieces(work)

    def _prefill_pieces(self, pieces: list[tuple[TargetCache, torch.Tensor]]) -> None:
        """One forward that appends each (cache, tokens) piece to its cache (distinct caches)."""
        if self._lean is None or not self._lean.available:
            for cache, tokens in pieces:
                # Default mask and positions: HF derives both from the cache length, which commit keeps exact.
                self._hf_forward(tokens.to(self.device), None, None, cache, logits_to_keep=1)
            return
        spans, positions = prefill_spans(pieces, self._masks, self._window, self.dtype if self._eager else None)
        input_ids = torch.cat([tokens for _, tokens in pieces]).to(self.device)[None]
        with self._sdpa_backends():
            self._lean.forward(input_ids, positions.to(self.device)[None], spans, logits=False)

    def _hf_forward(self, tokens, positions, mask, cache: TargetCache, **kwargs):
        """The model's own forward over one segment: tokens / positions [S], mask [1, 1, S, cache + S] or None."""
        with self._sdpa_backends():
            return self.model(input_ids=tokens[None], attention_mask=mask,
                              position_ids=None if positions is None else positions[None],
                              past_key_values=cache.kv, use_cache=True, **kwargs)  # fmt: skip

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

