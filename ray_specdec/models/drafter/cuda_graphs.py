"""CUDA graphs of the Mamba drafter's steps (one graph per row count) and catch-ups (one per token count).

A drafter step is ~100 small kernels (4 layers x in_proj, conv window, x_proj, dt, the scan update, out_proj, norms,
then the head). On a GPU each launch costs the host several microseconds and the kernels themselves almost nothing,
so an eager step is bound by launches. Replaying a captured graph issues them all at once: the idea of vLLM's and
gpt-fast's decode graphs, applied to the drafter, whose row counts per tree depth are few and known (B_i).

A graph reads and writes fixed buffers, while each tree depth's state is a buffer of its own (drafting keeps every
depth's state for the commit). So a replay copies the caller's state and tokens into the graph's buffers, replays,
and copies the advanced state back: four copies and a clone of the logits beside one replay, against ~100 launches.
The graph runs the very kernels of the eager step on the same shapes, so its results are the eager step's, bit for bit.
The drafter's catch-up after a verify (`extend`: a 1-row state advanced by the accepted tokens and the bonus token,
~150 launches in one sequence pass) is graphed the same way, one graph per token count.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Callable

import torch

MAX_GRAPH_ROWS = 64  # steps of more rows run eagerly: big trees are rare and their kernels no longer tiny
MAX_GRAPH_TOKENS = 32  # catch-ups of more tokens run eagerly


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    conv: torch.Tensor  # [L, rows, d_inner, d_conv], the graph's input and output state
    ssm: torch.Tensor  # [L, rows, d_inner, d_state]
    tokens: torch.Tensor  # [n]: one per row (a step) or a 1-row state's next n tokens (a catch-up)
    logits: torch.Tensor  # overwritten by every replay


class StepGraphs:
    """fn(conv, ssm, tokens) through a CUDA graph per token count n in 1..max_tokens, captured by `capture` (a
    drafter captures them all at load, as vLLM captures its decode graphs at start-up, so that no request's round, and
    no round time a bandit learns from, pays a capture) or else on first use.

    step_fn(conv, ssm, tokens [n]) -> logits: the eager function, advancing conv / ssm in place. new_buffers(n) ->
    (conv, ssm): zero state buffers for n tokens (n rows for a step, 1 row for a catch-up). Replays are serialized
    by a lock (the graph's buffers are shared by all callers); the work itself is ordered on the current stream.
    """

    def __init__(
        self,
        step_fn: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
        new_buffers: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
        device: torch.device,
        max_tokens: int = MAX_GRAPH_ROWS,
    ):
        if device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, got {device}")
        self._step_fn, self._new_buffers, self.device, self.max_tokens = step_fn, new_buffers, device, max_tokens
        self._graphs: dict[int, _Captured] = {}
        self._pool = None  # one memory pool shared by every captured row count
        self._lock = threading.Lock()

    @property
    def captured(self) -> list[int]:
        """Token counts with a captured graph."""
        return sorted(self._graphs)

    def covers(self, n: int) -> bool:
        return 1 <= n <= self.max_tokens

    def step(self, conv: torch.Tensor, ssm: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """Advance conv / ssm ([L, rows, ...], any strides) by tokens [n] in place -> the logits step_fn returns."""
        n = tokens.shape[0]
        if not self.covers(n):
            raise ValueError(f"no CUDA graph for {n} tokens (1..{self.max_tokens})")
        with self._lock:
            captured = self._graphs.get(n) or self._capture(n)
            captured.tokens.copy_(tokens)
            captured.conv.copy_(conv)
            captured.ssm.copy_(ssm)
            captured.graph.replay()
            conv.copy_(captured.conv)
            ssm.copy_(captured.ssm)
            return captured.logits.clone()

    def capture(self, counts) -> None:
        """Capture the graphs of these token counts now (those not captured yet)."""
        with self._lock:
            for n in counts:
                if not self.covers(n):
                    raise ValueError(f"no CUDA graph for {n} tokens (1..{self.max_tokens})")
                if n not in self._graphs:
                    self._capture(n)

    @torch.inference_mode()
    def _capture(self, n: int) -> _Captured:
        conv, ssm = self._new_buffers(n)
        tokens = torch.zeros(n, dtype=torch.long, device=self.device)
        # Warm up on a side stream first (lazy cuBLAS handles and workspaces must not be created during capture).
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):
                self._step_fn(conv, ssm, tokens)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            logits = self._step_fn(conv, ssm, tokens)
        self._pool = graph.pool()
        captured = _Captured(graph, conv, ssm, tokens, logits)
        self._graphs[n] = captured
        return captured
