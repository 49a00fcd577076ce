"""The engine's compute threads first: on CPU, every other thread of the serving process runs at the lowest priority.

Why. A step on CPU runs on the loop's thread and torch's OpenMP workers, which meet at a barrier after every parallel
operation. Another thread that takes one of their cores mid-operation stalls the others at the barrier too, so a
slice taken from one costs all of them (docs/BENCHMARKS.md: a process busy 12.5% of the 2-core
machine cost the loop 19% at 32 requests, and nothing at niceness 19). A Serve replica holds ~40 other threads:
Serve's event loop and HTTP server, Ray's core worker and gRPC threads, the bandit's and metrics' syncs. They need
little CPU but wake often. Served on 2 cores, those threads at niceness 19 gave 1.11x the tokens/s at one request
and 1.03-1.04x at 8 and 32 (alternated pairs; docs/BENCHMARKS.md).

How. Linux lets a process raise the niceness of its own threads without privileges (lowering it needs CAP_SYS_NICE).
The compute threads are the loop's own and its OpenMP team (`library.openmp_thread_ids`); every other thread of the
process gets niceness 19, and `refresh` repeats that at most every REFRESH_S for threads started later. The compute
threads keep the process's niceness (Ray starts workers at 15). Where the team cannot be known (no native kernels,
another OS, two OpenMP runtimes in the process) nothing changes: a worker of torch's left at 19 would slow every
step instead.
"""

from __future__ import annotations

import logging
import os
import threading
import time

logger = logging.getLogger(__name__)

LOWEST = 19  # the niceness other threads get
REFRESH_S = 5.0  # how often threads started since get it too
TASKS = "/proc/self/task"


class ComputeFirst:
    """Keeps the process's threads other than `compute` at niceness LOWEST."""

    def __init__(self, compute: set[int]):
        self.compute = frozenset(compute)
        self.lowered: set[int] = set()
        self._at = -float("inf")

    @classmethod
    def start(cls) -> "ComputeFirst | None":
        """On the loop's thread, after its first parallel torch work (the team exists): the loop's thread and its
        OpenMP team as the compute threads, every other thread lowered now. None (logged) where the team cannot be
        known."""
        from ray_specdec.models.native import library

        team = library.openmp_thread_ids()
        if team is None or threading.get_native_id() not in team:
            logger.info("compute threads first: off (the OpenMP team is unknown: %s)",
                        library.why_unavailable() or "not Linux, or two OpenMP runtimes")  # fmt: skip
            return None
        keeper = cls(set(team))
        keeper.refresh(force=True)
        logger.info("compute threads first: %d compute threads, %d others at niceness %d",
                    len(keeper.compute), len(keeper.lowered), LOWEST)  # fmt: skip
        return keeper

    def refresh(self, force: bool = False) -> None:
        """Lower the threads not lowered yet (at most every REFRESH_S unless forced)."""
        now = time.monotonic()
        if not force and now - self._at < REFRESH_S:
            return
        self._at = now
        try:
            threads = {int(name) for name in os.listdir(TASKS)}
        except OSError:
            return
        self.lowered &= threads  # ids of threads that ended may be reused
        for tid in threads - self.compute - self.lowered:
            try:
                if os.getpriority(os.PRIO_PROCESS, tid) < LOWEST:
                    os.setpriority(os.PRIO_PROCESS, tid, LOWEST)
                self.lowered.add(tid)
            except OSError:  # ended meanwhile, or not ours to change
                pass
