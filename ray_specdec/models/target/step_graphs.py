"""CUDA graphs of the target's forward around its attention ("piecewise" graphs, as vLLM captures its model with
attention left out): per padded row count, one graph from the token ids to the first layer's attention inputs, then
one from each layer's attention output to the next layer's attention inputs, the last ending at the final hidden
state. Attention runs eagerly between the graphs: it reads every request's own cache rows under its own tree mask,
whose lengths change every step, while everything else in a layer works row by row.

Why. A step of a 7B-sized Llama at 32 requests launched ~1,700 kernels (norms, projections, rotary, MLP, residuals:
~45 a layer, ~9 of them attention), and its host spent 42 ms a step launching them against 10 ms of GPU work.
A replay issues a piece's ~20-35 kernels for about the host cost of one launch.

How. The graphs read and write fixed buffers sized for the largest bucket: token ids, positions, the rotary tables,
the hidden state (two, alternating by layer), the attention inputs (query, key, value) and its output. A forward of
R rows takes the smallest bucket P >= R: its ids and positions go to the first R rows of their buffers (rows R..P-1
keep earlier values: every piece works row by row, so padding rows never reach a real row), the graphs replay, and
attention reads rows [0, R) of the query / key / value buffers and writes its output to rows [0, R) of its buffer.
A piece copies its results into the buffers inside its graph, so nothing a graph allocates outlives its replay and
all graphs share one memory pool, replayed in any order.

Fused. Where every span of a forward lives in the KV pool (models/target/kv_pool.py: every admitted request's cache on
CUDA), the attention goes into the graph too: the forward is one graph per bucket, each layer's attention one launch of
kernels/pooled_attention.py, which reads every request's pool rows in place and writes the forward's new K/V rows.
What changes per step are the graph's inputs: per row its request's pool offset, cached keys and span, and which of
its request's new rows it sees (its tree, or causal for a prefill chunk). The pool's tensors are the graph's too, so
a bucket's graph is captured on first use and again after the pool grows. Where a graph cannot be made (no Triton, a
failed build or capture), `fused` goes off and the pieces serve.

Exactness. A replay runs the eager forward's kernels, on P rows rather than R: cuBLAS picks kernels by shape, so a
row may round differently than in an eager forward of R rows (as it already may with other requests beside it; on
CUDA nothing is batch-invariant, models/target/lean_forward.py); the fused attention sums in its own order. Greedy
tokens match the target's own in float64 (the CUDA tests). With capture=False the pieces run eagerly through the same
buffers, the fused attention through its torch reference (the CPU tests check the data flow that way).
"""

from __future__ import annotations

import bisect
import logging
import math
import threading
from dataclasses import dataclass
from functools import partial
from typing import Callable

import torch

from kernels import pooled_attention as fused_attention
from ray_specdec.models.loading import failure
from ray_specdec.models.target import kv_pool
from ray_specdec.models.target.lean_forward import _MODEL_OPS

logger = logging.getLogger(__name__)

# Padded row counts with a graph; a forward of more rows (a long prefill chunk, whose kernels are big enough to keep
# the GPU busy) runs eagerly. Spaced by ~1.5x: at most a third of a bucket's rows are padding.
ROW_BUCKETS = (8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)


