"""What a client gets from Ray Serve's HTTP proxy when the replica behind its request is lost: an ASGI middleware.

Serve's proxy answers a request whose replica died before the status line with no response at all (uvicorn then sends
a bare 500), ends a stream cut by the replica's death by dropping the connection mid-body, and holds a request while
the app has no running replica until one comes up. `ReplicaLossGuard` wraps the proxy's ASGI app (Serve calls
`middlewares`, named by RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH, in the proxy; deployments/app.py sets it) and turns
these into answers an OpenAI client acts on:
- no response at all: 503 with Retry-After and an OpenAI-shaped error body (code "replica_lost");
- a server-sent-event stream that ends without its last body message: an OpenAI-shaped error event
  (`{"error": {...}, "status": 503}`) and `data: [DONE]`, the ending the app's own streams give a failure after the
  status line (serving/openai_server.py);
- a 503 without Retry-After (Serve's own back-pressure): the header added;
- GET .../health, .../ready or .../live not answered within HEALTH_DEADLINE_S (no replica runs, or none answers in
  time): 503, where the proxy would otherwise hold the probe until a replica comes back. The probe carries Serve's
  per-request timeout header (its proxy then gives up on it cleanly, with a 408 that becomes this 503), and the
  guard's own deadline stands behind it (a Serve without that header). A probe whose replica died before answering
  (the proxy had routed it there before it learnt of the death) is asked again within the deadline: another replica
  may well be there to answer, and that is what the probe asks.
A response that completed, and a non-stream body cut after its status line (its length is sent: nothing can be
added), pass as they are.

Plain ASGI without Ray or torch: the proxy process imports it, and so do the ingress replicas' own HTTP servers
(Serve's direct ingress applies the same middlewares there).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from typing import Any, Awaitable, Callable

logger = logging.getLogger("ray.serve")

Message = dict[str, Any]
ASGIApp = Callable[[dict, Callable[[], Awaitable[Message]], Callable[[Message], Awaitable[None]]], Awaitable[None]]

# The probes answered within HEALTH_DEADLINE_S (the last segment of the path, under any route prefix).
PROBE_PATHS = ("health", "ready", "live")
# A probe no replica answers by then gets 503: the proxy routes it to a running replica at once, which answers from
# memory; one that waits this long found none (or none that can answer: a replica that can serve answers in ms).
HEALTH_DEADLINE_S = 1.5
# Serve's per-request timeout header (its proxy answers 408 past it), set on a probe this much before the deadline.
TIMEOUT_HEADER = b"x-request-timeout-seconds"
HEADER_MARGIN_S = 0.3
# A probe whose replica was lost before answering is asked again, up to PROBE_TRIES in all, while at least
# PROBE_RETRY_MIN_S of the deadline is left.
PROBE_TRIES = 3
PROBE_RETRY_MIN_S = 0.2
RETRY_AFTER_S = 2  # seconds a client is asked to wait after a 503 (as serving/openai_server.py's)
LOST_MESSAGE = "the replica serving this request was lost; retry the request"


def error_body(message: str, code: str) -> dict[str, Any]:
    """OpenAI's error shape (serving/api.py's error_body, without its imports)."""
    return {"error": {"message": message, "type": "server_error", "param": None, "code": code}}


def is_probe(scope: dict) -> bool:
    return scope.get("method") == "GET" and scope.get("path", "").rstrip("/").rsplit("/", 1)[-1] in PROBE_PATHS


class ReplicaLossGuard:
    """The ASGI middleware (module docstring)."""

    def __init__(self, app: ASGIApp, health_deadline_s: float = HEALTH_DEADLINE_S):
        self.app = app
        self.health_deadline_s = health_deadline_s

    async def __call__(self, scope: dict, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        probe = is_probe(scope)
        started = ended = event_stream = answered = expired = client_left = False

        async def watched_receive() -> Message:
            nonlocal client_left
            message = await receive()
            if message["type"] == "http.disconnect":  # the client left (after [DONE], or gave up): nothing was lost
                client_left = True
            return message

        async def guarded_send(message: Message) -> None:
            nonlocal started, ended, event_stream, expired
            if answered or expired:  # the guard answers instead: a probe past its deadline, or Serve's 408 for it
                return
            if probe and message["type"] == "http.response.start" and message.get("status") == 408:
                expired = True
                return
            if message["type"] == "http.response.start":
                started = True
                headers = list(message.get("headers") or [])
                names = {bytes(k).lower() for k, _ in headers}
                event_stream = any(bytes(k).lower() == b"content-type" and bytes(v).startswith(b"text/event-stream")
                                   for k, v in headers)  # fmt: skip
                if message.get("status") == 503 and b"retry-after" not in names:
                    message = message | {"headers": headers + [(b"retry-after", str(RETRY_AFTER_S).encode())]}
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                ended = True
            await send(message)

        def settled() -> bool:  # a probe answered or past Serve's timeout, or its client gone: not asked again
            return started or expired or client_left

        failure: BaseException | None = None
        if probe:
            failure = await self._probe(scope, watched_receive, guarded_send, settled)
        else:
            try:
                await self.app(scope, watched_receive, guarded_send)
            except Exception as exc:  # the replica's death as the proxy raises it
                failure = exc
        answered = True
        if ended or client_left:  # answered whole, or nobody left to answer: Serve cancelled it for the client
            return
        if not started:
            timed_out = expired or isinstance(failure, (asyncio.TimeoutError, TimeoutError))
            if timed_out or failure is None:
                logger.warning("%s %s: no replica answered; 503", scope.get("method"), scope.get("path"))
            else:
                logger.warning("%s %s failed before its status line (%s); 503", scope.get("method"),
                               scope.get("path"), type(failure).__name__)  # fmt: skip
            message = "no replica of the app answered in time" if timed_out else LOST_MESSAGE
            with contextlib.suppress(Exception):  # a client that left meanwhile
                await _answer_503(send, error_body(message, "unavailable" if timed_out else "replica_lost"))
            return
        if event_stream:
            logger.warning("%s %s: stream cut (%s); closed with an error event", scope.get("method"),
                           scope.get("path"), type(failure).__name__ if failure else "no last body")  # fmt: skip
            event = error_body(LOST_MESSAGE, "replica_lost") | {"status": 503}
            data = f"data: {json.dumps(event, separators=(',', ':'))}\n\ndata: [DONE]\n\n"
            with contextlib.suppress(Exception):  # a client that left meanwhile
                await send({"type": "http.response.body", "body": data.encode(), "more_body": False})
            return
        if failure is not None:  # a body of known length, cut: the server can only close the connection
            raise failure

    async def _probe(self, scope: dict, receive, send, settled: Callable[[], bool]) -> BaseException | None:
        """A probe through the app within the deadline, asked again while its replica was lost before answering
        (the proxy routed it to a replica that died: the next try goes to a live one, and a probe has no effects)
        -> the last try's failure."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.health_deadline_s
        requests: list[Message] = []  # the request's own messages, given again to a retry

        async def recorded_receive() -> Message:
            message = await receive()
            if message["type"] == "http.request":
                requests.append(message)
            return message

        for tries in range(1, PROBE_TRIES + 1):
            replay = list(requests)

            async def replayed_receive() -> Message:
                return replay.pop(0) if replay else await recorded_receive()

            remaining = deadline - loop.time()
            timeout = str(max(remaining - HEADER_MARGIN_S, 0.1)).encode()
            headers = [(k, v) for k, v in scope.get("headers") or [] if bytes(k).lower() != TIMEOUT_HEADER]
            failure = None
            try:
                await asyncio.wait_for(self.app(scope | {"headers": headers + [(TIMEOUT_HEADER, timeout)]},
                                                replayed_receive, send), remaining)  # fmt: skip
            except Exception as exc:  # the replica's death as the proxy raises it, the deadline
                failure = exc
            timed_out = isinstance(failure, (asyncio.TimeoutError, TimeoutError))
            if settled() or timed_out or tries == PROBE_TRIES or deadline - loop.time() < PROBE_RETRY_MIN_S:
                return failure
            logger.info("%s %s: its replica was lost before answering; asked again", scope.get("method"),
                        scope.get("path"))  # fmt: skip


async def _answer_503(send, body: dict) -> None:
    payload = json.dumps(body).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode()),
               (b"retry-after", str(RETRY_AFTER_S).encode())]  # fmt: skip
    await send({"type": "http.response.start", "status": 503, "headers": headers})
    await send({"type": "http.response.body", "body": payload, "more_body": False})


def middlewares() -> list:
    """Serve's HTTP proxy callback (RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH=ray_specdec.serving.proxy_guard:
    middlewares): the guard as a Starlette middleware."""
    from starlette.middleware import Middleware

    return [Middleware(ReplicaLossGuard)]
