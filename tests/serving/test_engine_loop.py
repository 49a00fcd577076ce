"""EngineLoop: the scheduler stepped by a thread behind asyncio streams. Concurrent requests get the engine's tokens,
a consumer that leaves frees its request, a target fault is recovered without losing a token or ends every request
with TargetUnavailable, and requests that cannot run fail before their first chunk."""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter

import pytest
import torch

from ray_specdec.config import NO_TREE, SamplingParams, TreeConfig
from ray_specdec.engine import scheduler as scheduler_module
from ray_specdec.engine.llm import SpeculativeEngine
from ray_specdec.engine.request import QueueFull, RequestTooLarge
from ray_specdec.engine.scheduler import Scheduler
from ray_specdec.engine.scheduler_config import SchedulerConfig
from ray_specdec.engine.target_backend import LocalTarget, StepWork
from ray_specdec.models.drafter.mamba import MambaDrafter
from ray_specdec.models.target.model import TargetModel
from ray_specdec.serving import metrics as m
from ray_specdec.serving.engine_loop import EngineLoop, TargetUnavailable
from tests.helpers.bigram import bigram_pair
from tests.helpers.engine_loop import collect, run, wait_until
from tests.helpers.inputs import random_prompt
from tests.helpers.models import tiny_gpt_neox, tiny_mamba

POLICY = TreeConfig((2, 1))
# (prompt length, max_new_tokens, tree) per request
REQUESTS = [(1, 30, None), (40, 12, NO_TREE), (300, 25, TreeConfig((1, 1, 1))), (7, 40, TreeConfig((3, 2))),
            (120, 1, None), (64, 33, None)]  # fmt: skip


@pytest.fixture(scope="module")
def models():
    return TargetModel(tiny_gpt_neox(torch.float32, max_positions=2300)), tiny_mamba(torch.float32)


@pytest.fixture(scope="module")
def expected(models) -> list[list[int]]:
    """Each request's tokens on the in-process engine, alone."""
    target, drafter = models
    engine = SpeculativeEngine(target, drafter, POLICY)
    return [engine.generate(prompt, params, tree).token_ids for prompt, params, tree in requests()]


def requests() -> list[tuple[list[int], SamplingParams, TreeConfig | None]]:
    return [(random_prompt(n, seed=i), SamplingParams(max_new_tokens=m, ignore_eos=True), tree)
            for i, (n, m, tree) in enumerate(REQUESTS)]  # fmt: skip


class FailingTarget(LocalTarget):
    """A LocalTarget whose `run` raises on the calls in `fail_at` (1-based), or on every call from `dead_from` on."""

    def __init__(self, target, fail_at=(), dead_from: int | None = None):
        super().__init__(target)
        self.fail_at, self.dead_from, self.calls, self.resets = set(fail_at), dead_from, 0, 0

    def run(self, work: StepWork):
        self.calls += 1
        if self.calls in self.fail_at or (self.dead_from is not None and self.calls >= self.dead_from):
            raise RuntimeError("a target rank died")
        return super().run(work)

    def reset(self) -> None:
        self.resets += 1
        super().reset()


@pytest.fixture
def make_loop(models):
    """make_loop(backend=None, config=..., **EngineLoop kwargs) -> a running EngineLoop (stopped after the test)."""
    loops = []

    def make(backend=None, config=SchedulerConfig(), **kwargs) -> EngineLoop:
        target, drafter = models
        scheduler = Scheduler(backend or LocalTarget(target), drafter, None, POLICY, config)
        loops.append(EngineLoop(scheduler, **kwargs))
        return loops[-1]

    yield make
    for loop in loops:
        loop.stop()


async def collect_all(loop: EngineLoop) -> list[list[int] | BaseException]:
    calls = [collect(loop, f"r{i}", *request) for i, request in enumerate(requests())]
    return await asyncio.gather(*calls, return_exceptions=True)


def test_concurrent_requests_get_the_engines_tokens(make_loop, expected):
    loop = make_loop()
    assert run(collect_all(loop)) == expected
    wait_until(lambda: not loop.scheduler.has_work)
    assert not loop.scheduler.target.caches and loop.stats()["kv_reserved"] == 0 and loop.healthy
    assert loop.stats()["kv_waits"] == 0


