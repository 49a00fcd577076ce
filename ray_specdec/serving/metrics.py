"""Prometheus metrics of the serving app, without Ray: what each replica records, and the text a scraper reads.

`EngineMetrics` belongs to an engine replica's `EngineLoop` and records its requests and steps; `RouterMetrics`
counts the outcomes of the HTTP routes. Both hold cumulative numbers since their replica started and hand out a
picklable `snapshot()`. Every replica pushes its snapshot to one `MetricsStore` for the app (a Ray actor in
deployments/metrics.py), and `render` turns all of them into Prometheus' text format: counters and histograms summed
over replicas (a replica that is gone keeps its last numbers, so no sum ever falls), gauges with a `replica` label.
`METRICS` is the one list of what is exported; names are vLLM v1's with `ray_specdec:` for `vllm:` (docs/METRICS.md).

Speculative decoding, per round (one draft + verify of one request), in vLLM's terms:
- a draft: a round that verified a drafted tree (at least one draft token); a round without a tree is none;
- draft tokens: the drafted nodes the target verified (lookup nodes included), on the accepted path or not;
- accepted tokens: draft tokens the target kept, the bonus token excluded; accepted tokens per position p: rounds
  that accepted a token at depth p + 1 (positions count from 0, as vLLM's do).
Latencies are the engine's (time.monotonic in the replica), from a request's arrival at `EngineLoop.generate`:
- time to first token: to the end of the step whose round gave its first token;
- inter-token latency: from one round that gave the request tokens to its next, observed once per round whatever
  the number of tokens (as vLLM v1 observes once per engine step); rounds that a stream merges into one chunk
  (stream_interval_s) still count one by one;
- queue time: to admission (the start of the step that admitted it, or its `add` when there was room at once);
- end-to-end: to the end of the step of its last round (requests that finished: stop or length).
"""

from __future__ import annotations

import bisect
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

from prometheus_client import CONTENT_TYPE_PLAIN_0_0_4, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.utils import floatToGoString

from ray_specdec.engine.stats import GenerationStats

CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4
COUNTER, HISTOGRAM, GAUGE = "counter", "histogram", "gauge"
# {metric name: {label values: value}}; a histogram's value: its count per bucket (the last one +Inf), then the sum
Snapshot = dict[str, dict[tuple[str, ...], float | list[float]]]

# vLLM v1's buckets (vllm/v1/metrics/loggers.py), so that dashboards and SLOs written for vLLM read the same.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0)  # fmt: skip
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                   480.0, 960.0, 1920.0, 7680.0)  # fmt: skip


@dataclass(frozen=True)
class Metric:
    name: str
    kind: str  # COUNTER, HISTOGRAM or GAUGE
    help: str
    labels: tuple[str, ...] = ()  # a gauge's "replica" is the pushing replica's id, filled in by render
    buckets: tuple[float, ...] = ()  # histograms: upper bounds (+Inf implied)


PROMPT_TOKENS = "ray_specdec:prompt_tokens"
GENERATION_TOKENS = "ray_specdec:generation_tokens"
REQUEST_SUCCESS = "ray_specdec:request_success"
DRAFTS = "ray_specdec:spec_decode_num_drafts"
DRAFT_TOKENS = "ray_specdec:spec_decode_num_draft_tokens"
ACCEPTED = "ray_specdec:spec_decode_num_accepted_tokens"
ACCEPTED_PER_POS = "ray_specdec:spec_decode_num_accepted_tokens_per_pos"
DRAFTS_PER_POS = "ray_specdec:spec_decode_num_drafts_per_pos"
ROUNDS = "ray_specdec:rounds"
TTFT = "ray_specdec:time_to_first_token_seconds"
ITL = "ray_specdec:inter_token_latency_seconds"
E2E = "ray_specdec:e2e_request_latency_seconds"
QUEUE = "ray_specdec:request_queue_time_seconds"
PREFIX_QUERIES = "ray_specdec:prefix_cache_queries"
PREFIX_HITS = "ray_specdec:prefix_cache_hits"
RUNNING = "ray_specdec:num_requests_running"
WAITING = "ray_specdec:num_requests_waiting"
KV_USAGE = "ray_specdec:kv_cache_usage_perc"
KV_WAITS = "ray_specdec:kv_cache_waits"
KV_POOL_ROWS = "ray_specdec:kv_pool_rows"
KV_POOL_FREE = "ray_specdec:kv_pool_free_rows"
KV_POOL_PACKS = "ray_specdec:kv_pool_packs"
KV_POOL_MOVED = "ray_specdec:kv_pool_moved_rows"
ROUTER_REQUESTS = "ray_specdec:router_requests"
ROUTER_IN_FLIGHT = "ray_specdec:router_requests_in_flight"
BANDIT_PULLS = "ray_specdec:bandit_arm_pulls"
BANDIT_REWARD = "ray_specdec:bandit_arm_mean_reward"
BANDIT_BEST = "ray_specdec:bandit_best_arm"
DRAFTED_SHARE = "ray_specdec:speculation_drafted_share"
STEP_COST = "ray_specdec:speculation_step_cost_seconds"

