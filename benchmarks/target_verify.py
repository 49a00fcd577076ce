"""Verify latency of the Transformer target against tree size: one forward over [root, *n tree nodes].

A random 6-layer x 384 GPTNeoX (vocab 4096) with the cache at 128 tokens; prints median ms per verify for each tree
size, one column per attention implementation.
Run from the repository root: python -m benchmarks.target_verify [--dtype float32] [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import AutoModelForCausalLM, GPTNeoXConfig

from ray_specdec.config import TreeConfig
from ray_specdec.models.loading import resolve_dtype
from ray_specdec.models.target.model import TargetModel
from ray_specdec.speculation.tree import build_tree

TREE_SIZES = (0, 8, 16, 32)
ATTENTION = ("sdpa", "eager")


def build_target(attn: str, dtype: torch.dtype, vocab: int, max_positions: int = 2048) -> TargetModel:
    config = GPTNeoXConfig(
        vocab_size=vocab,
        hidden_size=384,
        num_hidden_layers=6,
        num_attention_heads=6,
        intermediate_size=4 * 384,
        max_position_embeddings=max_positions,
        attn_implementation=attn,
    )
    torch.manual_seed(0)
    return TargetModel(AutoModelForCausalLM.from_config(config, dtype=dtype).eval())


def tree_of(n: int):
    # A BFS prefix of a 4-ary tree is itself a valid tree: n=8 -> 4 + 4 nodes, n=32 -> 4 + 16 + 12.
    return build_tree(TreeConfig((4, 4, 4)).index_paths()[:n])


def time_verify(target: TargetModel, n: int, cache_len: int, repeats: int) -> float:
    """Median ms of one verify; commit([]) drops the verify rows so every call sees cache_len tokens."""
    cache = target.new_cache()
    target.prefill(cache, torch.randint(0, target.vocab_size, (cache_len,)))
    tree, tokens = tree_of(n), torch.randint(0, target.vocab_size, (n,))
    times = []
    for i in range(repeats + 3):
        start = time.perf_counter()
        target.verify(cache, 1, tree, tokens)
        elapsed = time.perf_counter() - start
        target.commit(cache, [])
        if i >= 3:  # warm-up
            times.append(elapsed)
    return 1e3 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--cache-len", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtype = resolve_dtype(args.dtype, "cpu")
    targets = {attn: build_target(attn, dtype, args.vocab) for attn in ATTENTION}
    threads = torch.get_num_threads()
    print(f"verify ms, 6x384 GPTNeoX, vocab {args.vocab}, {dtype}, cache {args.cache_len}, {threads} threads")
    print(f"{'nodes':>6}" + "".join(f"{attn:>10}" for attn in ATTENTION))
    for n in TREE_SIZES:
        row = [time_verify(targets[attn], n, args.cache_len, args.repeats) for attn in ATTENTION]
        print(f"{n:>6}" + "".join(f"{ms:>10.2f}" for ms in row))


if __name__ == "__main__":
    main()
