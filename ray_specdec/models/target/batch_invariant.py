"""Batch-invariant operations for the lean forward on CPU: a row's result does not depend on the other rows.

A step of the continuous-batching scheduler runs one forward over the verify rows of every request in flight, so the
rows a request shares its products with change from step to step (other requests, other tree sizes). Greedy output
must not: in float32, each row's logits and K/V must be the bits it gets alone. Per operation of the forward:

- Products: native/gemm.py's planned paths pick F.linear / oneDNN / weight-left / native by row count, and those round
  differently. The native GEMM (native/gemm_cpu.c) accumulates every output over the inputs in one fixed order,
  whatever the row count, row block or thread split (threads take output blocks, never parts of a sum), so every
  verify row's product goes through it, one row included (`product`).
- Attention: the native kernel (native/attention_cpu.c) computes each query row in its own vector lane with the same
  operations whatever the number of rows, and a masked key contributes an exact zero (its weight underflows to 0 and
  the running maximum never rises to it), so a root row gives the same bits alone or under a tree of any size. sdpa,
  which native/attention.py keeps for fewer than MIN_ROWS rows, is not used here (the lean loop's ragged attention).
- Activations: torch's elementwise kernels run vectors over the flattened tensor and a scalar loop over the tail; the
  two round GELU / SiLU differently (of a million random inputs, ~35% of GELU's and ~4% of SiLU's results differed
  on the development machine), and which elements fall in a tail depends on the row count and on how torch splits
  the elements over threads. With one thread and a width that is a multiple of VECTOR_MULTIPLE, every element takes
  the vector path (`activate`); an exact GELU runs the native decoder's row loop instead, on every thread.
- Rotary cos / sin come from a table per position (`RotaryTable`), computed in fixed blocks, so a row's values depend
  on its position only.
- LayerNorm / RMSNorm reduce each row on its own (they run on one thread all the same: `normalize`), embeddings
  gather, residual sums and products are exact per element: the same in any batch
  (tests/models/target/test_forward_batch.py checks the whole forward).

`why_unsupported(model)` names what keeps a model out (see TargetModel for the rest: float32 on CPU, the lean loop,
the native kernels). A step's prefill chunks run together through these products, activations, norms and rotary
values, each chunk attending on its own (sdpa, over its own rows and cache): so a chunk's K/V are the bits it gets
alone, whatever other requests' chunks share its forward (TargetModel._prefill_chunks).
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import activations as hf_activations

from ray_specdec.models.native import gemm

from ray_specdec.models.target import tp_shards

# Elements per vector step of torch's elementwise loops: two vectors of 16 floats (AVX-512); AVX2 / NEON take fewer.
VECTOR_MULTIPLE = 32
# Positions per block of the rotary table (a block's values come from one call of the model's rotary embedding).
ROTARY_BLOCK = 256
# Rotary embeddings whose frequencies change with the sequence length: a position's cos / sin depend on the batch.
_LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")


def why_unsupported(model) -> str | None:
    """Why a (lean-supported) model's forward cannot be made batch-invariant here, or None when it can."""
    width = _mlp_width(model)
    if width % VECTOR_MULTIPLE:
        return f"its MLP width {width} is not a multiple of {VECTOR_MULTIPLE} (activations would take scalar tails)"
    rope = getattr(model.base_model.rotary_emb, "rope_type", "default")
    if rope in _LENGTH_DEPENDENT_ROPE:
        return f"its rotary embedding ({rope!r}) depends on the sequence length"
    return tp_shards.why_unsupported(model)


def _mlp_width(model) -> int:
    """The width the MLP's activation runs over on this process: a tensor-parallel shard's share of it."""
    mlp = model.base_model.layers[0].mlp
    first = getattr(mlp, "dense_h_to_4h", None) or getattr(mlp, "up_proj", None)
    return int(first.weight.shape[0]) if first is not None else int(model.config.intermediate_size)


