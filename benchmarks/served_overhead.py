"""What an idle Serve app of ours costs the round loop on this machine: the in-process loop alone, beside the app
while it idles, and alone again once every Ray process has exited ("after").

The served app runs the same scheduler as the in-process loop, yet on a 2-core machine it gives ~0.7-0.8x of its
tokens/s. This benchmark separates the platform from the request path: the app is started in a process of its own (Ray,
the Serve controller and proxy, the engine replica: `serve run deployments:app`'s set, direct ingress on; before the
hubs moved into the one replica, also the bandit and metrics hubs) and sent nothing after one warm-up request, while the
in-process loop beside it runs closed loop cells. Cells alternate alone / beside / alone (`--cells` of each), each on
prompts no cell sent before. While the app idles, every process's wakeups (context switches of all its threads) and CPU
are sampled from /proc: on two cores each wakeup of another process preempts one of the loop's two OpenMP threads, and
the other waits for it at the next barrier, so wakeups cost more than their CPU time says.

Run from the repository root: python -m benchmarks.served_overhead [--concurrency 8] [--duration 10] [--cells 2]
[--tree none] [--json results.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

READY_TIMEOUT_S = 300.0
RAY_EXIT_TIMEOUT_S = 60.0
TOP_PROCESSES = 12

# (pid, tid) -> (process name, CPU ticks, context switches)
Snapshot = dict[tuple[int, int], tuple[str, int, int]]


def thread_counters(stat: str, status: str) -> tuple[int, int]:
    """(user + system CPU ticks, voluntary + involuntary context switches) of one thread from its /proc stat and
    status texts."""
    fields = stat[stat.rindex(")") + 2:].split()  # the name may hold spaces and parentheses
    ticks = int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of proc(5))
    switches = sum(int(line.split()[1]) for line in status.splitlines() if "ctxt_switches:" in line)
    return ticks, switches


def process_name(cmdline: bytes, comm: str = "?") -> str:
    """A short name for a process: Ray's own titles (`ray::ServeReplica:...`) as they are, else the program and the
    first argument that is not an option (the module after -m), without their folders; `comm` (in brackets) for a
    process without a command line (a kernel thread)."""
    parts = [p.decode(errors="replace") for p in cmdline.split(b"\0") if p]
    if not parts:
        return f"[{comm.strip()}]"
    if parts[0].startswith("ray::"):
        return parts[0].strip()
    program, rest = Path(parts[0]).name, parts[1:]
    for i, arg in enumerate(rest):
        if arg == "-m" and i + 1 < len(rest):
            return f"{program} -m {rest[i + 1]}"
        if not arg.startswith("-"):
            return f"{program} {Path(arg).name}"
    return program


def snapshot(proc: Path = Path("/proc")) -> Snapshot:
    """Every thread's counters; threads that end while being read are skipped."""
    out: Snapshot = {}
    for pid_dir in proc.iterdir():
        if not pid_dir.name.isdigit():
            continue
        try:
            name = process_name((pid_dir / "cmdline").read_bytes(), (pid_dir / "comm").read_text())
            for task in (pid_dir / "task").iterdir():
                ticks, switches = thread_counters((task / "stat").read_text(), (task / "status").read_text())
                out[(int(pid_dir.name), int(task.name))] = (name, ticks, switches)
        except (OSError, ValueError, IndexError):
            continue
    return out


def activity(before: Snapshot, after: Snapshot, seconds: float, hz: int) -> list[dict[str, Any]]:
    """Per process, over threads seen in both snapshots: wakeups per second and CPU (% of one core), busiest first."""
    if seconds <= 0:
        raise ValueError(f"seconds must be positive, got {seconds}")
    rows: dict[int, dict[str, Any]] = {}
    for key, (name, ticks, switches) in after.items():
        if key not in before:
            continue
        row = rows.setdefault(key[0], {"pid": key[0], "name": name, "wakeups_per_s": 0.0, "cpu_pct": 0.0})
        row["wakeups_per_s"] += (switches - before[key][2]) / seconds
        row["cpu_pct"] += 100.0 * (ticks - before[key][1]) / hz / seconds
    return sorted(rows.values(), key=lambda r: (-r["wakeups_per_s"], -r["cpu_pct"]))


def idle_app(folder: Path) -> None:
    """(In a process of its own.) The app as benchmarks/serve_peers.py starts it, one warm-up request, then idle
    until `folder/stop` exists; `folder/ready` says it is up, `folder/url` where it answers."""
    import httpx

    from benchmarks.serve_peers_servers import ours_server

    with ours_server(argparse.Namespace(ours_ingress="direct")) as endpoint:
        httpx.post(f"{endpoint.url}/v1/completions", json={"prompt": "def f(x):", "max_tokens": 8}, timeout=120,
                   trust_env=False).raise_for_status()  # fmt: skip
        (folder / "url").write_text(endpoint.url)
        (folder / "ready").touch()
        while not (folder / "stop").exists():
            time.sleep(0.5)


