"""KV granted as requests decode against KV reserved whole at admission (`SchedulerConfig.kv_grow`), in process.

The load is chat's without max_tokens: each request may generate up to the rest of the target's context (8,192 rows with
the shipped target), so it reserves ~8k KV rows, yet it stops at the first line break after 64 tokens (`min_tokens` 64,
every token whose text holds a line break a stop token), as most chat answers end long before the context does. A closed
loop keeps `--concurrency` requests in the scheduler (a finished one is replaced at once) for `--duration` seconds,
greedy, held-out code prompts of 32-512 tokens, the app's policy (the bandit's arms, the controller, lookup), the
app's KV budget (`--kv-budget-gib`, 2 by default). Cells alternate between the two settings, each on an engine of
its own (so that no engine's prefix cache holds another's prompts), every cell on fresh prompts; both engines see the
same prompts in the same order, and the greedy tokens of every request both finished are compared.

`--max-tokens N` sends serve_peers' load instead (max_tokens N, no stop before it): where reservations never fill
the budget, what the grants cost.

Run from the repository root: python -m benchmarks.kv_grow [--concurrency 32] [--duration 20] [--repeats 2]
[--max-tokens N] [--json results.json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time
from pathlib import Path
from typing import Any

from benchmarks.serve_peers import select_prompts
from ray_specdec.config import SamplingParams
from ray_specdec.engine.kv_sizing import kv_budget_rows
from ray_specdec.engine.config import EngineConfig
from ray_specdec.engine.llm import SpeculativeEngine
from ray_specdec.factory import load_drafter, load_target
from ray_specdec.speculation.bandit import Bandit

MIN_TOKENS = 64
WARM_UP = 4


def run_cell(engine: SpeculativeEngine, prompts: list[list[int]], params: list[SamplingParams], concurrency: int,
             duration: float) -> tuple[dict[str, Any], dict[int, list[int]]]:
    """Closed loop over prompts (in order; one params each) -> the cell's numbers and each finished request's tokens
    by prompt index."""
    scheduler = engine.scheduler
    order, running, finished = itertools.count(), {}, {}
    samples = {"running": [], "waiting": [], "kv_used": []}
    added, ttft = {}, []  # request -> when it was added; seconds to each request's first tokens (its queueing in)
    waits = produced = steps = 0

    def add() -> None:
        index = next(order)
        if index >= len(prompts):
            raise RuntimeError(f"the cell ran past its {len(prompts)} prompts: give more (--prompts)")
        running[f"k{index}"] = (index, [])
        added[f"k{index}"] = time.perf_counter()
        scheduler.add(f"k{index}", prompts[index], params[index])

    for _ in range(concurrency):
        add()
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < duration:
        for out in scheduler.step():
            index, ids = running[out.request_id]
            if not ids and out.chunk.token_ids:
                ttft.append(time.perf_counter() - added[out.request_id])
            ids += out.chunk.token_ids
            produced += len(out.chunk.token_ids)
            if out.chunk.finish_reason is not None:
                finished[index] = ids
                del running[out.request_id]
                add()
        steps += 1
        waits += scheduler.kv_waits
        samples["running"].append(scheduler.num_running)
        samples["waiting"].append(scheduler.num_waiting)
        samples["kv_used"].append(scheduler.reserved / scheduler.config.kv_budget_tokens)
    elapsed = time.perf_counter() - t0
    for key in running:
        scheduler.abort(key)
    while scheduler.has_work:
        scheduler.step()
    lengths = [len(t) for t in finished.values()]
    return {"tokens_per_s": produced / elapsed, "steps": steps, "finished": len(finished),
            "mean_running": statistics.fmean(samples["running"]), "mean_waiting": statistics.fmean(samples["waiting"]),
            "mean_kv_used": statistics.fmean(samples["kv_used"]), "kv_waits": waits,
            "mean_new_tokens": statistics.fmean(lengths) if lengths else 0.0, "seconds": elapsed,
            "ttft_p50_s": percentile(ttft, 50), "ttft_p95_s": percentile(ttft, 95)}, finished


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--duration", type=float, default=20.0, help="seconds per cell")
    p.add_argument("--repeats", type=int, default=2, help="cells per setting, alternated")
    p.add_argument("--prompts", type=int, default=400, help="prompts per pair of cells (each cell sends at most these)")
    p.add_argument("--kv-budget-gib", type=float, default=2.0, help="the KV budget (the app's default: 2)")
    p.add_argument("--max-tokens", type=int, default=None,
                   help="requests with this max_tokens and no stop before it (default: chat's, the rest of the "
                        "context)")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    for name in ("concurrency", "repeats", "prompts"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.max_tokens is not None and args.max_tokens < 1:
        p.error("--max-tokens must be >= 1")
    if args.duration <= 0 or args.kv_budget_gib <= 0:
        p.error("--duration and --kv-budget-gib must be positive")
    drafter = load_drafter(None, dtype="float32")
    engines = {}
    for grow in (True, False):
        target = load_target(None, dtype="float32")
        rows = kv_budget_rows(args.kv_budget_gib, target.kv_bytes_per_token)
        config = EngineConfig().with_fields(kv_budget_tokens=rows, kv_grow=grow)
        engines[grow] = SpeculativeEngine(target, drafter, Bandit(), config=config)
    engine = engines[True]
    tokenizer = engine.tokenizer
    line_breaks = tuple(i for i in range(len(tokenizer)) if "\n" in tokenizer.decode([i]))
    texts = select_prompts(args.repeats * args.prompts + WARM_UP, seed=23)
    encoded = [engine.encode(t) for t in texts]
    context = engine.scheduler.max_context

    def chat(prompt: list[int]) -> SamplingParams:  # no max_tokens: the rest of the context, as chat's default
        if args.max_tokens is not None:
            return SamplingParams(max_new_tokens=args.max_tokens)
        return SamplingParams(max_new_tokens=context - len(prompt), min_tokens=MIN_TOKENS,
                              stop_token_ids=line_breaks)

    for e in engines.values():  # warm-up, apart from the cells' prompts
        e.generate_many(encoded[-WARM_UP:], [chat(q) for q in encoded[-WARM_UP:]])
    cells, compared, differ = [], 0, 0
    reserves = f"prompt + {args.max_tokens}" if args.max_tokens is not None else f"~{context}"
    print(f"{args.concurrency} requests in flight, KV budget {engine.scheduler.config.kv_budget_tokens} rows, context "
          f"{context}: a request reserves {reserves} rows", flush=True)
    for repeat in range(args.repeats):
        prompts = encoded[repeat * args.prompts:(repeat + 1) * args.prompts]
        params = [chat(q) for q in prompts]
        tokens = {}
        for grow in ((True, False) if repeat % 2 == 0 else (False, True)):
            cell, tokens[grow] = run_cell(engines[grow], prompts, params, args.concurrency, args.duration)
            cell |= {"kv_grow": grow, "repeat": repeat}
            cells.append(cell)
            print(f"kv_grow {'on ' if grow else 'off'}: {cell['tokens_per_s']:7.1f} tok/s, "
                  f"{cell['mean_running']:5.1f} running / {cell['mean_waiting']:5.1f} waiting on average, KV "
                  f"{100 * cell['mean_kv_used']:5.1f}% granted, {cell['kv_waits']} rounds waited for KV, "
                  f"{cell['finished']} finished ({cell['mean_new_tokens']:.0f} tokens each), time to first tokens "
                  f"p50 {cell['ttft_p50_s']:.2f} s, p95 {cell['ttft_p95_s']:.2f} s", flush=True)
        for index in tokens[True].keys() & tokens[False].keys():
            compared += 1
            differ += tokens[True][index] != tokens[False][index]
    on = [c["tokens_per_s"] for c in cells if c["kv_grow"]]
    off = [c["tokens_per_s"] for c in cells if not c["kv_grow"]]
    ratio = statistics.median(on) / statistics.median(off)
    print(f"kv_grow on / off, medians: {ratio:.2f}x; greedy tokens differ in {differ} of {compared} requests both "
          f"finished", flush=True)
    results = {"concurrency": args.concurrency, "max_tokens": args.max_tokens, "duration_s": args.duration,
               "kv_budget_gib": args.kv_budget_gib, "kv_budget_rows": engine.scheduler.config.kv_budget_tokens,
               "context": context, "cells": cells, "on_over_off": ratio, "compared": compared,
               "differ": differ}  # fmt: skip
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    main()