def product(linear: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """linear(x) through the native GEMM, for x [..., in] (float32 on CPU) -> [..., out]. On a tensor-parallel
    shard's row-parallel layer (models/target/tp_shards.py): this rank's partial product, the ranks' partials added in
    rank order, then the bias, as the layer's own forward does with an all-reduce."""
    rows = x.numel() // x.shape[-1]
    flat = x.reshape(rows, x.shape[-1])
    shard = tp_shards.row_shard(linear)
    if shard is None:
        out = gemm.PATHS[gemm.NATIVE](flat, linear.weight, linear.bias)
    else:
        out = shard.sum(gemm.PATHS[gemm.NATIVE](flat[:, shard.inputs], linear.weight, None))
        if linear.bias is not None:
            out += linear.bias
    return out.reshape(*x.shape[:-1], out.shape[-1])


@contextlib.contextmanager
def one_thread():
    """torch on one thread inside the block."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def activate(fn: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """fn(x) for x [..., width] (width a multiple of VECTOR_MULTIPLE, contiguous): an exact (erf) GELU through the
    native decoder's `gelu_rows` on every thread, a row per thread at a time; anything else through torch on one
    thread, so that no element falls in a scalar tail. (One thread is no slower for a verify step's few rows, but a
    step's prefill chunks run ~1,000 rows together, where torch's GELU on one thread took ~10% of the forward. torch's
    thread count is per process: a forward in another Python thread meanwhile also runs on one.)"""
    if _exact_gelu(fn) and x.dtype == torch.float32 and x.device.type == "cpu" and x.is_contiguous() and not (
            torch.is_grad_enabled() and x.requires_grad):  # fmt: skip
        from ray_specdec.models.native import library

        lib = library.load()
        if lib is not None:
            out = torch.empty_like(x)
            width = x.shape[-1]
            lib.gelu_rows(x.numel() // max(width, 1), width, x.data_ptr(), out.data_ptr(), torch.get_num_threads())
            return out
    with one_thread():
        return fn(x)


def _exact_gelu(fn: nn.Module) -> bool:
    """Whether fn is the erf GELU as torch and HF define it, with the forward its class had at import (a kernel
    library may replace it)."""
    kind = type(fn)
    if _GELU_FORWARDS.get(kind) is not kind.forward or "forward" in vars(fn):
        return False
    if kind is nn.GELU:
        return fn.approximate == "none"
    return getattr(fn, "act", None) is F.gelu


_GELU_FORWARDS = {nn.GELU: nn.GELU.forward, hf_activations.GELUActivation: hf_activations.GELUActivation.forward}


def normalize(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """norm(x) (LayerNorm / RMSNorm over the last dimension) on one thread: each row is reduced on its own, so the
    bits are those of any thread count, and a verify step's few rows cost less than a parallel region's wake-up there
    (while another process holds the second core, a 32-row LayerNorm waited milliseconds for it; 512 rows take
    ~35 us longer on one thread than on two)."""
    with one_thread():
        return norm(x)


class RotaryTable:
    """cos / sin of the model's rotary embedding per position, filled on demand in blocks of ROTARY_BLOCK positions
    (each block one call of the embedding, so a position's values never depend on which rows asked for it)."""

    def __init__(self, rotary: nn.Module, max_positions: int, dtype: torch.dtype):
        self._rotary, self._dtype = rotary, dtype
        self._filled = 0
        dims = self.dims = rotary.inv_freq.numel() * 2
        # Untouched rows of torch.empty cost no memory: a long context fills only what it reaches.
        self._cos = torch.empty(max_positions, dims, dtype=dtype)
        self._sin = torch.empty(max_positions, dims, dtype=dtype)

    def __call__(self, position_ids: torch.Tensor, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """position_ids [1, R], all below `end` -> cos, sin [1, R, dims]."""
        while self._filled < end:
            start = self._filled
            stop = min(start + ROTARY_BLOCK, self._cos.shape[0])
            positions = torch.arange(start, stop)[None]
            cos, sin = self._rotary(self._cos[:1], position_ids=positions)
            self._cos[start:stop], self._sin[start:stop] = cos[0], sin[0]
            self._filled = stop
        flat = position_ids.reshape(-1)
        return self._cos[flat][None], self._sin[flat][None]
