"""Soak: the app on its defaults under `python -m ray_specdec loadtest --soak` for a long run, memory watched.

Starts Ray and the app (embedded default models, one engine replica on this machine's cores, Serve's settings for a
small machine and the HTTP proxy's guard as `serve run` sets them; Serve's direct ingress off, so that no fixed port
is taken) on a free loopback port, then runs the load test's soak (ray_specdec/tools/loadtest.py: 8 clients
streaming greedy and sampled requests of three prompt lengths, no prompt twice; the engine replica's resident memory
every 30 s). Writes loadtest.json, soak.csv, soak.png (memory and tokens/s over time), latency.png and timeline.png
to --out.

Run: python -m benchmarks.soak [--duration 1800] [--out docs/bench/soak]
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from benchmarks.serve_load import RAY_ENV, free_port


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=1800.0, help="seconds during which requests start")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--memory-interval", type=float, default=30.0, help="seconds between memory samples")
    parser.add_argument("--num-cpus", type=int, default=4, help="CPUs Ray may schedule (actors, not cores)")
    parser.add_argument("--out", type=Path, default=Path("bench_out/soak"))
    args = parser.parse_args(argv)

    import ray
    from ray import serve

    from deployments import AppArgs, app
    from deployments.app import proxy_guard_env, small_machine_serve_env
    from ray_specdec.tools import loadtest

    env = RAY_ENV | small_machine_serve_env(dict(os.environ)) | proxy_guard_env(dict(os.environ), False)
    os.environ.update(env)
    ray.init(num_cpus=args.num_cpus, include_dashboard=False, runtime_env={"env_vars": env})
    port = free_port()
    try:
        serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
        serve.run(app(AppArgs(direct_ingress=False)), name="specdec", route_prefix="/")
        return loadtest.main(["--url", f"http://127.0.0.1:{port}", "--soak", "--duration", str(args.duration),
                              "--concurrency", str(args.concurrency), "--memory-interval", str(args.memory_interval),
                              "--out", str(args.out)])  # fmt: skip
    finally:
        serve.shutdown()
        ray.shutdown()


if __name__ == "__main__":
    raise SystemExit(main())
