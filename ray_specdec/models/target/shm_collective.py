"""The sum over tensor-parallel ranks on one machine's CPU through shared memory, in place of gloo's all-reduce.

Why. A CPU target of tp_size > 1 all-reduces twice per layer and once for its head, every step. Over gloo (TCP on
loopback) one all-reduce of a verify step's few rows took ~1.5 ms between two rank processes on the 2-core machine:
13 of them made a one-row step ~20 ms inside a rank, against ~4 ms for the whole step at tp_size 1
(docs/BENCHMARKS.md). The ranks of a RankGroup share one machine (a
STRICT_PACK placement group), so they can share memory instead, as DeepSpeed's own `deepspeed_shm_comm` op does (off
here: ~100 s of JIT compilation per machine, and it needs LOCAL_SIZE set).

How. `ShmSum` maps one file of /dev/shm into every rank (rank 0 creates it under a random name, sends the name over
the process group, and removes it once all have mapped it, so nothing is left behind by a crash). A sum is one call
of the native `shm_sum_f32` (native/shm_cpu.c): copy the rank's vector into its slot, publish a sequence number,
wait for every rank's, and add the slots in rank order. So every rank gets the same bits, and the bits do not depend
on the vector's length: what batch invariance needs of the row-parallel products (models/target/tp_shards.py), which
gloo's all-reduce gives only for two ranks. Vectors larger than a slot (CAPACITY_FLOATS) and other dtypes go through the
process group as before (every rank decides alike: they hold the same shapes).

Where. `install(group)` on each rank after the process group exists (serving/target_worker.py), then
`ranks_sum(x, group)` (tp_shards.RowShard.sum) and DeepSpeed's `inference_all_reduce` (its row-parallel layers,
patched to come here) take it. RAY_SPECDEC_SHM_ALLREDUCE=0 keeps gloo. A peer that does not arrive within TIMEOUT_S
raises; a RankGroup has already failed that step at its own timeout and restarts the ranks, killing the waiting one.
"""

from __future__ import annotations

import logging
import os
import uuid
from pathlib import Path

import torch
import torch.distributed as dist

from ray_specdec import env
from ray_specdec.models.native import library

logger = logging.getLogger(__name__)

# Floats per rank's slot: 1 MiB (a 512-row prefill chunk of a 512-wide model; bigger sums take the process group).
CAPACITY_FLOATS = 1 << 18
# Seconds a rank waits for its peers in one sum before it gives up (a step's own timeout in RankGroup is shorter).
TIMEOUT_S = 600.0
SHM_DIR = Path("/dev/shm")
_FLAG_BYTES = 64

_active: "ShmSum | None" = None


def enabled_by_environment() -> bool:
    """RAY_SPECDEC_SHM_ALLREDUCE=0 (or off / false / no) keeps the process group's all-reduce."""
    return env.SHM_ALLREDUCE.on()


class ShmSum:
    """Every rank's float32 vector summed in rank order, through one shared mapping (collective: every rank of the
    group constructs it, and calls `sum` with vectors of the same length in the same order)."""

    def __init__(self, group=None, capacity: int = CAPACITY_FLOATS, timeout_s: float = TIMEOUT_S):
        self.group, self.capacity, self.timeout_s = group, capacity, timeout_s
        self.world, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self._lib = library.load()
        nbytes = _FLAG_BYTES * self.world + 2 * self.world * capacity * 4
        name = [f"ray_specdec_tp_{uuid.uuid4().hex}" if self.rank == 0 else None]
        dist.broadcast_object_list(name, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
        self.name = name[0]
        path = SHM_DIR / self.name
        error = None
        if self.rank == 0:
            error = _create(path, nbytes)
        dist.barrier(group=group)
        self._buffer = None
        if error is None:
            try:
                self._buffer = torch.from_file(str(path), shared=True, size=nbytes, dtype=torch.uint8)
            except (OSError, RuntimeError) as exc:
                error = f"{type(exc).__name__}: {exc}"
        ok = torch.tensor([int(error is None and self._lib is not None)])
        dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=group)  # on one machine every rank maps the same file
        dist.barrier(group=group)
        if self.rank == 0:
            path.unlink(missing_ok=True)
        if not int(ok):
            self._buffer = None
            why = error or (library.why_unavailable() if self._lib is None else "a peer could not map it")
            raise RuntimeError(f"shared memory between the ranks is unavailable: {why}")
        self._seq = 0

    def sum(self, x: torch.Tensor) -> torch.Tensor | None:
        """Every rank's x (float32, on CPU) summed in rank order -> a new tensor of x's shape; None where x does not
        fit a slot or is of another kind (then every rank falls back alike)."""
        if x.dtype != torch.float32 or x.device.type != "cpu" or x.numel() > self.capacity:
            return None
        x = x.contiguous()
        out = torch.empty_like(x)
        self._seq += 1
        status = self._lib.shm_sum_f32(self._buffer.data_ptr(), self.world, self.rank, self.capacity, self._seq,
                                       x.data_ptr(), out.data_ptr(), x.numel(), self.timeout_s)  # fmt: skip
        if status != 0:
            raise RuntimeError(f"tensor-parallel rank {self.rank}: a peer did not reach sum {self._seq} within "
                               f"{self.timeout_s:.0f} s (shared-memory all-reduce, status {status})")  # fmt: skip
        return out


def _create(path: Path, nbytes: int) -> str | None:
    """Rank 0: a zeroed file of nbytes (flags at 0) -> None, or why it could not be made."""
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, nbytes)
        finally:
            os.close(fd)
    except OSError as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def install(group=None) -> str | None:
    """Sums over `group` (its ranks on this machine's CPU) go through shared memory from now on, here and in
    DeepSpeed's row-parallel layers -> None, or why not (the process group's all-reduce stays)."""
    global _active
    if not enabled_by_environment():
        return "RAY_SPECDEC_SHM_ALLREDUCE=0"
    if not SHM_DIR.is_dir():
        return f"{SHM_DIR} does not exist"
    try:
        _active = ShmSum(group)
    except RuntimeError as exc:
        logger.warning("%s; the ranks all-reduce over the process group", exc)
        return str(exc)
    _patch_deepspeed()
    return None


def active() -> ShmSum | None:
    return _active


def ranks_sum(x: torch.Tensor, group=None) -> torch.Tensor | None:
    """x summed over the ranks of `group` in rank order through shared memory; None where that is not set up for
    this group or x does not fit (the caller then uses the process group)."""
    shm = _active
    if shm is None or dist.get_world_size(group) != shm.world:
        return None
    return shm.sum(x)


def _patch_deepspeed() -> None:
    """DeepSpeed's row-parallel layers all-reduce with `deepspeed.comm.inference_all_reduce`: sums that fit take the
    shared memory (in place, as that function works), the rest the original."""
    try:
        import deepspeed.comm as ds_comm
    except ImportError:
        return
    original = ds_comm.inference_all_reduce
    if getattr(original, "_ray_specdec_shm", False):
        return

    def inference_all_reduce(tensor, op=ds_comm.ReduceOp.SUM, group=None, async_op=False, *args, **kwargs):
        total = ranks_sum(tensor, group) if op == ds_comm.ReduceOp.SUM and not async_op else None
        if total is None:
            return original(tensor, op, group, async_op, *args, **kwargs)
        return tensor.copy_(total)

    inference_all_reduce._ray_specdec_shm = True
    ds_comm.inference_all_reduce = inference_all_reduce
