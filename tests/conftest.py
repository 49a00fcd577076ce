"""Test-wide settings: tiny models are overhead-bound, and one intra-op thread avoids oversubscribing a 2-core box
(Ray workers and DeepSpeed ranks started by tests run beside the test process). Measured GEMM plans
(models/cpu_gemm.py) are kept in a directory of this run's own, not in the user's cache.

The session ends with `os._exit(status)` once pytest has reported, where this process ran Ray: the deployment tests
start and shut down several Rays (and Serve's handles) in this one process, which Ray does not support cleanly
(ray-project/ray#31145: background threads keep pointers into a shut-down core worker), and the interpreter's own
teardown then crashed once after every test had passed (a thread jumping into freed memory, in the clean-clone CI
run of 2026-11-27). A server process starts one Ray and never tears down the interpreter that way. Every test's
outcome and the exit status are unchanged."""

import os
import sys
import tempfile

import pytest
import torch

torch.set_num_threads(1)
os.environ["RAY_SPECDEC_CACHE_DIR"] = tempfile.mkdtemp(prefix="ray_specdec_test_cache_")

_exit_status: list[int] = []


def pytest_sessionfinish(session, exitstatus):
    _exit_status.append(int(exitstatus))


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    """After every other plugin's unconfigure (the report is out): leave without the interpreter's teardown where a
    Ray ran in this process."""
    if _exit_status and "ray._raylet" in sys.modules:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(_exit_status[-1])
