"""An SSM target's commit: keeping the verify's per-row states against replaying the accepted tokens, and its state's
size against the context.

For each tree (none, a chain, two trees) one request verifies its rows over a cached context and commits its deepest
path, either by copying that row's kept state into its slot (what `SSMTargetModel.commit` does) or by dropping the
verify and prefilling the accepted tokens again from the state before it (activation replay). Each cell is the best of
`--repeats` (the state is restored between them, so every call sees the same context). Then the request's state bytes
and the state pool's bytes after prefills of growing contexts.

Run from the repository root (a random Mamba of the given shape; nothing is downloaded):
    python -m benchmarks.ssm_commit [--layers 8] [--hidden 768] [--threads 2] [--contexts 1024 4096 8192]
"""

from __future__ import annotations

import argparse
import time

import torch
from transformers import MambaConfig, MambaForCausalLM

from ray_specdec.config import TreeConfig
from ray_specdec.models.target.ssm import SSMTargetModel
from ray_specdec.speculation.tree import build_tree

TREES = ((), (1, 1, 1, 1), (3, 2, 1), (2, 2, 2, 1))


def best(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--contexts", type=int, nargs="*", default=[1024, 4096, 8192])
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    config = MambaConfig(vocab_size=4096, hidden_size=args.hidden, num_hidden_layers=args.layers, state_size=16,
                         expand=2, conv_kernel=4)  # fmt: skip
    target = SSMTargetModel(MambaForCausalLM(config).eval())
    cache = target.new_cache()
    target.prefill(cache, torch.randint(4, 4096, (args.context,)))
    snapshot = target.save_chunk(cache, 0, cache.committed)

    def restore():
        cache.committed = 0
        target.load_chunk(cache, snapshot)

    plain = None
    for branching in TREES:
        tree = build_tree(TreeConfig(branching).index_paths())
        tokens = torch.randint(4, 4096, (tree.num_nodes,))
        path = list(tree.leaf_paths[-1])
        rows = torch.cat([torch.tensor([5]), tokens])

        def keep():
            target.verify(cache, 5, tree, tokens)
            target.commit(cache, path)
            restore()

        def replay():
            target.verify(cache, 5, tree, tokens)
            target.commit(cache, [])
            target.prefill(cache, rows[path])
            restore()

        kept, replayed = best(keep, args.repeats), best(replay, args.repeats)
        plain = plain or kept
        name = ",".join(map(str, branching)) or "none"
        print(f"{name:>8}: {tree.num_nodes + 1:2d} rows: keep {kept * 1e3:6.1f} ms ({kept / plain:.2f}x a plain step), "
              f"replay of {len(path)} tokens {replayed * 1e3:6.1f} ms")
    for context in args.contexts:
        c = target.new_cache()
        target.prefill(c, torch.randint(4, 4096, (context,)))
        pool = target._pool
        print(f"context {context}: state {target.state_bytes} bytes a request, pool "
              f"{pool.conv.numel() * pool.conv.dtype.itemsize + pool.ssm.numel() * pool.ssm.dtype.itemsize} bytes")
        target.release(c)


if __name__ == "__main__":
    main()