def start_app(folder: Path) -> subprocess.Popen:
    """`idle_app` in a process of its own; -> that process once the app answers (its address in `folder/url`)."""
    with open(folder / "app.log", "w") as log:  # the child keeps its own descriptor
        app = subprocess.Popen([sys.executable, "-m", "benchmarks.served_overhead", "--idle-app", str(folder)],
                               stdout=subprocess.DEVNULL, stderr=log)  # fmt: skip
    deadline = time.monotonic() + READY_TIMEOUT_S
    while not (folder / "ready").exists():
        if app.poll() is not None or time.monotonic() > deadline:
            app.kill()
            tail = "\n".join((folder / "app.log").read_text(errors="replace").splitlines()[-20:])
            raise RuntimeError(f"the idle app did not come up within {READY_TIMEOUT_S:.0f} s; its log ends:\n{tail}")
        time.sleep(0.5)
    return app


def stop_app(folder: Path, app: subprocess.Popen) -> None:
    """Stops `start_app`'s app and waits for Ray's processes to exit."""
    (folder / "stop").touch()
    try:
        app.wait(timeout=120)
    except subprocess.TimeoutExpired:
        app.kill()
    deadline = time.monotonic() + RAY_EXIT_TIMEOUT_S  # Ray's processes exit after the driver, some seconds later
    while time.monotonic() < deadline and any(_is_ray(name) for name, _, _ in snapshot().values()):
        time.sleep(0.5)


def _is_ray(name: str) -> bool:
    return name.startswith("ray::") or name.split(" ")[0] in ("raylet", "gcs_server")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--duration", type=float, default=10.0, help="seconds per cell")
    parser.add_argument("--cells", type=int, default=2, help="cells per phase (alone, beside the app, alone)")
    parser.add_argument("--tree", default="none", help='a tree config, or "policy" for the app\'s policy')
    parser.add_argument("--sample", type=float, default=8.0, help="seconds of /proc sampling while the app idles")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--idle-app", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.idle_app is not None:
        idle_app(args.idle_app)
        return {}
    if args.concurrency < 1 or args.cells < 1 or args.duration <= 0 or args.sample <= 0:
        parser.error("--concurrency and --cells must be at least 1, --duration and --sample positive")

    from ray_specdec.config import TreeConfig

    try:
        tree = None if args.tree == "policy" else TreeConfig.parse(args.tree)
    except ValueError as exc:
        parser.error(f"--tree: {exc}")
    if any(_is_ray(name) for name, _, _ in snapshot().values()):
        print("warning: Ray processes are running already: the cells alone are not alone", flush=True)

    import torch

    from benchmarks.batched_loop import run_cell
    from benchmarks.serve_peers import select_prompts
    from benchmarks.serve_peers_servers import TARGET
    from ray_specdec.config import SamplingParams
    from ray_specdec.engine.llm import SpeculativeEngine
    from ray_specdec.factory import load_drafter, load_target
    from ray_specdec.speculation.bandit import Bandit

    target = load_target(str(TARGET), dtype="float32", device="cpu")
    engine = SpeculativeEngine(target, load_drafter(None, dtype="float32"), Bandit())
    prompts = [engine.encode(p) for p in select_prompts(6000, 97)]
    engine.generate_many(prompts[-4:], SamplingParams(max_new_tokens=64), tree)
    cells: list[dict[str, Any]] = []
    start = 0

    def run(phase: str) -> None:
        nonlocal start
        for _ in range(args.cells):
            cell, _ = run_cell(engine, prompts[:-4], args.concurrency, tree, args.duration, torch.device("cpu"),
                               start=start)  # fmt: skip
            start += cell["sent"]
            cells.append({"phase": phase, "tokens_per_s": round(cell["tokens_per_s"], 1)})
            print(f"{phase:6s} c={args.concurrency} {args.tree}: {cell['tokens_per_s']:.1f} tok/s", flush=True)

    run("alone")
    with tempfile.TemporaryDirectory() as folder:
        app = start_app(Path(folder))
        try:
            time.sleep(2.0)
            before = snapshot()
            time.sleep(args.sample)
            processes = activity(before, snapshot(), args.sample, os.sysconf("SC_CLK_TCK"))
            run("beside")
        finally:
            stop_app(Path(folder), app)
    run("after")
    mine = os.getpid()
    others = [p for p in processes if p["pid"] != mine]
    alone = statistics.median(c["tokens_per_s"] for c in cells if c["phase"] != "beside")
    beside = statistics.median(c["tokens_per_s"] for c in cells if c["phase"] == "beside")
    result = {
        "concurrency": args.concurrency, "tree": args.tree, "duration_s": args.duration, "cells": cells,
        "alone_tokens_per_s": alone, "beside_tokens_per_s": beside, "beside_over_alone": round(beside / alone, 3),
        "idle_wakeups_per_s": round(sum(p["wakeups_per_s"] for p in others), 1),
        "idle_cpu_pct": round(sum(p["cpu_pct"] for p in others), 2),
        "processes": [{k: round(v, 2) if isinstance(v, float) else v for k, v in p.items()}
                      for p in others[:TOP_PROCESSES]],  # fmt: skip
        "hardware": {"cpus": os.cpu_count(), "machine": platform.machine(), "torch_threads": torch.get_num_threads()},
    }
    print(f"\nbeside the idle app / alone (medians): {beside:.1f} / {alone:.1f} = {result['beside_over_alone']:.3f}x")
    print(f"while the app idled: {result['idle_wakeups_per_s']:.0f} wakeups/s, {result['idle_cpu_pct']:.1f}% of a "
          f"core, in every other process together; the busiest:")
    for p in result["processes"]:
        print(f"  {p['wakeups_per_s']:7.1f}/s {p['cpu_pct']:5.2f}%  {p['name']}")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