class PiecewiseGraphs:
    """`run(input_ids, position_ids, attend)` -> the final hidden state of LeanForward's layers, through graphs."""

    def __init__(self, lean, buckets: tuple[int, ...] = ROW_BUCKETS, capture: bool = True, fused: bool = True):
        """lean: a LeanForward (not batch-invariant: its verify rows take the model's own calls). capture: False runs
        the pieces eagerly through the same buffers (for tests off CUDA). fused: a forward whose spans all live in
        one KV pool runs as one graph, its attention through kernels/pooled_attention.py (the Triton kernel on CUDA,
        its torch reference elsewhere)."""
        model = lean.model
        self.device = next(model.parameters()).device
        if capture and self.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, got {self.device}")
        if lean.batch_invariant:
            raise ValueError("the batch-invariant forward has no graphs (it runs on CPU)")
        self.lean, self.buckets, self.graphed = lean, tuple(sorted(set(buckets))), capture
        self._layers = lean._layers
        self._graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}
        self.fused = fused and (self.device.type != "cuda" or fused_attention.triton is not None)
        on_gpu = self.device.type == "cuda" and fused_attention.triton is not None
        self._attention = fused_attention.pooled_attention if on_gpu else fused_attention.pooled_attention_ref
        # bucket -> (the pool it was captured on, the graph)
        self._fused: dict[int, tuple[tuple, torch.cuda.CUDAGraph]] = {}
        self.fused_why: str | None = None if self.fused else "fused=False, or no triton"
        self._pool = None  # one memory pool shared by every graph
        self.lock = threading.RLock()  # the buffers serve one forward at a time
        self._allocate(self.buckets[-1])

    @property
    def max_rows(self) -> int:
        return self.buckets[-1]

    def covers(self, rows: int) -> bool:
        return 1 <= rows <= self.max_rows

    def bucket(self, rows: int) -> int:
        """The padded row count of a forward of `rows` rows."""
        if not self.covers(rows):
            raise ValueError(f"no graph for {rows} rows (1..{self.max_rows})")
        return self.buckets[bisect.bisect_left(self.buckets, rows)]

    @torch.inference_mode()
    def _allocate(self, rows: int) -> None:
        """The storage of every buffer, for `rows` rows; shapes from one eager pass of the first piece over `rows`
        zero tokens. Each bucket views the start of each storage (`_at`)."""
        ids = torch.zeros(1, rows, dtype=torch.long, device=self.device)
        hidden = self.lean._embed(ids)
        cos, sin = self.lean._rotary(hidden, position_ids=ids)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        query, key, value = self.lean.before(self._layers[0], hidden, cos, sin, _MODEL_OPS)
        attended = hidden.new_empty(1, rows, query.shape[1] * value.shape[-1])
        # name -> (dtype, shape with the rows at dimension `dim`, dim)
        self._shapes = {
            "ids": (torch.long, ids.shape, 1), "positions": (torch.long, ids.shape, 1),
            "cos": (cos.dtype, cos.shape, 2), "sin": (sin.dtype, sin.shape, 2),
            "hidden0": (hidden.dtype, hidden.shape, 1), "hidden1": (hidden.dtype, hidden.shape, 1),
            "query": (query.dtype, query.shape, 2), "key": (key.dtype, key.shape, 2),
            "value": (value.dtype, value.shape, 2), "attended": (attended.dtype, attended.shape, 1),
            "meta": (torch.int32, torch.Size((rows, fused_attention.META_FIELDS)), 0),
            "visible": (torch.int8, torch.Size((rows, rows)), 0),
        }  # fmt: skip
        self._storage = {name: torch.zeros(shape.numel(), dtype=dtype, device=self.device)
                         for name, (dtype, shape, _) in self._shapes.items()}  # fmt: skip
        self._views: dict[int, _Buffers] = {}

    def _at(self, rows: int) -> "_Buffers":
        """Every buffer as a contiguous tensor of `rows` rows (a bucket's)."""
        if rows not in self._views:
            views = {}
            for name, (_, shape, dim) in self._shapes.items():
                shape = (*shape[:dim], rows, *shape[dim + 1 :])
                if name == "visible":
                    shape = (rows, rows)
                views[name] = self._storage[name][: math.prod(shape)].view(shape)
            self._views[rows] = _Buffers(**views)
        return self._views[rows]

    def _pieces(self, rows: int) -> list[Callable[[], None]]:
        """The forward of a bucket of `rows` rows as pieces, each from buffers to buffers: the first from the ids to
        the first layer's attention inputs, then one per layer from its attention output on."""
        b = self._at(rows)

        def first():
            hidden = self.lean._embed(b.ids)
            cos, sin = self.lean._rotary(hidden, position_ids=b.positions)
            b.cos.copy_(cos.unsqueeze(1))
            b.sin.copy_(sin.unsqueeze(1))
            enter(0, hidden)

        def enter(index: int, hidden: torch.Tensor) -> None:  # layer `index` up to its attention
            b.hidden(index).copy_(hidden)
            if index == len(self._layers):
                return
            query, key, value = self.lean.before(self._layers[index], hidden, b.cos, b.sin, _MODEL_OPS)
            b.query.copy_(query)
            b.key.copy_(key)
            b.value.copy_(value)

        def leave(index: int) -> None:  # layer `index` from its attention's output, then the next one's start
            enter(index + 1, self.lean.after(self._layers[index], b.hidden(index), b.attended, _MODEL_OPS))

        return [first, *(lambda i=i: leave(i) for i in range(len(self._layers)))]

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket's graphs now (the largest first), so that no request pays a capture."""
        if not self.graphed:
            return
        with self.lock:
            for rows in reversed(self.buckets):
                if rows in self._graphs:
                    continue
                graphs = self._captured([[piece] for piece in self._pieces(rows)])
                self._graphs[rows] = graphs

    def _captured(self, groups: list[list[Callable[[], None]]]) -> list[torch.cuda.CUDAGraph]:
        """One graph per group of steps (run in order), all in the shared memory pool. Every step runs twice first,
        on a side stream: lazy cuBLAS handles and workspaces (and Triton builds) must not happen during a capture."""
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):
                for step in (step for group in groups for step in group):
                    step()
        torch.cuda.current_stream(self.device).wait_stream(side)
        graphs = []
        for group in groups:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                for step in group:
                    step()
            self._pool = graph.pool()
            graphs.append(graph)
        return graphs

    def fuses(self, spans) -> "kv_pool.KVPool | None":
        """The pool a fused forward of these spans attends over: they all live in it (else None). Not where two spans
        share a cache (a prompt's last chunk and its first round): the fused attention writes no span's K/V before
        another's reads them."""
        if not self.fused or not spans or len({id(s.cache) for s in spans}) < len(spans):
            return None
        pool = kv_pool.pool_of(spans[0].cache)
        if pool is None or any(kv_pool.pool_of(s.cache) is not pool or (s.tree and s.ancestors is None)
                               for s in spans):  # fmt: skip
            return None
        return pool

    def _fused_steps(self, rows: int, pool) -> list[Callable[[], None]]:
        """The forward of a bucket as one sequence: the pieces with each layer's attention between them."""
        b = self._at(rows)
        pieces = self._pieces(rows)

        def attend(index: int) -> None:
            module = self.lean.attention_of(self._layers[index])
            heads = b.query.shape[1]
            self._attention(b.query[0].transpose(0, 1), b.key[0].transpose(0, 1), b.value[0].transpose(0, 1),
                            pool.keys[module.layer_idx], pool.values[module.layer_idx], b.meta, b.visible,
                            module.scaling, b.attended[0].view(rows, heads, -1))  # fmt: skip

        steps = [pieces[0]]
        for index, piece in enumerate(pieces[1:]):
            steps += [partial(attend, index), piece]
        return steps

    def _fused_graph(self, rows: int, pool) -> torch.cuda.CUDAGraph:
        """The bucket's whole forward as one graph over this pool's tensors (captured again after the pool grew)."""
        key = (id(pool), pool.rows, pool.keys[0].data_ptr())
        kept = self._fused.get(rows)
        if kept is not None and kept[0] == key:
            return kept[1]
        with torch.inference_mode():
            b = self._at(rows)
            b.meta.zero_()  # every row padding while warming up and capturing: no pool row is written
            (graph,) = self._captured([self._fused_steps(rows, pool)])
        self._fused[rows] = (key, graph)
        return graph

    def run_fused(self, input_ids: torch.Tensor, position_ids: torch.Tensor, spans, pool) -> torch.Tensor | None:
        """`run` for spans that all live in `pool` (`fuses`): the attention too is in the graph, one replay for the
        whole forward; every span's cache advances by its rows. None (nothing run) where the graph cannot be made:
        `fused` is then off, `fused_why` says why."""
        rows = input_ids.shape[1]
        padded = self.bucket(rows)
        graph = None
        if self.graphed:
            try:
                graph = self._fused_graph(padded, pool)
            except Exception as exc:  # (a Triton build, a capture): the pieces serve from now on
                self.fused, self.fused_why = False, failure(exc)
                logger.warning("the fused forward is off: %s", self.fused_why)
                return None
        meta = torch.zeros(padded, fused_attention.META_FIELDS, dtype=torch.int32)
        visible = torch.zeros(padded, padded, dtype=torch.int8)
        for span in spans:
            n = span.end - span.start
            meta[span.start : span.end] = torch.tensor([span.cache.pool_offset, span.cache.get_seq_length(),
                                                        span.start, n], dtype=torch.int32)  # fmt: skip
            seen = span.ancestors if span.tree else torch.ones(n, n, dtype=torch.bool).tril()
            visible[span.start : span.end, :n] = seen
        b = self._at(padded)
        b.meta.copy_(meta)
        b.visible.copy_(visible)
        b.ids[:, :rows].copy_(input_ids)
        b.positions[:, :rows].copy_(position_ids)
        if graph is not None:
            graph.replay()
        else:
            for step in self._fused_steps(padded, pool):
                step()
        for span in spans:
            span.cache.advance(span.end - span.start)
        return b.hidden(len(self._layers))[:, :rows]

    def run(self, input_ids: torch.Tensor, position_ids: torch.Tensor, attend) -> torch.Tensor:
        """input_ids / position_ids [1, R] -> the last layer's output [1, R, d]: a view of a buffer that the next run
        overwrites (hold `lock` until it is used). attend(module, query, key, value) -> [1, R, H * Dv]: the layer's
        attention over rows [0, R), as LeanForward's loop calls it."""
        rows = input_ids.shape[1]
        padded = self.bucket(rows)
        if self.graphed and padded not in self._graphs:
            self.capture()
        steps = [g.replay for g in self._graphs[padded]] if self.graphed else self._pieces(padded)
        b = self._at(padded)
        b.ids[:, :rows].copy_(input_ids)
        b.positions[:, :rows].copy_(position_ids)
        steps[0]()
        for layer, step in zip(self._layers, steps[1:]):
            out = attend(self.lean.attention_of(layer), b.query[:, :, :rows], b.key[:, :, :rows],
                         b.value[:, :, :rows])  # fmt: skip
            b.attended[:, :rows].copy_(out)
            step()
        return b.hidden(len(self._layers))[:, :rows]


@dataclass
class _Buffers:
    """A bucket's views of the buffers (`PiecewiseGraphs._at`)."""

    ids: torch.Tensor  # [1, P]
    positions: torch.Tensor  # [1, P]
    cos: torch.Tensor  # [1, 1, P, rotary dims]
    sin: torch.Tensor
    hidden0: torch.Tensor  # [1, P, d]: the input of even layers (and the output of odd ones)
    hidden1: torch.Tensor  # [1, P, d]: the input of odd layers
    query: torch.Tensor  # [1, H, P, D]: attention's inputs
    key: torch.Tensor  # [1, Hkv, P, D]
    value: torch.Tensor  # [1, Hkv, P, Dv]
    attended: torch.Tensor  # [1, P, H * Dv]: attention's output
    meta: torch.Tensor  # int32 [P, META_FIELDS]: the fused attention's rows (kernels/pooled_attention.py)
    visible: torch.Tensor  # int8 [P, P]: which of its request's new rows a row sees

    def hidden(self, layer: int) -> torch.Tensor:
        """The input of layer `layer` (the output of layer `layer - 1`)."""
        return self.hidden1 if layer % 2 else self.hidden0
