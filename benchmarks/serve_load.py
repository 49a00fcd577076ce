"""Drafting on vs off through the Serve app, side by side in one run: throughput at concurrency 1 and 8.

Starts Ray and the app (embedded default models, one engine replica given every CPU) on a loopback port, then runs
the closed-loop load test of `ray_specdec.tools.loadtest` once per (concurrency, mode), alternating modes:
- `off`: every request says tree "none" (plain target decoding through the same router and engine);
- `on`: the service's own choice: the shared bandit (default arms, no drafting among them) priced by the
  speculation controller;
- `chain`: every request asks for the chain 1,1,1,1 (speculation forced on, no controller; the app's default
  lookup branch rides on it, as on every drafted tree).
Prompts are held-out corpus windows (the domain the default models were trained on). The report gives tokens/s,
latency and mean accepted length per run and each mode's throughput as a ratio of `off` at the same concurrency.

Run: python -m benchmarks.serve_load [--duration 45] [--concurrency 1,8] [--temperature 0] [--out docs/bench]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import socket
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RAY_ENV = {
    "PYTHONPATH": str(REPO),
    "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "60",
    "OMP_NUM_THREADS": "1",
    "TOKENIZERS_PARALLELISM": "false",
}
MODES = {"off": "none", "on": None, "chain": "1,1,1,1"}


def ray_env() -> dict[str, str]:
    """RAY_ENV, and the Serve settings `serve run deployments:app` gives a small machine and its ingress
    (deployments/app.py: small_machine_serve_env, direct_ingress_env), for the Ray these benchmarks start before they
    build the app."""
    from deployments.app import direct_ingress_env, small_machine_serve_env

    return RAY_ENV | small_machine_serve_env(dict(os.environ)) | direct_ingress_env(True, dict(os.environ), False)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def heldout_texts(n: int, seed: int) -> tuple[str, ...]:
    from ray_specdec.training.corpus import heldout_prompts

    return tuple(p.text for p in heldout_prompts(n, 64, 256, seed=seed))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=45.0, help="seconds per (concurrency, mode) run")
    parser.add_argument("--concurrency", default="1,8")
    parser.add_argument("--warmup", type=float, default=30.0, help="seconds of load before measuring")
    parser.add_argument("--modes", default="off,on,chain")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--num-cpus", type=int, default=4, help="CPUs Ray may schedule (actors, not cores)")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="of every request (0: greedy); outputs are serve_load_t<T>.json/.md when > 0")
    parser.add_argument("--out", type=Path, default=Path("bench_out"))
    args = parser.parse_args(argv)
    if not 0 <= args.temperature <= 2:
        parser.error(f"--temperature must be in [0, 2], got {args.temperature}")
    modes = [m for m in args.modes.split(",") if m]
    if unknown := set(modes) - set(MODES):
        parser.error(f"unknown modes {sorted(unknown)}; choose from {sorted(MODES)}")
    concurrencies = [int(c) for c in args.concurrency.split(",")]

    import httpx
    import ray
    from ray import serve

    from deployments import AppArgs, app
    from ray_specdec.tools.loadtest import LoadTestConfig, describe, run_loadtest

    prompts = heldout_texts(args.prompts, seed=7)
    env = ray_env()
    os.environ.update(env)
    ray.init(num_cpus=args.num_cpus, include_dashboard=False, runtime_env={"env_vars": env})
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    runs = []
    try:
        serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
        serve.run(app(AppArgs(num_cpus_per_rank=args.num_cpus)), name="specdec", route_prefix="/")
        # warm-up: first calls pay one-time costs, and the bandit starts learning (as on a live service)
        asyncio.run(run_loadtest(LoadTestConfig(url, 2, args.warmup, None, prompts, args.max_tokens,
                                                temperature=args.temperature)))
        for concurrency in concurrencies:
            for mode in modes:
                config = LoadTestConfig(url, concurrency, args.duration, None, prompts, args.max_tokens,
                                        tree=MODES[mode], temperature=args.temperature)  # fmt: skip
                report = asyncio.run(run_loadtest(config))
                print(f"concurrency {concurrency}, drafting {mode}: {describe(report)}", flush=True)
                # what the shared bandit believes after the run (its per-cell estimates), to read its choices by
                bandit = httpx.get(f"{url}/v1/bandit", timeout=30, trust_env=False).json() if mode == "on" else None
                # an engine replica's loop state so far (steps, faults, KV reserved), cumulative over runs
                stats = httpx.get(f"{url}/v1/stats", timeout=30, trust_env=False).json()
                runs.append({"concurrency": concurrency, "mode": mode, "report": report, "bandit": bandit,
                             "engine": stats.get("engine")})
    finally:
        serve.shutdown()
        ray.shutdown()

    rows = []
    for run in runs:
        base = next(r for r in runs if r["concurrency"] == run["concurrency"] and r["mode"] == "off")
        tput, base_tput = run["report"]["throughput"]["tokens_per_s"], base["report"]["throughput"]["tokens_per_s"]
        rows.append({"concurrency": run["concurrency"], "mode": run["mode"], "tokens_per_s": round(tput, 2),
                     "ratio_vs_off": round(tput / base_tput, 3) if base_tput else None,
                     "requests": run["report"]["requests"], "latency_s": run["report"]["latency_s"],
                     "mean_accepted_length": run["report"]["mean_accepted_length"],
                     "router_after": run["router"],
                     **({"bandit_after": run["bandit"]} if run["bandit"] else {})})
    result = {"runs": rows, "duration_s": args.duration, "max_tokens": args.max_tokens,
              "temperature": args.temperature,
              "hardware": {"platform": platform.platform(), "cpus": os.cpu_count()},
              "when": time.strftime("%Y-%m-%d")}
    args.out.mkdir(parents=True, exist_ok=True)
    name = "serve_load" if args.temperature == 0 else f"serve_load_t{args.temperature:g}"
    (args.out / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
    lines = ["| concurrency | drafting | tokens/s | vs off | mean accepted length | latency p50 (s) | errors |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        lat = r["latency_s"] or {}
        acc = r["mean_accepted_length"]
        lines.append(f"| {r['concurrency']} | {r['mode']} | {r['tokens_per_s']:.1f} | {r['ratio_vs_off']:.2f}x | "
                     f"{'-' if acc is None else f'{acc:.2f}'} | {lat.get('p50', float('nan')):.2f} | "
                     f"{r['requests'].get('errors', 0)} |")
    (args.out / f"{name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
