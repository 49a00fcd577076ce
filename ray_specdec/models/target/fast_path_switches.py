"""Which fast paths a TargetModel takes, and why not where it does not: each an on / off / auto switch
(`switch_why`), with the reason that keeps it off on this model and device (its "blocker"). target/model.py asks them in
order at load: native attention, the lean forward, batch invariance, the KV pool, CUDA graphs."""

from __future__ import annotations

import logging

from transformers import PreTrainedModel

from ray_specdec import env
from ray_specdec.models.loading import failure
from ray_specdec.models.native import attention, library
from ray_specdec.models.target import batch_invariant as invariant, step_graphs

logger = logging.getLogger(__name__)

# A tensor-parallel shard's lean forward runs eagerly over caches of its own: the pool's sizes and the graphs (which
# would capture the ranks' all-reduces) have not been run on a shard.
SHARD_UNTESTED = "the model is a DeepSpeed shard (its forward runs eagerly, over caches of its own)"


def switch_why(name: str, requested: bool | None, switch: env.Switch, blocker) -> str | None:
    """Why an on/off/auto feature is off (None: on). requested None: on unless `switch` is set off or
    `blocker()` names a reason; True: on, or a RuntimeError with the reason; False: off."""
    if requested is False:
        return f"{name}=False"
    if requested is None and not switch.on():
        return f"{switch.name}=0"
    why = blocker()
    if requested and why is not None:
        raise RuntimeError(f"{name}=True but {why}")
    return why


def native_attention_why(model: PreTrainedModel) -> str | None:
    """Why the native attention cannot serve this model (a DeepSpeed shard's heads included), or None when it can."""
    if not attention.supported(model):
        return "it takes a float32 model on CPU with sdpa attention"
    if library.load() is None:
        return f"native kernels unavailable: {library.why_unavailable()}"
    return None


def batch_invariance_blocker(target) -> str | None:
    """Why the target's verify rows cannot be batch-invariant (None: they can)."""
    if target.lean_why is not None:
        return f"the lean forward is off ({target.lean_why})"
    if target.native_attention_why is not None:
        return f"the native attention is off ({target.native_attention_why})"
    return invariant.why_unsupported(target.model)


def kv_pool_blocker(target, insisted: bool) -> str | None:
    """Why the target's caches cannot live in a KV pool (None: they can)."""
    if target._lean is None:
        return f"the lean forward is off ({target.lean_why})"
    if target.sharded:
        return SHARD_UNTESTED
    if target.batch_invariant:
        return "the forward is batch-invariant (the native CPU attention serves every request in one call)"
    if target._eager:
        return "the model's attention is eager"
    if target._window is not None:
        return "the model attends through a sliding window"
    if target.device.type == "cpu" and not insisted:
        return "on the CPU the verify rows batch through the native attention (kv_pool=True pools anyway)"
    return None


def cuda_graphs_blocker(target) -> str | None:
    """Why the target's forwards cannot replay CUDA graphs (None: they can)."""
    if target._lean is None:
        return f"the lean forward is off ({target.lean_why})"
    if target.sharded:
        return SHARD_UNTESTED
    if target.device.type != "cuda":
        return f"CUDA graphs run on CUDA devices, not {target.device.type}"
    return None


def start_graphs(target, insisted: bool) -> None:
    """Capture every bucket's graphs now (seconds for a 7B model; none in any request)."""
    try:
        graphs = step_graphs.PiecewiseGraphs(target._lean, fused=env.FUSED_ATTENTION.on())
        with target._sdpa_backends():
            graphs.capture()
    except (RuntimeError, ValueError) as exc:
        if insisted:
            raise
        target.cuda_graphs_why = f"CUDA graph capture failed: {failure(exc)}"
        logger.warning("the target's forwards run eagerly: %s", target.cuda_graphs_why)
        return
    target._lean.graphs = graphs
