"""The ingress: an OpenAI-compatible FastAPI app on Ray Serve that hands each request to an engine replica.

Routes: POST /v1/completions (stream=true as server-sent events), GET /v1/models, GET /health, GET /v1/bandit,
GET /v1/stats (replica counts and the engines' loop state, read by the load test). The round loop runs in the engine
replicas (deployments/engine.py); a request is one streaming call to one of them, continued on another if its replica
is lost (ray_specdec/serving/router.py). Errors are OpenAI-shaped JSON: 400 for a body that is not JSON, unknown or
unsupported fields, out-of-range values and requests that can never fit the context or the KV budget, 404 for an
unknown route or model, 503 with Retry-After when the engines' queues are full or the target is down, 504 when a
request outlives `request_timeout_s`.

Metrics: GET /metrics, open without the API key (Prometheus scrapes it), answers the whole app's metrics in
Prometheus' text format from any replica: every replica's numbers as last pushed to the metrics hub
(deployments/metrics.py; this replica's own, fresh) and the bandit hub's summary; an app of one engine replica
keeps no hubs (AppArgs.hubs): its own numbers and bandit are the app's. docs/METRICS.md lists them.
"""


import asyncio
import contextlib
import json
import logging
import secrets
import time
from dataclasses import dataclass, replace

import ray
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from ray import serve
from ray.serve.config import HTTPOptions
from ray.serve.exceptions import BackPressureError
from transformers.utils import cached_file

from deployments.engine import EngineReplica
from deployments.ingress import direct_ingress_on, target_urls
from deployments.metrics import MetricsPush, replica_name
from ray_specdec.config import SamplingParams, TreeConfig
from ray_specdec.models.loading import load_tokenizer
from ray_specdec.serving import api, openai_chat
from ray_specdec.serving.event_stream import EventStream
from ray_specdec.serving.metrics import CONTENT_TYPE, RouterMetrics, Snapshot, bandit_gauges, render
from ray_specdec.serving.router import RequestError, Router

logger = logging.getLogger("ray.serve")  # Serve shows this logger's records in `serve run` output

fastapi_app = FastAPI(title="ray_specdec", docs_url=None, redoc_url=None)


# Seconds a client is asked to wait after a 503.
RETRY_AFTER_S = 2
# /health's wait for an engine replica's answer.
HEALTH_TIMEOUT_S = 5.0


class ApiError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.kind, self.param, self.code = status, kind, param, code


@fastapi_app.exception_handler(ApiError)
async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
    headers = {"Retry-After": str(RETRY_AFTER_S)} if exc.status == 503 else None
    return JSONResponse(api.error_body(str(exc), exc.kind, exc.param, exc.code), status_code=exc.status,
                        headers=headers)  # fmt: skip


@fastapi_app.exception_handler(RequestValidationError)
async def _invalid_request(request: Request, exc: RequestValidationError) -> JSONResponse:
    status, body = api.validation_error(exc.errors())
    return JSONResponse(body, status_code=status)


@fastapi_app.exception_handler(StarletteHTTPException)
async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    """Starlette's own answers (a route that does not exist, a method a route does not take) in OpenAI's error
    shape too, headers kept (405's Allow), instead of FastAPI's {"detail": ...}."""
    message = f"{exc.detail} ({request.method} {request.url.path})"
    return JSONResponse(api.error_body(message), status_code=exc.status_code, headers=exc.headers)


@dataclass(frozen=True)
class RouterSettings:
    model_name: str  # what /v1/models and responses call the target
    tokenizer: str  # directory or hub id holding the target's tokenizer
    max_context: int | None = None  # cap on prompt + max_tokens below the target's own context length
    request_timeout_s: float = 600.0  # a request still running after this gets 504 (streams: an error event)
    retry_s: float = 60.0  # how long a request whose replica was lost may wait for another one
    api_key: str | None = None  # when set, /v1/* needs "Authorization: Bearer <api_key>" (401 otherwise)
    stream_interval_s: float = 0.0  # a stream's chunks come at most this often after its first (rounds merged)


