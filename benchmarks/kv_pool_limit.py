"""The GPU's KV pool (`models/target/kv_pool.py`) under a device memory limit, as requests decode with their grants
growing (`kv_grow`): how often a request is refused a range (it then falls back to a cache of its own, or fails to
grow), how often the pool packs, and how many rows its packs and moves copy. No model and no timing: the pool's
bookkeeping and copies only, on the CPU, in one-row float32 layers.

A closed loop keeps `--concurrency` requests in flight for `--steps` steps. A request's prompt is 1-2,000 tokens and
it generates 16-1,000 (uniform); it is granted twice its prompt and first round at admission and doubled as it
decodes (1-5 tokens a step, a round of up to 16 rows), as kv_manager.PrefillPlan grants. As the scheduler keeps the
grants within its KV budget, a request is admitted, or grown, only where the grants then stay within `--limit` rows
(else it waits); the pool may not grow past `--limit` rows (the device raises OutOfMemoryError past it). A refusal is
therefore the pool's fragmentation or its growth policy, never the load.

Run from the repository root: python -m benchmarks.kv_pool_limit [--limit 60000] [--seeds 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import torch

from ray_specdec.models.target.kv_pool import KVPool

ROUND = 16  # verify rows a decoding request's next round may add


def run(seed: int, limit: int, concurrency: int, steps: int) -> dict[str, int]:
    rnd = random.Random(seed)
    pool = KVPool(layers=1, kv_heads=1, key_dim=1, value_dim=1, dtype=torch.float32, device="cpu")
    grow, copied = pool._grow, {"rows": 0}

    def grow_within(rows: int) -> None:
        if rows > limit:
            raise torch.OutOfMemoryError(f"{rows} rows past the device's {limit}")
        copied["rows"] += pool.rows
        grow(rows)

    pool._grow = grow_within
    live: dict[int, list] = {}  # id -> [cache, length, end]
    refused = waits = admitted = resizes = 0
    for step in range(steps):
        held = sum(c.fixed_capacity for c, _, _ in live.values())
        while len(live) < concurrency:
            prompt, generated = rnd.randint(1, 2000), rnd.randint(16, 1000)
            grant = min(2 * (prompt + ROUND), prompt + generated + ROUND)
            if held + grant > limit:
                break
            cache = pool.new_cache(grant)
            if cache is None:
                refused += 1
                break
            cache.layers[0].length = prompt
            live[step * concurrency + len(live)] = [cache, prompt, prompt + generated]
            admitted, held = admitted + 1, held + grant
        for key in list(live):
            cache, length, end = live[key]
            length += rnd.randint(1, 5)
            if length >= end:
                pool.free(cache)
                held -= cache.fixed_capacity
                del live[key]
                continue
            if length + ROUND > cache.fixed_capacity:
                grant = min(2 * (length + ROUND), end + ROUND)
                if held - cache.fixed_capacity + grant > limit:
                    waits += 1
                    continue
                before = cache.fixed_capacity
                try:
                    pool.resize(cache, grant)
                except torch.OutOfMemoryError:
                    refused += 1
                    continue
                held += grant - before
                resizes += 1
            cache.layers[0].length = length
            live[key][1] = length
    return {"seed": seed, "admitted": admitted, "resizes": resizes, "refused": refused, "waits": waits,
            "packs": getattr(pool, "packs", 0), "rows_moved": getattr(pool, "moved_rows", None),
            "pool_rows": pool.rows, "rows_copied_by_growth": copied["rows"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--limit", type=int, default=60_000, help="rows the device holds (and the KV budget)")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    rows = [run(seed, args.limit, args.concurrency, args.steps) for seed in range(args.seeds)]
    print(f"limit {args.limit} rows, {args.concurrency} requests in flight, {args.steps} steps")
    print("| seed | admitted | grants grown | refused | waits for KV | packs | rows moved (packs, moves) | pool rows | "
          "rows copied by growth |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['seed']} | {r['admitted']} | {r['resizes']} | {r['refused']} | {r['waits']} | {r['packs']} | "
              f"{r['rows_moved']} | {r['pool_rows']} | {r['rows_copied_by_growth']} |")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "runs": rows}, indent=1))


if __name__ == "__main__":
    main()
