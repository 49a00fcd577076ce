"""Native CPU kernels (C, compiled on first use and loaded with ctypes) beside their Python wrappers: `library` builds
and loads them, `gemm` the matrix products, `attention` the tree attention, `decoder` and `prefill` the target's
layers, `mamba` the drafter's step. Nothing here is required: every caller keeps a torch path."""
