"""An SSM target's commit: where the accepted node's state comes from, and the state's size against the context.

Three ways to the accepted node's SSM state after a verify:
- keep: the verify's scan writes every row's state, the commit copies the accepted row's;
- scan replay (what `SSMTargetModel.commit` does): the verify keeps every row's scan inputs (dt, x, B, C) and writes
  no row's state, the commit runs the scan again along the accepted path (at most depth + 1 rows) from the state
  before the verify (Snakes and Ladders' activation replay);
- forward replay: the commit drops the verify and prefills the accepted tokens again, a second forward (its cells
  restore the states once more: the verify advanced them to its roots).

First one layer's scan at a Mamba layer's shapes (d_inner 2 x hidden, 16 state elements) and a Mamba2 layer's (heads
of 64 channels, 128 state elements): a step of 1 and of --requests verifies of a --tree tree, keeping every row's
state, or none and then replaying the deepest path. Then a random --kind target: a step of --requests verifies of
each tree (none, a chain, two trees) committing the deepest path with scan replay, or forward replay. Each cell is the
best of --repeats (the states are restored between them). Then a request's state bytes and the pool's after prefills
of growing contexts.

Run from the repository root (random weights; nothing is downloaded):
    python -m benchmarks.ssm_commit [--kind mamba|mamba2] [--layers 8] [--hidden 768] [--threads 1] [--requests 8]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from transformers import Mamba2Config, Mamba2ForCausalLM, MambaConfig, MambaForCausalLM

from ray_specdec.config import TreeConfig
from ray_specdec.models.native import ssm_scan as native_ssm_scan
from ray_specdec.models.target.forward_layout import Segment
from ray_specdec.models.target.ssm import SSMTargetModel
from ray_specdec.models.target.ssm_scan import RowTrees
from ray_specdec.speculation.tree import build_tree

TREES = ((), (1, 1, 1, 1), (3, 2, 1), (2, 2, 2, 1))


def best(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def layer_cells(tree_config: tuple[int, ...], requests: int, repeats: int) -> None:
    """One layer's native scan of a step's verifies: every row's state kept, against none kept plus the deepest
    path's replay (ms)."""
    tree = build_tree(TreeConfig(tree_config).index_paths())
    n_rows = tree.parents.numel()
    path = list(tree.leaf_paths[-1])
    g = torch.Generator().manual_seed(0)
    for name, d_inner, n, head_dim in (("mamba", 1536, 16, None), ("mamba2", 1536, 128, 64)):
        for count in sorted({1, requests}):
            layout = RowTrees.build([tree.parents] * count, d_conv=4)
            rows = layout.rows
            dt = F.softplus(torch.randn(rows, d_inner, generator=g) - 2)
            x = torch.randn(rows, d_inner, generator=g)
            if head_dim is None:  # A per channel and state element, B / C shared by every channel
                A = -torch.rand(d_inner, n, generator=g) * 4
                B, C = torch.randn(rows, n, generator=g), torch.randn(rows, n, generator=g)
            else:  # A one value per head, B / C of one group
                A = -torch.rand(d_inner // head_dim, generator=g).repeat_interleave(head_dim) * 4
                B, C = torch.randn(rows, 1, n, generator=g), torch.randn(rows, 1, n, generator=g)
            start = torch.randn(count, d_inner, n, generator=g)
            every, nothing = torch.arange(rows), torch.empty(0, dtype=torch.long)
            out = torch.empty(rows, d_inner, n)
            chain = RowTrees.build([torch.arange(-1, len(path) - 1)] * count, d_conv=4)
            on_path = torch.cat([torch.tensor(path) + r * n_rows for r in range(count)])
            ends = torch.tensor(chain.starts[1:]) - 1

            def replay():
                native_ssm_scan.tree_scan(dt, x, B, C, A, start, layout, nothing)
                native_ssm_scan.tree_scan(dt[on_path], x[on_path], B[on_path], C[on_path], A, start, chain, ends)

            kept = best(lambda: native_ssm_scan.tree_scan(dt, x, B, C, A, start, layout, every, out), repeats)
            replayed = best(replay, repeats)
            print(f"  {name:6} {count} verifies, {rows:3d} rows: keep every state {kept * 1e3:7.2f} ms, scan and "
                  f"replay of {len(path)} rows {replayed * 1e3:7.2f} ms ({kept / replayed:4.1f}x)")


def make_target(kind: str, layers: int, hidden: int) -> SSMTargetModel:
    if kind == "mamba":
        config = MambaConfig(vocab_size=4096, hidden_size=hidden, num_hidden_layers=layers, state_size=16, expand=2,
                             conv_kernel=4)  # fmt: skip
        return SSMTargetModel(MambaForCausalLM(config).eval())
    config = Mamba2Config(vocab_size=4096, hidden_size=hidden, num_hidden_layers=layers, num_heads=2 * hidden // 64,
                          head_dim=64, n_groups=1, state_size=128, expand=2, conv_kernel=4)  # fmt: skip
    return SSMTargetModel(Mamba2ForCausalLM(config).eval())


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kind", choices=["mamba", "mamba2"], default="mamba")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--tree", type=int, nargs="*", default=[2, 2, 2, 1])  # the layer cells' tree
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--contexts", type=int, nargs="*", default=[1024, 4096, 8192])
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    print(f"threads {args.threads}: one layer's scan")
    layer_cells(tuple(args.tree), args.requests, args.repeats)
    target = make_target(args.kind, args.layers, args.hidden)
    print(f"{args.layers} x {args.hidden} {args.kind} target, native scan: {target.native_scan_why or 'yes'}")
    caches = [target.new_cache() for _ in range(args.requests)]
    for cache in caches:
        target.prefill(cache, torch.randint(4, 4096, (args.context,)))
    snapshots = [target.save_chunk(cache, 0, cache.committed) for cache in caches]

    def restore():
        for cache, snapshot in zip(caches, snapshots):
            cache.committed = 0
            target.load_chunk(cache, snapshot)

    for branching in TREES:
        tree = build_tree(TreeConfig(branching).index_paths())
        tokens = torch.randint(4, 4096, (tree.num_nodes + 1,))
        path = list(tree.leaf_paths[-1])

        def verify():
            target.forward_batch([Segment(cache, tokens, tree) for cache in caches])

        def scan_replay():
            verify()
            target.commit_many([(cache, path) for cache in caches])
            restore()

        def forward_replay():  # (the verify advanced the slots to its roots: restored, its rows dropped)
            verify()
            for cache in caches:
                cache.pending = None
            restore()
            target.forward_batch([Segment(cache, tokens[path]) for cache in caches])
            restore()

        by_scan, by_forward = best(scan_replay, args.repeats), best(forward_replay, args.repeats)
        name = ",".join(map(str, branching)) or "none"
        print(f"  {name:>8}: {args.requests} x {tree.num_nodes + 1:2d} rows: scan replay {by_scan * 1e3:7.1f} ms, "
              f"forward replay of {len(path)} tokens {by_forward * 1e3:7.1f} ms")
    for cache in caches:
        target.release(cache)
    for context in args.contexts:
        c = target.new_cache()
        target.prefill(c, torch.randint(4, 4096, (context,)))
        pool = target._pool
        print(f"context {context}: state {target.state_bytes} bytes a request, pool "
              f"{pool.conv.numel() * pool.conv.dtype.itemsize + pool.ssm.numel() * pool.ssm.dtype.itemsize} bytes")
        target.release(c)


if __name__ == "__main__":
    main()
