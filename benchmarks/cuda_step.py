"""The GPU pieces of a round, timed side by side on one CUDA device: drafter step (eager vs CUDA graph), state copy
(Triton kernel vs torch), target verify + commit (rows x context), with the shipped default models.

Every number is the median over repeats of a timed loop (synchronized before and after), so launch costs count as a
request sees them. State-copy bandwidth counts bytes read plus bytes written, against a large device-to-device copy
measured in the same run. Run: python -m benchmarks.cuda_step [--dtype bfloat16] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from kernels.state_copy import _launch, state_copy
from ray_specdec.config import TreeConfig
from ray_specdec.defaults import DEFAULT_DRAFTER, DEFAULT_TARGET
from ray_specdec.models.drafter.mamba import MambaDrafter
from ray_specdec.models.target.model import TargetModel
from ray_specdec.speculation.drafting import tree_for


def timed(fn: Callable[[], object], iters: int, repeats: int = 7) -> float:
    """Median seconds per call of fn over `repeats` loops of `iters` calls."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
        samples.append((time.perf_counter() - t0) / iters)
    return statistics.median(samples)


def copy_bandwidth() -> float:
    """Bytes per second of a 2 GiB device-to-device copy (read + write)."""
    src = torch.empty(1 << 29, dtype=torch.float32, device="cuda").normal_()
    dst = torch.empty_like(src)
    return 2 * src.numel() * 4 / timed(lambda: dst.copy_(src), iters=10, repeats=5)


def drafter_steps(drafter_path: str, dtype: torch.dtype) -> list[dict]:
    eager = MambaDrafter.from_pretrained(drafter_path, dtype=dtype, device="cuda", cuda_graphs=False)
    graphed = MambaDrafter.from_pretrained(drafter_path, dtype=dtype, device="cuda")
    rows_out = []
    for rows in (1, 3, 12, 64):
        tokens = torch.randint(0, eager.vocab_size, (rows,), device="cuda")
        state_e, state_g = eager.new_state(rows), graphed.new_state(rows)
        t_eager = timed(lambda: eager.step(state_e, tokens), iters=50)
        t_graph = timed(lambda: graphed.step(state_g, tokens), iters=50)
        rows_out.append({"rows": rows, "eager_ms": t_eager * 1e3, "graph_ms": t_graph * 1e3,
                         "speedup": t_eager / t_graph})
    return rows_out


def state_copies(bandwidth: float) -> list[dict]:
    # (label, layers, d_inner, d_conv, d_state, dtype): the shipped drafter, mamba-130m and mamba-2.8b sized states
    shapes = [("shipped 4x512", 4, 512, 4, 16, torch.float32), ("130m 24x1536", 24, 1536, 4, 16, torch.float32),
              ("2.8b 64x5120", 64, 5120, 4, 16, torch.float32)]
    out = []
    for label, layers, d_inner, d_conv, d_state, dtype in shapes:
        for rows_src, rows in ((1, 1), (4, 12), (16, 64)):
            src_conv = torch.randn(layers, rows_src, d_inner, d_conv, dtype=dtype, device="cuda")
            src_ssm = torch.randn(layers, rows_src, d_inner, d_state, dtype=dtype, device="cuda")
            index = torch.randint(0, rows_src, (rows,), device="cuda")
            dst_conv = torch.empty(layers, rows, d_inner, d_conv, dtype=dtype, device="cuda")
            dst_ssm = torch.empty(layers, rows, d_inner, d_state, dtype=dtype, device="cuda")

            def torch_copy():
                torch.index_select(src_conv, 1, index, out=dst_conv)
                torch.index_select(src_ssm, 1, index, out=dst_ssm)

            def per_layer():
                for layer in range(layers):
                    torch.index_select(src_conv[layer], 0, index, out=dst_conv[layer])
                    torch.index_select(src_ssm[layer], 0, index, out=dst_ssm[layer])

            t_kernel = timed(lambda: state_copy(src_conv, src_ssm, index, dst_conv, dst_ssm), iters=100)
            t_checked = timed(lambda: state_copy(src_conv, src_ssm, index, dst_conv, dst_ssm, index_checked=True),
                              iters=100)
            t_launch = timed(lambda: _launch(src_conv, src_ssm, index, dst_conv, dst_ssm), iters=100)
            t_torch = timed(torch_copy, iters=100)
            t_layers = timed(per_layer, iters=20)
            moved = 2 * (dst_conv.numel() + dst_ssm.numel()) * dst_conv.element_size()
            out.append({"state": label, "rows": rows, "bytes": moved, "kernel_us": t_kernel * 1e6,
                        "kernel_checked_us": t_checked * 1e6,
                        "launch_only_us": t_launch * 1e6,
                        "torch_us": t_torch * 1e6, "per_layer_us": t_layers * 1e6,
                        "kernel_share_of_copy_bw": moved / min(t_kernel, t_checked) / bandwidth})
    return out


