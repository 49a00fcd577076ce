#!/bin/bash
# The SSM and hybrid targets in process, one request, greedy (docs/MODELS.md "SSM and hybrid targets",
# docs/bench/ssm-targets/): plain decoding, fixed chains and trees, the bandit over them, and memory per request
# against context; each target with its drafters. Then drafter-mamba2 beside a Mamba drafter of the same recipe
# (scripts/drafter_sizes.sh's 2.8m, trained here if runs/drafter-2.8m is missing) and the shipped drafter-mamba, on
# target-neox-large (docs/bench/mamba2-drafter/).
set -e
cd "$(dirname "$0")/.."
export PYTHONPATH=.
mkdir -p runs/ssm-targets runs/mamba2-drafter
TREES="1,1;1,1,1;1,1,1,1;2,1,1;2,2,1;2,2,1,1;3,2,1"
for pair in target-hybrid:drafter-mamba-hybrid target-hybrid-large:drafter-mamba-hybrid target-mamba2:drafter-mamba \
            target-mamba2:drafter-mamba2; do
  t=${pair%%:*}; d=${pair#*:}
  python -m benchmarks.ssm_target_trees --target $t --drafter $d --trees "$TREES" --prompts 8 --repeats 2 --bandit \
    --bandit-warmup 4 --json runs/ssm-targets/${t}__$d.json
done
[ -d runs/train-split ] || python -c "
import shutil; from pathlib import Path; from ray_specdec.training import corpus
for rel in corpus.split_sources(corpus.list_sources())[0]:
    (Path('runs/train-split') / rel).parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(corpus.stdlib_root() / rel, Path('runs/train-split') / rel)"
[ -d runs/drafter-2.8m ] || python -m ray_specdec train-drafter --target target-neox --data runs/train-split \
  --out runs/drafter-2.8m --size 2.8m --seq-len 512 --batch-size 4 --lr 2e-3 --warmup-steps 10 --max-steps 160 \
  --max-minutes 600 --seed 3
for d in drafter-mamba2 runs/drafter-2.8m drafter-mamba; do
  python -m benchmarks.batched_loop --target target-neox-large --drafter $d --concurrency 1 --duration 12 --prompts 40 \
    --variants "batched drafting,batched none" --trees "1,1,1;1,1,1,1,1;2,2,1,1" \
    --json runs/mamba2-drafter/batched_loop_$(basename $d).json
done
