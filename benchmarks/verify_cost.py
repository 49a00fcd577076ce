"""What verify rows cost: one target forward against the rows each request verifies and the requests in the batch.

Each cell is one `forward_batch` over `batch` requests, each verifying `rows` rows (the root and a tree of rows - 1
nodes) at ~`context` tokens of cached context; the cell's time is the median over repeats (every verify is dropped
again, so each call sees the same contexts; an SSM target's keeps its root), and its ratio is to one request's one-row
step. Where a decode step is bound by reading the weights (a target far larger than the CPU's caches, or any real
model on a GPU), rows are nearly free until the products turn compute-bound; where the weights sit in cache, every row
costs.

Run from the repository root (any target: attention, SSM or hybrid):
    python -m benchmarks.verify_cost --target target-neox-large [--rows 1 2 4 8 16 32 64] [--batch 1 4 8]
        [--json out.json] [--plot out.png]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from ray_specdec.config import TreeConfig
from ray_specdec.models.target.kinds import load_target_model
from ray_specdec.models.target.model import Segment, TargetModel
from ray_specdec.models.target.ssm import SSMTargetModel
from ray_specdec.speculation.tree import TreeTensors, build_tree


def tree_of(nodes: int) -> TreeTensors:
    """A tree of `nodes` nodes: a BFS prefix of a 4-ary tree (itself a valid tree)."""
    return build_tree(TreeConfig((4, 4, 4, 4)).index_paths()[:nodes])


def segments(target: TargetModel, batch: int, rows: int, context: int, seed: int) -> list[Segment]:
    """`batch` requests with ~context tokens cached, each verifying `rows` rows."""
    g = torch.Generator().manual_seed(seed)
    tree = tree_of(rows - 1)
    out = []
    for _ in range(batch):
        cache = target.new_cache()
        length = max(1, context + int(torch.randint(-8, 9, (1,), generator=g)))
        target.prefill(cache, torch.randint(1, target.vocab_size, (length,), generator=g))
        out.append(Segment(cache, torch.randint(1, target.vocab_size, (rows,), generator=g), tree))
    return out


def time_cell(target: TargetModel, batch: list[Segment], repeats: int) -> float:
    """Median ms of one forward over the batch (after two warm-up forwards)."""
    times = []
    for i in range(repeats + 2):
        start = time.perf_counter()
        target.forward_batch(batch)
        elapsed = time.perf_counter() - start
        for segment in batch:  # an SSM target's verify advanced its state to the root: kept (a token more a
            # repeat, which its cost does not depend on)
            target.commit(segment.cache, [0] if isinstance(target, SSMTargetModel) else [])
        if i >= 2:
            times.append(elapsed)
    return 1e3 * statistics.median(times)


def measure(target: TargetModel, rows: list[int], batches: list[int], context: int, repeats: int) -> dict:
    cells = {}
    for b in batches:
        for r in rows:
            cells[(b, r)] = time_cell(target, segments(target, b, r, context, seed=1000 * b + r), repeats)
            print(f"  batch {b:>3} x {r:>3} rows: {cells[(b, r)]:8.2f} ms", flush=True)
    one = cells[(batches[0], rows[0])]
    return {
        "one_row_ms": one,
        "cells": [{"batch": b, "rows": r, "ms": ms, "ratio": ms / one} for (b, r), ms in cells.items()],
    }


def table(result: dict, rows: list[int], batches: list[int]) -> str:
    """Markdown: ms (and the ratio to one row of one request) per batch and rows per request."""
    by = {(c["batch"], c["rows"]): c for c in result["cells"]}
    head = "| requests \\ rows each | " + " | ".join(str(r) for r in rows) + " |"
    lines = [head, "|" + "---|" * (len(rows) + 1)]
    for b in batches:
        cells = [f"{by[(b, r)]['ms']:.1f} ms ({by[(b, r)]['ratio']:.2f}x)" for r in rows]
        lines.append(f"| {b} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(result: dict, batches: list[int], title: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for b in batches:
        cells = sorted((c["rows"], c["ratio"]) for c in result["cells"] if c["batch"] == b)
        ax.plot([b * r for r, _ in cells], [x for _, x in cells], marker="o", label=f"{b} request(s)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("verify rows in the forward (requests x rows each)")
    ax.set_ylabel("time / one request's one-row step")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="target-neox-large", help="embedded model name, HF id or directory")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--plot", type=Path, default=None)
    args = parser.parse_args()
    if min(args.rows) < 1 or min(args.batch) < 1:
        parser.error("--rows and --batch take counts >= 1")
    torch.set_num_threads(args.threads)
    target = load_target_model(args.target)  # a TargetModel, or an SSMTargetModel (the same calls)
    params = sum(p.numel() for p in target.model.parameters())
    title = (f"{args.target}: {params / 1e6:.1f}M params, {target.dtype}, {torch.get_num_threads()} threads, "
             f"~{args.context} tokens cached")  # fmt: skip
    print(title, flush=True)
    result = measure(target, sorted(args.rows), sorted(args.batch), args.context, args.repeats)
    result.update(target=args.target, parameters=params, threads=torch.get_num_threads(), context=args.context)
    print(table(result, sorted(args.rows), sorted(args.batch)))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1))
    if args.plot:
        args.plot.parent.mkdir(parents=True, exist_ok=True)
        plot(result, sorted(args.batch), title, args.plot)


if __name__ == "__main__":
    main()
