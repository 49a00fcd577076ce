"""ReplicaLossGuard (serving/proxy_guard.py) around stand-ins for Serve's proxy app, through Starlette's test client:
a lost replica's request gets 503 with Retry-After, a cut stream an error event and [DONE], a probe no replica
answers 503 within the deadline; complete answers pass untouched."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from starlette.testclient import TestClient

from ray_specdec.serving.proxy_guard import PROBE_TRIES, ReplicaLossGuard, middlewares

SSE = [(b"content-type", b"text/event-stream")]


def client(app, **kwargs) -> TestClient:
    return TestClient(ReplicaLossGuard(app, **kwargs), raise_server_exceptions=False)


async def dies_before_answering(scope, receive, send):
    """Serve's proxy when the replica died before its status line: no message, or the error raised."""
    if scope["path"] == "/raise":
        raise RuntimeError("ActorDiedError")


async def cut_stream(scope, receive, send):
    """A stream whose replica died after two events: no last body message."""
    await send({"type": "http.response.start", "status": 200, "headers": SSE})
    for i in range(2):
        await send({"type": "http.response.body", "body": f"data: {{\"i\": {i}}}\n\n".encode(), "more_body": True})
    if scope["path"] == "/raise":
        raise RuntimeError("ActorDiedError")


async def whole_stream(scope, receive, send):
    await send({"type": "http.response.start", "status": 200, "headers": SSE})
    await send({"type": "http.response.body", "body": b"data: {\"i\": 0}\n\n", "more_body": True})
    await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})


async def never_answers(scope, receive, send):
    await asyncio.sleep(30)


async def back_pressure(scope, receive, send):
    await send({"type": "http.response.start", "status": 503, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"{}", "more_body": False})


def events(text: str) -> list:
    data = [line.removeprefix("data: ") for line in text.splitlines() if line.startswith("data: ")]
    return [d if d == "[DONE]" else json.loads(d) for d in data]


@pytest.mark.parametrize("path", ["/v1/completions", "/raise"])
def test_a_request_without_an_answer_gets_503_with_retry_after(path):
    response = client(dies_before_answering).post(path, json={})
    assert response.status_code == 503 and response.headers["retry-after"] == "2"
    assert response.json()["error"]["code"] == "replica_lost"
    assert response.json()["error"]["type"] == "server_error"


@pytest.mark.parametrize("path", ["/v1/completions", "/raise"])
def test_a_cut_stream_ends_with_an_error_event_and_done(path):
    response = client(cut_stream).post(path, json={})
    assert response.status_code == 200
    got = events(response.text)
    assert got[:2] == [{"i": 0}, {"i": 1}] and got[-1] == "[DONE]" and len(got) == 4
    assert got[2]["status"] == 503 and got[2]["error"]["code"] == "replica_lost"


