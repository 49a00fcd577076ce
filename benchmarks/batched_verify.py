"""One batched verify forward over N requests against N one-request forwards, on the shipped target.

N requests, each with a 5-row verify (root + a 4-node tree (2, 1)) at ~200 tokens of context: the time of one
`forward_batch` over all N segments against N separate one-segment forwards, interleaved (so that a burst of other
work on a shared machine spoils both alike), medians; every verify is dropped again (commit of no rows) so every
call sees the same contexts.
Run from the repository root: python -m benchmarks.batched_verify [--requests 1 8 32] [--repeats 10] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from ray_specdec.config import TreeConfig
from ray_specdec.defaults import DEFAULT_TARGET
from ray_specdec.models.target.model import Segment, TargetModel
from ray_specdec.speculation.tree import build_tree

TREE = (2, 1)  # 4 nodes: 5 verify rows per request


def requests(target: TargetModel, n: int, context: int) -> list[Segment]:
    """n requests with `context` +- 8 tokens cached, each with one verify segment."""
    tree = build_tree(TreeConfig(TREE).index_paths())
    g = torch.Generator().manual_seed(n)
    segments = []
    for _ in range(n):
        cache = target.new_cache()
        target.prefill(cache, torch.randint(1, target.vocab_size, (context + int(torch.randint(-8, 9, (1,))),),
                                            generator=g))  # fmt: skip
        segments.append(Segment(cache, torch.randint(1, target.vocab_size, (1 + tree.num_nodes,), generator=g), tree))
    return segments


def timed(target: TargetModel, batches: list[list[Segment]]) -> float:
    """Seconds to run the batches one after the other (each verify dropped again afterwards)."""
    start = time.perf_counter()
    for batch in batches:
        target.forward_batch(batch)
        for segment in batch:
            target.commit(segment.cache, [])
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--context", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    target = TargetModel.from_pretrained(str(DEFAULT_TARGET))
    print(f"shipped target, {len(build_tree(TreeConfig(TREE).index_paths()).paths) + 1}-row verifies at ~"
          f"{args.context} tokens, {torch.get_num_threads()} threads, batch-invariant: {target.batch_invariant}; "
          f"median ms over {args.repeats}")
    print(f"{'requests':>8} {'batched':>9} {'separate':>9} {'speedup':>8} {'batched/req':>12}")
    for n in args.requests:
        segments = requests(target, n, args.context)
        ways = {"batched": [segments], "separate": [[s] for s in segments]}
        times: dict[str, list[float]] = {way: [] for way in ways}
        for i in range(args.repeats + 1):  # the first round warms up
            for way, batches in ways.items():
                seconds = timed(target, batches)
                if i:
                    times[way].append(seconds)
        batched, separate = (1e3 * statistics.median(times[way]) for way in ways)
        print(f"{n:>8} {batched:>9.2f} {separate:>9.2f} {separate / batched:>7.2f}x {batched / n:>12.2f}")


if __name__ == "__main__":
    main()
