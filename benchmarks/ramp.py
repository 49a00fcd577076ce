"""Autoscaling ramp: the app with `drafters=remote` and an autoscaled drafter pool under a ramp of clients.

Starts Ray and the app (the embedded target-neox and default drafter, one engine replica, the drafter replicas in a
`drafter` deployment autoscaled by Serve between --min-replicas and --max-replicas; Serve's settings for a small
machine, the HTTP proxy's guard as `serve run` sets them, and the autoscaling metrics pushed every second instead of
every 10 s so that a phase of tens of seconds is enough to react) on a free loopback port, then runs
`python -m ray_specdec loadtest --ramp` (ray_specdec/tools/loadtest.py): closed-loop clients per phase, e.g. 1, 8,
32, 8, 1, and per phase tokens/s, p50/p95 latency, errors and the replicas of each deployment sampled every second
from the app's GET /v1/stats. Writes loadtest.json, ramp.md (the table), ramp.png, latency.png and timeline.png to
--out, and load.json / load.md: the drafter replicas' own load as the engine last heard it (busy fraction, requests
drafted per second; /v1/stats engine.drafters.drafter_loads) sampled every second, per phase the means of their
sums (phases timed from this script's start of the load test: within a second of loadtest's own).

--scale-on busy (the app's default): the pool follows the share of their time the replicas spend drafting
(deployments/drafter_scaling.py: ceil(summed busy / --busy-target) replicas, fewer once a smaller pool stays under
3/4 of the target). --scale-on ongoing: Serve's default policy, ongoing calls per replica against --target-ongoing;
an engine keeps about one call per drafter replica in flight per step whatever its load, so that one measures the
share of a step with a call in flight, not the clients. Either way the engine moves shards beyond an even share to
a replica added later (drafter_pool_rebalance_s), so that it takes a share of the requests in flight.

Run: python -m benchmarks.ramp [--ramp 1,8,32,8,1] [--phase-seconds 40] [--tree 2,2,1,1] [--out docs/bench/ramp]
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time
from pathlib import Path

from benchmarks.serve_load import RAY_ENV, free_port

# Serve's autoscaling metrics every second (default 10 s), from the handles (the engines) and the replicas.
AUTOSCALING_ENV = {
    "RAY_SERVE_HANDLE_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "1",
    "RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "1",
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ramp", default="1,8,32,8,1", help="clients per phase")
    parser.add_argument("--phase-seconds", type=float, default=40.0)
    parser.add_argument("--min-replicas", type=int, default=1, help="drafter replicas at least")
    parser.add_argument("--max-replicas", type=int, default=3, help="drafter replicas at most")
    parser.add_argument("--scale-on", choices=["busy", "ongoing"], default="busy",
                        help="the pool's autoscaling policy (AppArgs.drafter_pool_scale_on)")  # fmt: skip
    parser.add_argument("--busy-target", type=float, default=0.6, help="busy fraction a drafter replica stays under")
    parser.add_argument("--target-ongoing", type=float, default=0.5,
                        help="Serve's target_ongoing_requests per drafter replica (--scale-on ongoing)")  # fmt: skip
    parser.add_argument("--upscale-delay", type=float, default=5.0, help="seconds")
    parser.add_argument("--downscale-delay", type=float, default=15.0, help="seconds")
    parser.add_argument("--look-back", type=float, default=5.0, help="Serve's look_back_period_s, seconds")
    parser.add_argument("--overlap", action="store_true", help="drafter_pool_overlap: draft the next round ahead")
    parser.add_argument("--tree", default=None,
                        help="one tree for every round (AppArgs.tree, e.g. 2,2,1,1), so that every round is drafted; "
                             "default: the service's own choice, which on a small CPU target prices a remote drafting "
                             "step's round trip above what it saves and drafts no round")  # fmt: skip
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--num-cpus", type=int, default=6, help="CPUs Ray may schedule (actors, not cores)")
    parser.add_argument("--out", type=Path, default=Path("bench_out/ramp"))
    args = parser.parse_args(argv)

    import ray
    from ray import serve

    from deployments import AppArgs, app
    from deployments.app import proxy_guard_env, small_machine_serve_env
    from ray_specdec.tools import loadtest

    # metrics_interval_s: how often the replicas push their metrics (the custom ones included) to the controller
    autoscaling = {"min_replicas": args.min_replicas, "max_replicas": args.max_replicas,
                   "target_ongoing_requests": args.target_ongoing, "upscale_delay_s": args.upscale_delay,
                   "downscale_delay_s": args.downscale_delay, "look_back_period_s": args.look_back,
                   "metrics_interval_s": 1.0}  # fmt: skip
    app_args = AppArgs(direct_ingress=False, drafters="remote", drafter_pool_autoscaling=autoscaling,
                       drafter_pool_overlap=args.overlap, drafter_pool_scale_on=args.scale_on,
                       drafter_pool_busy_target=args.busy_target, tree=args.tree)  # fmt: skip
    env = (RAY_ENV | AUTOSCALING_ENV | small_machine_serve_env(dict(os.environ))
           | proxy_guard_env(dict(os.environ), False))  # fmt: skip
    os.environ.update(env)
    ray.init(num_cpus=args.num_cpus, include_dashboard=False, runtime_env={"env_vars": env})
    port = free_port()
    try:
        serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
        serve.run(app(app_args), name="specdec", route_prefix="/")
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "app_args.json").write_text(json.dumps(
            {"drafters": "remote", "drafter_pool_autoscaling": autoscaling, "drafter_pool_overlap": args.overlap,
             "drafter_pool_scale_on": args.scale_on, "drafter_pool_busy_target": args.busy_target, "tree": args.tree,
             "env": AUTOSCALING_ENV}, indent=1) + "\n")  # fmt: skip
        url = f"http://127.0.0.1:{port}"
        sampler = LoadSampler(url)
        sampler.start()
        status = loadtest.main(["--url", url, "--ramp", args.ramp, "--phase-seconds", str(args.phase_seconds),
                                "--max-tokens", str(args.max_tokens), "--out", str(args.out)])  # fmt: skip
        sampler.stop()
        write_load(args.out, sampler.samples)
        return status
    finally:
        serve.shutdown()
        ray.shutdown()


class LoadSampler:
    """The drafter replicas' load as the engine reports it (GET /v1/stats), every second, in a thread."""

    def __init__(self, url: str, interval_s: float = 1.0):
        self.url, self.interval_s = url, interval_s
        self.samples: list[dict] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        self.t0 = time.perf_counter()
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def _run(self) -> None:
        import httpx

        while not self._stop.wait(self.interval_s):
            try:
                stats = httpx.get(f"{self.url}/v1/stats", timeout=10, trust_env=False).json()
            except Exception:  # a busy server: the next sample
                continue
            loads = stats["engine"].get("drafters", {}).get("drafter_loads", {})
            t = round(time.perf_counter() - self.t0, 3)
            self.samples.append({"t": t, "drafter": stats["replicas"].get("drafter"), "loads": loads})


