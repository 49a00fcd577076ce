"""Metrics without Ray: a scripted sequence of engine events gives exact counters and histogram buckets, replicas'
snapshots sum, stale replicas keep their counters but not their gauges, and the text parses as Prometheus'."""

from __future__ import annotations

import pytest

from ray_specdec.config import TreeConfig
from ray_specdec.serving import metrics as m
from ray_specdec.speculation.bandit import BanditConfig, BanditHub
from tests.helpers.metrics import parse, scripted

# (tree, depth, accepted, draft tokens) of request "a"'s rounds; each gives accepted + 1 tokens


def test_counters_are_exact_for_a_scripted_sequence():
    snap = scripted().snapshot()
    counters = {name: series for name, series in snap.items() if m.METRICS[name].kind == m.COUNTER}
    assert counters == {
        m.PROMPT_TOKENS: {(): 5 + 3},
        m.GENERATION_TOKENS: {(): 1 + 3 + 2 + 1},
        m.REQUEST_SUCCESS: {("length",): 1, ("abort",): 1, ("stop",): 1},
        m.DRAFTS: {(): 3},
        m.DRAFT_TOKENS: {(): 10},
        m.ACCEPTED: {(): 3},
        m.ACCEPTED_PER_POS: {("0",): 2, ("1",): 1},
        m.DRAFTS_PER_POS: {("0",): 3, ("1",): 3},
        m.ROUNDS: {("2,1",): 2, ("1,1",): 1, ("none",): 1},
        m.PREFIX_QUERIES: {(): 60},
        m.PREFIX_HITS: {(): 25},
        m.KV_WAITS: {(): 7},
        m.KV_POOL_PACKS: {(): 2},
        m.KV_POOL_MOVED: {(): 420},
    }
    assert snap[m.RUNNING] == {(): 2} and snap[m.WAITING] == {(): 1} and snap[m.KV_USAGE] == {(): 0.25}
    assert snap[m.KV_POOL_ROWS] == {(): 4096} and snap[m.KV_POOL_FREE] == {(): 3000}


def test_histograms_count_each_observation_in_its_bucket():
    samples = parse(m.render({"r1": scripted().snapshot()}))

    def bucket(name: str, le: str) -> float:
        return samples[(f"{name}_bucket", (("le", le),))]

    # TTFT: a 0.5 s (a bound: le is inclusive), c 0.2 s
    assert [bucket(m.TTFT, le) for le in ("0.1", "0.25", "0.5", "+Inf")] == [0, 1, 2, 2]
    assert samples[(f"{m.TTFT}_sum", ())] == pytest.approx(0.7) and samples[(f"{m.TTFT}_count", ())] == 2
    # ITL: one per round after the first with tokens, 0.0625 and 0.1875 s
    assert [bucket(m.ITL, le) for le in ("0.05", "0.075", "0.15", "0.2", "+Inf")] == [0, 1, 1, 2, 2]
    assert samples[(f"{m.ITL}_sum", ())] == 0.25
    # queue: a 0.2 s, c 0 s; b left while waiting
    assert samples[(f"{m.QUEUE}_count", ())] == 2 and samples[(f"{m.QUEUE}_sum", ())] == pytest.approx(0.2)
    assert bucket(m.QUEUE, "0.3") == 2
    # e2e: finished requests only (a 0.75 s, c 0.2 s), not the aborted one
    assert [bucket(m.E2E, le) for le in ("0.3", "0.8", "+Inf")] == [1, 2, 2]


def test_replicas_sum_and_gauges_keep_their_replica():
    one, two = scripted().snapshot(), scripted().snapshot()
    two[m.RUNNING] = {(): 5}
    samples = parse(m.render({"engine/a": one, "engine/b": two}))
    assert samples[(f"{m.ACCEPTED}_total", ())] == 6
    assert samples[(f"{m.ROUNDS}_total", (("tree", "2,1"),))] == 4
    assert samples[(f"{m.REQUEST_SUCCESS}_total", (("finished_reason", "abort"),))] == 2
    assert samples[(f"{m.TTFT}_bucket", (("le", "0.25"),))] == 2 and samples[(f"{m.TTFT}_count", ())] == 4
    assert samples[(m.RUNNING, (("replica", "engine/a"),))] == 2
    assert samples[(m.RUNNING, (("replica", "engine/b"),))] == 5


def test_an_empty_app_exports_zeroed_unlabelled_series():
    samples = parse(m.render({}))
    assert samples[(f"{m.DRAFTS}_total", ())] == 0 and samples[(f"{m.E2E}_count", ())] == 0
    assert not any(name == m.RUNNING for name, _ in samples)


def test_a_stale_replica_keeps_its_counters_but_not_its_gauges():
    now = [0.0]
    store = m.MetricsStore(stale_after_s=10.0, clock=lambda: now[0])
    store.push("engine/a", scripted().snapshot())
    now[0] = 5.0
    store.push("engine/b", scripted().snapshot())
    now[0] = 12.0
    snaps = store.snapshots()
    assert m.RUNNING not in snaps["engine/a"] and snaps["engine/a"][m.DRAFTS] == {(): 3}
    assert snaps["engine/b"][m.RUNNING] == {(): 2}


def test_router_outcomes_and_in_flight():
    in_flight = [3]
    rec = m.RouterMetrics(lambda: in_flight[0])
    for status in ("ok", "ok", "rejected"):
        rec.record(status)
    assert rec.snapshot() == {m.ROUTER_REQUESTS: {("ok",): 2, ("rejected",): 1}, m.ROUTER_IN_FLIGHT: {(): 3}}
    samples = parse(m.render({"router/x": rec.snapshot()}))
    assert samples[(m.ROUTER_IN_FLIGHT, (("replica", "router/x"),))] == 3


def test_the_bandits_summary_becomes_gauges():
    arms = (TreeConfig((2, 1)), TreeConfig((1,)))
    hub = BanditHub(BanditConfig(arms=arms))
    samples = parse(m.render({}, m.bandit_gauges(hub.summary())))
    pulls = {labels: v for (name, labels), v in samples.items() if name == m.BANDIT_PULLS}
    assert len(pulls) == len(hub.summary()["buckets"]) * len(arms) and set(pulls.values()) == {0}
    assert m.bandit_gauges(None) == {m.BANDIT_PULLS: {}, m.BANDIT_REWARD: {}, m.BANDIT_BEST: {}}
