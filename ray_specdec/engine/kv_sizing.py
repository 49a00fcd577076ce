"""A scheduler's KV budget against the memory that is to hold it.

The budget (`SchedulerConfig.kv_budget_tokens`, or `kv_budget_gib` in GiB) bounds the rows all admitted requests'
caches may hold. Nothing allocates it up front (caches and the GPU's pool grow with the grants), so a budget larger
than the device only shows when the load fills it: as an out-of-memory error mid-step, long after start. So the
budget is checked once the models are loaded, against what the device has free for it (`device_room`): CUDA's free
memory on the device, or on the CPU what Linux counts available (MemAvailable), or less where the process's cgroup
(a container's memory limit: Docker, Kubernetes) allows less. A budget that does not fit is a one-line error at
start that names the most that would; the library's and the CLI's default (131,072 rows, ~64 GiB of a 7B model's
KV), which nobody chose, shrinks to fit instead, with a warning. `kv_budget_gib="auto"` takes `AUTO_SHARE` of that
room (vLLM sizes its KV cache from `gpu_memory_utilization` the same way): the rest is for activations, the
allocator's slack and, on CUDA, the graphs' pools.

With tensor parallelism each rank holds a `tp_size`-th of every row: on CUDA each rank's own device must hold its
share (`shards`); on the CPU the ranks share the host's memory, which must hold the whole budget.
"""

from __future__ import annotations

import logging
import math
import os

import torch

logger = logging.getLogger(__name__)

AUTO_SHARE = 0.9  # of the memory free after loading that kv_budget_gib="auto" takes
GIB = 1 << 30
NO_LIMIT = 1 << 62  # a cgroup v1 memory limit at least this large is "unlimited" (the kernel writes ~2**63)


def device_room(device: torch.device | str) -> int | None:
    """Bytes free for KV on `device` now (call it after loading the models): CUDA's free memory, the CPU's available
    memory (Linux's MemAvailable, or what the process's cgroup still allows where that is less); None where that
    cannot be read."""
    device = torch.device(device)
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    if device.type != "cpu":
        return None
    rooms = [room for room in (_mem_available(), cgroup_room()) if room is not None]
    return min(rooms) if rooms else None


def _mem_available(meminfo: str = "/proc/meminfo") -> int | None:
    try:
        with open(meminfo) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def cgroup_room(root: str = "/sys/fs/cgroup", self_cgroup: str = "/proc/self/cgroup") -> int | None:
    """Bytes the process's memory cgroup still allows: its limit less its usage, the reclaimable page cache
    (inactive files) counted free as MemAvailable counts it; cgroup v2 or v1, at the process's own cgroup path or, in
    a container that sees its cgroup as the root, at the root. None where no limit is set or none can be read."""
    try:
        with open(self_cgroup) as f:
            entries = [line.strip().split(":", 2) for line in f if line.count(":") >= 2]
    except OSError:
        return None
    for hierarchy, controllers, path in entries:
        if hierarchy == "0" and controllers == "":  # v2: one unified hierarchy
            base, files = root, ("memory.max", "memory.current", "inactive_file")
        elif "memory" in controllers.split(","):  # v1: the memory controller's own hierarchy
            base, files = os.path.join(root, "memory"), ("memory.limit_in_bytes", "memory.usage_in_bytes",
                                                         "total_inactive_file")  # fmt: skip
        else:
            continue
        for where in (os.path.join(base, path.lstrip("/")), base):
            room = _cgroup_dir_room(where, *files)
            if room is not None:
                return room
    return None


def _cgroup_dir_room(where: str, limit_file: str, usage_file: str, inactive_key: str) -> int | None:
    try:
        with open(os.path.join(where, limit_file)) as f:
            limit = f.read().strip()
        with open(os.path.join(where, usage_file)) as f:
            usage = int(f.read().strip())
    except (OSError, ValueError):
        return None
    if limit == "max" or not limit.isdigit() or int(limit) >= NO_LIMIT:
        return None
    inactive = 0
    try:
        with open(os.path.join(where, "memory.stat")) as f:
            for line in f:
                key, _, value = line.partition(" ")
                if key == inactive_key:
                    inactive = int(value)
    except (OSError, ValueError):
        pass
    return max(0, int(limit) - usage + inactive)


def kv_budget_rows(budget_gib: float, bytes_per_token: int) -> int:
    """A KV budget in GiB as rows of the target's cache."""
    return max(1, math.floor(budget_gib * GIB / max(bytes_per_token, 1)))


def fitted_kv_budget(rows: int, budget_gib: float | str | None, bytes_per_token: int, room: int | None,
                     shards: int = 1, given: bool = True) -> int:
    """The budget in rows: `budget_gib` GiB where given ("auto": AUTO_SHARE of the room), else `rows`; checked
    against `room` (bytes free on each device that holds a `shards`-th of every row; None: unchecked). ValueError, one
    line, where it does not fit or "auto" has no room to go by; a budget nobody chose (`given` False: the default
    rows) that does not fit shrinks to "auto" instead, with a warning."""
    bytes_per_token = max(bytes_per_token, 1)
    if budget_gib == "auto":
        if room is None:
            raise ValueError("kv_budget_gib='auto' needs the device's free memory, which cannot be read here: "
                             "give kv_budget_gib in GiB or kv_budget_tokens")  # fmt: skip
        return max(1, math.floor(AUTO_SHARE * room * shards / bytes_per_token))
    if budget_gib is not None:
        if isinstance(budget_gib, str) or not (math.isfinite(budget_gib) and budget_gib > 0):
            raise ValueError(f"kv_budget_gib must be a number of GiB > 0 or 'auto', got {budget_gib!r}")
        rows = kv_budget_rows(budget_gib, bytes_per_token)
    if room is not None and rows * bytes_per_token / shards > room:
        if not given and budget_gib is None:
            fitted = fitted_kv_budget(rows, "auto", bytes_per_token, room, shards)
            logger.warning("the default KV budget of %d rows does not fit the %.2f GiB free; %d rows instead (90%%)",
                           rows, room / GIB, fitted)
            return fitted
        most = AUTO_SHARE * room * shards / GIB
        per = f" per device at tp_size {shards}" if shards > 1 else ""
        raise ValueError(
            f"a KV budget of {rows * bytes_per_token / GIB:.2f} GiB ({rows} rows of {bytes_per_token} bytes) does not "
            f"fit: {room / GIB:.2f} GiB free{per} after loading the models; give kv_budget_gib {most:.2f} or less, "
            f"or 'auto'"
        )
    return rows
