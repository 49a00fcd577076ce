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
from tests.helpers.bigram import PROMPTS, greedy_reference
from deployments.app import PROXY_GUARD_ENV
from tests.helpers.serve import HealthPoller, post, serve_app

MAX_TOKENS = 150  # long enough that the requests are still running when a replica is killed


@pytest.fixture(scope="module")
def url(model_dirs):
    target, drafter = model_dirs
    args = AppArgs(target=str(target), drafter=str(drafter), ingress="router", replicas=2, num_cpus_per_rank=0.5,
                   stream_interval_s=0, retry_s=60)  # fmt: skip
    with serve_app(args, env=PROXY_GUARD_ENV) as base:
        yield base


@pytest.fixture(scope="module")
def reference(engine) -> dict[str, list[int]]:
    return greedy_reference(engine, MAX_TOKENS)


def test_router_mode_answers_like_the_target(url, reference):
    response = post(url, {"prompt": PROMPTS[0], "max_tokens": MAX_TOKENS})
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["token_ids"] == reference[PROMPTS[0]]
    stats = httpx.get(f"{url}/v1/stats", trust_env=False).json()
    assert (stats["replicas"]["router"], stats["replicas"]["engine"]) == (1, 2)


def engine_replica_names() -> list[str]:
    return sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                  if a["name"].startswith("SERVE_REPLICA::specdec#engine#"))  # fmt: skip


KILL_TRIES = 3  # a try where no stream was on the killed replica any more proves nothing: kill again


def test_a_killed_engine_replica_loses_no_request(url, reference):
    """Eight greedy streams over both engine replicas; one replica is killed once every stream has its first
    tokens: every stream still ends with exactly the target's tokens, some of them continued on the other replica,
    and /health, polled throughout, says 200 (one replica of two can serve) and nothing else.
    On a loaded machine the victim's streams may all have ended before the kill (or the streams all gone to the
    other replica): then Serve's replacement is awaited and it is tried again, every try's tokens checked."""
    for _ in range(KILL_TRIES):
        with HealthPoller(url) as health:
            continued = _kill_a_replica_under_eight_streams(url, reference)
        assert set(health.statuses()) == {200}, health.polls
        if continued >= 1:  # the power of two choices spread the eight streams over both replicas
            return
    pytest.fail(f"in {KILL_TRIES} tries no stream was running on the killed replica when it died")


def _kill_a_replica_under_eight_streams(url, reference) -> int:
    """One try -> how many streams the router continued on the other replica; every stream's tokens are checked,
    and Serve has two engine replicas again when it returns."""
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

    before = httpx.get(f"{url}/v1/stats", trust_env=False).json()["continued"]
    threads = [threading.Thread(target=stream, args=(i,)) for i in range(len(prompts))]
    for thread in threads:
        thread.start()
    started.wait()  # every stream has its first chunk: all are running on some replica
    victim = engine_replica_names()[0]
    ray.kill(ray.get_actor(victim, namespace="serve"), no_restart=True)
    for thread in threads:
        thread.join(timeout=180)
    assert finish == ["length"] * len(prompts)
    assert tokens == [reference[p] for p in prompts]
    continued = httpx.get(f"{url}/v1/stats", trust_env=False).json()["continued"] - before
    deadline = time.monotonic() + 120  # Serve replaces the killed replica
    while len(engine_replica_names()) < 2 or victim in engine_replica_names():
        assert time.monotonic() < deadline, engine_replica_names()
        time.sleep(1)
    return continued