METRICS = {m.name: m for m in (
    Metric(PROMPT_TOKENS, COUNTER, "Prompt tokens of requests that got their first token."),
    Metric(GENERATION_TOKENS, COUNTER, "Generated tokens (after stop checks)."),
    Metric(REQUEST_SUCCESS, COUNTER, "Requests that ended, by reason: stop, length, abort (the client left), error "
           "(the target was lost).", ("finished_reason",)),
    Metric(DRAFTS, COUNTER, "Rounds that verified a drafted tree."),
    Metric(DRAFT_TOKENS, COUNTER, "Drafted tokens the target verified (every tree node)."),
    Metric(ACCEPTED, COUNTER, "Drafted tokens the target accepted (bonus tokens excluded)."),
    Metric(ACCEPTED_PER_POS, COUNTER, "Rounds that accepted a drafted token at depth position + 1.", ("position",)),
    Metric(DRAFTS_PER_POS, COUNTER, "Rounds whose drafted tree reached depth position + 1.", ("position",)),
    Metric(ROUNDS, COUNTER, "Draft + verify rounds by the tree they drafted (the speculation controller's choice; "
           "none: no draft).", ("tree",)),
    Metric(TTFT, HISTOGRAM, "Time to first token in seconds.", buckets=TTFT_BUCKETS),
    Metric(ITL, HISTOGRAM, "Seconds between a request's rounds that gave tokens (one observation per round).",
           buckets=ITL_BUCKETS),
    Metric(E2E, HISTOGRAM, "End-to-end latency of finished requests in seconds.", buckets=REQUEST_BUCKETS),
    Metric(QUEUE, HISTOGRAM, "Seconds from arrival to admission (KV reserved).", buckets=REQUEST_BUCKETS),
    Metric(PREFIX_QUERIES, COUNTER, "Prompt tokens looked up in the prefix cache at admission."),
    Metric(PREFIX_HITS, COUNTER, "Prompt tokens found in the prefix cache (copied, not prefilled)."),
    Metric(RUNNING, GAUGE, "Requests admitted (prefilling or decoding).", ("replica",)),
    Metric(WAITING, GAUGE, "Requests waiting for admission.", ("replica",)),
    Metric(KV_USAGE, GAUGE, "KV budget reserved by admitted requests (1 means 100 percent).", ("replica",)),
    Metric(KV_WAITS, COUNTER, "Rounds a decoding request skipped because its KV could not grow within the budget "
           "(kv_grow; it keeps its cache and goes on when rows free: no preemption)."),
    Metric(KV_POOL_ROWS, GAUGE, "Token rows the target's KV pool holds per layer (pooled caches: CUDA's default).",
           ("replica",)),
    Metric(KV_POOL_FREE, GAUGE, "Of those, rows no request's cache holds.", ("replica",)),
    Metric(KV_POOL_PACKS, COUNTER, "Times the KV pool slid caches together to free a range at its end."),
    Metric(KV_POOL_MOVED, COUNTER, "Rows the KV pool copied to pack or to move a growing cache."),
    Metric(ROUTER_REQUESTS, COUNTER, "HTTP outcomes: ok (per choice), rejected (4xx), error (5xx or an error event "
           "in a stream), cancelled (the client left).", ("status",)),
    Metric(ROUTER_IN_FLIGHT, GAUGE, "Choices the routes are serving.", ("replica",)),
    Metric(BANDIT_PULLS, GAUGE, "The bandit's rounds per tree, context bucket and load level.",
           ("bucket", "load", "tree")),
    Metric(BANDIT_REWARD, GAUGE, "The bandit's mean reward per tree, context bucket and load level.",
           ("bucket", "load", "tree")),
    Metric(BANDIT_BEST, GAUGE, "1 for the bandit's current best tree of each context bucket and load level.",
           ("bucket", "load", "tree")),
    Metric(DRAFTED_SHARE, GAUGE, "Share of the rounds the speculation controller chose a drafted tree for, since "
           "the replica started.", ("replica",)),
    Metric(STEP_COST, GAUGE, "The speculation controller's step cost model: seconds per unit of each feature of a "
           "step (fixed, target_rows, verify_row_kilotokens, drafting, drafter_rows, replays).",
           ("feature", "replica")),
)}  # fmt: skip


