"""The native kernels' pool (models/native/pool_cpu.c), driven from Python through a ctypes callback: every job's
chunks partition its range exactly once, in chunks of its grain, on more than one thread when asked; jobs one after
the other never mix (a chunk always runs with its own job's context); and a caller that finds the pool busy (another
thread's job) runs its job alone, whole and correct."""

from __future__ import annotations

import ctypes
import random
import threading
import time

import pytest

from ray_specdec.models import native

TASK = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64)


@pytest.fixture(scope="module")
def pool_for():
    lib = native.load()
    if lib is None:
        pytest.skip(f"native kernels unavailable: {native.why_unavailable()}")
    lib.pool_for.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, TASK, ctypes.c_void_p]
    lib.pool_for.restype = None
    return lib.pool_for


def run(pool_for, threads: int, n: int, grain: int, job: int = 1, pause_s: float = 0.0) -> list[tuple]:
    """pool_for over [0, n) -> the (job, begin, end, thread) of every chunk run."""
    seen, lock = [], threading.Lock()

    def task(ctx, begin, end):
        with lock:
            seen.append((ctx, begin, end, threading.get_native_id()))
        if pause_s:
            time.sleep(pause_s)  # lets the other threads claim chunks meanwhile (the GIL is released)

    callback = TASK(task)
    pool_for(threads, n, grain, callback, job)
    return seen


def assert_partition(seen: list[tuple], n: int, grain: int, job: int = 1) -> None:
    assert all(ctx == job for ctx, *_ in seen), "a chunk ran with another job's context"
    spans = sorted((begin, end) for _, begin, end, _ in seen)
    if n <= 0:
        assert spans == []
        return
    if len(spans) == 1 and spans[0] == (0, n):  # run whole on the caller's thread (one thread, or one chunk)
        return
    assert spans == [(b, min(b + grain, n)) for b in range(0, n, grain)]


@pytest.mark.parametrize("threads", [1, 2, 4])
@pytest.mark.parametrize("n, grain", [(0, 1), (1, 1), (7, 1), (100, 3), (1000, 64), (65, 64)])
def test_chunks_partition_the_range(pool_for, threads, n, grain):
    assert_partition(run(pool_for, threads, n, grain), n, grain)


def test_the_workers_take_part(pool_for):
    seen = run(pool_for, 4, 64, 1, pause_s=0.002)
    assert_partition(seen, 64, 1)
    assert len({thread for *_, thread in seen}) > 1


def test_jobs_one_after_another_never_mix(pool_for):
    rng = random.Random(0)
    for job in range(1, 300):
        n, grain = rng.randint(1, 40), rng.randint(1, 5)
        assert_partition(run(pool_for, rng.choice([2, 3, 4]), n, grain, job), n, grain, job)


def test_callers_on_two_threads_each_get_their_whole_job(pool_for):
    failures = []

    def caller(first_job: int) -> None:
        try:
            for job in range(first_job, first_job + 100):
                assert_partition(run(pool_for, 2, 50, 2, job, pause_s=0.0001), 50, 2, job)
        except AssertionError as e:
            failures.append(e)

    callers = [threading.Thread(target=caller, args=(k * 1000,)) for k in (1, 2)]
    for t in callers:
        t.start()
    for t in callers:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in callers) and not failures, failures