def test_a_scheduler_built_by_a_function_is_built_and_stepped_on_the_loops_thread(models, expected):
    """The models are built where they run: torch's parallel work stays on one thread (EngineLoop's docstring)."""
    target, drafter = models
    built_on, stepped_on = [], set()

    def build() -> Scheduler:
        built_on.append(threading.get_ident())
        return Scheduler(LocalTarget(target), drafter, None, POLICY, SchedulerConfig())

    loop = EngineLoop(build, on_step=lambda scheduler, seconds: stepped_on.add(threading.get_ident()))
    try:
        assert built_on and built_on[0] != threading.get_ident() and isinstance(loop.scheduler, Scheduler)
        assert run(collect_all(loop)) == expected
        assert stepped_on == {built_on[0]}
    finally:
        loop.stop()

    def broken() -> Scheduler:
        raise FileNotFoundError("no such model")

    with pytest.raises(FileNotFoundError, match="no such model"):
        EngineLoop(broken)


def test_rounds_are_merged_into_one_chunk_per_interval(make_loop, expected):
    """interval_s: after the first chunk, the rounds of each interval come as one chunk (inf: the first and the
    last); the tokens are the same as with a chunk per round."""
    loop = make_loop()
    prompt, params, tree = requests()[0]

    async def chunks(interval_s):
        return [c.token_ids async for c in loop.generate(f"i{interval_s}", prompt, params, tree, interval_s)]

    every, merged = run(chunks(0.0)), run(chunks(float("inf")))
    assert sum(every, []) == sum(merged, []) == expected[0]
    assert len(every) > 2 and len(merged) == 2  # the first chunk is never held


@pytest.mark.parametrize("alone", [True, False], ids=["alone", "with_others"])
def test_a_consumer_that_goes_away_aborts_its_request(make_loop, expected, alone):
    loop = make_loop()
    prompt = random_prompt(50, seed=3)

    async def leave_after_two_chunks():
        chunks = 0
        async for _ in loop.generate("leaver", prompt, SamplingParams(max_new_tokens=2000, ignore_eos=True)):
            chunks += 1
            if chunks == 2:
                raise asyncio.CancelledError  # as when the client disconnects

    async def main():
        others = [] if alone else [collect(loop, f"r{i}", *r) for i, r in enumerate(requests())]
        return await asyncio.gather(leave_after_two_chunks(), *others, return_exceptions=True)

    results = run(main())
    assert isinstance(results[0], asyncio.CancelledError)
    assert results[1:] == ([] if alone else expected)
    wait_until(lambda: not loop.scheduler.has_work and not loop.scheduler.target.caches)
    assert loop.scheduler.reserved == 0
    assert loop.metrics.snapshot()[m.REQUEST_SUCCESS] == {("abort",): 1} | ({} if alone else {("length",): 6})


@pytest.mark.parametrize("fail_at", [(1,), (3,), (2, 6)])
def test_a_target_fault_is_recovered_and_every_request_completes_exactly(make_loop, models, expected, fail_at):
    backend = FailingTarget(models[0], fail_at=fail_at)
    recoveries = []
    loop = make_loop(backend, recover=lambda: recoveries.append(backend.calls))
    assert run(collect_all(loop)) == expected
    assert loop.faults == loop.recoveries == len(fail_at) == len(recoveries) and backend.resets == len(fail_at)
    assert loop.healthy
    wait_until(lambda: not loop.scheduler.has_work and not backend.caches)


@pytest.mark.parametrize("fail_on", [3, 8])
@pytest.mark.parametrize("recovers", [True, False])
def test_a_fault_after_some_rounds_of_a_step_were_taken_loses_none_of_them(make_loop, models, expected, monkeypatch,
                                                                          fail_on, recovers):  # fmt: skip
    """A step that fails part way through judging its rounds (an error surfacing after the forward) has taken the
    rounds before it: their tokens are in their requests, and a request that finished in them has left the
    scheduler. Their chunks were dropped: that request hung, and after a recovery another lost a round's tokens."""
    real, calls = scheduler_module.judge, Counter()

    def judge(*args, **kwargs):
        calls["judged"] += 1
        if calls["judged"] == fail_on:
            raise RuntimeError("an error surfacing after the forward")
        return real(*args, **kwargs)

    monkeypatch.setattr(scheduler_module, "judge", judge)
    loop = make_loop(recover=(lambda: None) if recovers else None)
    results = run(collect_all(loop))
    if recovers:
        assert results == expected and loop.recoveries == 1
    else:
        failed = [isinstance(r, TargetUnavailable) for r in results]
        assert any(failed) and all(ok or r == e for ok, r, e in zip(failed, results, expected)), results
    assert loop.faults == 1
    wait_until(lambda: not loop.scheduler.has_work)