def test_a_client_that_leaves_mid_stream_gets_nothing_more_and_no_warning(caplog):
    """Serve's proxy, told by the client's disconnect, cancels the request: no last body, but nothing was lost."""
    sent: list[dict] = []

    async def leaves_after_the_first_event(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": SSE})
        await send({"type": "http.response.body", "body": b"data: {\"i\": 0}\n\n", "more_body": True})
        assert (await receive())["type"] == "http.disconnect"

    async def receive():
        return {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": []}
    with caplog.at_level("WARNING"):
        asyncio.run(ReplicaLossGuard(leaves_after_the_first_event)(scope, receive, send))
    assert [m.get("body") for m in sent] == [None, b"data: {\"i\": 0}\n\n"]  # the app's own messages only
    assert not [r for r in caplog.records if "stream cut" in r.getMessage()]


def test_a_whole_stream_passes_untouched():
    response = client(whole_stream).post("/v1/completions", json={})
    assert events(response.text) == [{"i": 0}, "[DONE]"]


@pytest.mark.parametrize("path", ["/health", "/ready", "/live", "/single/health"])
def test_a_probe_nobody_answers_gets_503_within_the_deadline(path):
    start = time.monotonic()
    response = client(never_answers, health_deadline_s=0.3).get(path)
    assert response.status_code == 503 and response.headers["retry-after"] == "2"
    assert time.monotonic() - start < 5


def test_only_probes_have_a_deadline():
    async def slow(scope, receive, send):
        await asyncio.sleep(0.5)
        await back_pressure(scope, receive, send)

    response = client(slow, health_deadline_s=0.1).get("/v1/models")
    assert response.status_code == 503 and response.content == b"{}"  # the app's own answer, late


def test_a_503_without_retry_after_gets_one():
    response = client(back_pressure).get("/v1/models")
    assert response.status_code == 503 and response.headers["retry-after"] == "2" and response.content == b"{}"


def test_serve_takes_the_callback():
    from ray.serve._private.http_util import validate_http_proxy_callback_return

    assert [m.cls for m in validate_http_proxy_callback_return(middlewares())] == [ReplicaLossGuard]


async def times_out_as_serve_does(scope, receive, send):
    """Serve's proxy past the request's timeout header: 408 (the header must be there, within the deadline)."""
    timeout = dict(scope["headers"]).get(b"x-request-timeout-seconds")
    await send({"type": "http.response.start", "status": 408 if timeout else 200, "headers": []})
    await send({"type": "http.response.body", "body": timeout or b"no header", "more_body": False})


def test_a_probe_carries_serves_timeout_header_and_its_408_becomes_503():
    response = client(times_out_as_serve_does, health_deadline_s=1.5).get("/health",
                                                                        headers={"x-request-timeout-seconds": "60"})
    assert response.status_code == 503 and response.headers["retry-after"] == "2"
    assert response.json()["error"]["code"] == "unavailable"
    other = client(times_out_as_serve_does).post("/v1/completions", json={})
    assert other.status_code == 200 and other.content == b"no header"  # only probes get the header


def test_the_header_is_below_the_deadline():
    seen = []

    async def app(scope, receive, send):
        seen.append(float(dict(scope["headers"])[b"x-request-timeout-seconds"]))
        await back_pressure(scope, receive, send)

    client(app, health_deadline_s=1.5).get("/live")
    assert 0 < seen[0] < 1.5


@pytest.mark.parametrize("how", ["raises", "no answer"])
def test_a_probe_whose_replica_died_is_asked_again_and_a_live_replica_answers(how):
    """The proxy routed the probe to a replica that died before answering; asked again, it goes to a live one."""
    tries = []

    async def first_replica_dead(scope, receive, send):
        assert (await receive())["type"] == "http.request"  # each try gets the request again
        tries.append(dict(scope["headers"])[b"x-request-timeout-seconds"])
        if len(tries) == 1:
            if how == "raises":
                raise RuntimeError("ActorDiedError")
            return
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok", "more_body": False})

    response = client(first_replica_dead).get("/health")
    assert (response.status_code, response.content, len(tries)) == (200, b"ok", 2)
    assert float(tries[1]) <= float(tries[0])  # the retry has what is left of the deadline


def test_a_probe_whose_replicas_keep_dying_gets_503_after_a_few_tries():
    tries = []

    async def always_dead(scope, receive, send):
        tries.append(scope["path"])
        raise RuntimeError("ActorDiedError")

    response = client(always_dead).get("/ready")
    assert response.status_code == 503 and response.json()["error"]["code"] == "replica_lost"
    assert len(tries) == PROBE_TRIES
    assert client(always_dead).post("/v1/completions", json={}).status_code == 503
    assert len(tries) == PROBE_TRIES + 1  # a request is never sent twice: only probes are


def test_a_probe_that_timed_out_is_not_asked_again():
    tries = []

    async def slow(scope, receive, send):
        tries.append(1)
        await asyncio.sleep(30)

    assert client(slow, health_deadline_s=0.5).get("/health").status_code == 503
    assert len(tries) == 1
