"""The shipped monitoring config: every query of the Grafana dashboard names only metrics (and labels) the app
exports, and the Prometheus scrape config reads GET /metrics."""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml
from prometheus_client.parser import text_string_to_metric_families

from ray_specdec.serving import metrics as m
from ray_specdec.speculation.bandit import Bandit, BanditConfig
from tests.helpers.metrics import scripted

DEPLOYMENTS = Path(__file__).resolve().parents[2] / "deployments"
# PromQL words in the dashboard's queries that are not label names
GROUPING = re.compile(r"\b(?:by|ignoring|on|without)\s*\(([^)]*)\)")


def exported() -> tuple[set[str], set[str]]:
    """(sample names, label names) of a render with every kind of metric populated."""
    routes = m.RouterMetrics(lambda: 1)
    routes.record("ok")
    bandit = Bandit(BanditConfig())
    bandit.record(bandit.arms[0], 100, 2, 0.01)
    shared = m.bandit_gauges(bandit.summary())
    text = m.render({"engine/a": scripted().snapshot(), "router/b": routes.snapshot()}, shared).decode()
    samples = [s for family in text_string_to_metric_families(text) for s in family.samples]
    names = {s.name for s in samples}
    assert {n.removesuffix("_total") for n in names if not n.endswith(("_bucket", "_sum", "_count"))} >= {
        name for name, metric in m.METRICS.items() if metric.kind != m.HISTOGRAM}  # every metric is in the render
    return names, {label for s in samples for label in s.labels}


def queries() -> list[str]:
    dashboard = json.loads((DEPLOYMENTS / "grafana_dashboard.json").read_text())
    return [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]


def test_every_dashboard_query_names_exported_metrics_and_labels():
    names, labels = exported()
    exprs = queries()
    assert len(exprs) >= 12
    for expr in exprs:
        used = set(re.findall(r"ray_specdec:[A-Za-z0-9_:]+", expr))
        assert used and used <= names, (expr, used - names)
        grouped = {label.strip() for group in GROUPING.findall(expr) for label in group.split(",") if label.strip()}
        assert grouped <= labels, (expr, grouped - labels)
    everything = " ".join(exprs)
    for name in (m.TTFT, m.ITL, m.E2E, m.QUEUE, m.RUNNING, m.WAITING, m.KV_USAGE, m.ACCEPTED_PER_POS, m.ROUNDS,
                 m.KV_POOL_FREE, m.KV_POOL_MOVED):
        assert name in everything, name


def test_the_scrape_config_reads_the_apps_metrics_route():
    config = yaml.safe_load((DEPLOYMENTS / "prometheus.yml").read_text())
    (job,) = config["scrape_configs"]
    assert job["metrics_path"] == "/metrics" and len(job["static_configs"][0]["targets"]) == 1
