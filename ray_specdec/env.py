"""Every `RAY_SPECDEC_*` environment variable, declared once with what it does, and read here.

On/off switches (`Switch.on()`) keep a fast path's default unless set: off where set to 0 / off / false / no, on where
set to anything else. Each is read when asked, not at import, so that a test or a process can set it late.
docs/SETTINGS.md lists them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class Switch:
    """An on/off environment switch."""

    name: str
    default: bool
    doc: str

    def on(self) -> bool:
        value = os.environ.get(self.name)
        if value is None:
            return self.default
        return value.strip().lower() not in ("0", "off", "false", "no")


@dataclass(frozen=True)
class Variable:
    """An environment variable that holds a value."""

    name: str
    doc: str

    def value(self) -> str | None:
        """The value as set (None where unset)."""
        return os.environ.get(self.name)


NATIVE = Switch("RAY_SPECDEC_NATIVE", True, "the native CPU kernels (models/native/); 0: the torch paths")
NATIVE_ISA = Variable("RAY_SPECDEC_NATIVE_ISA", "build the native kernels for avx512, avx2 or scalar instead of this "
                                                "machine's own instruction set (native)")
NATIVE_DECODER = Switch("RAY_SPECDEC_NATIVE_DECODER", True, "the verify forward's decoder layers in one native call")
NATIVE_PREFILL = Switch("RAY_SPECDEC_NATIVE_PREFILL", True, "prefill chunks' rotary, cache writes and attention "
                                                            "natively (the same bits as the torch path)")
PLANNED_GEMM = Switch("RAY_SPECDEC_PLANNED_GEMM", True, "per row count the fastest of the equivalent native GEMMs, "
                                                        "measured once per machine")
LEAN = Switch("RAY_SPECDEC_LEAN", True, "the target's lean forward (one flat batch); 0: HF's forward per request")
BATCH_INVARIANT = Switch("RAY_SPECDEC_BATCH_INVARIANT", True, "the target's verify rows computed the same whatever "
                                                              "shares the forward (float32 on CPU)")
KV_POOL = Switch("RAY_SPECDEC_KV_POOL", True, "every request's KV in one pooled tensor per layer (CUDA)")
CUDA_GRAPHS = Switch("RAY_SPECDEC_CUDA_GRAPHS", True, "CUDA graphs of the target's forward and the drafter's steps")
FUSED_ATTENTION = Switch("RAY_SPECDEC_FUSED_ATTENTION", True, "the pooled attention fused into the target's "
                                                              "piecewise CUDA graphs")
SHM_ALLREDUCE = Switch("RAY_SPECDEC_SHM_ALLREDUCE", True, "tensor-parallel CPU ranks sum through shared memory in rank "
                                                          "order; 0: the process group's all-reduce")
# Off by default: an idle call took ~0.9 ms against ~5.2 ms on the 2-core machine, but the channels' readers poll,
# and there the polling took the cores the ranks and the loop compute on (docs/BENCHMARKS.md).
COMPILED_STEPS = Switch("RAY_SPECDEC_COMPILED_STEPS", False, "a tensor-parallel step as a compiled Ray graph over the "
                                                             "ranks instead of one task per rank (polls: off where "
                                                             "the ranks have no cores to spare)")
CACHE_DIR = Variable("RAY_SPECDEC_CACHE_DIR", "where measured GEMM plans, native builds and grown models are kept "
                                              "(default ~/.cache/ray_specdec; empty: keep no plans)")
API_KEY = Variable("RAY_SPECDEC_API_KEY", "the app's api_key where the argument is not given")

ALL = (NATIVE, NATIVE_ISA, NATIVE_DECODER, NATIVE_PREFILL, PLANNED_GEMM, LEAN, BATCH_INVARIANT, KV_POOL, CUDA_GRAPHS,
       FUSED_ATTENTION, SHM_ALLREDUCE, COMPILED_STEPS, CACHE_DIR, API_KEY)
