"""The OpenAI-compatible HTTP server, without Ray: the FastAPI app, its OpenAI-shaped errors, and `OpenAIServer`, whose
methods are the routes that answer from an engine.

Routes here: POST /v1/completions and POST /v1/chat/completions (stream=true as server-sent events), GET /v1/models
and GET /v1/models/{id}. A request is encoded, checked and handed to serving/router.py's `Router` over the engine
client the server is given; its choices (prompts x n) run all or none. Errors are OpenAI-shaped JSON: 400 for a body
that is not JSON, unknown or unsupported fields, out-of-range values and requests that can never fit the context or
the KV budget, 401 for a missing API key, 404 for an unknown route or model, 503 with Retry-After when the engines'
queues are full or the target is down, 504 when a request outlives `request_timeout_s`.

deployments/router.py makes `OpenAIServer` a Ray Serve ingress over the engine deployment or an engine replica in
its own process, and adds the routes that ask Serve and the hubs: /health, /v1/stats, /v1/bandit and /metrics.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from dataclasses import dataclass, replace
from typing import Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from transformers.utils import cached_file

from ray_specdec.config import SamplingParams, TreeConfig
from ray_specdec.models.loading import load_tokenizer, resolve_model_path
from ray_specdec.serving import api, openai_chat
from ray_specdec.serving.event_stream import EventStream
from ray_specdec.serving.config import ServingConfig
from ray_specdec.serving.metrics import RouterMetrics
from ray_specdec.serving.router import EngineClient, RequestError, Router

app = FastAPI(title="ray_specdec", docs_url=None, redoc_url=None)

# Seconds a client is asked to wait after a 503.
RETRY_AFTER_S = 2


class ApiError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.kind, self.param, self.code = status, kind, param, code


@app.exception_handler(ApiError)
async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
    headers = {"Retry-After": str(RETRY_AFTER_S)} if exc.status == 503 else None
    return JSONResponse(api.error_body(str(exc), exc.kind, exc.param, exc.code), status_code=exc.status,
                        headers=headers)  # fmt: skip


@app.exception_handler(RequestValidationError)
async def _invalid_request(request: Request, exc: RequestValidationError) -> JSONResponse:
    status, body = api.validation_error(exc.errors())
    return JSONResponse(body, status_code=status)


@app.exception_handler(StarletteHTTPException)
async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    """Starlette's own answers (a route that does not exist, a method a route does not take) in OpenAI's error
    shape too, headers kept (405's Allow), instead of FastAPI's {"detail": ...}."""
    message = f"{exc.detail} ({request.method} {request.url.path})"
    return JSONResponse(api.error_body(message), status_code=exc.status_code, headers=exc.headers)


@dataclass(frozen=True, kw_only=True)
class ServerSettings(ServingConfig):
    """What one server answers with: the target's name and tokenizer, and the serving settings."""

    model_name: str  # what /v1/models and responses call the target
    tokenizer: str  # directory or hub id holding the target's tokenizer
    max_context: int | None = None  # cap on prompt + max_tokens below the target's own context length


def nth_sample(params: SamplingParams, j: int) -> SamplingParams:
    """The j-th of n independent samples of one prompt: its own random streams (`SamplingParams.choice`)."""
    return params if j == 0 else replace(params, choice=j)


def generation_config(model: str) -> dict:
    """The target's generation_config.json as written (its defaults for sampling), {} where it has none."""
    try:  # an embedded model's name is its directory (as a hub id it would be looked up online, and not found)
        with open(cached_file(resolve_model_path(model), "generation_config.json")) as f:
            return json.load(f)
    except Exception:  # none: OpenAI's defaults
        return {}


async def all_or_none(awaitables: list, timeout_s: float) -> list:
    """Every awaitable's result, in order. If one raises, or the timeout passes, or the caller is cancelled, the
    others are cancelled and awaited before the error goes on: the choices of a refused request (one of them queue
    full, say) do not run on unread, and their streams are closed, not still running."""
    tasks = [asyncio.ensure_future(a) for a in awaitables]
    try:
        return await asyncio.wait_for(asyncio.gather(*tasks), timeout_s)
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


def downstream_error(exc: BaseException) -> tuple[int, str]:
    """(HTTP status, message) for a failure of the engine or another downstream call."""
    if isinstance(exc, RequestError):
        return exc.status, str(exc)
    if isinstance(exc, TimeoutError):
        return 504, "the model did not answer in time"
    return 500, f"generation failed: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"


class OpenAIServer:
    """The routes over one engine client: `client` streams a request's chunks (serving/router.py's `EngineClient`),
    `info` is the engine's (`max_context`, `vocab_size`, `tp_size`), `lost(exc)` says whether a failed call lost its
    replica (the request then continues on another), and `max_waiting` is how many sequences the engine queues at
    once (0: not known here)."""

    def __init__(self, settings: ServerSettings, client: EngineClient, info: dict,
                 lost: Callable[[BaseException], bool], max_waiting: int = 0):
        self.settings = settings
        self.info = info
        self.max_waiting = max_waiting
        max_context = min(info["max_context"], settings.max_context or info["max_context"])
        self.core = Router(client, load_tokenizer(settings.tokenizer), max_context, lost, settings.retry_s,
                           settings.stream_interval_s)  # fmt: skip
        self.defaults = api.generation_defaults(generation_config(settings.tokenizer))
        self.metrics = RouterMetrics(lambda: self.core.in_flight)

    @app.post("/v1/completions")
    async def completions(self, body: api.CompletionRequest, request: Request):
        self._authorize(request)
        self._check_model(body.model)
        tokenizer = self.core.tokenizer
        try:
            prompts = body.prompts(tokenizer)
            params = body.sampling_params(self.defaults)
            params.check_vocab(self.info["vocab_size"])
            for prompt in prompts:
                self.core.check_length(len(prompt), params)
        except (ValueError, RequestError) as exc:
            self.metrics.record("rejected")
            raise ApiError(400, str(exc), param="prompt" if isinstance(exc, RequestError) else None) from None
        choices = [(prompt, nth_sample(params, j)) for prompt in prompts for j in range(body.n)]
        self._check_fits(len(choices), "n" if body.n > 1 else "prompt")
        name = self.settings.model_name
        if body.stream:
            stream = api.CompletionStream(body, tokenizer, name, sum(map(len, prompts)))
            return await self._stream(choices, body.tree_config(), stream)
        return api.completion_body(body, tokenizer, name, await self._generate(choices, body.tree_config()))

    @app.post("/v1/chat/completions")
    async def chat_completions(self, body: openai_chat.ChatCompletionRequest, request: Request):
        self._authorize(request)
        self._check_model(body.model)
        tokenizer = self.core.tokenizer
        try:
            ids = body.render(tokenizer)
            params = body.sampling_params(self.core.max_context - len(ids), self.defaults)
            params.check_vocab(self.info["vocab_size"])
            self.core.check_length(len(ids), params)
        except (ValueError, RequestError) as exc:
            self.metrics.record("rejected")
            raise ApiError(400, str(exc), param="messages") from None
        choices = [(ids, nth_sample(params, j)) for j in range(body.n)]
        self._check_fits(len(choices), "n")
        name = self.settings.model_name
        if body.stream:
            return await self._stream(choices, body.tree_config(), openai_chat.ChatStream(body, tokenizer, name,
                                                                                          len(ids)))  # fmt: skip
        return openai_chat.chat_body(body, tokenizer, name, await self._generate(choices, body.tree_config()))

    def _authorize(self, request: Request) -> None:
        key = self.settings.api_key
        if key is not None and not secrets.compare_digest(request.headers.get("authorization", ""), f"Bearer {key}"):
            raise ApiError(401, "Incorrect or missing API key: send 'Authorization: Bearer <key>'",
                           code="invalid_api_key")  # fmt: skip

    def _check_fits(self, sequences: int, param: str) -> None:
        """A request of more sequences (prompts x n) than the engine replica queues at once (`max_waiting`; each is
        queued before any is admitted) could only ever be refused as busy: it gets 400 saying so, not 503 and a
        Retry-After. Router mode spreads a request's sequences over the replicas and leaves this to Serve."""
        limit = self.max_waiting
        if 0 < limit < sequences:
            self.metrics.record("rejected")
            raise ApiError(400, f"this request asks for {sequences} sequences (prompts x n); this server queues at "
                                f"most {limit} at once (max_waiting)", param=param)  # fmt: skip

    def _check_model(self, model: str | None) -> None:
        if model not in (None, self.settings.model_name):
            raise ApiError(404, f"The model {model!r} does not exist; this server has {self.settings.model_name!r}",
                           param="model", code="model_not_found")  # fmt: skip

    async def _generate(self, choices: list[tuple[list[int], SamplingParams]], tree: TreeConfig | None) -> list:
        """Every choice (prompt, params) as one engine request, concurrently -> their Generations in order."""
        try:
            gens = await all_or_none([self.core.generate(ids, params, tree) for ids, params in choices],
                                     self.settings.request_timeout_s)  # fmt: skip
        except asyncio.CancelledError:
            self.metrics.record("cancelled")
            raise
        except Exception as exc:
            status, message = downstream_error(exc)
            self.metrics.record("rejected" if status < 500 else "error")
            raise ApiError(status, message, "invalid_request_error" if status < 500 else "server_error") from None
        for _ in gens:
            self.metrics.record("ok")
        return gens

    async def _stream(self, choices: list[tuple[list[int], SamplingParams]], tree: TreeConfig | None, bodies):
        """A refusal before the first chunks (queue full, target down, KV budget) is still an HTTP status: every
        choice's first chunk is awaited before the status line goes out."""
        streams = [self.core.stream(ids, params, tree) for ids, params in choices]
        deadline = time.monotonic() + self.settings.request_timeout_s  # the whole request's, first chunks included
        try:
            firsts = await all_or_none([anext(s) for s in streams], self.settings.request_timeout_s)
        except Exception as exc:
            for stream in streams:
                await stream.aclose()
            status, message = downstream_error(exc)
            self.metrics.record("rejected" if status < 500 else "error")
            raise ApiError(status, message, "invalid_request_error" if status < 500 else "server_error") from None
        return EventStream(self._events(choices, streams, firsts, bodies, deadline))

    async def _events(self, choices, streams, firsts, bodies, deadline: float):
        """Server-sent events of the choices' streams, interleaved as their chunks come, until `deadline` (the
        request's, from its arrival: the wait for the first chunks counts)."""
        queue: asyncio.Queue = asyncio.Queue()
        for index, first in enumerate(firsts):
            queue.put_nowait((index, first))

        async def pump(index: int, stream) -> None:
            try:
                async for chunk in stream:
                    queue.put_nowait((index, chunk))
            except Exception as exc:
                queue.put_nowait((index, exc))

        pumps = [asyncio.create_task(pump(i, s)) for i, (s, f) in enumerate(zip(streams, firsts))
                 if f.finish_reason is None]  # fmt: skip
        status, open_choices = "cancelled", len(choices)
        try:
            while open_choices:
                # a stalled engine must not hold the stream past its deadline either
                index, chunk = await asyncio.wait_for(queue.get(), max(deadline - time.monotonic(), 0.0))
                if isinstance(chunk, Exception):
                    raise chunk
                for body in bodies.chunks(index, chunk):
                    yield api.sse(body)
                if chunk.finish_reason is not None:
                    open_choices -= 1
                    self.metrics.record("ok")
            for body in bodies.end():
                yield api.sse(body)
            status = "ok"
            yield api.sse("[DONE]")
        except Exception as exc:  # the status line is sent: report in the stream, as OpenAI does
            status, (code, message) = "error", downstream_error(exc)
            yield api.sse(api.error_body(message, "server_error") | {"status": code})
            yield api.sse("[DONE]")
        finally:  # the pumps end before their streams close: a stream a pump still runs cannot be closed
            for task in pumps:
                task.cancel()
            await asyncio.gather(*pumps, return_exceptions=True)
            for stream in streams:
                await stream.aclose()
            if status != "ok":
                self.metrics.record(status)

    @app.get("/v1/models")
    async def models(self, request: Request) -> dict:
        self._authorize(request)
        return api.model_list([self._card()])

    @app.get("/v1/models/{model_id:path}")
    async def model(self, model_id: str, request: Request) -> dict:
        self._authorize(request)
        self._check_model(model_id)
        return self._card()

    def _card(self) -> dict:
        return api.model_card(self.settings.model_name, max_context=self.core.max_context,
                              tp_size=self.info["tp_size"])  # fmt: skip