class Recorder:
    """Numbers of METRICS by label values. Recorded on one thread, snapshot on another: both under a lock."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values: Snapshot = {}

    def snapshot(self) -> Snapshot:
        with self._lock:
            return {name: {labels: list(v) if isinstance(v, list) else v for labels, v in series.items()}
                    for name, series in self._values.items()}  # fmt: skip

    def _inc(self, name: str, amount: float = 1, labels: tuple[str, ...] = ()) -> None:
        series = self._values.setdefault(name, {})
        series[labels] = series.get(labels, 0) + amount

    def _observe(self, name: str, value: float) -> None:
        bounds = METRICS[name].buckets
        row = self._values.setdefault(name, {}).setdefault((), [0] * (len(bounds) + 2))
        row[bisect.bisect_left(bounds, value)] += 1  # the first bucket whose bound is >= value
        row[-1] += value

    def _set(self, name: str, value: float, labels: tuple[str, ...] = ()) -> None:
        self._values.setdefault(name, {})[labels] = value


@dataclass
class _Live:
    arrival: float
    prompt_tokens: int
    last: float | None = None  # when its latest round with tokens ended
    # its rounds already in the counters: GenerationStats' totals as of the last look
    rounds: int = 0
    drafts: int = 0
    draft_tokens: int = 0
    reached: list[int] = field(default_factory=list)
    offered: list[int] = field(default_factory=list)
    trees: dict[str, int] = field(default_factory=dict)


class EngineMetrics(Recorder):
    """One engine replica's requests and scheduler. The loop's thread records (times from time.monotonic)."""

    def __init__(self) -> None:
        super().__init__()
        self._live: dict[str, _Live] = {}
        self._queued: set[str] = set()  # arrived, not admitted yet

    def arrived(self, request_id: str, prompt_tokens: int, t: float) -> None:
        """The request entered the scheduler; `t`: when it reached the engine."""
        with self._lock:
            self._live[request_id] = _Live(t, prompt_tokens)
            self._queued.add(request_id)

    def admissions(self, waiting: Iterable[str], t: float) -> None:
        """Requests that arrived and are no longer `waiting` (ids; read only while some arrived and were not
        admitted yet) were admitted at `t`."""
        with self._lock:
            if not self._queued:
                return
            waiting = set(waiting)
            for request_id in self._queued - waiting:
                self._observe(QUEUE, t - self._live[request_id].arrival)
            self._queued &= waiting

    def produced(self, request_id: str, num_tokens: int, finish_reason: str | None, stats: GenerationStats,
                 t: float) -> None:
        """One round of the request ended at `t`: `num_tokens` new tokens; stats: the request's so far."""
        with self._lock:
            live = self._live.get(request_id)
            if live is None:
                return
            if num_tokens:
                if live.last is None:
                    self._observe(TTFT, t - live.arrival)
                    self._inc(PROMPT_TOKENS, live.prompt_tokens)
                else:
                    self._observe(ITL, t - live.last)
                live.last = t
                self._inc(GENERATION_TOKENS, num_tokens)
            if stats.rounds != live.rounds:
                self._count_rounds(live, stats)
            if finish_reason is not None:
                self._end(request_id, finish_reason, t)

    def ended(self, request_id: str, reason: str, t: float) -> None:
        """The request left without a last round: "abort" (its client left) or "error" (the target was lost)."""
        with self._lock:
            if request_id in self._live:
                self._end(request_id, reason, t)

    def scheduler_state(self, running: int, waiting: int, kv_reserved: int, kv_budget: int, kv_waited: int = 0) -> None:
        """The scheduler's gauges, and its rounds skipped for KV since the replica started (a counter's total)."""
        with self._lock:
            self._set(RUNNING, running)
            self._set(WAITING, waiting)
            self._set(KV_USAGE, kv_reserved / kv_budget)
            self._set(KV_WAITS, kv_waited)

    def kv_pool(self, stats: dict[str, int]) -> None:
        """The target's KV pool (`KVPool.stats()`): its rows and free rows now, packs and rows moved since it began."""
        with self._lock:
            self._set(KV_POOL_ROWS, stats["rows"])
            self._set(KV_POOL_FREE, stats["free_rows"])
            self._set(KV_POOL_PACKS, stats["packs"])
            self._set(KV_POOL_MOVED, stats["moved_rows"])

    def prefix_cache(self, queried: int, hits: int) -> None:
        """The prefix cache's totals since the replica started (prompt tokens looked up, found)."""
        with self._lock:
            self._set(PREFIX_QUERIES, queried)
            self._set(PREFIX_HITS, hits)

    def speculation(self, summary: dict) -> None:
        """The speculation controller's state (`SpeculationController.summary()`)."""
        with self._lock:
            if summary["drafted_share"] is not None:
                self._set(DRAFTED_SHARE, float(summary["drafted_share"]))
            for feature, seconds in summary["cost_weights"].items():
                self._set(STEP_COST, float(seconds), (feature,))

    def _count_rounds(self, live: _Live, stats: GenerationStats) -> None:
        """The spec-decode counters of the request's rounds since the last look (`stats`: its totals so far). Every
        step calls this for every request: plain differences of a few numbers. (Counts only grow: a smaller total
        counts nothing.)"""
        for name, now, before in ((DRAFTS, stats.drafts, live.drafts),
                                  (DRAFT_TOKENS, stats.draft_tokens, live.draft_tokens)):  # fmt: skip
            if now > before:
                self._inc(name, now - before)
        accepted = self._inc_per_position(ACCEPTED_PER_POS, stats.reached_depth, live.reached)
        if accepted:  # a round that kept k tokens reached depths 1..k
            self._inc(ACCEPTED, accepted)
        self._inc_per_position(DRAFTS_PER_POS, stats.offered_depth, live.offered)
        for tree, n in stats.trees.items():
            if n > live.trees.get(tree, 0):
                self._inc(ROUNDS, n - live.trees.get(tree, 0), (tree,))
        live.rounds, live.drafts, live.draft_tokens = stats.rounds, stats.drafts, stats.draft_tokens
        live.reached, live.offered, live.trees = list(stats.reached_depth), list(stats.offered_depth), dict(stats.trees)

    def _inc_per_position(self, name: str, now: list[int], before: list[int]) -> int:
        """Counts per depth position since `before` (both cumulative) into the counter; -> their sum."""
        total = 0
        for p, n in enumerate(now):
            delta = n - (before[p] if p < len(before) else 0)
            if delta > 0:
                self._inc(name, delta, (str(p),))
                total += delta
        return total

    def _end(self, request_id: str, reason: str, t: float) -> None:
        live = self._live.pop(request_id)
        self._queued.discard(request_id)
        self._inc(REQUEST_SUCCESS, 1, (reason,))
        if reason in ("stop", "length"):
            self._observe(E2E, t - live.arrival)


