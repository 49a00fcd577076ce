"""Ray Serve apps for the HTTP tests: Ray and Serve on a free loopback port with the app at /, and the HTTP calls the
tests make on it."""

from __future__ import annotations

import contextlib
import json
import os
import socket
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[2]
# Workers import this checkout; autoscaling metrics are pushed every second (default 10 s) so tests see scaling soon;
# the proxy gets a minute to come up (default 5 s: too short when a shared 2-core box is busy).
RAY_ENV = {
    "PYTHONPATH": str(REPO),
    "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "60",
    "RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S": "60",
    "RAY_SERVE_HANDLE_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "1",
    "RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "1",
    "OMP_NUM_THREADS": "1",
    "TOKENIZERS_PARALLELISM": "false",
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serve_app(args, address: str | None = None, num_cpus: int = 2, more: dict[str, object] | None = None,
              env: dict[str, str] | None = None):
    """Start Ray (or join `address`), Serve on a free loopback port and the app; yield its base URL. `more`: other
    apps, by name, served beside it at /<name>; `env`: more environment for this Ray alone (Serve's own settings)."""
    import ray
    from ray import serve

    from deployments import app

    os.environ.update(RAY_ENV)  # for the driver's own handles too
    saved = {k: os.environ.get(k) for k in env or {}}
    os.environ.update(env or {})  # a Ray started here inherits them; the workers get them with RAY_ENV
    ray_env = RAY_ENV | (env or {})
    if address is None:
        ray.init(num_cpus=num_cpus, include_dashboard=False, runtime_env={"env_vars": ray_env},
                 _system_config={"metrics_report_interval_ms": 1000})  # fmt: skip
    else:
        ray.init(address=address, runtime_env={"env_vars": ray_env})
    port = free_port()
    try:
        # one HTTP proxy, on the head: simulated nodes share this machine's ports
        serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
        # every app at once: their replicas start side by side
        targets = [serve.RunTarget(app(a), name=name, route_prefix=f"/{name}") for name, a in (more or {}).items()]
        serve.run_many([*targets, serve.RunTarget(app(args), name="specdec", route_prefix="/")])
        yield f"http://127.0.0.1:{port}"
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
        for k, v in saved.items():  # the next Ray of this test session starts without them
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def post(url: str, body, timeout: float = 120.0) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", json=body, timeout=timeout, trust_env=False)


def sse_chunks(response: httpx.Response) -> list:
    """The JSON chunks of a server-sent event stream, checking it ends with [DONE]."""
    data = [line.removeprefix("data: ") for line in response.text.splitlines() if line.startswith("data: ")]
    assert data and data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


class HealthPoller:
    """GET {url}{path} every interval_s on a thread of its own while in the `with` block: `polls` holds
    (monotonic time sent, monotonic time answered, status or None when no answer came within timeout_s)."""

    def __init__(self, url: str, path: str = "/health", interval_s: float = 0.25, timeout_s: float = 10.0):
        import threading

        self.url, self.path, self.interval_s, self.timeout_s = url, path, interval_s, timeout_s
        self.polls: list[tuple[float, float, int | None]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        import time

        while not self._stop.is_set():
            sent = time.monotonic()
            try:
                status = httpx.get(f"{self.url}{self.path}", timeout=self.timeout_s, trust_env=False).status_code
            except httpx.HTTPError:
                status = None
            self.polls.append((sent, time.monotonic(), status))
            self._stop.wait(self.interval_s)

    def __enter__(self) -> "HealthPoller":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def statuses(self, after: float = float("-inf")) -> list[int | None]:
        return [status for sent, _, status in self.polls if sent >= after]

    def unanswered_in_time(self, deadline_s: float) -> list[tuple[float, float, int | None]]:
        """The polls not answered 200: each a 503 that took at least deadline_s (the proxy guard's deadline, a
        replica too busy to answer sooner on a loaded machine) is left out; the rest are returned."""
        return [(sent, answered, status) for sent, answered, status in self.polls
                if status != 200 and not (status == 503 and answered - sent >= deadline_s)]  # fmt: skip

    def first(self, status: int, after: float) -> float | None:
        """When the first poll sent after `after` that got `status` was answered, or None."""
        return next((answered for sent, answered, s in self.polls if sent >= after and s == status), None)


def stream_completion(url: str, body: dict, on_first=None, timeout: float = 180.0) -> dict:
    """POST a streamed completion -> {"status": HTTP status, "tokens": ids streamed, "finish": finish_reason,
    "error": the error event or None, "done": whether [DONE] closed it, "retry_after": the header or None}.
    on_first(): called at the first chunk."""
    out = {"status": None, "tokens": [], "finish": None, "error": None, "done": False, "retry_after": None}
    with httpx.stream("POST", f"{url}/v1/completions", json=body | {"stream": True}, timeout=timeout,
                      trust_env=False) as response:  # fmt: skip
        out["status"], out["retry_after"] = response.status_code, response.headers.get("retry-after")
        if response.status_code != 200:
            response.read()
            out["error"] = response.json()
            return out
        first = True
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            data = line.removeprefix("data: ")
            if data == "[DONE]":
                out["done"] = True
                break
            event = json.loads(data)
            if "error" in event:
                out["error"] = event
                continue
            choice = event["choices"][0]
            out["tokens"] += choice["token_ids"]
            out["finish"] = choice["finish_reason"] or out["finish"]
            if first and on_first is not None:
                first = False
                on_first()
    return out
