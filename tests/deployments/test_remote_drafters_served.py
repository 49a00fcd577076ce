"""The app with drafters=remote: a `drafter` deployment of two replicas beside the engine, drafting each next round
ahead while the target verifies (drafter_pool_overlap). Requests served at once give the target's own greedy tokens,
drafted through the pool, and a drafter replica killed under load costs no request and changes no token."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
import ray

from deployments.app import AppArgs
from tests.helpers.bigram import PROMPTS, greedy_reference
from tests.helpers.serve import post, serve_app

MAX_TOKENS = 96
LONG_TOKENS = 240  # still running when a drafter replica is killed


@pytest.fixture(scope="module")
def url(model_dirs):
    target, drafter = model_dirs
    args = AppArgs(target=str(target), drafter=str(drafter), num_cpus_per_rank=1, stream_interval_s=0, tree="2,1,1",
                   drafters="remote", drafter_pool_replicas=2, drafter_pool_actor_options={"num_cpus": 0},
                   drafter_pool_shards=8, drafter_pool_overlap=True)
    with serve_app(args) as base:
        yield base


@pytest.fixture(scope="module")
def reference(engine) -> dict[str, list[int]]:
    return greedy_reference(engine, MAX_TOKENS)


@pytest.fixture(scope="module")
def long_reference(engine) -> dict[str, list[int]]:
    return greedy_reference(engine, LONG_TOKENS)


def all_at_once(url: str, prompts: list[str], during=None, max_tokens: int = MAX_TOKENS) -> list[httpx.Response]:
    answers: list[httpx.Response | None] = [None] * len(prompts)

    def ask(i: int) -> None:
        answers[i] = post(url, {"prompt": prompts[i], "max_tokens": max_tokens}, timeout=180)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
    for thread in threads:
        thread.start()
    if during is not None:
        during()
    for thread in threads:
        thread.join(timeout=240)
    return answers


def stats(url: str) -> dict:
    return httpx.get(f"{url}/v1/stats", timeout=30, trust_env=False).json()


def test_requests_drafted_by_the_pool_give_the_target_greedy_tokens(url, reference):
    before = stats(url)["engine"]["drafters"]
    prompts = PROMPTS * 2
    for prompt, answer in zip(prompts, all_at_once(url, prompts)):
        assert answer.status_code == 200, answer.text
        assert answer.json()["choices"][0]["token_ids"] == reference[prompt]
    after = stats(url)
    assert after["replicas"]["drafter"] == 2
    drafters = after["engine"]["drafters"]
    assert drafters["drafts"] > before["drafts"] and drafters["ahead_hits"] > before["ahead_hits"], drafters


def test_a_drafter_replica_killed_under_load_costs_no_request(url, reference, long_reference):
    before = stats(url)["engine"]["drafters"]

    def kill() -> None:  # a drafter replica that holds shards of the requests in flight
        time.sleep(0.5)
        names = sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                       if a["name"].startswith("SERVE_REPLICA::specdec#drafter#"))  # fmt: skip
        assert len(names) == 2
        holding = stats(url)["engine"]["drafters"]["drafter_workers"]
        name = next(n for n in names if n.rsplit("#", 1)[-1] in holding)
        ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)

    prompts = PROMPTS * 2
    for prompt, answer in zip(prompts, all_at_once(url, prompts, during=kill, max_tokens=LONG_TOKENS)):
        assert answer.status_code == 200, answer.text
        assert answer.json()["choices"][0]["token_ids"] == long_reference[prompt]
    after = stats(url)["engine"]["drafters"]
    lost = after["drafter_failed_calls"] + after["drafter_missing_states"]
    assert lost > before["drafter_failed_calls"] + before["drafter_missing_states"], (before, after)
    # the engine drafts on after the loss (Serve brings a replica back; its shards are rebuilt from token ids)
    drafts = stats(url)["engine"]["drafters"]["drafts"]
    for prompt, answer in zip(PROMPTS, all_at_once(url, PROMPTS)):
        assert answer.json()["choices"][0]["token_ids"] == reference[prompt]
    assert stats(url)["engine"]["drafters"]["drafts"] > drafts
