"""One tensor-parallel rank of the target, without Ray: the sharded model and its shard of every request's KV cache.

With world_size > 1 a worker joins a torch.distributed group (gloo on CPU, nccl on GPU) and shards the target with
DeepSpeed AutoTP (`init_inference(..., replace_with_kernel_inject=False)`): Linear layers are split across ranks and
all-reduced, so every rank runs the same calls on the same inputs and ends up with the same full logits. The
scheduler's target side reaches the ranks with one call per step (`run(StepWork)`: commits, frees, allocations and
the batched forward); every rank gets the same work in the same order, and only rank 0 returns logits. Each rank's
target runs the lean forward over its shard (GPTNeoX and Llama): one forward for the verify rows of every request of
the step, batch-invariant on CPU (models/target/tp_shards.py).

With world_size == 1 DeepSpeed is not used at all: the plain HF module is exactly what the in-process engine runs
(bit-identical logits, float64 allowed), and there is nothing to shard. `init_inference` with tp_size 1 would only
cast the model (refusing float64 on CPU) and import DeepSpeed for nothing.
"""

from __future__ import annotations

import os
import socket

import numpy as np
import torch
import torch.distributed as dist
from transformers import AutoConfig, AutoModelForCausalLM

from ray_specdec.engine.kv_sizing import device_room
from ray_specdec.engine.target_backend import StepWork, TargetCaches
from ray_specdec.models.loading import resolve_dtype, resolve_model_path
from ray_specdec.models.target import shm_collective
from ray_specdec.models.target.kinds import check_tensor_parallel, load_target_model, target_kind
from ray_specdec.models.target.model import ATTN_IMPLEMENTATION, TargetModel


def free_port() -> int:
    """A TCP port that is free on this machine now (for the rank-0 rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def init_distributed(rank: int, world_size: int, master_addr: str, master_port: int, device: torch.device) -> None:
    """Join the process group of the target's ranks: nccl on GPU, gloo on CPU."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device.index or 0)  # a bare "cuda" has no index, which set_device refuses
    dist.init_process_group(
        backend, init_method=f"tcp://{master_addr}:{master_port}", rank=rank, world_size=world_size
    )


def load_target(model: str, *, dtype: str | torch.dtype | None, device: torch.device, tp_size: int) -> TargetModel:
    """The target on `device`; with tp_size > 1, this rank's AutoTP shard (the process group must exist). SSM and
    hybrid targets load at tp_size 1 only (`check_tensor_parallel`)."""
    path = resolve_model_path(model)
    config = AutoConfig.from_pretrained(path)
    check_tensor_parallel(config, tp_size)
    if target_kind(config) == "ssm":  # at tp_size 1
        return load_target_model(path, dtype=dtype, device=device)
    torch_dtype = resolve_dtype(dtype, device)
    hf_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype, attn_implementation=ATTN_IMPLEMENTATION)
    hf_model.eval()
    if tp_size == 1:
        return TargetModel(hf_model.to(device))
    return TargetModel(_auto_tp(hf_model, torch_dtype, device, tp_size))


def check_tp_dtype(dtype: torch.dtype) -> None:
    """DeepSpeed's accelerator refuses some dtypes (float64 on CPU); say so in terms of this project's settings."""
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    supported = accelerator.supported_dtypes()
    if dtype not in supported:
        raise ValueError(
            f"tensor parallelism (DeepSpeed AutoTP) on {accelerator.device_name()} supports {supported}, not "
            f"{dtype}; use tp_size=1 for {dtype}"
        )


def _auto_tp(model, dtype: torch.dtype, device: torch.device, tp_size: int):
    import deepspeed

    if device.type == "cpu":
        _use_process_group_all_reduce()
    # DeepSpeed puts the shards on accelerator device LOCAL_RANK (under Ray: each rank sees its one GPU as index 0).
    os.environ["LOCAL_RANK"] = str(device.index or 0)
    return deepspeed.init_inference(
        model, tensor_parallel={"tp_size": tp_size}, dtype=dtype, replace_with_kernel_inject=False
    )


def _use_process_group_all_reduce() -> None:
    """Make DeepSpeed's CPU all-reduce go through the gloo process group instead of its shared-memory op.

    That op (deepspeed_shm_comm) is C++ that DeepSpeed JIT-compiles when its comm backend starts (~100 s of g++ CPU
    time, once per machine: a fresh CI machine would pay it in the tests). It also segfaults unless LOCAL_SIZE equals
    the world size, and its kernel only knows bf16 / fp16 / fp32. DeepSpeed looks the op up in `__compatible_ops__`
    before building it; marked incompatible, nothing is compiled and AutoTP all-reduces with torch.distributed.
    """
    import deepspeed.ops
    from deepspeed.accelerator import get_accelerator

    name = get_accelerator().get_op_builder("ShareMemCommBuilder").NAME
    deepspeed.ops.__compatible_ops__[name] = False


