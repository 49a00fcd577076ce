"""An engine replica killed under load in the default mode (ingress=engine: the replica answers HTTP itself), over real
HTTP through Serve's proxy with its guard (ray_specdec/serving/proxy_guard.py). One local Ray, two apps:
- "specdec" at /: two engine replicas. The killed replica's requests are lost (its streams end with an error event,
  its unanswered requests get 503 with Retry-After) and nothing else: the other replica's streams finish exactly, a
  retry of a lost request is served at once by the survivor, and /health stays 200 throughout.
- "single" at /single: the only engine replica. /health turns 503 within seconds of the kill (the proxy holds a
  probe no replica answers: the guard answers it) and 200 once Serve's replacement runs; every lost request, retried,
  gets exactly the target's tokens.
No response in either is a 500. Router mode's kill (requests continued on the other replica) is in
test_router_mode.py, a target rank's (tp_size 2: the replica survives, its target restarts) in test_engine.py.
"""

from __future__ import annotations

import threading
import time

import httpx
import pytest
import ray

from deployments import AppArgs
from deployments.app import PROXY_GUARD_ENV
from ray_specdec.serving.proxy_guard import HEADER_MARGIN_S, HEALTH_DEADLINE_S
from tests.helpers.bigram import LONG_TOKENS, PROMPTS
from tests.helpers.serve import HealthPoller, post, serve_app, stream_completion

MAX_TOKENS = LONG_TOKENS  # long enough that the requests still run while the test reads which replica holds which
# Loose bounds for a loaded 2-core machine around what the guard promises (a probe answered within 1.5 s).
SEEN_WITHIN_S = 5.0
# A probe the guard answered 503 at its deadline (less the margin of Serve's own timeout header): the replica it
# reached was slow, not gone.
PROBE_LATE_S = HEALTH_DEADLINE_S - HEADER_MARGIN_S
KILL_TRIES = 5  # a try where one replica holds every stream proves nothing: tried again


@pytest.fixture(scope="module")
def urls(long_model_dirs):
    target, drafter = long_model_dirs
    common = dict(target=str(target), drafter=str(drafter), num_cpus_per_rank=0.5, stream_interval_s=0)
    with serve_app(AppArgs(**common, replicas=2), more={"single": AppArgs(**common)}, env=PROXY_GUARD_ENV) as base:
        yield {"two": base, "single": f"{base}/single"}


@pytest.fixture(scope="module")
def reference(long_reference) -> dict[str, list[int]]:
    return long_reference


def replica_names(app_name: str) -> list[str]:
    return sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                  if a["name"].startswith(f"SERVE_REPLICA::{app_name}#engine#"))  # fmt: skip


def running_replicas(app_name: str) -> list[str]:
    """The actor names of the app's engine replicas the Serve controller counts as running."""
    controller = ray.get_actor("SERVE_CONTROLLER_ACTOR", namespace="serve")
    details = ray.get(controller.get_serve_instance_details.remote())
    replicas = details["applications"][app_name]["deployments"]["engine"]["replicas"]
    return sorted(r["actor_name"] for r in replicas if r["state"] == "RUNNING")


def wait_for_replicas(app_name: str, count: int, gone: str) -> float:
    """Until Serve runs `count` engine replicas of the app, `gone` not among them -> when it first did."""
    deadline = time.monotonic() + 180
    while len(names := running_replicas(app_name)) < count or gone in names:
        assert time.monotonic() < deadline, (app_name, names)
        time.sleep(0.2)
    return time.monotonic()


def under_load(url: str, prompts: list[str], plain: list[str], kill) -> tuple[list[dict], list[httpx.Response]]:
    """Streams of `prompts` and non-streamed requests of `plain`, all at once; kill() once every stream has its
    first chunk -> each stream's outcome (stream_completion) and each plain response."""
    started = threading.Barrier(len(prompts) + 1, timeout=120)
    streams: list[dict] = [{} for _ in prompts]
    answers: list[httpx.Response | None] = [None] * len(plain)

    def stream(i: int) -> None:
        try:
            streams[i] = stream_completion(url, {"prompt": prompts[i], "max_tokens": MAX_TOKENS},
                                           on_first=started.wait)  # fmt: skip
        except httpx.HTTPError as exc:  # a stream dropped mid-body (Serve's proxy without its guard)
            streams[i] = {"status": None, "done": False, "exception": repr(exc)}

    def ask(i: int) -> None:
        answers[i] = post(url, {"prompt": plain[i], "max_tokens": MAX_TOKENS}, timeout=180)

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(len(prompts))]
    threads += [threading.Thread(target=ask, args=(i,)) for i in range(len(plain))]
    for thread in threads:
        thread.start()
    started.wait()
    kill()
    for thread in threads:
        thread.join(timeout=240)
    return streams, answers


