"""Closed-loop load test of the completion API on this machine: N concurrent clients for S seconds (or R requests).

Measures throughput (requests/s, completion tokens/s), time to first token (streaming), latency percentiles, errors by
kind, the mean accepted length reported in each response's "speculative" block, and replica counts over time from a
`ReplicaReader` sampled every second (default: `GET {url}/v1/stats`, read as {"replicas": {name: count}}; failures
are skipped). Writes `loadtest.json`, `latency.png` and `timeline.png`.

Ramp (`--ramp 1,8,32,8,1 --phase-seconds 40`): phases of closed-loop clients, one after another, at each count in
turn. At a phase boundary clients are added or told to stop; a stopping client's request in flight finishes, and
every request counts in the phase it started in. The report's "phases" give per phase its clients, requests, errors,
completion tokens/s (tokens of the phase's successful requests over the phase's length), latency percentiles and the
replica counts sampled during it (min and max per deployment); a Markdown table of them is printed and written to
`ramp.md`, and `ramp.png` plots tokens/s, clients and replicas over time.

Soak (`--soak`): 8 clients for 30 minutes (each unless given), streaming a mix: greedy and sampled requests
(temperature 0.7, top_p 0.95) alternately, prompts of 1, 4 and 16 copies of a base prompt, each behind a number of
its own (no prompt twice: the prefix cache fills as it would in service). The engine replica's resident memory is
read from `GET {url}/v1/stats` ("engine": {"rss_bytes", "replica"}) every 30 s; `soak.csv` and `soak.png` hold it
with the completion tokens/s of each interval, and the report's "memory" block says how much it grew in each half of
the run (once the KV budget and the prefix cache are full, the second half's growth should be ~0).

Only loopback URLs are accepted (localhost, 127.0.0.0/8, ::1), and proxies from the environment are ignored: this
tool must not be pointed at someone else's server.
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import ipaddress
import json
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Awaitable, Callable, Mapping

import httpx
import numpy as np

ReplicaReader = Callable[[], "Mapping[str, int] | None | Awaitable[Mapping[str, int] | None]"]

DEFAULT_PROMPTS = (
    "The history of the printing press begins",
    "def fibonacci(n):",
    "Explain why the sky is blue in two sentences.",
    "Once upon a time, in a small village by the sea,",
)
MAX_CONCURRENCY = 1024


def check_loopback(url: str) -> str:
    """The URL without a trailing slash, if its host is loopback; ValueError otherwise."""
    try:
        parsed = httpx.URL(url)
    except httpx.InvalidURL as exc:
        raise ValueError(f"invalid URL {url!r}: {exc}") from None
    if parsed.scheme not in ("http", "https") or not parsed.host:
        raise ValueError(f"URL must be http(s)://host[:port], got {url!r}")
    host = parsed.host
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        raise ValueError(f"refusing non-loopback host {host!r}: only localhost, 127.0.0.0/8 and ::1 are allowed")
    return url.rstrip("/")


@dataclass(frozen=True)
class LoadTestConfig:
    url: str
    concurrency: int = 1
    duration_s: float = 30.0  # no request starts after this; requests in flight may finish (within timeout_s)
    max_requests: int | None = None
    prompts: tuple[str, ...] = DEFAULT_PROMPTS  # used in order, cycling
    max_tokens: int = 64
    stream: bool = False
    tree: str | None = None  # forwarded as the request's "tree" (e.g. "none" to turn drafting off)
    timeout_s: float = 120.0  # per request, whole response included
    sample_interval_s: float = 1.0
    temperature: float = 0.0  # sent with every request: 0 greedy, > 0 sampled (the server picks a seed per request)
    mix: bool = False  # the soak's requests instead (module docstring): temperature ignored
    memory_interval_s: float | None = None  # read the engine's resident memory from /v1/stats this often (None: never)
    # clients per phase, one phase after another (module docstring); set, it fixes concurrency (the largest count)
    # and duration_s (phases x phase_s)
    ramp: tuple[int, ...] | None = None
    phase_s: float = 30.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "url", check_loopback(self.url))
        if self.ramp is not None:
            ramp = tuple(self.ramp)
            if not ramp:
                raise ValueError("ramp needs at least one phase")
            if not all(isinstance(c, int) and 1 <= c <= MAX_CONCURRENCY for c in ramp):
                raise ValueError(f"ramp client counts must be integers in [1, {MAX_CONCURRENCY}], got {list(ramp)}")
            if not self.phase_s > 0:
                raise ValueError(f"phase seconds must be > 0, got {self.phase_s}")
            object.__setattr__(self, "ramp", ramp)
            object.__setattr__(self, "concurrency", max(ramp))
            object.__setattr__(self, "duration_s", len(ramp) * self.phase_s)
        if not 1 <= self.concurrency <= MAX_CONCURRENCY:
            raise ValueError(f"concurrency must be in [1, {MAX_CONCURRENCY}], got {self.concurrency}")
        if not self.duration_s > 0 or not self.timeout_s > 0 or not self.sample_interval_s > 0:
            raise ValueError("duration, timeout and sample interval must be > 0")
        if self.max_requests is not None and self.max_requests < 1:
            raise ValueError(f"max requests must be >= 1, got {self.max_requests}")
        if not self.prompts or self.max_tokens < 1:
            raise ValueError("need at least one prompt and max_tokens >= 1")
        if not 0.0 <= self.temperature <= 2.0:
            raise ValueError(f"temperature must be in [0, 2], got {self.temperature}")
        if self.memory_interval_s is not None and not self.memory_interval_s > 0:
            raise ValueError(f"memory interval must be > 0, got {self.memory_interval_s}")


# The soak's mix (module docstring): sampled requests' settings, and prompt lengths in copies of a base prompt.
SOAK_TEMPERATURE, SOAK_TOP_P = 0.7, 0.95
SOAK_COPIES = (1, 4, 16)


def request_body(config: LoadTestConfig, i: int) -> dict[str, Any]:
    """The body of the run's i-th request."""
    prompt = config.prompts[i % len(config.prompts)]
    body: dict[str, Any] = {"prompt": prompt, "max_tokens": config.max_tokens, "stream": config.stream,
                            "temperature": config.temperature}  # fmt: skip
    if config.mix:  # greedy and sampled alternately; 1, 4, 16 copies in turn over each pair
        copies = SOAK_COPIES[(i // 2) % len(SOAK_COPIES)]
        body["prompt"] = f"{i}. " + " ".join([prompt] * copies)
        body |= {"temperature": SOAK_TEMPERATURE, "top_p": SOAK_TOP_P} if i % 2 else {"temperature": 0.0}
    if config.tree is not None:
        body["tree"] = config.tree
    return body


@dataclass
class RequestResult:
    start_s: float  # since the start of the run
    latency_s: float
    error: str | None = None  # kind: "http_503", "timeout", "connect", "transport", "bad_response", "stream_error"
    ttft_s: float | None = None  # streaming only: first chunk with text
    completion_tokens: int = 0
    accepted_length: float | None = None  # the response's speculative.mean_accepted_length
    rounds: int | None = None
    client: int | None = None  # which closed-loop client sent it (0 ..)
    phase: int | None = None  # ramp only: the phase it started in

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclass
class _StreamTally:
    ttft_s: float | None = None
    chunk_tokens: int = 0
    final: dict[str, Any] = field(default_factory=dict)  # last "usage" and "speculative" seen

    def add(self, chunk: dict[str, Any], elapsed_s: float) -> None:
        choice = (chunk.get("choices") or [{}])[0]
        if self.ttft_s is None and (choice.get("text") or choice.get("token_ids")):
            self.ttft_s = elapsed_s
        ids = choice.get("token_ids")
        self.chunk_tokens += len(ids) if ids is not None else int(bool(choice.get("text")))
        self.final.update({k: chunk[k] for k in ("usage", "speculative") if k in chunk})


def _finish(result: RequestResult, body: dict[str, Any], tokens: int) -> RequestResult:
    spec = body.get("speculative") or {}
    result.completion_tokens = int((body.get("usage") or {}).get("completion_tokens", tokens))
    if spec.get("mean_accepted_length") is not None:
        result.accepted_length = float(spec["mean_accepted_length"])
        result.rounds = int(spec["rounds"]) if spec.get("rounds") is not None else None
    return result


async def _send(
    client: httpx.AsyncClient, config: LoadTestConfig, body: dict[str, Any], t0: float, start: float
) -> RequestResult:
    result = RequestResult(start - t0, 0.0)
    url = f"{config.url}/v1/completions"
    if not config.stream:
        response = await client.post(url, json=body)
        if response.status_code != 200:
            result.error = f"http_{response.status_code}"
            return result
        return _finish(result, response.json(), 0)
    tally = _StreamTally()
    async with client.stream("POST", url, json=body) as response:
        if response.status_code != 200:
            await response.aread()
            result.error = f"http_{response.status_code}"
            return result
        async for line in response.aiter_lines():
            data = line.removeprefix("data:").strip() if line.startswith("data:") else None
            if data == "[DONE]":
                break
            if data:
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = "stream_error"
                    return result
                tally.add(chunk, time.perf_counter() - start)
    result.ttft_s = tally.ttft_s
    return _finish(result, tally.final, tally.chunk_tokens)


async def _one_request(
    client: httpx.AsyncClient, config: LoadTestConfig, body: dict[str, Any], t0: float, start: float
) -> RequestResult:
    """start: when the caller decided to send it (the time it checked against the run's deadline)."""
    try:
        result = await asyncio.wait_for(_send(client, config, body, t0, start), config.timeout_s)
    except (asyncio.TimeoutError, httpx.TimeoutException):
        result = RequestResult(start - t0, 0.0, error="timeout")
    except httpx.ConnectError:
        result = RequestResult(start - t0, 0.0, error="connect")
    except httpx.HTTPError:
        result = RequestResult(start - t0, 0.0, error="transport")
    except (ValueError, KeyError, TypeError, IndexError):  # malformed JSON or fields
        result = RequestResult(start - t0, 0.0, error="bad_response")
    result.latency_s = time.perf_counter() - start
    return result


def stats_reader(client: httpx.AsyncClient, url: str) -> ReplicaReader:
    """Default replica reader: {"replicas": {...}} of GET {url}/v1/stats; None when absent or failing."""

    async def read() -> Mapping[str, int] | None:
        try:
            response = await client.get(f"{url}/v1/stats")
            replicas = response.json().get("replicas") if response.status_code == 200 else None
        except (httpx.HTTPError, ValueError, AttributeError):
            return None
        return replicas if isinstance(replicas, dict) else None

    return read


async def _sample_replicas(reader: ReplicaReader, config: LoadTestConfig, t0: float, stop: asyncio.Event, out: list):
    while not stop.is_set():
        t = time.perf_counter() - t0
        try:
            value = await reader() if inspect.iscoroutinefunction(reader) else await asyncio.to_thread(reader)
        except Exception:  # a reader is best effort: a failing sample must not stop the load
            value = None
        if value is not None:
            out.append({"t": round(t, 3), "replicas": {str(k): int(v) for k, v in dict(value).items()}})
        try:
            await asyncio.wait_for(stop.wait(), config.sample_interval_s)
        except asyncio.TimeoutError:
            pass


async def _sample_memory(client: httpx.AsyncClient, config: LoadTestConfig, t0: float, stop: asyncio.Event,
                         out: list) -> None:
    """The engine replica's resident memory from GET /v1/stats every memory_interval_s, from the start (failures
    skipped: a busy server answers the next)."""
    while not stop.is_set():
        await _sample_memory_once(client, config, t0, out)
        try:
            await asyncio.wait_for(stop.wait(), config.memory_interval_s)
        except asyncio.TimeoutError:
            pass


async def _sample_memory_once(client: httpx.AsyncClient, config: LoadTestConfig, t0: float, out: list) -> None:
    t = time.perf_counter() - t0
    try:
        engine = (await client.get(f"{config.url}/v1/stats")).json()["engine"]
        out.append({"t": t, "replica": str(engine.get("replica")), "rss_bytes": int(engine["rss_bytes"])})
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        pass


async def run_loadtest(config: LoadTestConfig, replica_reader: ReplicaReader | None = None) -> dict[str, Any]:
    """Run the load; returns the report (see `summarize`)."""
    limits = httpx.Limits(max_connections=config.concurrency + 1, max_keepalive_connections=config.concurrency + 1)
    timeout = httpx.Timeout(config.timeout_s)
    async with httpx.AsyncClient(limits=limits, timeout=timeout, trust_env=False) as client:
        reader = replica_reader or stats_reader(client, config.url)
        results: list[RequestResult] = []
        samples: list[dict[str, Any]] = []
        memory: list[dict[str, Any]] = []
        issued = 0
        current: list[int | None] = [0]  # ramp: the phase now (None once the last one ended)
        phase_bounds: list[float] = []  # ramp: when each phase began, then when the last one ended
        t0 = time.perf_counter()
        deadline = t0 + config.duration_s

        async def worker(k: int) -> None:
            nonlocal issued
            while (config.max_requests is None or issued < config.max_requests) and (
                start := time.perf_counter()
            ) < deadline:  # a request's recorded start is the time checked here, so none starts after the deadline
                phase = current[0]
                if config.ramp is not None and (phase is None or k >= config.ramp[phase]):
                    break  # this client is not part of the phase now
                body = request_body(config, issued)
                issued += 1
                result = await _one_request(client, config, body, t0, start)
                result.client, result.phase = k, phase if config.ramp is not None else None
                results.append(result)

        async def ramp_clients(ramp: tuple[int, ...]) -> None:
            """Each phase in turn: the clients it lacks are started (a stopping one still finishing its request
            goes on if the new phase keeps it), those beyond its count stop after their request in flight."""
            tasks: dict[int, asyncio.Task] = {}
            for phase, count in enumerate(ramp):
                current[0] = phase
                # the clock read after the phase changed and before any client of it starts: a request's recorded
                # start (read before it checked the phase) falls within its own phase's bounds, exactly
                phase_bounds.append(time.perf_counter() - t0)
                for k in range(count):
                    if k not in tasks or tasks[k].done():
                        tasks[k] = asyncio.create_task(worker(k))
                await asyncio.sleep(max(0.0, t0 + (phase + 1) * config.phase_s - time.perf_counter()))
            current[0] = None
            phase_bounds.append(time.perf_counter() - t0)
            await asyncio.gather(*tasks.values())

        stop = asyncio.Event()
        samplers = [asyncio.create_task(_sample_replicas(reader, config, t0, stop, samples))]
        if config.memory_interval_s is not None:
            samplers.append(asyncio.create_task(_sample_memory(client, config, t0, stop, memory)))
        try:
            if config.ramp is not None:
                await ramp_clients(config.ramp)
            else:
                await asyncio.gather(*(worker(k) for k in range(config.concurrency)))
        finally:
            wall_s = time.perf_counter() - t0
            if config.memory_interval_s is not None and not stop.is_set():  # the state the run ended in
                await _sample_memory_once(client, config, t0, memory)
            stop.set()
            await asyncio.gather(*samplers)
    return summarize(results, wall_s, samples, config, memory, phase_bounds)


def percentiles(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    v = np.asarray(values, dtype=np.float64)
    p50, p95, p99 = np.percentile(v, [50, 95, 99])
    return {"mean": float(v.mean()), "p50": float(p50), "p95": float(p95), "p99": float(p99), "max": float(v.max())}


def _timeline(results: list[RequestResult], wall_s: float) -> list[dict[str, float]]:
    """Completed requests and completion tokens per second of the run (the last bin may be shorter)."""
    starts = range(int(np.ceil(wall_s)) or 1)
    bins = [{"t": float(s), "seconds": min(1.0, wall_s - s), "requests": 0, "tokens": 0} for s in starts]
    for r in results:
        if r.ok:
            b = bins[min(int(r.start_s + r.latency_s), len(bins) - 1)]
            b["requests"] += 1
            b["tokens"] += r.completion_tokens
    return bins


def memory_summary(memory: list[dict[str, Any]], wall_s: float) -> dict[str, Any] | None:
    """The engine's resident memory over the run (of the replica sampled most): first, last and largest sample in
    MiB, and the growth over each half of the run (the last sample at or before the half, to the end)."""
    if not memory:
        return None
    replica = Counter(m["replica"] for m in memory).most_common(1)[0][0]
    points = [(m["t"], m["rss_bytes"] / 2**20) for m in memory if m["replica"] == replica]
    half = [mib for t, mib in points if t <= wall_s / 2][-1]
    return {"replica": replica, "samples": len(points), "first_mib": points[0][1], "last_mib": points[-1][1],
            "max_mib": max(mib for _, mib in points), "growth_first_half_mib": half - points[0][1],
            "growth_second_half_mib": points[-1][1] - half}  # fmt: skip


def phase_summary(
    results: list[RequestResult], samples: list[dict[str, Any]], ramp: tuple[int, ...], bounds: list[float]
) -> list[dict[str, Any]]:
    """Per ramp phase: its clients and time span, the requests that started in it (errors by kind; completion
    tokens/s of the successful ones over the phase's length; latency percentiles) and the replica counts sampled
    within its span (the first phase's from the run's start, the last one's on while its requests finish):
    {deployment: {"min", "max"}}."""
    phases = []
    for phase, clients in enumerate(ramp):
        start, end = bounds[phase], bounds[phase + 1]
        mine = [r for r in results if r.phase == phase]
        ok = [r for r in mine if r.ok]
        tokens = sum(r.completion_tokens for r in ok)
        last = phase == len(ramp) - 1
        counts: dict[str, list[int]] = {}
        for s in samples:
            if (phase == 0 or start <= s["t"]) and (last or s["t"] < end):
                for name, n in s["replicas"].items():
                    counts.setdefault(name, []).append(n)
        phases.append({
            "phase": phase, "clients": clients, "start_s": start, "end_s": end,
            "requests": len(mine), "ok": len(ok), "errors": len(mine) - len(ok),
            "errors_by_kind": dict(Counter(r.error for r in mine if not r.ok)),
            "completion_tokens": tokens, "tokens_per_s": tokens / max(end - start, 1e-9),
            "latency_s": percentiles([r.latency_s for r in ok]),
            "replicas": {name: {"min": min(v), "max": max(v)} for name, v in sorted(counts.items())},
        })  # fmt: skip
    return phases


def summarize(
    results: list[RequestResult], wall_s: float, samples: list[dict[str, Any]], config: LoadTestConfig,
    memory: list[dict[str, Any]] | None = None, phase_bounds: list[float] | None = None,
) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    tokens = sum(r.completion_tokens for r in ok)
    spec = [r for r in ok if r.accepted_length is not None]
    weights = [r.rounds if r.rounds else 1 for r in spec]
    accepted = float(np.average([r.accepted_length for r in spec], weights=weights)) if spec else None
    return {
        "config": {k: v for k, v in asdict(config).items() if k != "prompts"} | {"num_prompts": len(config.prompts)},
        "wall_s": wall_s,
        "requests": {"total": len(results), "ok": len(ok), "errors": len(results) - len(ok)},
        "errors": dict(Counter(r.error for r in results if not r.ok)),
        "throughput": {"requests_per_s": len(ok) / wall_s, "tokens_per_s": tokens / wall_s},
        "completion_tokens": tokens,
        "latency_s": percentiles([r.latency_s for r in ok]),
        "ttft_s": percentiles([r.ttft_s for r in ok if r.ttft_s is not None]),
        "mean_accepted_length": accepted,
        "replicas": samples,
        "memory": memory_summary(memory or [], wall_s),
        "memory_samples": memory or [],
        "phases": phase_summary(results, samples, config.ramp, phase_bounds or []) if config.ramp else None,
        "timeline": _timeline(results, wall_s),
        "requests_log": [asdict(r) for r in results],
    }


def _plot_replicas(ax, report: dict[str, Any], wall_s: float) -> None:
    """Running replicas of each deployment over time, as sampled (the last value held to the end of the run)."""
    from matplotlib.ticker import MaxNLocator

    names = sorted({name for s in report["replicas"] for name in s["replicas"]})
    for name in names:
        points = [(s["t"], s["replicas"][name]) for s in report["replicas"] if name in s["replicas"]]
        points.append((max(wall_s, points[-1][0]), points[-1][1]))
        ax.step(*zip(*points), where="post", label=name)
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    if names:
        ax.legend(title="deployment")
    else:
        ax.text(0.5, 0.5, "no replica samples", ha="center", transform=ax.transAxes)


def plot_latency(report: dict[str, Any], path: Path) -> Path:
    """Histogram and CDF of successful requests' latency, with p50/p95/p99 marked."""
    from matplotlib.figure import Figure  # the OO API renders with Agg, whatever pyplot's backend

    latencies = np.sort([r["latency_s"] for r in report["requests_log"] if r["error"] is None])
    fig = Figure(figsize=(10, 4))
    hist, cdf = fig.subplots(1, 2)
    hist.hist(latencies, bins=int(np.clip(len(latencies) // 5, 5, 50)))
    hist.set(xlabel="latency (s)", ylabel="requests", title="Latency histogram")
    cdf.plot(latencies, np.arange(1, len(latencies) + 1) / max(len(latencies), 1), drawstyle="steps-post")
    for name, value in (report["latency_s"] or {}).items():
        if name in ("p50", "p95", "p99"):
            cdf.axvline(value, linestyle=":", color="gray")
            cdf.annotate(name, (value, 0.02), rotation=90)
    cdf.set(xlabel="latency (s)", ylabel="fraction of requests", title="Latency CDF")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return path


def plot_timeline(report: dict[str, Any], path: Path) -> Path:
    """Completion tokens/s and requests/s per second of the run, and replica counts over time."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 6))
    tokens_ax, replicas_ax = fig.subplots(2, 1, sharex=True)
    bins, wall_s = report["timeline"], report["wall_s"]
    edges = [b["t"] for b in bins] + [bins[-1]["t"] + bins[-1]["seconds"]]
    tokens_ax.stairs([b["tokens"] / b["seconds"] for b in bins], edges, fill=True, alpha=0.4)
    requests_ax = tokens_ax.twinx()
    requests_ax.stairs([b["requests"] / b["seconds"] for b in bins], edges, color="tab:orange", linestyle="--")
    tokens_ax.set(ylabel="completion tokens/s", title="Throughput (completions per second of the run)")
    requests_ax.set_ylabel("requests/s (dashed)", color="tab:orange")
    _plot_replicas(replicas_ax, report, wall_s)
    replicas_ax.set(xlabel="time (s)", ylabel="replicas", title="Replicas")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return path


def soak_rows(report: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per memory sample: its time, replica and resident MiB, and the completed requests, errors and
    completion tokens/s since the previous sample (the first: since the start)."""
    rows, last = [], 0.0
    for m in report["memory_samples"]:
        window = [r for r in report["requests_log"] if last < r["start_s"] + r["latency_s"] <= m["t"]]
        ok = [r for r in window if r["error"] is None]
        seconds = max(m["t"] - last, 1e-9)
        rows.append({"t_s": round(m["t"], 3), "replica": m["replica"], "rss_mib": round(m["rss_bytes"] / 2**20, 1),
                     "requests_ok": len(ok), "errors": len(window) - len(ok),
                     "tokens_per_s": round(sum(r["completion_tokens"] for r in ok) / seconds, 1) if m["t"] else None})
        last = m["t"]
    return rows


def write_soak_csv(report: dict[str, Any], path: Path) -> Path:
    rows = soak_rows(report)
    fields = ["t_s", "replica", "rss_mib", "requests_ok", "errors", "tokens_per_s"]
    lines = [",".join(fields)] + [",".join("" if row[f] is None else str(row[f]) for f in fields) for row in rows]
    path.write_text("\n".join(lines) + "\n")
    return path


def plot_soak(report: dict[str, Any], path: Path) -> Path:
    """The engine's resident memory and the completion tokens/s of each sampling interval over the run."""
    from matplotlib.figure import Figure

    rows = soak_rows(report)
    fig = Figure(figsize=(10, 6))
    memory_ax, tokens_ax = fig.subplots(2, 1, sharex=True)
    for replica in sorted({row["replica"] for row in rows}):
        mine = [row for row in rows if row["replica"] == replica]
        memory_ax.plot([r["t_s"] / 60 for r in mine], [r["rss_mib"] for r in mine], marker="o", label=replica)
    memory_ax.set(ylabel="resident memory (MiB)", title="Engine replica memory")
    memory_ax.legend(title="replica", fontsize="small")
    timed = [row for row in rows if row["tokens_per_s"] is not None]
    tokens_ax.plot([r["t_s"] / 60 for r in timed], [r["tokens_per_s"] for r in timed], marker="o")
    tokens_ax.set(xlabel="time (min)", ylabel="completion tokens/s", title="Throughput per sampling interval")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return path


def ramp_table(report: dict[str, Any]) -> str:
    """The ramp's phases as a Markdown table: a replicas column per deployment sampled ("1-3": min to max)."""
    phases = report["phases"]
    names = sorted({name for p in phases for name in p["replicas"]})

    def replicas(p: dict[str, Any], name: str) -> str:
        r = p["replicas"].get(name)
        return "n/a" if r is None else str(r["min"]) if r["min"] == r["max"] else f"{r['min']}-{r['max']}"

    def ms(p: dict[str, Any], key: str) -> str:
        return "n/a" if p["latency_s"] is None else f"{1000 * p['latency_s'][key]:.0f}"

    header = ["phase", "clients", "requests", "errors", "tokens/s", "p50 latency (ms)", "p95 latency (ms)",
              *(f"{name} replicas" for name in names)]  # fmt: skip
    rows = [[str(p["phase"]), str(p["clients"]), str(p["requests"]), str(p["errors"]), f"{p['tokens_per_s']:.1f}",
             ms(p, "p50"), ms(p, "p95"), *(replicas(p, name) for name in names)] for p in phases]  # fmt: skip
    return "\n".join("| " + " | ".join(row) + " |" for row in [header, ["---"] * len(header), *rows])


def plot_ramp(report: dict[str, Any], path: Path) -> Path:
    """Completion tokens/s per second of the run with the ramp's clients, and replicas per deployment over time;
    phase boundaries dotted."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(10, 6))
    tokens_ax, replicas_ax = fig.subplots(2, 1, sharex=True)
    bins, phases, wall_s = report["timeline"], report["phases"], report["wall_s"]
    edges = [b["t"] for b in bins] + [bins[-1]["t"] + bins[-1]["seconds"]]
    tokens_ax.stairs([b["tokens"] / b["seconds"] for b in bins], edges, fill=True, alpha=0.4)
    clients_ax = tokens_ax.twinx()
    clients_ax.stairs([p["clients"] for p in phases], [p["start_s"] for p in phases] + [phases[-1]["end_s"]],
                      color="tab:orange", linestyle="--", baseline=None)  # fmt: skip
    clients_ax.set_ylim(bottom=0)
    clients_ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    clients_ax.set_ylabel("clients (dashed)", color="tab:orange")
    tokens_ax.set(ylabel="completion tokens/s", title="Throughput and clients")
    _plot_replicas(replicas_ax, report, wall_s)
    for ax in (tokens_ax, replicas_ax):
        for p in phases[1:]:
            ax.axvline(p["start_s"], linestyle=":", color="gray")
    replicas_ax.set(xlabel="time (s)", ylabel="replicas (running)", title="Replicas per deployment")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return path


def write_report(report: dict[str, Any], out_dir: str | Path) -> list[Path]:
    """loadtest.json plus the plots (and soak.csv, soak.png where memory was sampled; ramp.md, ramp.png for a
    ramp); returns the paths written."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "loadtest.json").write_text(json.dumps(report, indent=1))
    paths = [out / "loadtest.json", plot_latency(report, out / "latency.png"),
             plot_timeline(report, out / "timeline.png")]  # fmt: skip
    if report["memory_samples"]:
        paths += [write_soak_csv(report, out / "soak.csv"), plot_soak(report, out / "soak.png")]
    if report.get("phases"):
        (out / "ramp.md").write_text(ramp_table(report) + "\n")
        paths += [out / "ramp.md", plot_ramp(report, out / "ramp.png")]
    return paths


def describe(report: dict[str, Any]) -> str:
    def ms(stats: dict[str, float] | None, key: str) -> str:
        return f"{1000 * stats[key]:.0f}ms" if stats else "n/a"

    req, thr, lat, ttft = report["requests"], report["throughput"], report["latency_s"], report["ttft_s"]
    accepted = report["mean_accepted_length"]
    text = (
        f"{req['ok']}/{req['total']} ok in {report['wall_s']:.1f}s, errors {report['errors'] or 0}; "
        f"{thr['requests_per_s']:.2f} req/s, {thr['tokens_per_s']:.1f} tok/s; latency p50 {ms(lat, 'p50')} "
        f"p95 {ms(lat, 'p95')} p99 {ms(lat, 'p99')}; ttft p50 {ms(ttft, 'p50')}; "
        f"mean accepted length {'n/a' if accepted is None else f'{accepted:.2f}'}"
    )
    if (memory := report.get("memory")) is not None:
        text += (f"; engine memory {memory['first_mib']:.0f} -> {memory['last_mib']:.0f} MiB (max "
                 f"{memory['max_mib']:.0f}; +{memory['growth_first_half_mib']:.0f} in the first half, "
                 f"+{memory['growth_second_half_mib']:.0f} in the second)")  # fmt: skip
    return text


# The CLI's defaults, plain and with --soak (a flag given on the command line wins over either).
PLAIN_DEFAULTS: dict[str, Any] = {"concurrency": 1, "duration": 30.0, "memory_interval": None}
SOAK_DEFAULTS: dict[str, Any] = {"concurrency": 8, "duration": 1800.0, "memory_interval": 30.0}


class _UsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        raise _UsageError(message)


def read_prompts(path: str | Path) -> tuple[str, ...]:
    """The "prompt" field of every line of a JSONL file (e.g. from `qa-traffic`)."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
        prompts = tuple(json.loads(line)["prompt"] for line in lines if line.strip())
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise _UsageError(f"cannot read prompts from {path}: {exc}") from None
    if not prompts:
        raise _UsageError(f"no prompts in {path}")
    return prompts


RAMP_PHASE_S = 30.0  # --phase-seconds' default


def parse_ramp(text: str | None, phase_s: float | None, *, soak: bool, concurrency: int | None,
               duration: float | None) -> tuple[int, ...] | None:
    """--ramp's client counts (None without it); _UsageError for a list that is not positive integers or a ramp
    combined with the flags it replaces."""
    if text is None:
        if phase_s is not None:
            raise _UsageError("--phase-seconds needs --ramp")
        return None
    clashes = [flag for flag, given in (("--soak", soak), ("--concurrency", concurrency is not None),
                                        ("--duration", duration is not None)) if given]  # fmt: skip
    if clashes:
        raise _UsageError(f"--ramp sets the clients and the duration itself: drop {', '.join(clashes)}")
    try:
        ramp = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise _UsageError(f"--ramp must be client counts separated by commas, e.g. 1,8,32,8,1, got {text!r}") from None
    if not all(1 <= c <= MAX_CONCURRENCY for c in ramp):
        raise _UsageError(f"--ramp client counts must be in [1, {MAX_CONCURRENCY}], got {text!r}")
    return ramp


def main(argv: list[str] | None = None, *, replica_reader: ReplicaReader | None = None) -> int:
    parser = _Parser(prog="ray_specdec loadtest", description="Load test a local ray_specdec server.")
    parser.add_argument("--url", required=True, help="base URL, loopback only, e.g. http://127.0.0.1:8000")
    parser.add_argument("--soak", action="store_true",
                        help=f"soak: the mixed requests, streamed, with the engine's memory sampled (defaults: "
                             f"concurrency {SOAK_DEFAULTS['concurrency']}, duration {SOAK_DEFAULTS['duration']:.0f} s, "
                             f"memory interval {SOAK_DEFAULTS['memory_interval']:.0f} s)")  # fmt: skip
    parser.add_argument("--concurrency", type=int, help="concurrent clients (default 1)")
    parser.add_argument("--duration", type=float, help="seconds during which requests start (default 30)")
    parser.add_argument("--memory-interval", type=float, help="seconds between reads of the engine's memory")
    parser.add_argument("--ramp", help="clients per phase, one phase after another, e.g. 1,8,32,8,1 (instead of "
                                       "--concurrency and --duration)")  # fmt: skip
    parser.add_argument("--phase-seconds", type=float, help="length of each ramp phase (default 30)")
    parser.add_argument("--sample-interval", type=float, default=1.0, help="seconds between replica count samples")
    parser.add_argument("--requests", type=int, help="stop after this many requests")
    parser.add_argument("--prompts", help="JSONL file with a 'prompt' field per line (default: a few built-in)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--stream", action="store_true", help="stream responses (measures time to first token)")
    parser.add_argument("--tree", help="tree config sent with every request, e.g. 3,2,2,1,1 or none")
    parser.add_argument("--timeout", type=float, default=120.0, help="per-request timeout in seconds")
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy requests; > 0: sampled")
    parser.add_argument("--out", default="runs/loadtest", help="directory for loadtest.json and plots")
    try:
        args = parser.parse_args(argv)
        prompts = read_prompts(args.prompts) if args.prompts else DEFAULT_PROMPTS
        defaults = SOAK_DEFAULTS if args.soak else PLAIN_DEFAULTS
        given = {k: getattr(args, k) for k in defaults if getattr(args, k) is not None}
        picked = defaults | given
        ramp = parse_ramp(args.ramp, args.phase_seconds, soak=args.soak, concurrency=args.concurrency,
                          duration=args.duration)  # fmt: skip
        config = LoadTestConfig(
            args.url, picked["concurrency"], picked["duration"], args.requests, prompts, args.max_tokens,
            args.stream or args.soak, args.tree, args.timeout, temperature=args.temperature, mix=args.soak,
            sample_interval_s=args.sample_interval, memory_interval_s=picked["memory_interval"], ramp=ramp,
            phase_s=RAMP_PHASE_S if args.phase_seconds is None else args.phase_seconds,
        )  # fmt: skip
    except (_UsageError, ValueError) as exc:
        print(f"loadtest: error: {exc}", file=sys.stderr)
        return 2
    report = asyncio.run(run_loadtest(config, replica_reader))
    paths = write_report(report, args.out)
    print(describe(report))
    if report["phases"]:
        print(ramp_table(report))
    print("wrote " + ", ".join(str(p) for p in paths))
    return 0