class RouterMetrics(Recorder):
    """The HTTP routes' outcomes (ROUTER_REQUESTS), and the choices in flight (`in_flight()`, read at snapshot)."""

    def __init__(self, in_flight: Callable[[], int]):
        super().__init__()
        self.in_flight = in_flight

    def record(self, status: str) -> None:
        with self._lock:
            self._inc(ROUTER_REQUESTS, 1, (status,))

    def snapshot(self) -> Snapshot:
        with self._lock:
            self._set(ROUTER_IN_FLIGHT, self.in_flight())
        return super().snapshot()


class MetricsStore:
    """The app's metrics: every replica's latest snapshot (by replica id). A replica not heard from for
    `stale_after_s` keeps its counters and histograms (sums since it started: dropping them would make the app's
    sums fall) but not its gauges (they describe a replica that may be gone)."""

    def __init__(self, stale_after_s: float = 10.0, clock: Callable[[], float] = time.monotonic):
        self.stale_after_s = stale_after_s
        self._clock = clock
        self._latest: dict[str, tuple[float, Snapshot]] = {}

    def push(self, replica: str, snapshot: Snapshot) -> None:
        self._latest[replica] = (self._clock(), snapshot)

    def snapshots(self) -> dict[str, Snapshot]:
        now = self._clock()
        return {replica: snap if now - t <= self.stale_after_s else _without_gauges(snap)
                for replica, (t, snap) in self._latest.items()}  # fmt: skip


