"""Test-wide settings: tiny models are overhead-bound, and one intra-op thread avoids oversubscribing a 2-core box
(Ray workers and DeepSpeed ranks started by tests run beside the test process)."""

import torch

torch.set_num_threads(1)