async def _result(response):
    """Await a DeploymentResponse; cancelling the wait cancels the remote call too."""
    try:
        return await response
    except asyncio.CancelledError:
        response.cancel()
        raise


class ServeEngine:
    """EngineClient over the engine deployment's handle: one streaming call per request."""

    def __init__(self, handle):
        self.handle = handle.options(stream=True)

    async def generate(self, prompt_ids: list[int], params: SamplingParams, tree: TreeConfig | None,
                       interval_s: float, resumed: int = 0):
        stream = self.handle.generate.remote(prompt_ids, params, tree, None, interval_s, resumed)
        try:
            async for item in stream:
                yield item
        finally:
            stream.cancel()


class LocalEngine:
    """EngineClient over the engine replica in this process (engine mode): no remote call at all."""

    def __init__(self, replica: EngineReplica):
        self.replica = replica

    def generate(self, prompt_ids: list[int], params: SamplingParams, tree: TreeConfig | None, interval_s: float,
                 resumed: int = 0):
        return self.replica.generate(prompt_ids, params, tree, None, interval_s, resumed)


def _never(exc: BaseException) -> bool:
    return False  # the engine is this process: nothing to continue elsewhere


def replica_lost(exc: BaseException) -> bool:
    """Whether an engine call failed because its replica (or its process) is gone."""
    return isinstance(exc, (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError))


# Module-level helpers of RouterDeployment stay above it: Serve rebuilds the class in the replica from a pickle whose
# functions see only the module's names defined before the class (a name below it is a NameError there, at run time).
def _nth_sample(params: SamplingParams, j: int) -> SamplingParams:
    """The j-th of n independent samples of one prompt: its own seed when the request gave one."""
    return params if params.seed is None or j == 0 else replace(params, seed=params.seed + j)


def _generation_config(model: str) -> dict:
    """The target's generation_config.json as written (its defaults for sampling), {} where it has none."""
    try:
        with open(cached_file(model, "generation_config.json")) as f:
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


def _downstream_error(exc: BaseException) -> tuple[int, str]:
    """(HTTP status, message) for a failure of the engine or another downstream call."""
    if isinstance(exc, RequestError):
        return exc.status, str(exc)
    if isinstance(exc, BackPressureError):
        return 503, "the server is overloaded; retry later"
    if isinstance(exc, TimeoutError):
        return 504, "the model did not answer in time"
    return 500, f"generation failed: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"


