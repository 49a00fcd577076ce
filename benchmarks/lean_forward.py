"""Verify forwards of the target through HF's forward, the lean loop (models/target/lean_forward.py) with torch ops, and
the lean loop with its decoder layers in one native call (models/native/decoder.py), side by side.

The targets share one model (the same weights, GEMM plan and attention), so the only difference is the forward's
own code; calls alternate, and each cell is the median of `--repeats` verifies at that context. Also checks the
logits: the lean loop's torch ops against HF's (bit for bit where both take the same products), the native layers
against the torch ops (the largest difference, and whether every row's greedy token is the same).
Run from the repository root: python -m benchmarks.lean_forward [--target PATH] [--repeats 40]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from ray_specdec.config import TreeConfig
from ray_specdec.defaults import DEFAULT_TARGET
from ray_specdec.models.target.model import TargetModel
from ray_specdec.speculation.drafting import tree_for

CONTEXTS = (200, 1000, 3000)
TREES = {"plain step": "", "chain 1,1,1": "1,1,1", "tree 2,2,1,1+L8": "2,2,1,1+L8"}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default=str(DEFAULT_TARGET))
    p.add_argument("--repeats", type=int, default=40)
    args = p.parse_args()

    native = TargetModel.from_pretrained(args.target, lean=True)
    lean = TargetModel(native.model, native.tokenizer, lean=True)
    lean._lean.native_decoder = None
    hf = TargetModel(native.model, native.tokenizer, lean=False)
    if native._lean.native_decoder is None:
        print(f"(no native decoder layers: {native._lean.native_decoder_why})")
    threads = torch.get_num_threads()
    print(f"ms per verify, {Path(args.target).name}, {threads} threads (median of {args.repeats}, interleaved)")
    print("| context | verify | HF forward | lean | lean / HF | logits equal | native layers | native / lean "
          "| max abs diff | greedy same |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    g = torch.Generator().manual_seed(0)
    for context in CONTEXTS:
        prompt = torch.randint(1, lean.vocab_size, (context,), generator=g)
        caches = {t: t.new_cache() for t in (lean, hf, native)}
        for target, cache in caches.items():
            target.prefill(cache, prompt)
        for name, spec in TREES.items():
            tree = tree_for(TreeConfig.parse(spec)) if spec else tree_for(TreeConfig(()))
            tokens = torch.randint(1, lean.vocab_size, (tree.num_nodes,), generator=g)
            times: dict[TargetModel, list[float]] = {t: [] for t in caches}
            logits = {}
            for _ in range(args.repeats + 3):
                for target, cache in caches.items():
                    start = time.perf_counter()
                    logits[target] = target.verify(cache, 5, tree, tokens)
                    times[target].append(time.perf_counter() - start)
                    target.commit(cache, [])
            base, fast, fused = (1e3 * statistics.median(times[t][3:]) for t in (hf, lean, native))
            equal = "yes" if torch.equal(logits[lean], logits[hf]) else "NO"
            diff = float((logits[native] - logits[lean]).abs().max())
            greedy = "yes" if torch.equal(logits[native].argmax(-1), logits[lean].argmax(-1)) else "NO"
            rows = f"{name} ({1 + tree.num_nodes} rows)"
            print(f"| {context} | {rows} | {base:.2f} | {fast:.2f} | {fast / base:.2f} | {equal} | {fused:.2f} "
                  f"| {fused / fast:.2f} | {diff:.1e} | {greedy} |")


if __name__ == "__main__":
    main()
