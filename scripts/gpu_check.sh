#!/usr/bin/env bash
# The checks to run when a GPU is at hand (CI has none): the CUDA tests, then the batched loop on the GPU, with the
# shipped models and with a Llama-7B-sized target of random weights (tree none); the default on CUDA (`batched`: pooled
# caches and the target's CUDA graphs, one per forward with the attention in it) against graphs around the attention only
# (`pieces`) and no graphs (`eager`). Needs torch with CUDA, transformers
# and triton; no Ray. Logs and the benchmarks' JSON go to $OUT (default gpu_out/).
# Run from the repository root: bash scripts/gpu_check.sh   (DURATION / DURATION_7B: seconds per cell, 8 / 12)
set -u
out=${OUT:-gpu_out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
quiet() { grep -v "Loading weights\|Warning\|_warn_once\|output = func\|forward_call"; }

nvidia-smi -L
python3 -c "import torch, transformers, triton
print('torch', torch.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__)"
python3 -m pytest -q -p no:cacheprovider --timeout 300 tests/engine/test_cuda_batching.py tests/engine/test_cuda.py \
  tests/models/target/test_kv_pool.py tests/models/target/test_step_graphs.py tests/kernels/test_pooled_attention.py 2>&1 \
  | tee "$out/tests.log" | quiet | tail -25
python3 -m benchmarks.batched_loop --device cuda --dtype float32 --duration "${DURATION:-8}" \
  --variants "batched drafting,batched none,pieces none,eager none" \
  --json "$out/batched_loop.json" 2>&1 | tee "$out/batched_loop.log" | quiet
python3 -m benchmarks.batched_loop --device cuda --dtype bfloat16 --synthetic-llama 4096,32 \
  --duration "${DURATION_7B:-12}" --variants "pieces none,eager none,batched none" \
  --profile "batched none@32" --json "$out/batched_loop_7b.json" 2>&1 | tee "$out/batched_loop_7b.log" | quiet