def write_load(out: Path, samples: list[dict]) -> None:
    """load.json (the samples) and load.md: per phase of loadtest.json, the means of the replicas' summed busy
    fractions and requests drafted per second, and the most replicas any replica reported load for at once."""
    phases = json.loads((out / "loadtest.json").read_text())["phases"]
    (out / "load.json").write_text(json.dumps(samples) + "\n")
    rows = ["| phase | clients | summed busy (mean) | busiest replica (mean) | requests drafted/s (mean) | "
            "replicas reporting (max) |", "| --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    for p in phases:
        inside = [s for s in samples if p["start_s"] <= s["t"] < p["end_s"]]
        busy = [sum(v["drafter_busy"] for v in s["loads"].values()) for s in inside]
        top = [max((v["drafter_busy"] for v in s["loads"].values()), default=0.0) for s in inside]
        rate = [sum(v["drafter_requests_per_s"] for v in s["loads"].values()) for s in inside]
        most = max((len(s["loads"]) for s in inside), default=0)

        def mean(xs: list[float]) -> str:
            return f"{sum(xs) / len(xs):.2f}" if xs else "-"

        rows.append(f"| {p['phase']} | {p['clients']} | {mean(busy)} | {mean(top)} | {mean(rate)} | {most} |")
    (out / "load.md").write_text("\n".join(rows) + "\n")
    print("\n".join(rows))


if __name__ == "__main__":
    raise SystemExit(main())