def _without_gauges(snapshot: Snapshot) -> Snapshot:
    return {name: series for name, series in snapshot.items() if METRICS[name].kind != GAUGE}


def bandit_gauges(summary: dict | None) -> Snapshot:
    """The bandit hub's summary (`GET /v1/bandit`) as gauges (labels: the cell's bucket, e.g. "greedy <1k", its load
    level, e.g. "2-4", and the tree)."""
    pulls, reward, best = {}, {}, {}
    for bucket in (summary or {}).get("buckets", []):
        for arm in bucket["arms"]:
            key = (bucket["bucket"], bucket["load"], arm["tree"])
            pulls[key] = arm["pulls"]
            if arm["mean_reward"] is not None:
                reward[key] = arm["mean_reward"]
            best[key] = float(arm["tree"] == bucket["best"])
    return {BANDIT_PULLS: pulls, BANDIT_REWARD: reward, BANDIT_BEST: best}


def render(snapshots: dict[str, Snapshot], shared: Snapshot | None = None) -> bytes:
    """Prometheus text (format 0.0.4) of replicas' snapshots (by replica id) and app-wide gauges (`shared`)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector(snapshots, shared or {}))
    return generate_latest(registry)


class _Collector:
    def __init__(self, snapshots: dict[str, Snapshot], shared: Snapshot):
        self.snapshots, self.shared = snapshots, shared

    def collect(self):
        for m in METRICS.values():
            if m.kind == GAUGE:
                family = GaugeMetricFamily(m.name, m.help, labels=m.labels)
                for labels, value in sorted(self._gauge(m).items()):
                    family.add_metric(labels, value)
            elif m.kind == COUNTER:
                family = CounterMetricFamily(m.name, m.help, labels=m.labels)
                for labels, value in sorted(self._summed(m).items()):
                    family.add_metric(labels, value)
            else:
                family = HistogramMetricFamily(m.name, m.help, labels=m.labels)
                for labels, row in sorted(self._summed(m).items()):
                    family.add_metric(labels, _cumulative(m.buckets, row), row[-1])
            yield family

    def _summed(self, m: Metric) -> dict[tuple[str, ...], float | list[float]]:
        zero = [0] * (len(m.buckets) + 2) if m.kind == HISTOGRAM else 0
        total = {(): zero} if not m.labels else {}  # an unlabelled series exists before its first event
        for snap in self.snapshots.values():
            for labels, value in snap.get(m.name, {}).items():
                old = total.get(labels, zero)
                total[labels] = [a + b for a, b in zip(old, value)] if m.kind == HISTOGRAM else old + value
        return total

    def _gauge(self, m: Metric) -> dict[tuple[str, ...], float]:
        if "replica" not in m.labels:
            return dict(self.shared.get(m.name, {}))
        return {(*labels, replica): value for replica, snap in self.snapshots.items()
                for labels, value in snap.get(m.name, {}).items()}  # fmt: skip


def _cumulative(bounds: Sequence[float], row: list[float]) -> list[tuple[str, float]]:
    """Per-bucket counts as Prometheus' cumulative (le, count) pairs, +Inf last."""
    out, running = [], 0
    for bound, count in zip([*bounds, float("inf")], row):
        running += count
        out.append((floatToGoString(bound), running))
    return out
