"""Wall-clock timing of work that may run asynchronously on a device.

On CUDA a call returns once its kernels are queued: `perf_counter` around it measures the launches, and the device's
time lands in whatever next waits for it. A cost that is measured apart from the step it runs in (a drafter prefill,
which the speculation controller charges as a per-request cost) must therefore wait for the device at both ends: at the
start so that earlier queued work is not counted, at the end so that its own is. On CPU both waits are no-ops.
"""

from __future__ import annotations

import time

import torch


def synchronize(device: torch.device | str) -> None:
    """Wait until `device` has finished every queued kernel (nothing to wait for off CUDA)."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def now(device: torch.device | str) -> float:
    """perf_counter once `device` is idle: two such readings bracket the device time of what ran between them."""
    synchronize(device)
    return time.perf_counter()


def settle(outputs) -> None:
    """Wait for the devices that hold `outputs` (tensors, or None for nothing), so a timing taken next includes them."""
    for device in {t.device for t in outputs if t is not None}:
        synchronize(device)
