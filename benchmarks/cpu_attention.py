"""The target's verify forward with the native CPU attention against sdpa, interleaved in one run.

Two copies of the target (both on the planned GEMM paths), one switched to the native attention, each with its cache
prefilled to the same context; then verifies of 1 + n chain rows, alternating between the two in random order, and
the median ms of each with their ratio. Rows below attention.MIN_ROWS run sdpa in both (a control for noise).

Run from the repository root: python -m benchmarks.cpu_attention [--target PATH] [--contexts 200,1000,3000]
    [--rows 1,3,5,8,12,16,25] [--repeats 30]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from ray_specdec.defaults import DEFAULT_TARGET
from ray_specdec.models.native import attention
from ray_specdec.models.target.model import TargetModel
from ray_specdec.speculation.tree import build_tree


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default=str(DEFAULT_TARGET))
    parser.add_argument("--contexts", default="200,1000,3000", help="tokens in the cache, comma-separated")
    parser.add_argument("--rows", default="1,3,5,8,12,16,25", help="verify rows (root + chain), comma-separated")
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args(argv)
    targets = {
        "sdpa": TargetModel.from_pretrained(args.target, native_attention=False),
        "native": TargetModel.from_pretrained(args.target, native_attention=True),
    }
    print(f"torch threads: {torch.get_num_threads()}; native from {attention.MIN_ROWS} to "
          f"{attention.MAX_ROWS} rows\n")  # fmt: skip
    print("| context | rows | sdpa (ms) | native (ms) | sdpa / native |")
    print("| --- | --- | --- | --- | --- |")
    gen = torch.Generator().manual_seed(0)
    for context in (int(c) for c in args.contexts.split(",")):
        prompt = torch.randint(0, targets["sdpa"].vocab_size, (context,), generator=gen)
        caches = {}
        for name, target in targets.items():
            caches[name] = target.new_cache()
            target.prefill(caches[name], prompt)
        for rows in (int(r) for r in args.rows.split(",")):
            tree = build_tree([(0,) * depth for depth in range(1, rows)])
            draft = torch.randint(0, targets["sdpa"].vocab_size, (rows - 1,), generator=gen)
            times = {name: [] for name in targets}
            for _ in range(args.repeats + 3):
                for name in random.sample(list(targets), len(targets)):
                    start = time.perf_counter()
                    targets[name].verify(caches[name], int(prompt[-1]), tree, draft)
                    times[name].append(time.perf_counter() - start)
                    targets[name].commit(caches[name], [0])  # the cache is back at `context + rounds` tokens
            ms = {name: 1e3 * statistics.median(t[3:]) for name, t in times.items()}
            print(f"| {context} | {rows} | {ms['sdpa']:.2f} | {ms['native']:.2f} | {ms['sdpa'] / ms['native']:.2f}x |",
                  flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
