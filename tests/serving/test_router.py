"""Router: forwards a request to an engine replica and, when the replica is lost mid-stream, continues it on
another from the tokens streamed so far: the whole output is what an uninterrupted request gives. Error items become
RequestError with their status; a replica lost for longer than retry_s gives ServiceUnavailable."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import uuid

import pytest
import torch

from ray_specdec.config import SamplingParams, TreeConfig
from ray_specdec.defaults import DEFAULT_TARGET
from ray_specdec.engine.llm import SpeculativeEngine
from ray_specdec.engine.scheduler import Scheduler
from ray_specdec.engine.target_backend import LocalTarget
from ray_specdec.models.loading import load_tokenizer
from ray_specdec.models.target.model import TargetModel
from ray_specdec.serving import router as router_module
from ray_specdec.serving.engine_loop import EngineLoop
from ray_specdec.serving.router import RequestError, Router, ServiceUnavailable
from tests.helpers.inputs import random_prompt
from tests.helpers.models import tiny_gpt_neox, tiny_mamba, tiny_tokenizer

POLICY = TreeConfig((2, 1))
PARAMS = SamplingParams(max_new_tokens=30, ignore_eos=True)
SEEDED = SamplingParams(max_new_tokens=30, ignore_eos=True, temperature=1.0, top_p=0.95, seed=11)


class ReplicaLost(ConnectionError):
    """What the fake client raises when its replica "dies"."""


def lost(exc: BaseException) -> bool:
    return isinstance(exc, ReplicaLost)


class LosingClient:
    """An EngineClient streaming from an EngineLoop whose replica is lost after `lose_after[i]` chunks of its i-th call
    (calls past the list are never lost); `items` are yielded first instead, if given (error items)."""

    def __init__(self, loop: EngineLoop, lose_after=(), items=()):
        self.loop, self.lose_after, self.items = loop, list(lose_after), list(items)
        self.calls: list[tuple[list[int], SamplingParams]] = []

    async def generate(self, prompt_ids, params, tree, interval_s=0.0, resumed=0):  # streams every round
        call = len(self.calls)
        self.calls.append((list(prompt_ids), params, resumed))
        for item in self.items:
            yield item
        limit = self.lose_after[call] if call < len(self.lose_after) else None
        chunks = 0
        stream = self.loop.generate(uuid.uuid4().hex, prompt_ids, params, tree, 0.0, resumed)
        async with contextlib.aclosing(stream):
            async for chunk in stream:
                if chunks == limit:
                    raise ReplicaLost("the replica's actor died")
                chunks += 1
                yield chunk


@pytest.fixture(scope="module")
def models():
    return TargetModel(tiny_gpt_neox(torch.float32, max_positions=512)), tiny_mamba(torch.float32)


@pytest.fixture(scope="module")
def loop(models):
    target, drafter = models
    loop = EngineLoop(Scheduler(LocalTarget(target), drafter, None, POLICY))
    yield loop
    loop.stop()


@pytest.fixture(autouse=True)
def no_pause(monkeypatch):
    monkeypatch.setattr(router_module, "RETRY_PAUSE_S", 0.01)


def make_router(client, retry_s: float = 60.0) -> Router:
    return Router(client, tiny_tokenizer(), max_context=512, lost=lost, retry_s=retry_s)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, timeout=120))


@pytest.mark.parametrize("params", [PARAMS, SEEDED], ids=["greedy", "seeded"])
@pytest.mark.parametrize("lose_after", [[0], [1], [4], [2, 3], [0, 0, 5]])
def test_a_request_continues_on_another_replica_with_the_same_tokens(models, loop, lose_after, params):
    """Greedy requests, and seeded sampled ones (coupled sampling: each token keyed by its absolute position), get the
    tokens of an uninterrupted request, and of the target alone."""
    target, drafter = models
    prompt = random_prompt(40, seed=7)
    expected = SpeculativeEngine(target, drafter, POLICY).generate(prompt, params).token_ids
    assert expected == SpeculativeEngine(target, None).generate(prompt, params).token_ids
    client = LosingClient(loop, lose_after)
    router = make_router(client)
    result = run(router.generate(prompt, params))
    assert result.token_ids == expected and result.finish_reason == "length"
    assert result.stats.new_tokens == params.max_new_tokens and result.prompt_tokens == len(prompt)
    assert router.continued == len(lose_after) and router.in_flight == 0
    # each replica after a loss got the prompt and every token streamed so far, marked as the request's own
    for (ids, sent, resumed), _ in zip(client.calls[1:], lose_after):
        done = len(ids) - len(prompt)
        assert ids == prompt + expected[:done] and sent == params and resumed == done


@pytest.fixture(scope="module")
def worded():
    """An EngineLoop over a tiny target of the shipped tokenizer's vocabulary, with that tokenizer (stop strings)."""
    target = TargetModel(tiny_gpt_neox(torch.float32, vocab=4096, max_positions=512, seed=3))
    tokenizer = load_tokenizer(DEFAULT_TARGET)
    loop = EngineLoop(Scheduler(LocalTarget(target), None, tokenizer, TreeConfig(())))
    yield loop, tokenizer
    loop.stop()