def verifies(target_path: str, dtype: torch.dtype) -> list[dict]:
    target = TargetModel.from_pretrained(target_path, dtype=dtype, device="cuda")
    out = []
    for context in (200, 2000):
        cache = target.new_cache()
        target.prefill(cache, torch.randint(0, target.vocab_size, (context,), device="cuda"))
        for branching in ((), (1, 1, 1, 1), (3, 2, 2, 1, 1), (2, 2, 2, 1, 1, 1)):
            tree = tree_for(TreeConfig(branching))
            tokens = torch.randint(0, target.vocab_size, (tree.num_nodes,), device="cuda")

            def verify():  # a round's target work: the forward, then keep nothing (the cache length stays put)
                target.verify(cache, 5, tree, tokens)
                target.commit(cache, [])

            t = timed(verify, iters=20)
            out.append({"context": context, "tree": ",".join(map(str, branching)) or "none",
                        "rows": 1 + tree.num_nodes, "verify_ms": t * 1e3})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--target", default=str(DEFAULT_TARGET))
    parser.add_argument("--drafter", default=str(DEFAULT_DRAFTER))
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("error: benchmarks.cuda_step needs a CUDA device")
    dtype = getattr(torch, args.dtype)
    bandwidth = copy_bandwidth()
    report = {"device": torch.cuda.get_device_name(0), "dtype": args.dtype, "copy_bandwidth_GBps": bandwidth / 1e9,
              "drafter_step": drafter_steps(args.drafter, dtype), "state_copy": state_copies(bandwidth),
              "verify": verifies(args.target, dtype)}
    print(f"{report['device']}, {args.dtype}; device-to-device copy {bandwidth / 1e9:.0f} GB/s")
    print("\ndrafter step   rows  eager ms  graph ms  speedup")
    for r in report["drafter_step"]:
        print(f"{'':14} {r['rows']:5} {r['eager_ms']:9.3f} {r['graph_ms']:9.3f} {r['speedup']:7.1f}x")
    print("\nstate copy      state          rows   kernel us  (index pre-checked)  (launch only)  torch us  "
          "per-layer us  kernel GB/s (share of copy)")
    for r in report["state_copy"]:
        best = min(r["kernel_us"], r["kernel_checked_us"])
        print(f"{'':15} {r['state']:14} {r['rows']:4} {r['kernel_us']:11.1f} {r['kernel_checked_us']:20.1f} "
              f"{r['launch_only_us']:14.1f} "
              f"{r['torch_us']:9.1f} {r['per_layer_us']:13.1f}  {r['bytes'] / best / 1e3:8.1f} "
              f"({r['kernel_share_of_copy_bw']:.0%})")
    print("\nverify          context  tree         rows  ms")
    for r in report["verify"]:
        print(f"{'':15} {r['context']:7}  {r['tree']:12} {r['rows']:4}  {r['verify_ms']:.3f}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