@serve.ingress(fastapi_app)
class OpenAIServer:
    """The routes, over either engine: `engine_handle` (router mode: the engine deployment's replicas, a hop away) or
    `replica_kwargs` (engine mode: an `EngineReplica` built in this process, the loop beside the routes)."""

    async def __init__(self, settings: RouterSettings, engine_handle=None, bandit_hub=None,
                       replica_kwargs: dict | None = None, metrics_hub=None):
        self.settings = settings
        self.engine = engine_handle
        self.replica = None
        if replica_kwargs is not None:
            # the weights load on a thread: the replica's event loop keeps answering Serve's health checks
            self.replica = await asyncio.to_thread(EngineReplica, **replica_kwargs, bandit_hub=bandit_hub)
            self.info, client, lost = self.replica.info(), LocalEngine(self.replica), _never
        else:
            self.info, client, lost = await engine_handle.info.remote(), ServeEngine(engine_handle), replica_lost
        max_context = min(self.info["max_context"], settings.max_context or self.info["max_context"])
        self.bandit_hub = bandit_hub
        self.core = Router(client, load_tokenizer(settings.tokenizer), max_context, lost, settings.retry_s,
                           settings.stream_interval_s)  # fmt: skip
        self.defaults = api.generation_defaults(_generation_config(settings.tokenizer))
        self.metrics = RouterMetrics(lambda: self.core.in_flight)
        self.metrics_hub = metrics_hub
        self.replica_name = replica_name("router" if self.replica is None else "engine")
        self.metrics_push = None
        if metrics_hub is not None:
            self.metrics_push = MetricsPush(metrics_hub, self.replica_name, self._metrics_snapshot)
        self.app_name = serve.get_replica_context().app_name
        logger.info("ray_specdec is ready. Try:\n%s", await self._curl_example())
        if direct_ingress_on():
            self._announcing = asyncio.get_running_loop().create_task(self._announce_direct())

    @fastapi_app.post("/v1/completions")
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
        choices = [(prompt, _nth_sample(params, j)) for prompt in prompts for j in range(body.n)]
        self._check_fits(len(choices), "n" if body.n > 1 else "prompt")
        name = self.settings.model_name
        if body.stream:
            stream = api.CompletionStream(body, tokenizer, name, sum(map(len, prompts)))
            return await self._stream(choices, body.tree_config(), stream)
        return api.completion_body(body, tokenizer, name, await self._generate(choices, body.tree_config()))

    @fastapi_app.post("/v1/chat/completions")
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
        choices = [(ids, _nth_sample(params, j)) for j in range(body.n)]
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
        limit = 0 if self.replica is None else self.replica.loop.scheduler.config.max_waiting
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
            status, message = _downstream_error(exc)
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
            status, message = _downstream_error(exc)
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
            status, (code, message) = "error", _downstream_error(exc)
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

    @fastapi_app.get("/v1/models")
    async def models(self, request: Request) -> dict:
        self._authorize(request)
        return api.model_list([self._card()])

    @fastapi_app.get("/v1/models/{model_id:path}")
    async def model(self, model_id: str, request: Request) -> dict:
        self._authorize(request)
        self._check_model(model_id)
        return self._card()

    def _card(self) -> dict:
        return api.model_card(self.settings.model_name, max_context=self.core.max_context,
                              tp_size=self.info["tp_size"])  # fmt: skip

    @fastapi_app.get("/health")
    async def health(self):
        """200 while an engine replica runs with its target up; 503 otherwise (no replica, or the replica asked has
        its target down or restarting: where new requests get 503 too)."""
        status = await asyncio.to_thread(serve.status)
        engine = status.applications[self.app_name].deployments["engine"]
        running = engine.replica_states.get("RUNNING", 0)
        target = {"healthy": False, "recovering": False}
        if self.replica is not None:
            target = await self.replica.health()
        elif running:
            with contextlib.suppress(Exception):  # no answer in time is not healthy either
                target = await asyncio.wait_for(_result(self.engine.health.remote()), HEALTH_TIMEOUT_S)
        healthy = running and target["healthy"] and not str(engine.status).endswith("UNHEALTHY")
        body = {"status": "ok" if healthy else "unavailable", "in_flight": self.core.in_flight,
                "engine_replicas": running, "engine_status": str(engine.status),
                "target_recovering": target["recovering"]}  # fmt: skip
        if not healthy:
            return JSONResponse(body | {"status": "unavailable"}, status_code=503,
                                headers={"Retry-After": str(RETRY_AFTER_S)})  # fmt: skip
        return body

    @fastapi_app.get("/v1/bandit")
    async def bandit(self) -> dict:
        summary = await self._bandit_summary()
        return {"policy": "fixed"} if summary is None else summary

    async def _bandit_summary(self) -> dict | None:
        """The app's bandit: the hub's, or the one engine replica's own (AppArgs.hubs); None under a fixed tree."""
        if self.bandit_hub is not None:
            return await asyncio.wait_for(_result(self.bandit_hub.summary.remote()), 30.0)
        if self.replica is not None and self.replica.bandit is not None:
            return self.replica.bandit.summary()
        return None

    @fastapi_app.get("/metrics")
    async def prometheus(self) -> Response:
        """The whole app's metrics (module docstring); no API key."""
        snapshots = {}
        if self.metrics_hub is not None:
            snapshots = await asyncio.wait_for(_result(self.metrics_hub.snapshots.remote()), 30.0)
        snapshots[self.replica_name] = self._metrics_snapshot()
        summary = await self._bandit_summary()
        return Response(render(snapshots, bandit_gauges(summary)), media_type=CONTENT_TYPE)

    def _metrics_snapshot(self) -> Snapshot:
        """The routes' numbers, with the engine replica's in engine mode (one process, one push)."""
        snapshot = self.metrics.snapshot()
        return snapshot if self.replica is None else snapshot | self.replica.loop.metrics.snapshot()

    @fastapi_app.get("/v1/stats")
    async def stats(self) -> dict:
        status = await asyncio.to_thread(serve.status)
        deployments = status.applications[self.app_name].deployments
        replicas = {name: d.replica_states.get("RUNNING", 0) for name, d in deployments.items()}
        if self.replica is not None:
            engine = await self.replica.stats()
        else:
            engine = await asyncio.wait_for(_result(self.engine.stats.remote()), 30.0)
        return {"replicas": replicas, "in_flight": self.core.in_flight, "continued": self.core.continued,
                "engine": engine, "direct_urls": await self._direct_urls()}

    async def _direct_urls(self) -> list[str]:
        """Base URLs of this app's replicas' own HTTP servers under Ray Serve's direct ingress (`direct_ingress`,
        RAY_SERVE_ENABLE_DIRECT_INGRESS=1), sorted; [] when it is off. A client there skips the proxy: no hop between
        the HTTP connection and the replica (docs/INTERFACES.md, "Serving")."""
        if not direct_ingress_on():
            return []
        try:
            controller = ray.get_actor("SERVE_CONTROLLER_ACTOR", namespace="serve")
            details, groups = await asyncio.gather(controller.get_serve_instance_details.remote(),
                                                   controller.get_target_groups.remote(self.app_name))  # fmt: skip
        except Exception as exc:  # an older Ray without target groups: the proxy's address still serves
            logger.debug("direct ingress addresses unavailable: %s", exc)
            return []
        http = details.get("http_options") or {}
        return target_urls(groups, self.app_name, http.get("host"), http.get("port") or HTTPOptions().port)

    async def _announce_direct(self, wait_s: float = 60.0) -> None:
        """Log the direct ingress addresses once Serve has given this replica its port (after __init__)."""
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            await asyncio.sleep(1.0)
            if urls := await self._direct_urls():
                logger.info("direct ingress (no proxy hop; POST <url>/v1/completions): %s", " ".join(urls))
                return

    async def _curl_example(self) -> str:
        """A ready-to-paste request against this app's HTTP address (read from the Serve controller)."""
        host, port, prefix = "127.0.0.1", HTTPOptions().port, "/"
        try:
            controller = ray.get_actor("SERVE_CONTROLLER_ACTOR", namespace="serve")
            details = await controller.get_serve_instance_details.remote()
            http = details.get("http_options") or {}
            host = http.get("host") or host
            port = http.get("port") or port
            prefix = details["applications"][self.app_name].get("route_prefix") or prefix
        except Exception:  # the defaults of `serve run` are the best guess
            pass
        host = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
        body = json.dumps({"prompt": "def fibonacci(n):", "max_tokens": 32, "temperature": 0})
        url = f"http://{host}:{port}{prefix.rstrip('/')}/v1/completions"
        return f"curl -s {url} -H 'Content-Type: application/json' -d '{body}'"

    async def check_health(self) -> None:
        """Serve's health check: in engine mode, the engine replica's (a dead loop or a target that did not come
        back restarts the replica)."""
        if self.replica is not None:
            await self.replica.check_health()

    def __del__(self) -> None:  # Serve calls it when the replica shuts down
        if getattr(self, "replica", None) is not None:
            self.replica.shutdown()


# Router mode: the routes alone (no CPU of their own), a hop before the engine deployment's replicas.
RouterDeployment = serve.deployment(name="router", ray_actor_options={"num_cpus": 0})(OpenAIServer)
# Engine mode: the routes and an engine replica in one process; the HTTP proxy hands each request to one of them.
# No access log: each request is one long streaming call.
ServerDeployment = serve.deployment(name="engine", logging_config={"enable_access_log": False},
                                    health_check_period_s=5)(OpenAIServer)  # fmt: skip
