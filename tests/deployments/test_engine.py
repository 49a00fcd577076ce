"""The engine replica on Ray core (no Serve): faults of a tensor-parallel target under load (issue 18, "Faults").

One EngineReplica with tp_size 2 (two rank actors over gloo, the bigram pair of helpers/bigram) serves six concurrent
greedy requests of mixed lengths and trees. A rank actor is SIGKILLed after a fixed step, while every request is in
flight (the loop's on_step hook runs between steps, so the kill lands at the same point whatever the machine's speed):
- the ranks restart and every request is prefilled again from its token ids: each finishes with the tokens the
  in-process engine gives it alone, and the replica reported itself unhealthy while its target was down;
- when the ranks cannot be restarted within recover_timeout_s, every request in flight ends with a 503 item (the
  router turns it into 503 with Retry-After), and so does a new one, and Serve's health check fails.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time

import pytest
import ray

from deployments import engine as engine_module
from deployments.engine import EngineReplica
from ray_specdec.config import SamplingParams, TreeConfig
from ray_specdec.engine.outputs import StreamChunk
from ray_specdec.engine.config import EngineConfig
from ray_specdec.engine.scheduler_config import SchedulerConfig
from tests.helpers.bigram import PROMPTS
from tests.helpers.reference import greedy_margin

MAX_TOKENS = 40
# (prompt, tree) per request; None: the replica's fixed tree
REQUESTS = [(PROMPTS[0], None), (PROMPTS[1], "2,1"), (PROMPTS[2], "none"), (PROMPTS[3], "1,1,1"),
            (" ".join(PROMPTS), None), (" ".join(PROMPTS[::-1] * 3), "2,2")]  # fmt: skip
# Step 1 prefills every prompt; by step KILL_AT_STEP a request has at most 3 x 4 tokens: none has finished.
KILL_AT_STEP = 4


@pytest.fixture(scope="module")
def replica(model_dirs):
    target, drafter = model_dirs
    ray.init(num_cpus=2, include_dashboard=False)
    replica = EngineReplica(str(target), str(drafter), tp_size=2, num_cpus_per_rank=0.5, policy=TreeConfig((1, 1)),
                            config=EngineConfig(scheduler=SchedulerConfig(prefill_chunk=16)))  # fmt: skip
    yield replica
    replica.shutdown()
    ray.shutdown()


@pytest.fixture(scope="module")
def reference(engine) -> list[list[int]]:
    """Each request alone on the in-process engine (TP=1), on paths without float32 near-ties: TP=2 reorders sums."""
    out = []
    for prompt, tree in REQUESTS:
        ids = engine.encode(prompt)
        tokens = engine.generate(ids, SamplingParams(max_new_tokens=MAX_TOKENS), tree and TreeConfig.parse(tree))
        assert greedy_margin(engine.target.model, ids, tokens.token_ids) > 1e-3
        out.append(tokens.token_ids)
    return out


def rank_pids(replica: EngineReplica) -> list[int]:
    return ray.get([rank.__ray_call__.remote(lambda actor: os.getpid()) for rank in replica.backend._ranks])


def kill_rank_at(replica: EngineReplica, step: int, rank: int, sig: int = signal.SIGKILL,
                 killed: list[float] | None = None) -> list[int]:
    """Signal rank `rank`'s process (SIGKILL: dead; SIGSTOP: hung) after the loop's `step`-th step from now; -> the
    requests running then (filled in). killed: gets the signal's time.monotonic()."""
    pid, running, at = rank_pids(replica)[rank], [], replica.loop.scheduler.steps + step

    def on_step(scheduler, seconds: float) -> None:
        if scheduler.steps != at or running:
            return
        running.append(scheduler.num_running)
        if killed is not None:
            killed.append(time.monotonic())
        os.kill(pid, sig)
        deadline = time.monotonic() + 30
        while sig == signal.SIGKILL and _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)

    replica.loop.on_step = on_step
    return running


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


# /health answers from the replica's health(): it must turn within this of the loss and of the recovery (issue 62).
HEALTH_FLIP_S = 2.0


class HealthWatch:
    """replica.health()["healthy"] read every 20 ms on a thread while in the `with` block: `seen` holds (time, it)."""

    def __init__(self, replica: EngineReplica):
        self.replica, self.seen, self._stop = replica, [], threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.seen.append((time.monotonic(), asyncio.run(self.replica.health())["healthy"]))
            self._stop.wait(0.02)

    def __enter__(self) -> "HealthWatch":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def first(self, healthy: bool, after: float) -> float:
        return next(t for t, h in self.seen if t >= after and h == healthy)