@pytest.mark.parametrize("lose_after", [[2], [5], [1, 3]])
def test_a_continued_request_keeps_its_min_tokens_penalties_and_stop_string(worded, lose_after):
    """The replica that continues a request takes the tokens streamed so far as the request's own: presence and
    frequency penalties count them, min_tokens and max_tokens go on from them, and a stop string that starts in
    them still stops it. Sent as prompt tokens with max_tokens cut by their number (as before), the penalties
    forgot them, a stop string across the cut was missed, and a min_tokens above what was left was refused."""
    loop, tokenizer = worded
    prompt = random_prompt(12, seed=5, vocab=4096)
    base = SamplingParams(max_new_tokens=24, min_tokens=20, presence_penalty=1.5, frequency_penalty=0.5)
    whole = run(make_router(LosingClient(loop)).generate(prompt, base)).token_ids
    assert len(whole) == 24
    stop = tokenizer.decode(whole[:8])[-3:] + tokenizer.decode(whole[8:10])  # starts before token 8, ends after it
    params = dataclasses.replace(base, stop=(stop,), min_tokens=5)
    expected = run(make_router(LosingClient(loop)).generate(prompt, params))
    assert expected.finish_reason == "stop" and len(expected.token_ids) < 24
    for p in (base, params):
        result = run(make_router(LosingClient(loop, lose_after)).generate(prompt, p))
        assert result.token_ids == (whole if p is base else expected.token_ids)
        assert result.text == (tokenizer.decode(whole) if p is base else expected.text)


@pytest.mark.parametrize("retry_s", [0.0, 0.2])
def test_a_replica_lost_for_longer_than_retry_s_gives_service_unavailable(loop, retry_s):
    client = LosingClient(loop, lose_after=[0] * 10_000)
    router = make_router(client, retry_s=retry_s)
    with pytest.raises(ServiceUnavailable) as info:
        run(router.generate(random_prompt(5, seed=1), PARAMS))
    assert info.value.status == 503 and router.in_flight == 0
    assert (len(client.calls) == 1) == (retry_s == 0.0)


@pytest.mark.parametrize("status, error", [(400, RequestError), (503, ServiceUnavailable)])
def test_error_items_become_request_errors_with_their_status(loop, status, error):
    client = LosingClient(loop, items=[{"error": status, "message": "no"}])
    router = make_router(client)
    with pytest.raises(error, match="no") as info:
        run(router.generate(random_prompt(5, seed=1), PARAMS))
    assert info.value.status == status and len(client.calls) == 1 and router.continued == 0


def test_other_engine_errors_are_not_retried(loop):
    class Broken:
        calls = 0

        async def generate(self, prompt_ids, params, tree, interval_s=0.0, resumed=0):  # streams every round
            Broken.calls += 1
            raise ValueError("a bug, not a lost replica")
            yield

    router = make_router(Broken())
    with pytest.raises(ValueError, match="a bug"):
        run(router.generate([5, 6], PARAMS))
    assert Broken.calls == 1 and router.in_flight == 0


def test_check_length_and_empty_prompts(loop):
    client = LosingClient(loop)
    router = make_router(client)
    router.check_length(500, SamplingParams(max_new_tokens=12))
    with pytest.raises(RequestError, match="context length") as info:
        router.check_length(501, SamplingParams(max_new_tokens=12))
    assert info.value.status == 400
    with pytest.raises(RequestError) as info:
        run(router.generate(random_prompt(500, seed=1), SamplingParams(max_new_tokens=13)))
    assert info.value.status == 400 and not client.calls  # refused before any replica is asked
    with pytest.raises(RequestError) as info:
        router.encode("")
    assert info.value.status == 400
