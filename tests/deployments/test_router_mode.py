"""ingress=router over real HTTP: router replicas in front of two engine replicas (one local Ray, tiny float32 models).

The default shape (ingress=engine, tests/deployments/test_app_http.py) answers HTTP in the engine replicas, so a
replica that dies takes its requests with it. Router mode pays a hop per chunk for the opposite: a request whose engine
replica dies mid-stream continues on the other from the tokens it has streamed (ray_specdec/serving/router.py), and
greedy output is still exactly the target's.
"""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
import ray

from deployments import AppArgs
from deployments.app import PROXY_GUARD_ENV
from ray_specdec.serving.proxy_guard import HEADER_MARGIN_S, HEALTH_DEADLINE_S
from tests.helpers.bigram import LONG_TOKENS, PROMPTS
from tests.helpers.serve import HealthPoller, post, serve_app

MAX_TOKENS = LONG_TOKENS  # long enough that the streams still run while the test reads which replica holds some
# A probe the guard answered 503 at its deadline (less the margin of Serve's own timeout header): the replica it
# reached was slow, not gone.
PROBE_LATE_S = HEALTH_DEADLINE_S - HEADER_MARGIN_S
KILL_TRIES = 4  # a try where the test never sees a replica holding streams kills nothing and proves nothing: again


@pytest.fixture(scope="module")
def url(long_model_dirs):
    target, drafter = long_model_dirs
    args = AppArgs(target=str(target), drafter=str(drafter), ingress="router", replicas=2, num_cpus_per_rank=0.5,
                   stream_interval_s=0, retry_s=60)  # fmt: skip
    with serve_app(args, env=PROXY_GUARD_ENV) as base:
        yield base


@pytest.fixture(scope="module")
def reference(long_reference) -> dict[str, list[int]]:
    return long_reference


def test_router_mode_answers_like_the_target(url, reference):
    response = post(url, {"prompt": PROMPTS[0], "max_tokens": MAX_TOKENS})
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["token_ids"] == reference[PROMPTS[0]]
    assert (replicas := stats(url)["replicas"])["router"] == 1 and replicas["engine"] == 2, replicas


def stats(url: str) -> dict:
    return httpx.get(f"{url}/v1/stats", timeout=30, trust_env=False).json()


def engine_loads(url: str, polls: int):
    """(engine replica id, its running requests) as /v1/stats reports them, poll after poll (the router asks the
    less loaded of the two engine replicas, so a loaded one may never answer)."""
    for _ in range(polls):
        engine = stats(url)["engine"]
        yield engine["replica"], engine["running"]


def wait_until_routed(url: str, count: int) -> None:
    """Until the router has sent stats calls to `count` different engine replicas (its handle learns of a replica
    Serve counts as running a moment later)."""
    seen, deadline = set(), time.monotonic() + 60
    while len(seen) < count:
        assert time.monotonic() < deadline, seen
        seen |= {replica for replica, _ in engine_loads(url, polls=4)}


def test_a_killed_engine_replica_loses_no_request(url, reference):
    """Eight greedy streams over both engine replicas; once every stream has its first tokens, an engine replica the
    test sees running some of them is killed: every stream still ends with exactly the target's tokens, the killed
    replica's continued on the other, and /health, polled throughout, says 200 (one replica of two can serve) and
    nothing else. Where the test sees no replica holding streams (the router's stats calls go to the less loaded
    one: all eight on the other), nothing is killed and it is tried again, every try's tokens checked."""
    wait_until_routed(url, 2)
    for _ in range(KILL_TRIES):
        with HealthPoller(url) as health:
            killed, continued = _eight_streams_and_a_kill(url, reference)
        assert not health.unanswered_in_time(PROBE_LATE_S), health.polls  # (test_replica_loss.py: why)
        assert health.statuses().count(200) > len(health.polls) / 2, health.polls
        if killed:
            assert continued >= 1, f"replica {killed} was killed holding running streams, yet none was continued"
            return
    pytest.fail(f"in {KILL_TRIES} tries the test never saw an engine replica holding streams")


def _eight_streams_and_a_kill(url, reference) -> tuple[str | None, int]:
    """One try -> (the engine replica killed, or None; how many streams the router continued on the other replica);
    every stream's tokens are checked."""
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(8)]
    tokens: list[list[int]] = [[] for _ in prompts]
    finish: list[str | None] = [None] * len(prompts)
    started = threading.Barrier(len(prompts) + 1, timeout=120)

    def stream(index: int) -> None:
        body = {"prompt": prompts[index], "max_tokens": MAX_TOKENS, "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120, trust_env=False) as response:
            assert response.status_code == 200
            first = True
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                choice = json.loads(line.removeprefix("data: "))["choices"][0]
                tokens[index] += choice["token_ids"]
                finish[index] = choice["finish_reason"]
                if first:
                    first = False
                    started.wait()

    before = stats(url)["continued"]
    threads = [threading.Thread(target=stream, args=(i,)) for i in range(len(prompts))]
    for thread in threads:
        thread.start()
    started.wait()  # every stream has its first chunk: all are running on some replica
    victim = next((replica for replica, running in engine_loads(url, polls=4) if running > 0), None)
    if victim is not None:
        ray.kill(ray.get_actor(f"SERVE_REPLICA::specdec#engine#{victim}", namespace="serve"), no_restart=True)
    for thread in threads:
        thread.join(timeout=180)
    assert finish == ["length"] * len(prompts)
    assert tokens == [reference[p] for p in prompts]
    return victim, stats(url)["continued"] - before
