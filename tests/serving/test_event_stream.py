"""EventStream: a body streams whole; a client that leaves closes the body; a cancelled response cancels it too."""

import asyncio

import pytest

from ray_specdec.serving.event_stream import EventStream

SCOPE = {"type": "http", "asgi": {"spec_version": "2.1"}, "method": "POST", "path": "/v1/completions"}


def body(n: int, log: list, step: asyncio.Event | None = None):
    async def events():
        try:
            for i in range(n):
                if step is not None:
                    await step.wait()
                    step.clear()
                log.append(f"made {i}")
                yield f"data: {i}\n\n"
        finally:
            log.append("closed")

    return events()


class Client:
    """The ASGI side: records what was sent; `leave()` makes receive say http.disconnect."""

    def __init__(self):
        self.sent: list[dict] = []
        self.gone = asyncio.Event()
        self.receives = 0

    async def receive(self) -> dict:
        self.receives += 1
        await self.gone.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: dict) -> None:
        self.sent.append(message)

    def chunks(self) -> list[bytes]:
        return [m["body"] for m in self.sent if m["type"] == "http.response.body" and m.get("body")]


def test_a_body_goes_out_whole_and_the_listener_is_left_behind():
    async def main():
        client, log = Client(), []
        response = asyncio.ensure_future(EventStream(body(5, log))(SCOPE, client.receive, client.send))
        done, _ = await asyncio.wait({response}, timeout=5)
        assert done and response.result() is None  # not waiting for the client to leave
        await asyncio.sleep(0)
        assert asyncio.all_tasks() == {asyncio.current_task()}  # the listener is gone too, not left waiting
        return client, log

    client, log = asyncio.run(main())
    start = client.sent[0]
    assert start["type"] == "http.response.start" and start["status"] == 200
    assert (b"content-type", b"text/event-stream; charset=utf-8") in start["headers"]
    assert client.chunks() == [f"data: {i}\n\n".encode() for i in range(5)]
    assert client.sent[-1] == {"type": "http.response.body", "body": b"", "more_body": False}
    assert log[-1] == "closed" and client.receives == 1


def test_a_client_that_leaves_closes_the_body():
    async def main():
        client, log, step = Client(), [], asyncio.Event()
        response = asyncio.ensure_future(EventStream(body(100, log, step))(SCOPE, client.receive, client.send))
        for sent in (1, 2):  # two chunks out, one at a time
            step.set()
            while len(client.chunks()) < sent:
                await asyncio.sleep(0.001)
        client.gone.set()
        done, _ = await asyncio.wait({response}, timeout=5)
        assert done and response.result() is None  # over at once, and a client that left is not an error
        return client, log

    client, log = asyncio.run(main())
    assert client.chunks() == [b"data: 0\n\n", b"data: 1\n\n"]
    assert log == ["made 0", "made 1", "closed"]


def test_a_cancelled_response_cancels_its_body():
    async def main():
        client, log, step = Client(), [], asyncio.Event()
        response = asyncio.ensure_future(EventStream(body(100, log, step))(SCOPE, client.receive, client.send))
        step.set()
        await asyncio.sleep(0.01)
        response.cancel()
        with pytest.raises(asyncio.CancelledError):
            await response
        return log

    assert asyncio.run(main()) == ["made 0", "closed"]