def test_a_rank_that_fails_again_as_the_target_is_reset_is_recovered_anew(make_loop, models, expected):
    """reset_target after a recovery can fail too (a restarted rank that dies at once); it ran outside the recovery's
    try, so the exception ended the loop's thread and every stream in flight hung."""

    class ResetFailsOnce(FailingTarget):
        def reset(self) -> None:
            if self.resets == 0:
                self.resets += 1
                raise RuntimeError("the restarted rank died again")
            super().reset()

    backend = ResetFailsOnce(models[0], fail_at=(3,))
    loop = make_loop(backend, recover=lambda: None, recover_timeout_s=30)
    assert run(collect_all(loop)) == expected
    assert loop.alive and loop.healthy and loop.faults == loop.recoveries == 1 and backend.resets == 2


def test_a_callers_event_loop_closed_under_its_stream_does_not_end_the_loops_thread(make_loop, expected):
    """An offline caller whose event loop closes while its request still streams (no abort sent): the next chunk
    for it raised 'Event loop is closed' on the loop's thread, which ended it, and every other request hung."""
    loop = make_loop()
    prompt, params, tree = requests()[0]
    gone = asyncio.new_event_loop()
    stream = loop.generate("orphan", prompt, params, tree)
    gone.run_until_complete(anext(stream))  # its first chunk, then the caller's loop closes, the stream left open
    gone.close()
    wait_until(lambda: not loop.scheduler.has_work)  # the orphan decodes on, its chunks go nowhere
    assert loop.alive and run(collect_all(loop)) == expected


def test_a_target_that_does_not_come_back_fails_every_request_in_flight(make_loop, models, expected):
    backend = FailingTarget(models[0], dead_from=3)
    attempts = []

    def recover():
        attempts.append(time.monotonic())
        raise RuntimeError("the ranks did not restart")

    loop = make_loop(backend, recover=recover, recover_timeout_s=0.3)
    results = run(collect_all(loop))
    failed = [isinstance(r, TargetUnavailable) for r in results]
    assert sum(failed) >= len(REQUESTS) - 1  # all but the 1-token request, which may finish in the first steps
    assert all(ok or r == e for ok, r, e in zip(failed, results, expected)), results
    assert attempts and not loop.healthy and loop.faults == 1 and loop.recoveries == 0
    wait_until(lambda: not loop.scheduler.has_work)
    outcomes = loop.metrics.snapshot()[m.REQUEST_SUCCESS]
    assert outcomes[("error",)] == sum(failed) and sum(outcomes.values()) == len(REQUESTS)
    assert loop.alive
    with pytest.raises(TargetUnavailable):
        run(collect(loop, "late", [5, 6], SamplingParams(max_new_tokens=3)))


def test_requests_that_cannot_run_fail_before_their_first_chunk(make_loop):
    long = SamplingParams(max_new_tokens=2000, ignore_eos=True)
    # the first request's reservation (5 + 2000 + 5 rows), granted whole, leaves no room for a second (5 + 64 + 5):
    # it waits
    loop = make_loop(config=SchedulerConfig(kv_budget_tokens=2050, max_waiting=1, kv_grow=False))

    async def main():
        with pytest.raises(RequestTooLarge, match="context length"):
            await collect(loop, "too long", random_prompt(400, seed=1), long)
        with pytest.raises(RequestTooLarge, match="KV budget"):
            await collect(loop, "too big", random_prompt(200, seed=1), long)
        running = asyncio.ensure_future(collect(loop, "running", random_prompt(5, seed=1), long))
        waiting = asyncio.ensure_future(collect(loop, "waiting", random_prompt(5, seed=2), SamplingParams()))
        while loop.scheduler.num_waiting == 0:
            await asyncio.sleep(0.01)
        with pytest.raises(QueueFull):
            await collect(loop, "one too many", random_prompt(5, seed=3), SamplingParams())
        running.cancel()
        assert len(await waiting) == 64  # it runs once the first request is gone
        with pytest.raises(asyncio.CancelledError):
            await running

    run(main())
    wait_until(lambda: not loop.scheduler.has_work and not loop.scheduler.target.caches)



