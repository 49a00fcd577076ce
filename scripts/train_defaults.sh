#!/bin/bash
# Trains and exports the whole default model family on CPU: the commands that produced the shipped weights
# (docs/MODELS.md has the results). Minutes per model can be overridden (NEOX_MIN, MAMBA_MIN, LLAMA_MIN, SMALL_MIN);
# checkpoints go to runs/ and every train command takes --resume to continue a run.
# The tokenizer comes first: python -m ray_specdec.training.tokenizer (writes runs/tokenizer).
set -x
cd "$(dirname "$0")/.."
export PYTHONPATH=.
D=ray_specdec/default_models
T="python -m ray_specdec.training.train --threads 2"
$T --arch target-neox --name target-neox-r2 --max-minutes ${NEOX_MIN:-38} --batch-size 8 --seq-len 256 --lr 1.5e-3 --warmup-steps 30 > runs/target-neox-r2.log 2>&1
python -m ray_specdec.training.export --run runs/target-neox-r2 --out $D/target-neox
$T --arch drafter-mamba --name drafter-mamba-r2 --teacher $D/target-neox --warmup-steps 20 --max-minutes ${MAMBA_MIN:-16} --lr 2e-3 > runs/drafter-mamba-r2.log 2>&1
python -m ray_specdec.training.export --run runs/drafter-mamba-r2 --out $D/drafter-mamba
$T --arch target-llama --name target-llama-r2 --teacher $D/target-neox --alpha 0.5 --warmup-steps 20 --max-minutes ${LLAMA_MIN:-10} --lr 1.5e-3 > runs/target-llama-r2.log 2>&1
python -m ray_specdec.training.export --run runs/target-llama-r2 --out $D/target-llama
$T --arch drafter-neox-small --name drafter-neox-small-r2 --teacher $D/target-neox --warmup-steps 20 --max-minutes ${SMALL_MIN:-6} --lr 2e-3 > runs/drafter-neox-small-r2.log 2>&1
python -m ray_specdec.training.export --run runs/drafter-neox-small-r2 --out $D/drafter-neox-small
echo CHAIN R2 DONE
# Round 3: both drafters continued from their exported weights for the same steps and tokens (docs/MODELS.md).
R3="--tokenizer $D/target-neox --teacher $D/target-neox --seq-len 512 --batch-size 4 --warmup-steps 10 --lr 1e-3"
$T --arch drafter-mamba --name drafter-mamba-r3 --init-from $D/drafter-mamba $R3 --max-minutes ${MAMBA3_MIN:-45} > runs/drafter-mamba-r3.log 2>&1
python -m ray_specdec.training.export --run runs/drafter-mamba-r3 --out $D/drafter-mamba --tokenizer $D/target-neox
STEPS=$(python -c "import json; print(json.load(open('runs/drafter-mamba-r3/summary.json'))['steps'])")
$T --arch drafter-neox-small --name drafter-neox-small-r3 --init-from $D/drafter-neox-small $R3 --max-steps $STEPS --max-minutes 60 > runs/drafter-neox-small-r3.log 2>&1
python -m ray_specdec.training.export --run runs/drafter-neox-small-r3 --out $D/drafter-neox-small --tokenizer $D/target-neox
echo R3 DONE
# Round 4: drafter-mamba distilled on target-neox's own continuations (train-drafter --generate-tokens), from its
# round-3 weights, on the corpus train split's files.
python -c "
import shutil; from pathlib import Path; from ray_specdec.training import corpus
for rel in corpus.split_sources(corpus.list_sources())[0]:
    (Path('runs/train-split') / rel).parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(corpus.stdlib_root() / rel, Path('runs/train-split') / rel)"
python -m ray_specdec train-drafter --target $D/target-neox --data runs/train-split --out runs/drafter-mamba-r4 \
  --init-from $D/drafter-mamba --generate-tokens 250000 --seq-len 512 --batch-size 4 --lr 1e-3 --warmup-steps 10 \
  --max-minutes 25 --seed 3
cp runs/drafter-mamba-r4/model.safetensors runs/drafter-mamba-r4/training.json $D/drafter-mamba/
echo R4 DONE
# target-hybrid: target-llama with layers 1, 3 and 5 made Mamba2 layers from their attention (training/hybrid.py,
# "Mamba in the Llama"), then distilled from target-llama on the corpus train split.
python -m ray_specdec.training.hybrid --source $D/target-llama --out runs/target-hybrid-init
$T --arch target-hybrid --name target-hybrid --tokenizer $D/target-llama --teacher $D/target-llama \
  --init-from runs/target-hybrid-init --alpha 0.9 --lr 5e-4 --warmup-steps 10 --max-steps 150 --max-minutes 60 \
  > runs/target-hybrid.log 2>&1
python -m ray_specdec.training.export --run runs/target-hybrid --out $D/target-hybrid --tokenizer $D/target-llama
echo HYBRID DONE
# target-mamba2: a pure Mamba2 target, distilled from target-neox as target-llama was (a fixed step count).
$T --arch target-mamba2 --name target-mamba2 --tokenizer $D/target-neox --teacher $D/target-neox --alpha 0.5 \
  --seq-len 256 --batch-size 8 --lr 1.5e-3 --warmup-steps 20 --max-steps 300 --max-minutes 40 > runs/target-mamba2.log 2>&1
python -m ray_specdec.training.export --run runs/target-mamba2 --out $D/target-mamba2 --tokenizer $D/target-neox
# drafter-mamba2: the Mamba2 drafter, the drafter size sweep's recipe (scripts/drafter_sizes.sh) at 2.8m.
python -m ray_specdec train-drafter --arch mamba2 --target $D/target-neox --data runs/train-split --out runs/drafter-mamba2 \
  --size 2.8m --seq-len 512 --batch-size 4 --lr 2e-3 --warmup-steps 10 --max-steps 160 --max-minutes 600 --seed 3
# drafter-mamba-hybrid: drafter-mamba distilled further against target-hybrid (its paired drafter, defaults.py).
python -m ray_specdec train-drafter --target $D/target-hybrid --data runs/train-split --out runs/drafter-mamba-hybrid \
  --init-from drafter-mamba --seq-len 512 --batch-size 4 --lr 1e-3 --warmup-steps 10 --max-steps 150 --max-minutes 30 \
  --seed 3
for d in drafter-mamba2 drafter-mamba-hybrid; do
  mkdir -p $D/$d && cp runs/$d/*.json runs/$d/model.safetensors runs/$d/chat_template.jinja $D/$d/
done
echo SSM DONE