async def generate_all(replica: EngineReplica, engine) -> list[list[int] | dict]:
    """Every request at once -> its tokens, or the error item that ended its stream."""

    async def one(prompt: str, tree: str | None):
        tokens, finish = [], None
        params = SamplingParams(max_new_tokens=MAX_TOKENS)
        async for item in replica.generate(engine.encode(prompt), params, tree and TreeConfig.parse(tree)):
            if isinstance(item, dict):
                return item
            assert isinstance(item, StreamChunk) and finish is None
            tokens += item.token_ids
            finish = item.finish_reason
        assert finish == "length"
        return tokens

    return await asyncio.gather(*(one(prompt, tree) for prompt, tree in REQUESTS))


def health_check_error(replica: EngineReplica, timeout_s: float) -> str | None:
    """Serve's health check, polled until it fails (the loop has given up) -> its message, or None."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            asyncio.run(replica.check_health())
        except RuntimeError as exc:
            return str(exc)
        time.sleep(0.2)
    return None


def test_a_killed_rank_is_restarted_and_every_request_finishes_exactly(replica, engine, reference):
    """... and the replica's health (its /health) says so: not healthy within HEALTH_FLIP_S of the kill, healthy
    again within HEALTH_FLIP_S of the ranks' restart."""
    before, killed, restarted = rank_pids(replica), [], []
    running = kill_rank_at(replica, KILL_AT_STEP, rank=1, killed=killed)
    seen_while_down = []
    start = replica.backend.start

    def watched_start():  # the loop's recovery: what the replica says about itself while its target is down
        seen_while_down.append(asyncio.run(replica.health()))
        asyncio.run(replica.check_health())  # Serve must not kill a replica that is recovering its requests
        try:
            return start()
        finally:
            restarted.append(time.monotonic())

    replica.backend.start = watched_start
    try:
        with HealthWatch(replica) as health:
            outputs = asyncio.run(generate_all(replica, engine))
    finally:
        del replica.backend.start
        replica.loop.on_step = None
    assert running == [len(REQUESTS)]  # the kill hit with every request in flight
    assert outputs == reference
    assert seen_while_down and seen_while_down[0] == {"healthy": False, "recovering": True}
    assert health.first(False, after=killed[0]) - killed[0] < HEALTH_FLIP_S, health.seen
    assert health.first(True, after=restarted[-1]) - restarted[-1] < HEALTH_FLIP_S, health.seen
    assert (replica.loop.faults, replica.loop.recoveries) == (1, 1)
    assert asyncio.run(replica.health()) == {"healthy": True, "recovering": False}
    assert set(rank_pids(replica)).isdisjoint(before)  # both ranks are new processes
    assert replica.backend.request_ids() == [[], []]


def test_a_hung_rank_times_out_and_every_request_finishes_exactly(replica, engine, reference, monkeypatch):
    """A rank that stops (SIGSTOP: alive, never answering) fails its step after the step timeout; the ranks are
    replaced (the stopped process killed) and every request finishes with its exact tokens."""
    monkeypatch.setattr(engine_module, "RANK_STEP_TIMEOUT_S", 3.0)
    faults, before = replica.loop.faults, rank_pids(replica)
    running = kill_rank_at(replica, KILL_AT_STEP, rank=1, sig=signal.SIGSTOP)
    try:
        outputs = asyncio.run(generate_all(replica, engine))
    finally:
        replica.loop.on_step = None
    assert running == [len(REQUESTS)] and outputs == reference
    assert replica.loop.faults == faults + 1
    assert set(rank_pids(replica)).isdisjoint(before)
    deadline = time.monotonic() + 30
    while _alive(before[1]) and time.monotonic() < deadline:  # the stopped process was killed, not left behind
        time.sleep(0.05)
    assert not _alive(before[1])


def test_a_target_that_cannot_come_back_answers_503(replica, engine):
    running = kill_rank_at(replica, KILL_AT_STEP, rank=0)

    def broken_start():
        raise RuntimeError("no node can host the ranks")

    replica.backend.start = broken_start
    replica.recover_timeout_s = replica.loop.recover_timeout_s = 2.0
    try:
        outputs = asyncio.run(generate_all(replica, engine))
        assert running == [len(REQUESTS)]
        assert [o["error"] for o in outputs] == [503] * len(REQUESTS)
        assert all("did not recover" in o["message"] for o in outputs)
        assert asyncio.run(replica.health())["healthy"] is False
        late = asyncio.run(generate_all(replica, engine))  # a request arriving while the target is down
        assert [o["error"] for o in late] == [503] * len(REQUESTS)
        assert health_check_error(replica, timeout_s=10) == "the target is down"  # Serve replaces the replica
    finally:
        del replica.backend.start
        replica.loop.on_step = None
