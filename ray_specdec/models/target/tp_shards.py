"""What the lean forward needs to know of a DeepSpeed AutoTP shard: which Linear layers it replaced, and how a
batch-invariant product goes through each.

AutoTP (`deepspeed.init_inference(..., tensor_parallel=...)`, serving/target_worker.py) replaces a model's Linear
layers in place, so a rank's model is still the HF class, with a share of every layer's heads:
- column-parallel layers (`LinearLayer`, and `fused_LinearLayer` for GPTNeoX's fused query_key_value) hold a block of
  the output features: `x @ W_shard^T + b_shard`, each rank computing its own heads, no communication;
- row-parallel layers (`LinearAllreduce`: the attention's output projection and the MLP's down projection) hold a
  block of the input features: `x_shard @ W_shard^T` summed over the ranks (an all-reduce), then the whole bias;
- the LM head (`LmHeadLinearAllreduce`) is row-parallel over the full hidden state, each rank taking its slice.

Called as modules (what the lean forward's model ops do) they are exactly what HF's forward runs on the shard, the
all-reduces inside them. A batch-invariant product (models/target/batch_invariant.py) cannot call them: its GEMM must be
the native one, and the sum over the ranks must not depend on the batch either. An all-reduce's order per element can
(ring algorithms cut the tensor into chunks by its size, so with more than two ranks an element's partial sums meet in
an order that moves with the row count), so `RowShard.sum` gathers every rank's partial product and adds them in
rank order: every rank gets the same bits, whatever the batch. On one machine's CPU the ranks do that through shared
memory (models/target/shm_collective.py); elsewhere the gather moves (ranks - 1) / ranks more bytes than an all-reduce's
reduce-scatter and gather halves, and verify rows are few.

Class names are matched, not DeepSpeed's classes imported (importing DeepSpeed costs seconds, and only a shard's
process has it loaded). A TP layer of any other kind (vocabulary-parallel embeddings, gathered outputs, sub-parameter
layouts of other models) keeps the shard's forward out of batch invariance: `why_unsupported` names it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ray_specdec.models.target import shm_collective

COLUMN_PARALLEL = ("LinearLayer", "fused_LinearLayer")
ROW_PARALLEL = ("LinearAllreduce",)
LM_HEAD = ("LmHeadLinearAllreduce",)
_KNOWN = COLUMN_PARALLEL + ROW_PARALLEL + LM_HEAD


def _is_tp_layer(module: torch.nn.Module) -> bool:
    return type(module).__module__.startswith("deepspeed.")


def is_shard(model: torch.nn.Module) -> bool:
    """Whether AutoTP replaced any of the model's layers."""
    return any(_is_tp_layer(m) for m in model.modules())


def why_unsupported(model: torch.nn.Module) -> str | None:
    """Why a shard's products cannot be made batch-invariant here (None: they can, or the model is no shard)."""
    for name, module in model.named_modules():
        if not _is_tp_layer(module):
            continue
        kind = type(module).__name__
        if kind not in _KNOWN:
            return f"its layer {name} is a DeepSpeed {kind}"
        if kind in LM_HEAD and not (hasattr(module, "_partition_sizes") and hasattr(module, "tp_index")):
            return f"its layer {name} ({kind}) does not say which input features it holds"
        if getattr(module, "gather_output", False):
            return f"its layer {name} gathers its output over the ranks"
        if kind in COLUMN_PARALLEL and getattr(module, "tp_overlap_comm", False):
            return f"its layer {name} overlaps communication (tp_overlap_comm)"
    return None


@dataclass(frozen=True)
class RowShard:
    """A row-parallel layer's share: its input features `inputs` (the whole input for LinearAllreduce, whose input
    is already this rank's share), and the group its partial products are summed over."""

    inputs: slice
    group: object

    def sum(self, partial: torch.Tensor) -> torch.Tensor:
        """Every rank's `partial` added in rank order (the same bits on every rank, whatever the row count)."""
        world = dist.get_world_size(self.group)
        if world == 1:
            return partial
        total = shm_collective.ranks_sum(partial, self.group)  # the same order, through shared memory
        if total is not None:
            return total
        parts = [torch.empty_like(partial) for _ in range(world)]
        dist.all_gather(parts, partial.contiguous(), group=self.group)
        total = parts[0]
        for part in parts[1:]:
            total = total + part
        return total


def row_shard(module: torch.nn.Module) -> RowShard | None:
    """A row-parallel layer's share (None: the module's product is whole on this rank: a Linear, or a column-parallel
    layer, whose output block is this rank's share and needs no sum)."""
    kind = type(module).__name__
    if not _is_tp_layer(module) or kind not in ROW_PARALLEL + LM_HEAD:
        return None
    if kind in LM_HEAD:  # it takes the whole hidden state and cuts its own slice
        sizes, index = module._partition_sizes, module.tp_index
        start = sum(sizes[:index])
        return RowShard(slice(start, start + sizes[index]), module.mp_group)
    return RowShard(slice(None), module.mp_group)