def check_outcomes(prompts, streams, plain, answers, reference) -> list[str]:
    """Every request ended exactly (the target's tokens) or lost in the promised shape -> the lost ones' prompts."""
    lost = []
    for prompt, s in zip(prompts, streams):
        assert s["status"] == 200 and s["done"], s  # a cut stream is closed, not dropped
        if s["error"] is None:
            assert (s["finish"], s["tokens"]) == ("length", reference[prompt])
            continue
        assert s["error"]["status"] == 503 and s["error"]["error"]["code"] == "replica_lost", s["error"]
        assert s["tokens"] == reference[prompt][: len(s["tokens"])]  # what came before the cut was right
        lost.append(prompt)
    for prompt, response in zip(plain, answers):
        assert response.status_code in (200, 503), response.text  # never 500
        if response.status_code == 503:
            assert response.headers["retry-after"] and response.json()["error"]["type"] == "server_error"
            lost.append(prompt)
        else:
            assert response.json()["choices"][0]["token_ids"] == reference[prompt]
    return lost


def retried(url: str, prompt: str, deadline: float) -> tuple[int, list[int]]:
    """A lost request sent again until it is answered (waiting Retry-After after a 503) -> (tries, its tokens)."""
    tries = 0
    while True:
        tries += 1
        response = post(url, {"prompt": prompt, "max_tokens": MAX_TOKENS}, timeout=180)
        assert response.status_code in (200, 503), response.text
        if response.status_code == 200:
            return tries, response.json()["choices"][0]["token_ids"]
        assert time.monotonic() < deadline, "no replica served the retry"
        time.sleep(float(response.headers["retry-after"]))


def replica_loads(url: str, polls: int):
    """(replica id, running requests) as /v1/stats reports them, poll after poll (Serve's proxy sends each poll to
    the less loaded of two replicas, so a loaded one may never answer)."""
    for _ in range(polls):
        engine = httpx.get(f"{url}/v1/stats", timeout=30, trust_env=False).json()["engine"]
        yield engine["replica"], engine["running"]


def wait_until_routed(url: str, count: int) -> None:
    """Until Serve's proxy has sent stats polls to `count` different replicas (a replacement counted RUNNING by the
    controller reaches the proxy's routing table a moment later)."""
    seen, deadline = set(), time.monotonic() + 60
    while len(seen) < count:
        assert time.monotonic() < deadline, seen
        seen |= {replica for replica, _ in replica_loads(url, polls=4)}


def test_one_of_two_replicas_lost_costs_its_own_requests_and_a_retry_is_served_at_once(urls, reference):
    url = urls["two"]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(8)]
    wait_until_routed(url, 2)
    for _ in range(KILL_TRIES):
        killed = []

        def kill_a_replica_holding_some_streams() -> None:
            """Kill a replica running some streams but not all: the spread is the proxy's choice, and a try
            where one replica holds every stream proves nothing (it is let finish, and tried again)."""
            some = (r for r, running in replica_loads(url, polls=4) if 0 < running < len(prompts))
            if (replica := next(some, None)) is not None:
                killed.append(f"SERVE_REPLICA::specdec#engine#{replica}")
                ray.kill(ray.get_actor(killed[0], namespace="serve"), no_restart=True)

        with HealthPoller(url) as health:
            streams, answers = under_load(url, prompts, [], kill_a_replica_holding_some_streams)
            lost = check_outcomes(prompts, streams, [], answers, reference)
            for prompt in lost:  # at once, while Serve is still replacing the dead replica: the survivor serves it
                assert retried(url, prompt, time.monotonic()) == (1, reference[prompt])
        # one replica of two was always there to serve: every probe answered in time said 200 (on a loaded machine
        # the survivor may miss the guard's deadline: that 503 says it was slow, and most probes still say 200)
        assert not health.unanswered_in_time(PROBE_LATE_S), health.polls
        assert health.statuses().count(200) > len(health.polls) / 2, health.polls
        if not killed:
            assert lost == []
            continue
        assert 0 < len(lost) < len(prompts), lost  # the kill cut the victim's streams, and only those
        wait_for_replicas("specdec", 2, killed[0])
        wait_until_routed(url, 2)
        return
    pytest.fail(f"in {KILL_TRIES} tries one replica always held every stream")


def test_the_only_replica_lost_turns_health_503_then_200_and_every_retry_is_exact(urls, reference):
    url = urls["single"]
    prompts, plain = PROMPTS[:3], PROMPTS[3:]
    victim = replica_names("single")[0]
    killed = []

    def kill() -> None:
        killed.append(time.monotonic())
        ray.kill(ray.get_actor(victim, namespace="serve"), no_restart=True)

    with HealthPoller(url) as health:
        streams, answers = under_load(url, prompts, plain, kill)
        lost = check_outcomes(prompts, streams, plain, answers, reference)
        assert set(prompts) <= set(lost)  # every stream was running on the only replica
        back = wait_for_replicas("single", 1, victim)
        for prompt in lost:
            assert retried(url, prompt, time.monotonic() + 60)[1] == reference[prompt]
        deadline = time.monotonic() + 30
        while health.first(200, after=back) is None and time.monotonic() < deadline:
            time.sleep(0.2)
    down = health.first(503, after=killed[0])
    assert down is not None and down - killed[0] < SEEN_WITHIN_S, health.polls
    up = health.first(200, after=back)
    assert up is not None and up - back < SEEN_WITHIN_S, (back, health.polls)
    # from the loss on, every probe is answered: 503 until the replacement serves, then 200 (never flapping back)
    after = health.statuses(after=killed[0] + 0.5)
    k = after.index(200)
    assert k >= 1 and after == [503] * k + [200] * (len(after) - k), health.polls