def test_metrics_count_what_the_requests_did():
    """The engine's counters equal the sums of its requests' statistics (models that agree often, so that rounds
    accept at several depths); one TTFT, queue time and e2e latency per request, one inter-token latency per later
    round; the gauges go back to zero."""
    target, drafter = bigram_pair()
    scheduler = Scheduler(LocalTarget(TargetModel(target)), MambaDrafter(drafter), None, POLICY, SchedulerConfig())
    loop = EngineLoop(scheduler)
    # (prompt length, max_new_tokens, tree)
    shapes = [(5, 24, None), (20, 30, TreeConfig((3, 2, 1))), (60, 12, NO_TREE), (1, 8, None)]

    async def last_chunk(i, length, max_new_tokens, tree):
        params = SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)
        async for chunk in loop.generate(f"r{i}", random_prompt(length, seed=i), params, tree):
            pass
        return chunk

    async def main():
        return await asyncio.gather(*(last_chunk(i, *shape) for i, shape in enumerate(shapes)))

    try:
        stats = [chunk.stats for chunk in run(main())]
        wait_until(lambda: not loop.scheduler.has_work)
    finally:
        loop.stop()
    snap = loop.metrics.snapshot()
    n = len(shapes)
    trees = sum((s.trees for s in stats), Counter())
    assert snap[m.PROMPT_TOKENS] == {(): sum(length for length, _, _ in shapes)}
    assert snap[m.GENERATION_TOKENS] == {(): sum(s.new_tokens for s in stats)} == {(): sum(k for _, k, _ in shapes)}
    assert snap[m.REQUEST_SUCCESS] == {("length",): n}
    assert snap[m.DRAFTS] == {(): sum(s.drafts for s in stats)} == {(): trees.total() - trees["none"]}
    assert snap[m.DRAFT_TOKENS] == {(): sum(s.draft_tokens for s in stats)}
    assert snap[m.ACCEPTED] == {(): sum(sum(s.accepted_lengths) - s.rounds for s in stats)}
    assert snap[m.ROUNDS] == {(tree,): count for tree, count in trees.items()}
    per_pos = [sum(s.reached_depth[p] for s in stats if p < len(s.reached_depth)) for p in range(3)]
    assert [snap[m.ACCEPTED_PER_POS].get((str(p),), 0) for p in range(3)] == per_pos and per_pos[1] > 0
    for name, count in ((m.TTFT, n), (m.QUEUE, n), (m.E2E, n), (m.ITL, sum(s.rounds for s in stats) - n)):
        assert sum(snap[name][()][:-1]) == count, name
    assert snap[m.RUNNING] == snap[m.WAITING] == snap[m.KV_USAGE] == {(): 0}


def test_the_controllers_state_reaches_the_metrics_and_the_stats():
    """The loop copies the speculation controller's state out (at most once a second, and when the work runs out) to
    `stats()["speculation"]` and to its gauges: the share of rounds it drafted and the step cost model's weights."""
    from ray_specdec.speculation.bandit import Bandit, BanditConfig

    target, drafter = bigram_pair()
    policy = Bandit(BanditConfig(arms=(TreeConfig((2, 1)), NO_TREE)))
    scheduler = Scheduler(LocalTarget(TargetModel(target)), MambaDrafter(drafter), None, policy, SchedulerConfig())
    loop = EngineLoop(scheduler)
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)

    async def drain(i):
        async for _ in loop.generate(f"r{i}", random_prompt(8 + i, seed=i), params):
            pass

    async def main():
        await asyncio.gather(*(drain(i) for i in range(6)))

    try:
        run(main())
        wait_until(lambda: not loop.scheduler.has_work
                   and loop.speculation_summary == scheduler.controller.summary())  # fmt: skip
    finally:
        loop.stop()
    summary = loop.stats()["speculation"]
    rounds = summary["drafted_rounds"] + summary["undrafted_rounds"]
    assert rounds >= 6 * 40 // 3  # every round of the six requests was the controller's (at most 3 tokens each)
    assert summary["drafted_share"] == pytest.approx(summary["drafted_rounds"] / rounds)
    assert set(summary["cost_weights"]) == {"fixed", "target_rows", "verify_row_kilotokens", "drafting",
                                            "drafter_rows", "replays"}  # fmt: skip
    assert summary["cost_steps"] > 0
    snap = loop.metrics.snapshot()
    assert snap[m.DRAFTED_SHARE] == {(): summary["drafted_share"]}
    assert snap[m.STEP_COST] == {(k,): v for k, v in summary["cost_weights"].items()}
    text = m.render({"engine-1": snap}).decode()
    assert f'ray_specdec:speculation_drafted_share{{replica="engine-1"}} {summary["drafted_share"]!r}' in text