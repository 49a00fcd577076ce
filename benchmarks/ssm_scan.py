"""An SSM target's tree scan and conv per layer, native against torch, and the target's forwards with either.

Per layer, at one Mamba layer's shapes (d_inner 2 x hidden, 16 state elements) and one Mamba2 layer's (heads of 64
channels, 128 state elements, one group): a prefill chunk (a chain of --chunk tokens), one verify of a --tree tree, and
a step of --requests such verifies; each timed with torch's scan (`tree_scan`, then the kept rows' states, as the
target takes them) and the native one (`native/ssm_scan.py`), and so the conv (`tree_conv`; the Mamba layer's only).
Then a random Mamba target's forwards with each path (native_scan): a prefill of the chunk, one verify, a step of
--requests verifies. Each cell is the best of --repeats, at each thread count.

Run from the repository root (random weights; nothing is downloaded):
    python -m benchmarks.ssm_scan [--layers 8] [--hidden 768] [--chunk 512] [--tree 2 2 2 1] [--threads 1 2]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from transformers import MambaConfig, MambaForCausalLM

from ray_specdec.config import TreeConfig
from ray_specdec.models.native import ssm_scan as native_ssm_scan
from benchmarks.ssm_commit import best
from ray_specdec.models.target.forward_layout import Segment
from ray_specdec.models.target.ssm import SSMTargetModel
from ray_specdec.models.target.ssm_scan import RowTrees, tree_conv, tree_scan
from ray_specdec.speculation.tree import build_tree


def layer_cells(name: str, d_inner: int, n: int, head_dim: int | None, shapes: dict, repeats: int) -> None:
    """The scan (and for Mamba the conv) of one layer over each forward shape: torch's and native (ms)."""
    g = torch.Generator().manual_seed(0)
    for shape, (parents, kept_rows) in shapes.items():
        layout = RowTrees.build(parents, d_conv=4)
        rows, segments = layout.rows, layout.segments
        dt = F.softplus(torch.randn(rows, d_inner, generator=g) - 2)
        x = torch.randn(rows, d_inner, generator=g)
        if head_dim is None:  # Mamba: A per channel and state element, B / C shared by every channel
            A = -torch.rand(d_inner, n, generator=g) * 4
            B, C, A_native = torch.randn(rows, n, generator=g), torch.randn(rows, n, generator=g), A
        else:  # Mamba2: A one value per head, B / C of one group
            A_native = -torch.rand(d_inner // head_dim, generator=g).repeat_interleave(head_dim) * 4
            A = A_native[:, None].expand(-1, n).contiguous()
            B, C = torch.randn(rows, 1, n, generator=g), torch.randn(rows, 1, n, generator=g)
        start = torch.randn(segments, d_inner, n, generator=g)
        kept = torch.tensor(kept_rows)
        conv_in = torch.randn(rows, d_inner, generator=g)
        conv_state = torch.randn(segments, 3, d_inner, generator=g)
        weight, bias = torch.randn(d_inner, 4, generator=g), torch.randn(d_inner, generator=g)

        def torch_scan():
            y, states = tree_scan(dt, x, B, C, A, start, layout)
            return y, states.index_select(0, kept)

        torch_ms = best(torch_scan, repeats) * 1e3
        native_ms = best(lambda: native_ssm_scan.tree_scan(dt, x, B, C, A_native, start, layout, kept), repeats) * 1e3
        line = (f"  {name:6} {shape:18} {rows:4d} rows: scan torch {torch_ms:8.3f} ms, native {native_ms:7.3f} ms "
                f"({torch_ms / native_ms:5.1f}x)")
        if head_dim is None:
            history = torch.empty(kept.numel(), 3, d_inner)

            def torch_conv():
                out, inputs = tree_conv(conv_in, conv_state, layout, weight, bias)
                return out, inputs[layout.windows[kept, 1:]]

            conv_ms = best(torch_conv, repeats) * 1e3
            native_conv_ms = best(lambda: native_ssm_scan.tree_conv(conv_in, conv_state, layout, weight, bias, kept,
                                                                    history), repeats) * 1e3  # fmt: skip
            line += f"; conv torch {conv_ms:6.3f} ms, native {native_conv_ms:6.3f} ms"
        print(line)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--chunk", type=int, default=512)
    parser.add_argument("--tree", type=int, nargs="*", default=[2, 2, 2, 1])
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    tree = build_tree(TreeConfig(tuple(args.tree)).index_paths())
    verify_parents = tree.parents  # [root, *nodes]
    n_verify = verify_parents.numel()
    shapes = {  # each forward's segments' parents and the rows it keeps states of
        f"prefill {args.chunk}": ([torch.arange(-1, args.chunk - 1)], [args.chunk - 1]),
        f"verify {n_verify} rows": ([verify_parents], list(range(n_verify))),
        f"{args.requests} verifies": ([verify_parents] * args.requests, list(range(n_verify * args.requests))),
    }
    torch.manual_seed(0)
    config = MambaConfig(vocab_size=4096, hidden_size=args.hidden, num_hidden_layers=args.layers, state_size=16,
                         expand=2, conv_kernel=4)  # fmt: skip
    model = MambaForCausalLM(config).eval()
    targets = {"native": SSMTargetModel(model), "torch": SSMTargetModel(model, native_scan=False)}
    assert targets["native"].native_scan_why is None, targets["native"].native_scan_why
    d_inner = 2 * args.hidden
    for threads in args.threads:
        torch.set_num_threads(threads)
        print(f"threads {threads}: one layer")
        layer_cells("mamba", d_inner, 16, None, shapes, args.repeats)
        layer_cells("mamba2", d_inner, 128, 64, shapes, args.repeats)
        print(f"threads {threads}: {args.layers} x {args.hidden} Mamba target, batch-invariant "
              f"{targets['native'].batch_invariant}")
        cells = {}
        for name, target in targets.items():
            prompt = torch.randint(4, 4096, (args.chunk,))

            def prefill():
                cache = target.new_cache()
                target.prefill(cache, prompt)
                target.release(cache)

            caches = [target.new_cache() for _ in range(args.requests)]
            for cache in caches:
                target.prefill(cache, torch.randint(4, 4096, (args.context,)))
            tokens = torch.randint(4, 4096, (n_verify,))

            def verify(count):
                target.forward_batch([Segment(cache, tokens, tree) for cache in caches[:count]])
                target.commit_many([(cache, []) for cache in caches[:count]])  # keeps nothing: the state is unchanged

            cells[name] = (best(prefill, args.repeats), best(lambda: verify(1), args.repeats),
                           best(lambda: verify(args.requests), args.repeats))
            for cache in caches:
                target.release(cache)
        for i, what in enumerate((f"prefill of {args.chunk}", f"verify of {n_verify} rows",
                                  f"step of {args.requests} verifies")):
            t, n = cells["torch"][i] * 1e3, cells["native"][i] * 1e3
            print(f"  {what:26}: torch {t:8.2f} ms, native conv and scan {n:8.2f} ms ({t / n:4.1f}x)")


if __name__ == "__main__":
    main()
