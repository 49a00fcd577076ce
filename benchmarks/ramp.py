"""Autoscaling ramp: the app with `drafters=remote` and an autoscaled drafter pool under a ramp of clients.

Starts Ray and the app (the embedded target-neox and default drafter, one engine replica, the drafter replicas in a
`drafter` deployment autoscaled by Serve between --min-replicas and --max-replicas; Serve's settings for a small
machine, the HTTP proxy's guard as `serve run` sets them, and the autoscaling metrics pushed every second instead of
every 10 s so that a phase of tens of seconds is enough to react) on a free loopback port, then runs
`python -m ray_specdec loadtest --ramp` (ray_specdec/tools/loadtest.py): closed-loop clients per phase, e.g. 1, 8,
32, 8, 1, and per phase tokens/s, p50/p95 latency, errors and the replicas of each deployment sampled every second
from the app's GET /v1/stats. Writes loadtest.json, ramp.md (the table), ramp.png, latency.png and timeline.png to
--out.

Serve scales a deployment by its ongoing requests (calls in flight or queued, averaged over look_back_period_s)
against target_ongoing_requests. An engine sends one call per drafter replica per step (two with --overlap: the next
round's draft while the target verifies; one per shard not placed yet), so what Serve sees is the share of a step
with a call in flight, not the number of clients: the pool follows that share (hence a target below 1, 0.5 by
default), and a request's shard stays on the replica that holds it (Serve routes a call to the replica with its shard
loaded), so a replica added later drafts mostly shards placed after it started.

Run: python -m benchmarks.ramp [--ramp 1,8,32,8,1] [--phase-seconds 40] [--out docs/bench/ramp]
"""

from __future__ import annotations

import argparse
import json
import os
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
    parser.add_argument("--target-ongoing", type=float, default=0.5,
                        help="Serve's target_ongoing_requests per drafter replica")  # fmt: skip
    parser.add_argument("--upscale-delay", type=float, default=5.0, help="seconds")
    parser.add_argument("--downscale-delay", type=float, default=15.0, help="seconds")
    parser.add_argument("--look-back", type=float, default=11.0,
                        help="Serve's look_back_period_s, seconds (over 10: Serve warns otherwise)")  # fmt: skip
    parser.add_argument("--overlap", action="store_true", help="drafter_pool_overlap: draft the next round ahead")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--num-cpus", type=int, default=6, help="CPUs Ray may schedule (actors, not cores)")
    parser.add_argument("--out", type=Path, default=Path("bench_out/ramp"))
    args = parser.parse_args(argv)

    import ray
    from ray import serve

    from deployments import AppArgs, app
    from deployments.app import proxy_guard_env, small_machine_serve_env
    from ray_specdec.tools import loadtest

    autoscaling = {"min_replicas": args.min_replicas, "max_replicas": args.max_replicas,
                   "target_ongoing_requests": args.target_ongoing, "upscale_delay_s": args.upscale_delay,
                   "downscale_delay_s": args.downscale_delay, "look_back_period_s": args.look_back}  # fmt: skip
    app_args = AppArgs(direct_ingress=False, drafters="remote", drafter_pool_autoscaling=autoscaling,
                       drafter_pool_overlap=args.overlap)  # fmt: skip
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
             "env": AUTOSCALING_ENV}, indent=1) + "\n")  # fmt: skip
        return loadtest.main(["--url", f"http://127.0.0.1:{port}", "--ramp", args.ramp, "--phase-seconds",
                              str(args.phase_seconds), "--max-tokens", str(args.max_tokens), "--out",
                              str(args.out)])  # fmt: skip
    finally:
        serve.shutdown()
        ray.shutdown()


if __name__ == "__main__":
    raise SystemExit(main())