def narrowed(logits: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Float32 logits as `dtype` (a half-precision model's own) where that holds them exactly, else as they are.

    A bfloat16 or float16 model computes its logits in that dtype, and the target hands them on as float32: every
    value survives the way back, so rank 0 ships half the bytes of a sampled request's rows through Ray (the loop
    widens them again: `widened`). Checked, not assumed: a model whose head computes in float32 ships float32.
    """
    if logits.dtype != torch.float32 or dtype not in (torch.bfloat16, torch.float16):
        return logits
    narrow = logits.to(dtype)
    return narrow if torch.equal(narrow.to(torch.float32), logits) else logits


def shipped(logits: torch.Tensor) -> np.ndarray:
    """Rank 0's rows as they travel through Ray: a NumPy array of the tensor's bits (bfloat16, which NumPy lacks, as
    int16; no logits are ever int16), on the CPU.

    Ray passes a NumPy array's buffer out of band, written once into the object store and mapped by the loop's
    process, while a torch tensor is pickled whole on both sides. Measured on the 2-core machine, one actor call
    returning 320 rows of float32 logits, the loop's copy included: 38 ms against 133 ms at a 32,000-token
    vocabulary, 85 ms against 440 ms at 128,256 (benchmarks/logits_shipping.py)."""
    logits = logits.detach().cpu()
    if logits.dtype == torch.bfloat16:
        logits = logits.view(torch.int16)
    return logits.numpy()


def widened(logits: torch.Tensor | np.ndarray | None) -> torch.Tensor | None:
    """What rank 0 shipped, as the loop takes it: a tensor of the loop's own (Ray maps a shipped array read-only),
    half-precision logits back to float32 (exactly)."""
    if logits is None:
        return None
    if isinstance(logits, np.ndarray):
        logits = torch.from_numpy(np.array(logits))  # a writable copy (of the narrow bits, where they are narrow)
        if logits.dtype == torch.int16:
            logits = logits.view(torch.bfloat16)
    if logits.dtype in (torch.bfloat16, torch.float16):
        return logits.to(torch.float32)
    return logits


class TargetWorker:
    """One rank: the (sharded) target and its shard of every request's KV cache, driven one step at a time."""

    def __init__(
        self,
        model: str,
        *,
        dtype: str | torch.dtype | None = None,
        device: str = "cpu",
        rank: int = 0,
        world_size: int = 1,
        master_addr: str = "127.0.0.1",
        master_port: int = 29500,
    ):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world size {world_size}")
        self.rank, self.world_size = rank, world_size
        device = torch.device(device)
        # where the ranks sum over shared memory instead of gloo (None: they do; CPU ranks of one machine)
        self.shm_allreduce_why: str | None = "one rank" if world_size == 1 else "NCCL on GPUs"
        if world_size > 1:
            # before the rendezvous: fail at once, not after it
            check_tensor_parallel(AutoConfig.from_pretrained(resolve_model_path(model)), world_size)
            check_tp_dtype(resolve_dtype(dtype, device))
            init_distributed(rank, world_size, master_addr, master_port, device)
            if device.type == "cpu":
                self.shm_allreduce_why = shm_collective.install()
        self.target = load_target(model, dtype=dtype, device=device, tp_size=world_size)
        self.model_name = model
        self.caches = TargetCaches(self.target)

    def info(self) -> dict:
        t = self.target
        return {
            "model": self.model_name,
            "vocab_size": t.vocab_size,
            "max_context": t.max_context,
            "eos_token_ids": sorted(t.eos_token_ids),
            "tp_size": self.world_size,
            "dtype": str(t.dtype).removeprefix("torch."),
            "kv_bytes_per_token": t.kv_bytes_per_token * self.world_size,
            "kv_room_bytes": device_room(t.device),  # free for KV on this rank's device (engine/kv_sizing.py)
            "shm_allreduce_why": self.shm_allreduce_why,
        }

    def run(self, work: StepWork) -> list[np.ndarray | None] | None:
        """One step (collective: every rank gets the same work in the same order); rank 0 -> the logits on the
        CPU as NumPy arrays (`shipped`; in the model's dtype where they are exactly that: `narrowed`), other ranks
        -> None. `widened` makes tensors of them again."""
        logits = self.caches.run(work)
        if self.rank != 0:
            return None
        return [None if x is None else shipped(narrowed(x, self.target.dtype)) for x in logits]

    def request_ids(self) -> list[str]:
        return list(self.caches.caches)
