"""Serve's direct ingress (`direct_ingress`, on for `serve run`): the engine replica answers HTTP on a port of its own,
and a request there gives exactly what it gives through the proxy, errors included."""

from __future__ import annotations

import httpx
import pytest
from ray.serve.schema import Target, TargetGroup

from deployments import AppArgs
from deployments.app import DIRECT_INGRESS_DRAIN_ENV, DIRECT_INGRESS_ENV
from deployments.ingress import target_urls
from tests.helpers.bigram import PROMPTS, greedy_reference
from tests.helpers.serve import post, serve_app, sse_chunks

MAX_TOKENS = 24


@pytest.fixture(scope="module")
def urls(model_dirs):
    """(the proxy's URL, the engine replica's own), from a Ray whose Serve runs direct ingress."""
    target, drafter = model_dirs
    args = AppArgs(target=str(target), drafter=str(drafter), num_cpus_per_rank=0.5)
    with serve_app(args, env={DIRECT_INGRESS_ENV: "1"} | DIRECT_INGRESS_DRAIN_ENV) as proxy:
        from benchmarks.serve_peers_servers import direct_url

        yield proxy, direct_url(proxy)


@pytest.fixture(scope="module")
def reference(engine) -> dict[str, list[int]]:
    return greedy_reference(engine, MAX_TOKENS)


def test_the_replica_names_its_own_loopback_address(urls):
    proxy, direct = urls
    assert direct.startswith("http://127.0.0.1:") and direct != proxy
    stats = httpx.get(f"{direct}/v1/stats", timeout=60, trust_env=False).json()
    assert stats["direct_urls"] == [direct] and stats["replicas"]["engine"] == 1
    assert httpx.get(f"{direct}/health", timeout=60, trust_env=False).status_code == 200


def test_greedy_through_the_replicas_port_is_the_target_alone(urls, reference):
    proxy, direct = urls
    for prompt in PROMPTS:
        body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
        there = post(direct, body)
        assert there.status_code == 200, there.text
        assert there.json()["choices"][0]["token_ids"] == reference[prompt]
        streamed = sse_chunks(post(direct, body | {"stream": True}))
        assert [t for c in streamed for t in c["choices"][0]["token_ids"]] == reference[prompt]
        assert post(proxy, body).json()["choices"][0]["token_ids"] == reference[prompt]


@pytest.mark.parametrize("body, status", [({"prompt": PROMPTS[0], "max_tokens": 0}, 400),
                                          ({"prompt": PROMPTS[0], "max_tokens": 10**6}, 400)])
def test_bad_input_gets_the_same_error_there(urls, body, status):
    proxy, direct = urls
    there, via_proxy = post(direct, body), post(proxy, body)
    assert there.status_code == via_proxy.status_code == status
    assert there.json() == via_proxy.json() and there.json()["error"]["message"]


def test_target_urls_follow_the_host_the_replicas_bind():
    """Serve's target groups name each replica by its node's IP; a replica binds the app's HTTP host, which
    `serve run` leaves unset (Serve's loopback default)."""
    def group(app, protocol, *ports, prefix="/"):
        targets = [Target(ip="10.0.0.7", port=p, instance_id="node", name=f"r{p}") for p in ports]
        return TargetGroup(targets=targets, route_prefix=prefix, protocol=protocol, app_name=app)

    groups = [group("specdec", "HTTP", 30001, 30000), group("specdec", "gRPC", 40000), group("other", "HTTP", 30002)]
    assert target_urls(groups, "specdec", None) == ["http://127.0.0.1:30000", "http://127.0.0.1:30001"]
    assert target_urls(groups, "specdec", "127.0.0.1") == target_urls(groups, "specdec", None)
    assert target_urls(groups, "specdec", "0.0.0.0") == ["http://10.0.0.7:30000", "http://10.0.0.7:30001"]
    assert target_urls([group("other", "HTTP", 30002, prefix="/other/")], "other", None) == [
        "http://127.0.0.1:30002/other"]
    assert target_urls(groups, "missing", None) == []


def test_target_urls_leave_out_the_proxies_serve_names_while_no_replica_runs():
    """Before the app's first replica runs (and after its last is lost) Serve's target groups name its proxies, at
    the app's HTTP port: the startup log once announced the proxy's port 8000 as the replica's own address."""
    proxies = TargetGroup(targets=[Target(ip="10.0.0.7", port=8000, instance_id="node", name="SERVE_PROXY_ACTOR-x")],
                          route_prefix="/", protocol="HTTP", app_name="specdec")
    assert target_urls([proxies], "specdec", None, proxy_port=8000) == []
    assert target_urls([proxies], "specdec", None) == ["http://127.0.0.1:8000"]  # no proxy port given: kept
    running = TargetGroup(targets=[Target(ip="10.0.0.7", port=30000, instance_id="node", name="SERVE_REPLICA::r")],
                          route_prefix="/", protocol="HTTP", app_name="specdec")
    assert target_urls([running], "specdec", None, proxy_port=8000) == ["http://127.0.0.1:30000"]
