"""Test-wide settings: tiny models are overhead-bound, and one intra-op thread avoids oversubscribing a 2-core box
(Ray workers and DeepSpeed ranks started by tests run beside the test process). Measured GEMM plans
(models/cpu_gemm.py) are kept in a directory of this run's own, not in the user's cache."""

import os
import tempfile

import torch

torch.set_num_threads(1)
os.environ["RAY_SPECDEC_CACHE_DIR"] = tempfile.mkdtemp(prefix="ray_specdec_test_cache_")
