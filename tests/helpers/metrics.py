"""Prometheus text as {(sample name, sorted labels): value}, scraped over HTTP or rendered in process, and a scripted
sequence of engine events with known counters."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

from ray_specdec.engine.stats import GenerationStats
from ray_specdec.serving import metrics as m

# (tree, depth, accepted, draft tokens) of request "a"'s rounds; each gives accepted + 1 tokens
ROUNDS_A = [("2,1", 2, 0, 4), ("2,1", 2, 2, 4), ("1,1", 2, 1, 2)]


def parse(text: bytes) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} of an exposition."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text.decode()) for s in family.samples}  # fmt: skip


def scrape_metrics(url: str) -> dict[tuple[str, tuple], float]:
    """GET /metrics (no API key), parsed: {(sample name, sorted label pairs): value}."""
    response = httpx.get(f"{url}/metrics", timeout=60, trust_env=False)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/plain; version=0.0.4")
    return parse(response.content)


def metric_sum(samples: dict[tuple[str, tuple], float], name: str, **labels: str) -> float:
    """The sum of a scrape's samples named `name` whose labels include `labels`."""
    return sum(v for (n, pairs), v in samples.items() if n == name and labels.items() <= dict(pairs).items())


def scripted() -> m.EngineMetrics:
    """Request "a": arrives at 0, admitted at 0.2, rounds end at 0.5, 0.5625, 0.75 (length); "b" arrives at 0.3 and
    leaves while waiting; "c": arrives at 1, admitted at once, one undrafted round, stops at 1.2."""
    rec = m.EngineMetrics()
    rec.arrived("a", 5, 0.0)
    rec.arrived("b", 7, 0.3)
    rec.admissions({"a", "b"}, 0.1)
    rec.admissions({"b"}, 0.2)
    stats = GenerationStats()
    for (tree, depth, accepted, drafted), t in zip(ROUNDS_A, (0.5, 0.5625, 0.75)):
        stats.record_round(tree, depth, accepted, drafted)
        rec.produced("a", accepted + 1, "length" if t == 0.75 else None, stats, t)
        if t != 0.75:  # a step that gave "a" no round (the stats as they were) counts nothing
            rec.produced("a", 0, None, stats, t)
    rec.ended("b", "abort", 0.7)
    rec.admissions(set(), 0.8)  # b is gone: not admitted
    rec.arrived("c", 3, 1.0)
    rec.admissions(set(), 1.0)
    plain = GenerationStats()
    plain.record_round("none", 0, 0, 0)
    rec.produced("c", 1, "stop", plain, 1.2)
    rec.scheduler_state(running=3, waiting=0, kv_reserved=900, kv_budget=1200, kv_waited=3)
    rec.scheduler_state(running=2, waiting=1, kv_reserved=300, kv_budget=1200, kv_waited=7)  # totals: the last stands
    rec.prefix_cache(queried=40, hits=10)
    rec.prefix_cache(queried=60, hits=25)  # totals: the last one stands
    rec.kv_pool({"rows": 2048, "free_rows": 1000, "packs": 1, "moved_rows": 300})
    rec.kv_pool({"rows": 4096, "free_rows": 3000, "packs": 2, "moved_rows": 420})  # totals: the last one stands
    rec.speculation({"drafted_share": 0.25, "cost_weights": {"fixed": 2e-3, "target_rows": 1e-4}})
    return rec
