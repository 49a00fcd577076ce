"""Two settings of the served app against each other, side by side in one run: app arguments and Ray's environment.

On the 2-core machine a served cell moves by 5-10% from one start of the app to the next, so a single pair of runs
says little. Here each run starts Ray and the app afresh in a process of its own (so that Ray's environment is
that run's alone), sends closed-loop requests over HTTP to the replica's own port (direct ingress, as
benchmarks/serve_peers.py does), and stops everything; runs of A and B alternate A B B A A B ... for `--pairs`
pairs, each run on held-out prompts no other run sent (the prefix cache must not serve them). It prints every run's
tokens/s per cell and, per cell, the medians and B / A.

Both sides get benchmarks/serve_load.py's Ray environment (`ray_env`: the settings `serve run` gives a small machine)
and then their own `--a-env` / `--b-env` on top, so a side can put back what the app's defaults take away.

Run from the repository root, for example (the hubs of the app's first versions, and Ray's prestarted workers,
against the defaults):
    python -m benchmarks.served_ab --a-args hubs=deployments \
        --a-env RAY_prestart_worker_first_driver=1,RAY_enable_worker_prestart=1 --pairs 3 --json ab.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from typing import Any

from benchmarks.serve_peers_servers import TARGET

RUN_TIMEOUT_S = 900.0
REQUEST_TIMEOUT_S = 120.0
WARMUP_REQUESTS = 2  # benchmarks/serve_peers.warm_up's
PROMPTS_PER_RUN = 4000


def parse_pairs(text: str) -> dict[str, str]:
    """'k=v,k2=v2' -> {k: v, k2: v2} ('' -> {}); a value may hold '=' but no ','."""
    out = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise argparse.ArgumentTypeError(f"expected key=value, got {item!r}")
        out[key.strip()] = value.strip()
    return out


def parse_cells(text: str) -> list[tuple[int, str | None]]:
    """'1:policy;8:none;1:3,2,1' -> [(1, None), (8, 'none'), (1, '3,2,1')]: concurrency and tree (policy: the
    service's choice), cells apart by ';'."""
    cells = []
    for item in filter(None, (part.strip() for part in text.split(";"))):
        count, _, tree = item.partition(":")
        if not count.isdigit() or int(count) < 1 or not tree:
            raise argparse.ArgumentTypeError(f"a cell is <concurrency>:<tree or policy>, got {item!r}")
        cells.append((int(count), None if tree == "policy" else tree))
    return cells


def cell_name(concurrency: int, tree: str | None) -> str:
    return f"c={concurrency} {tree or 'policy'}"


def run_order(pairs: int) -> list[str]:
    """A B B A A B ...: each side as often first as second within every two pairs."""
    return [side for i in range(pairs) for side in (("A", "B") if i % 2 == 0 else ("B", "A"))]


def summarize(runs: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per cell: the medians of A's and B's tokens/s and B / A."""
    out = {}
    for cell in runs[0]["cells"]:
        a = statistics.median(r["cells"][cell] for r in runs if r["side"] == "A")
        b = statistics.median(r["cells"][cell] for r in runs if r["side"] == "B")
        out[cell] = {"A": a, "B": b, "B/A": b / a}
    return out


def one_run(app_args: dict[str, str], env: dict[str, str], cells: list[tuple[int, str | None]], duration: float,
            warmup: float, seed: int) -> dict[str, float]:
    """Start Ray with `env` (this process's environment holds it too: Ray's own processes read theirs from it) and the
    app, measure every cell with benchmarks/serve_peers.py's closed loop, stop; -> tokens/s per cell. Each request is
    greedy with max_tokens 64, streamed, on a prompt no earlier request of the run sent."""
    import asyncio

    import ray
    from ray import serve

    from benchmarks.serve_load import free_port
    from benchmarks.serve_peers import closed_loop, select_prompts, warm_up
    from benchmarks.serve_peers_results import summarize_cell
    from benchmarks.serve_peers_servers import Endpoint, direct_url
    from deployments import app
    from deployments.app import parse_app_args

    def reported(text: str) -> int:
        raise ValueError("ours reports every answer's usage: no text is counted by re-tokenizing it")

    args = parse_app_args({"target": str(TARGET), "dtype": "float32", "num_cpus_per_rank": 2} | app_args)
    ray.init(num_cpus=4, include_dashboard=False, runtime_env={"env_vars": env})
    try:
        port = free_port()
        serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
        serve.run(app(args), name="specdec", route_prefix="/")
        endpoint = Endpoint(direct_url(f"http://127.0.0.1:{port}"), None)
        prompts = select_prompts(PROMPTS_PER_RUN, seed)
        load = argparse.Namespace(timeout=REQUEST_TIMEOUT_S, max_tokens=64, fresh_prompts=True, prompts=len(prompts),
                                  prompts_sent=WARMUP_REQUESTS, paired_reserved=0)  # fmt: skip
        warm_up(endpoint, prompts, 0.0, load)  # prompts [0, WARMUP_REQUESTS): the cells start after them
        out = {}
        for concurrency, tree in cells:
            fields = {"tree": tree} if tree else {}
            for seconds in (warmup, duration):  # at this load first: the guard and the bandit see it
                load.duration = seconds
                results, wall_s = asyncio.run(closed_loop(endpoint, prompts, fields, concurrency, 0.0, load))
                cell = summarize_cell(results, wall_s, reported)
                if cell["errors"]:
                    raise RuntimeError(f"{cell_name(concurrency, tree)}: errors {cell['errors']}")
            out[cell_name(concurrency, tree)] = cell["tokens_per_s"]
        return out
    finally:
        serve.shutdown()
        ray.shutdown()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--a-args", type=parse_pairs, default={}, help="app arguments of A: k=v,k=v")
    parser.add_argument("--a-env", type=parse_pairs, default={}, help="environment of A's Ray: K=V,K=V")
    parser.add_argument("--b-args", type=parse_pairs, default={}, help="app arguments of B (default: the app's)")
    parser.add_argument("--b-env", type=parse_pairs, default={})
    parser.add_argument("--cells", type=parse_cells, default=parse_cells("1:policy;8:none"),
                        help="<concurrency>:<tree or policy>;...")
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--duration", type=float, default=20.0, help="measured seconds per cell")
    parser.add_argument("--warmup", type=float, default=5.0, help="seconds of each cell's load before it")
    parser.add_argument("--seed", type=int, default=500)
    parser.add_argument("--json", help="write every run and the summary here")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # internal: one run, its JSON on the last line
    args = parser.parse_args(argv)
    if args.pairs < 1:
        parser.error("--pairs must be at least 1")
    if args.one:
        spec = json.loads(args.one)
        result = one_run(spec["app_args"], spec["env"], args.cells, args.duration, args.warmup, spec["seed"])
        print(json.dumps(result), flush=True)
        return 0

    from benchmarks.serve_load import ray_env

    sides = {"A": (args.a_args, args.a_env), "B": (args.b_args, args.b_env)}
    cells_text = ";".join(f"{c}:{t or 'policy'}" for c, t in args.cells)
    runs = []
    for i, side in enumerate(run_order(args.pairs)):
        app_args, env = sides[side]
        run_env = ray_env() | env
        spec = json.dumps({"app_args": app_args, "env": run_env, "seed": args.seed + i})
        command = [sys.executable, "-m", "benchmarks.served_ab", "--one", spec, "--cells", cells_text,
                   "--duration", str(args.duration), "--warmup", str(args.warmup)]  # fmt: skip
        child_env = os.environ | run_env
        started = time.monotonic()
        proc = subprocess.run(command, env=child_env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
        if proc.returncode != 0:
            tail = " | ".join((proc.stdout + proc.stderr).strip().splitlines()[-5:])
            print(f"run {i + 1} ({side}) failed, exit {proc.returncode}: {tail}", file=sys.stderr)
            return 1
        cells = json.loads(proc.stdout.strip().splitlines()[-1])
        runs.append({"side": side, "seed": args.seed + i, "cells": cells})
        shown = "  ".join(f"{cell}: {value:.1f}" for cell, value in cells.items())
        print(f"run {i + 1}/{2 * args.pairs} {side}: {shown} tok/s ({time.monotonic() - started:.0f} s)", flush=True)
    summary = summarize(runs)
    print()
    for side, (app_args, env) in sides.items():
        print(f"{side}: app args {app_args or '-'}, environment {env or '-'}")
    print(f"{'cell':<16}{'A tok/s':>10}{'B tok/s':>10}{'B/A':>8}   (medians of {args.pairs} runs each)")
    for cell, row in summary.items():
        print(f"{cell:<16}{row['A']:>10.1f}{row['B']:>10.1f}{row['B/A']:>8.3f}")
    if args.json:
        record = {"a": {"args": args.a_args, "env": args.a_env}, "b": {"args": args.b_args, "env": args.b_env},
                  "cells": cells_text, "duration_s": args.duration, "warmup_s": args.warmup, "runs": runs,
                  "summary": summary, "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
                  "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}  # fmt: skip
        with open(args.json, "w") as f:
            json.dump(record, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
