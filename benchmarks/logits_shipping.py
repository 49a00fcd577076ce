"""What it costs a tensor-parallel target's rank 0 to hand a step's sampled verify rows to the loop through Ray.

A greedy request's rows come back as their argmaxes; a sampled one's as logits [rows, V] (the rejection sampler and
the request's random streams live in the loop's process). One actor call per setting returns, side by side in one
run:

- `argmax`: the rows' argmaxes only (what a greedy step ships; the floor);
- `tensor`: the rows as a torch tensor (what rank 0 returned before `target_worker.shipped`: pickled whole);
- `array`: the rows as `shipped` makes them (a NumPy array Ray passes out of band through the object store),
  widened back into a tensor of the caller's own by `widened`.

The actor holds the rows already; the time is the call, the transfer and (for `array`) the caller's copy. Each
setting also checks that `array` and `tensor` hand the caller the same float32 values.

Run from the repository root: python -m benchmarks.logits_shipping [--repeats 10] [--settings 32000:320,...]
[--json out.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import ray
import torch

from ray_specdec.serving.target_worker import shipped, widened

SETTINGS = [(4096, 10), (4096, 320), (32000, 10), (32000, 320), (128256, 10), (128256, 320)]  # (vocabulary, rows)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
WAYS = ("argmax", "tensor", "array")


@ray.remote(num_cpus=0)
class RankZero:
    def __init__(self):
        self.rows: dict[tuple, torch.Tensor] = {}

    def make(self, vocab: int, rows: int, dtype: str) -> None:
        self.rows[vocab, rows, dtype] = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(0)).to(
            DTYPES[dtype])

    def argmax(self, key):
        return self.rows[key].argmax(dim=-1)

    def tensor(self, key):
        return self.rows[key]

    def array(self, key):
        return shipped(self.rows[key])


def fetch(actor, way: str, key) -> torch.Tensor:
    """One call returning the rows `way`, as the caller holds them (logits: a float32 tensor of its own)."""
    out = ray.get(getattr(actor, way).remote(key))
    return widened(out) if way == "array" else out.to(torch.float32) if way == "tensor" else out


def time_call(actor, way: str, key, repeats: int) -> float:
    """Median seconds of `fetch`, after two warm-up calls."""
    times = []
    for i in range(repeats + 2):
        t0 = time.perf_counter()
        out = fetch(actor, way, key)
        float(out[-1, -1] if out.dim() == 2 else out[-1])
        if i >= 2:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def parse_settings(text: str) -> list[tuple[int, int]]:
    """"V:rows,V:rows" -> [(V, rows), ...]"""
    try:
        settings = [tuple(int(x) for x in item.split(":")) for item in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"settings are V:rows pairs, comma-separated, not {text!r}") from None
    if any(len(s) != 2 or min(s) < 1 for s in settings):
        raise argparse.ArgumentTypeError(f"settings are V:rows pairs of positive counts, not {text!r}")
    return settings


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--settings", type=parse_settings, default=SETTINGS, help="V:rows pairs, comma-separated")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        actor = RankZero.remote()
        results = []
        print("| dtype | V | rows | MB (float32) | argmax ms | tensor ms | array ms | tensor / array |")
        print("| --- | --- | --- | --- | --- | --- | --- | --- |")
        for dtype in DTYPES:
            for vocab, rows in args.settings:
                key = (vocab, rows, dtype)
                ray.get(actor.make.remote(*key))
                same = torch.equal(fetch(actor, "array", key), fetch(actor, "tensor", key))
                if not same:
                    raise AssertionError(f"{dtype} rows of V={vocab} differ after shipping as an array")
                ms = {way: 1e3 * time_call(actor, way, key, args.repeats) for way in WAYS}
                results.append({"dtype": dtype, "vocab": vocab, "rows": rows, "same": same,
                                **{f"{w}_ms": ms[w] for w in WAYS}})  # fmt: skip
                print(f"| {dtype} | {vocab:,} | {rows} | {rows * vocab * 4 / 1e6:.1f} | {ms['argmax']:.1f} | "
                      f"{ms['tensor']:.1f} | {ms['array']:.1f} | {ms['tensor'] / ms['array']:.1f}x |", flush=True)
    finally:
        ray.shutdown()
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"results": results, "repeats": args.repeats, "torch": torch.__version__,
                                         "ray": ray.__version__, "machine": platform.machine(),
                                         "cpus": torch.get_num_threads()}, indent=1))  # fmt: skip
    return {"results": results}


if __name__ == "__main__":
    main()
