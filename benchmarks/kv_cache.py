"""Verify latency over transformers' DynamicCache (torch.cat per forward) vs GrowableKVCache (in-place writes).

The same random 6-layer x 384 GPTNeoX (vocab 4096, sdpa) verifies trees of n nodes with the cache at several lengths;
both caches are timed interleaved, round by round, so load on a shared machine hits both alike. Prints, for wall
time and for the calling thread's CPU time (with one intra-op thread all of torch's work; far less disturbed by other
processes than wall time on a shared machine), the median ms per verify and the median of the per-round ratios
growable / dynamic; then the one-off prefill wall time of each cache.
Run from the repository root: python -m benchmarks.kv_cache [--threads 1] [--repeats 15]
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Sequence

import torch
from transformers import DynamicCache

from benchmarks.target_verify import build_target, tree_of
from ray_specdec.models.target.kv_cache import TargetCache
from ray_specdec.models.target.model import TargetModel

CACHE_LENGTHS = (128, 1024, 4096, 8192)
TREE_SIZES = (0, 16)
# Room for a verify at the longest cache length (GPTNeoX's default context is 2048).
MAX_POSITIONS = 16384


class CatCache(DynamicCache):
    """The baseline: DynamicCache, whose layers grow by torch.cat, compacted by gather + slice."""

    def compact(self, base: int, keep: Sequence[int]) -> None:
        index = torch.tensor(list(keep), dtype=torch.long) + base
        for layer in self.layers:
            layer.keys[:, :, base : base + len(keep)] = layer.keys.index_select(2, index)
            layer.values[:, :, base : base + len(keep)] = layer.values.index_select(2, index)
            layer.keys, layer.values = layer.keys[:, :, : base + len(keep)], layer.values[:, :, : base + len(keep)]


def filled_cache(target: TargetModel, kind: str, length: int) -> tuple[TargetCache, float]:
    """A cache of `kind` holding `length` random tokens, and the seconds its prefill took."""
    cache = TargetCache(CatCache()) if kind == "dynamic" else target.new_cache()
    start = time.perf_counter()
    target.prefill(cache, torch.randint(0, target.vocab_size, (length,)))
    return cache, time.perf_counter() - start


def time_verify(target: TargetModel, cache: TargetCache, n: int) -> tuple[float, float]:
    """(wall, thread CPU) seconds of one verify of an n-node tree; commit([]) then drops its rows, so the cache
    length is unchanged."""
    tree, tokens = tree_of(n), torch.randint(0, target.vocab_size, (n,))
    wall, cpu = time.perf_counter(), time.thread_time()
    target.verify(cache, 1, tree, tokens)
    elapsed = time.perf_counter() - wall, time.thread_time() - cpu
    target.commit(cache, [])
    return elapsed


def measure(target: TargetModel, length: int, repeats: int) -> dict:
    """Interleaved verify times {(kind, n): [(wall, cpu) seconds]} at one cache length, plus prefill seconds."""
    caches, prefill = {}, {}
    for kind in ("dynamic", "growable"):
        caches[kind], prefill[kind] = filled_cache(target, kind, length)
    times = {(kind, n): [] for kind in caches for n in TREE_SIZES}
    for rep in range(repeats + 2):
        for n in TREE_SIZES:
            for kind in (("dynamic", "growable") if rep % 2 else ("growable", "dynamic")):
                elapsed = time_verify(target, caches[kind], n)
                if rep >= 2:  # warm-up: the growable cache reaches its final capacity here
                    times[kind, n].append(elapsed)
    return {"times": times, "prefill": prefill}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--lengths", type=int, nargs="+", default=list(CACHE_LENGTHS))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    target = build_target("sdpa", torch.float32, 4096, max_positions=MAX_POSITIONS)
    print(f"verify ms (median of {args.repeats}, interleaved), 6x384 GPTNeoX, vocab 4096, float32, sdpa, "
          f"{torch.get_num_threads()} thread(s); ratio = growable / dynamic")
    clocks, cols = ("wall", "cpu"), ("dynamic", "growable", "ratio")
    columns = "".join(f"{clock + ' ' + col:>14}" for clock in clocks for col in cols)
    print(f"{'cache':>6}{'nodes':>6}{columns}{'prefill s dyn/grow':>22}")
    for length in args.lengths:
        result = measure(target, length, args.repeats)
        for n in TREE_SIZES:
            dynamic, growable = result["times"]["dynamic", n], result["times"]["growable", n]
            cells = _cells(dynamic, growable, clock=0) + _cells(dynamic, growable, clock=1)
            prefill = "{dynamic:.2f} / {growable:.2f}".format(**result["prefill"]) if n == TREE_SIZES[0] else ""
            print(f"{length:>6}{n:>6}{cells}{prefill:>22}", flush=True)


def _cells(dynamic: list[tuple[float, float]], growable: list[tuple[float, float]], clock: int) -> str:
    """Median ms of each cache and median per-round ratio, for clock 0 (wall) or 1 (CPU)."""
    dyn, grow = [t[clock] for t in dynamic], [t[clock] for t in growable]
    ratio = statistics.median(g / d for g, d in zip(grow, dyn))
    return f"{1e3 * statistics.median(dyn):>14.2f}{1e3 * statistics.median(grow):>14.2f}{ratio:>14.2f}"


if __name__ == "__main__":
    main()
