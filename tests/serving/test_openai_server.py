"""A request's choices in serving/openai_server.py, without a Serve app: `all_or_none` runs them together, and when one
fails (a full queue, a lost target) or time runs out, the others are cancelled, not left running unread; a stream's
events close every choice when the client leaves."""

import asyncio
import time
from types import SimpleNamespace

import pytest

from ray_specdec.engine.outputs import StreamChunk
from ray_specdec.serving.openai_server import OpenAIServer, all_or_none


def test_every_result_comes_back_in_order():
    async def value(v, delay):
        await asyncio.sleep(delay)
        return v

    assert asyncio.run(all_or_none([value(1, 0.03), value(2, 0.0), value(3, 0.01)], 5)) == [1, 2, 3]


async def waits(name, left: list):
    """A choice that would run long; `left` notes that it ended (what the engine's stream does here: abort its
    request)."""
    try:
        await asyncio.sleep(30)
    finally:
        left.append(name)


def test_one_failure_cancels_the_others_before_it_goes_on():
    left: list[str] = []

    async def refused():
        await asyncio.sleep(0.01)
        raise RuntimeError("queue full")

    async def go():
        with pytest.raises(RuntimeError, match="queue full"):
            await all_or_none([waits("a", left), refused(), waits("b", left)], 30)
        return sorted(left)

    assert asyncio.run(go()) == ["a", "b"]  # both ended before the error reached the caller


def test_the_timeout_cancels_every_one():
    left: list[int] = []

    async def go():
        with pytest.raises(TimeoutError):
            await all_or_none([waits(0, left), waits(1, left)], 0.05)

    asyncio.run(go())
    assert sorted(left) == [0, 1]


def test_streams_whose_first_chunk_was_awaited_can_be_closed_after_a_failure():
    """The choices' first chunks are awaited together; when one stream fails, closing the others must not find them
    still running ('aclose(): asynchronous generator is already running' was a 500)."""
    closed: list[int] = []

    async def stream(i):
        try:
            if i == 1:
                raise RuntimeError("queue full")
            await asyncio.sleep(30)
            yield i
        finally:
            closed.append(i)

    async def go():
        streams = [stream(i) for i in range(3)]
        with pytest.raises(RuntimeError, match="queue full"):
            await all_or_none([anext(s) for s in streams], 30)
        for s in streams:
            await s.aclose()

    asyncio.run(go())
    assert sorted(closed) == [0, 1, 2]


def test_a_stream_left_mid_way_closes_every_choice():
    """The SSE generator of a streamed request closed while its choices' pumps are still reading them (the client
    left): every choice's stream is closed (its engine request aborted) and closing raises nothing (closing a stream
    a pump still ran was 'asynchronous generator is already running')."""

    closed: list[int] = []
    recorded: list[str] = []

    async def stream(i):
        try:
            yield StreamChunk([i], f"t{i}", None, None)
            await asyncio.sleep(30)  # the engine's next round, never reached
            yield StreamChunk([i], "x", "length", None)
        finally:
            closed.append(i)

    class Bodies:
        def chunks(self, index, chunk):
            return [{"index": index, "text": chunk.text}]

        def end(self):
            return []

    async def go():
        streams = [stream(i) for i in range(2)]
        firsts = [await anext(s) for s in streams]
        server = SimpleNamespace(settings=SimpleNamespace(request_timeout_s=60),
                                 metrics=SimpleNamespace(record=recorded.append))
        events = OpenAIServer._events(server, [None, None], streams, firsts, Bodies(), time.monotonic() + 60)
        got = [await anext(events), await anext(events)]  # both first chunks
        await asyncio.sleep(0.05)  # the pumps are inside their streams now
        await events.aclose()  # what the server does when the client goes away
        return got

    got = asyncio.run(go())
    assert [g.count("t0") + g.count("t1") for g in got] == [1, 1]
    assert sorted(closed) == [0, 1] and recorded == ["cancelled"]


def test_a_streams_deadline_counts_from_the_request_not_from_its_first_chunks():
    """The wait for the first chunks took request_timeout_s of its own and the events then got a fresh one: a
    stalled stream could run twice the timeout. The events now end at the request's deadline, with an error event."""

    async def stalled():
        yield StreamChunk([1], "t", None, None)
        await asyncio.sleep(3600)  # an engine that never answers again
        yield StreamChunk([1], "x", "length", None)

    class Bodies:
        def chunks(self, index, chunk):
            return [{"index": index, "text": chunk.text}]

    async def go():
        stream = stalled()
        first = await anext(stream)
        recorded = []
        server = SimpleNamespace(settings=SimpleNamespace(request_timeout_s=3600),
                                 metrics=SimpleNamespace(record=recorded.append))  # fmt: skip
        events = OpenAIServer._events(server, [None], [stream], [first], Bodies(), time.monotonic() + 0.2)
        return [event async for event in events], recorded

    events, recorded = asyncio.run(asyncio.wait_for(go(), timeout=60))
    assert '"text":"t"' in events[0] and '"status":504' in events[1] and events[-1] == "data: [DONE]\n\n"
    assert recorded == ["error"]

