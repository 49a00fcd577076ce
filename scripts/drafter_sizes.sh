#!/bin/bash
# Drafter size sweep against target-neox-large (docs/MODELS.md "Drafter sizes", docs/bench/drafter-sizes/): Mamba
# drafters of 0.7M, 2.8M and 11M parameters, each from scratch with the same recipe, data, steps and seed, distilled
# from target-neox (whose logits target-neox-large computes, at an eighth of the cost); then each drafter, and the
# shipped one, in process on target-neox-large at one request: fixed chains and a tree, the controller, plain decoding.
# STEPS (default 160) sets the training steps of every size.
set -e
cd "$(dirname "$0")/.."
export PYTHONPATH=.
python -c "
import shutil; from pathlib import Path; from ray_specdec.training import corpus
for rel in corpus.split_sources(corpus.list_sources())[0]:
    (Path('runs/train-split') / rel).parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(corpus.stdlib_root() / rel, Path('runs/train-split') / rel)"
for s in 0.7m 2.8m 11m; do
  python -m ray_specdec train-drafter --target target-neox --data runs/train-split --out runs/drafter-$s --size $s \
    --seq-len 512 --batch-size 4 --lr 2e-3 --warmup-steps 10 --max-steps ${STEPS:-160} --max-minutes 600 --seed 3
done
mkdir -p runs/drafter-sizes
for d in runs/drafter-0.7m runs/drafter-2.8m runs/drafter-11m drafter-mamba; do
  python -m benchmarks.batched_loop --target target-neox-large --drafter $d --concurrency 1 --duration 12 --prompts 40 \
    --variants "batched drafting,batched none,per-request none" --trees "1,1,1;1,1,1,1,1;2,2,1,1" \
    --json runs/drafter-sizes/batched_loop_$(basename $d).json
done
