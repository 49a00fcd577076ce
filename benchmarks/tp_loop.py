"""The scheduler over tensor-parallel target ranks (Ray actors, DeepSpeed AutoTP) under a closed load: what each of
the ranks' fast paths is worth.

- `now`: the defaults: the ranks' lean forward (one forward per step for every request's verify rows;
  models/target/tp_shards.py), their sums through shared memory on CPU (models/target/shm_collective.py), a Ray task per
  rank a step;
- `compiled`: a step as one Ray compiled graph call instead (RAY_SPECDEC_COMPILED_STEPS=1, off by default);
- `gloo`: gloo's all-reduce instead of shared memory (RAY_SPECDEC_SHM_ALLREDUCE=0);
- `before`: gloo and HF's forward once per request per step (RAY_SPECDEC_LEAN=0): what the ranks ran before.

Each variant starts its own local Ray and `RankGroup` (`--tp` rank actors of one thread each, gloo on CPU, NCCL on
GPU), and runs the same prompts in the same order: held-out code windows of 32-512 tokens (benchmarks/serve_peers.py's),
64 new tokens (`--max-tokens`), greedy, a finished request replaced by the next prompt at once. Each cell runs the
app's policy (the bandit's arms priced by the controller, the lookup branch) and `tree none`; the greedy tokens of each
variant are compared with `before`'s prompt by prompt (they may part at near-ties: the per-request path's products
take other row counts, so other roundings).

Run from the repository root: python -m benchmarks.tp_loop [--tp 2] [--concurrency 1,8] [--duration 15]
[--device cpu] [--variants now,before] [--json results.json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import ray
import torch

from benchmarks.batched_loop import run_cell
from benchmarks.serve_peers import select_prompts
from deployments.engine import RankGroup
from ray_specdec.config import TreeConfig
from ray_specdec.defaults import DEFAULT_DRAFTER, DEFAULT_TARGET
from ray_specdec.engine.config import EngineConfig
from ray_specdec.engine.scheduler import Scheduler
from ray_specdec.models.drafter.mamba import MambaDrafter
from ray_specdec.models.loading import load_tokenizer
from ray_specdec.speculation.bandit import Bandit

# name -> the switches it turns off (in the ranks' environment and this process's, where the RankGroup lives)
VARIANTS = {
    "now": {},
    "compiled": {"RAY_SPECDEC_COMPILED_STEPS": "1"},  # a step as one Ray compiled graph call, not a task per rank
    "gloo": {"RAY_SPECDEC_SHM_ALLREDUCE": "0"},  # gloo's all-reduce, not shared memory
    "before": {"RAY_SPECDEC_SHM_ALLREDUCE": "0", "RAY_SPECDEC_LEAN": "0"},  # and HF's forward once per request
}
WARM_UP = 64  # prompts at the end of the list (at most half), for the warm-up cell (5 s at 4 requests)
REFERENCE = "before"  # HF's forward per request, over gloo: the ranks before this benchmark


def run_variant(name: str, args: argparse.Namespace, texts: list[str]) -> tuple[list[dict], dict[str, dict]]:
    if ray.is_initialized():
        raise RuntimeError("tp_loop starts a Ray of its own per variant; run it in a process without one")
    saved = dict(os.environ)
    os.environ.update(VARIANTS[name])
    ray.init(num_cpus=args.tp, include_dashboard=False, runtime_env={"env_vars": VARIANTS[name]})
    try:
        group = RankGroup(str(DEFAULT_TARGET), tp_size=args.tp, dtype=args.dtype, device=args.device,
                          num_cpus_per_rank=1)  # fmt: skip
        try:
            tokenizer = load_tokenizer(str(DEFAULT_TARGET))
            drafter = MambaDrafter.from_pretrained(str(DEFAULT_DRAFTER), dtype=args.dtype, device=args.device)
            prompts = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
            scheduler = Scheduler(group, drafter, tokenizer, Bandit(), EngineConfig().scheduler,
                                  speculation=EngineConfig().speculation)
            loop, device = SimpleNamespace(scheduler=scheduler), torch.device("cpu")  # the loop's side is on the CPU
            warm_up = min(WARM_UP, len(prompts) // 2)
            run_cell(loop, prompts, 4, None, min(5.0, args.duration), device, max_new_tokens=args.max_tokens,
                     start=len(prompts) - warm_up)
            cells, outputs = [], {}
            # each cell from a share of the prompts of its own: a prompt the engine saw would hit its prefix cache
            kinds = list(itertools.product(args.concurrency, (("drafting", None), ("none", "none"))))
            share = (len(prompts) - warm_up) // len(kinds)
            for k, (c, (label, tree)) in enumerate(kinds):
                cell, tokens = run_cell(loop, prompts, c, tree and TreeConfig.parse(tree), args.duration, device,
                                        max_new_tokens=args.max_tokens, start=k * share)  # fmt: skip
                cells.append(cell | {"variant": f"{name} {label}", "concurrency": c})
                outputs.setdefault(f"{label} c={c}", {}).update(tokens)
                print(f"{name} {label:8s} c={c:<3d} {cell['tokens_per_s']:8.1f} tok/s  {cell['steps_per_s']:6.1f} "
                      f"steps/s", flush=True)  # fmt: skip
            return cells, outputs
        finally:
            group.shutdown()
    finally:
        ray.shutdown()
        os.environ.clear()
        os.environ.update(saved)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--concurrency", default="1,8")
    p.add_argument("--duration", type=float, default=15.0, help="seconds per cell")
    p.add_argument("--prompts", type=int, default=1600)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of {','.join(VARIANTS)}")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    args.variants = [v for v in args.variants.split(",") if v]
    if unknown := set(args.variants) - set(VARIANTS):
        p.error(f"unknown variants {sorted(unknown)}; choose from {','.join(VARIANTS)}")
    if REFERENCE not in args.variants:
        p.error(f"the variants must include {REFERENCE}, the reference of the ratios and greedy tokens")
    texts = select_prompts(args.prompts, seed=18)
    results: dict[str, Any] = {"tp": args.tp, "device": args.device, "dtype": args.dtype, "cells": []}
    outputs = {}
    for name in args.variants:
        cells, outputs[name] = run_variant(name, args, texts)
        results["cells"] += cells
    table = {(c["variant"], c["concurrency"]): c["tokens_per_s"] for c in results["cells"]}
    for name, c, label in itertools.product(args.variants, args.concurrency, ("drafting", "none")):
        if name == REFERENCE:
            continue
        key, ours, ref = f"{name} {label} c={c}", table[f"{name} {label}", c], table[f"{REFERENCE} {label}", c]
        mine, theirs = outputs[name][f"{label} c={c}"], outputs[REFERENCE][f"{label} c={c}"]
        shared = sorted(set(mine) & set(theirs))
        differ = sum(mine[i] != theirs[i] for i in shared)
        results.setdefault("ratios", {})[key] = ours / ref
        results.setdefault("greedy", {})[key] = {"compared": len(shared), "differ": differ}
        print(f"c={c} {label}: {name} / {REFERENCE} {ours / ref:.2f}x ({ours:.1f} / {ref:.1f} tok/s); greedy tokens "
              f"differ on {differ} of {len(shared)} prompts")  # fmt: skip
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    main()
