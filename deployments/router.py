"""The ingress on Ray Serve: serving/openai_server.py's OpenAI-compatible routes as a Serve deployment, in front of
the engine replicas (deployments/engine.py) or beside one in the same process.

Router mode (`RouterDeployment`): the routes alone; a request is one streaming call to an engine replica, continued
on another if its replica is lost (ray_specdec/serving/router.py). Engine mode (`ServerDeployment`): the routes and an
`EngineReplica` in one process, no hop between them.

Routes added here, which ask Serve and the hubs: GET /health and GET /ready (readiness: 200 exactly when the app can
serve a request now, else 503 with Retry-After), GET /live (liveness: this replica runs and should not be replaced),
GET /v1/bandit, GET /v1/stats (replica counts and the engines' loop state, read by the load test) and GET /metrics.
/metrics, open without the API key (Prometheus scrapes it), answers the whole app's metrics in Prometheus' text
format from any replica: every replica's numbers as last pushed to the metrics hub (deployments/metrics.py; this
replica's own, fresh) and the bandit hub's summary; an app of one engine replica keeps no hubs (AppArgs.hubs): its
own numbers and bandit are the app's. docs/METRICS.md lists them. Serve's HTTP proxy runs serving/proxy_guard.py's
middleware in front: a request whose replica died gets 503, a stream it cut an error event, a probe that no replica
answers (none runs) 503 within 1.5 s.
"""


import asyncio
import contextlib
import json
import logging
import time

import ray
from fastapi.responses import JSONResponse, Response
from ray import serve
from ray.serve.config import HTTPOptions
from ray.serve.exceptions import BackPressureError

from deployments.engine import HEALTH_CHECK_PERIOD_S, EngineReplica
from deployments.ingress import direct_ingress_on, target_urls
from deployments.metrics import MetricsPush, replica_name
from ray_specdec.config import SamplingParams, TreeConfig
from ray_specdec.serving.metrics import CONTENT_TYPE, Snapshot, bandit_gauges, render
from ray_specdec.serving.openai_server import RETRY_AFTER_S, OpenAIServer, ServerSettings, app
from ray_specdec.serving.router import ServiceUnavailable

logger = logging.getLogger("ray.serve")  # Serve shows this logger's records in `serve run` output

# /health's wait for an engine replica's answers (router mode), below the HTTP proxy's deadline for a probe
# (serving/proxy_guard.py), and how many engine replicas it asks at most.
HEALTH_TIMEOUT_S = 1.0
HEALTH_ASKS = 3


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
        except BackPressureError:  # Serve's queue of the engine deployment is full
            raise ServiceUnavailable("the server is overloaded; retry later") from None
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


# Module-level helpers of the deployments stay above the class: Serve rebuilds the class in the replica from a pickle
# whose functions see only the module's names defined before the class (a name below it is a NameError there, at run
# time).
@serve.ingress(app)
class ServeServer(OpenAIServer):
    """`OpenAIServer` over either engine: `engine_handle` (router mode: the engine deployment's replicas, a hop away)
    or `replica_kwargs` (engine mode: an `EngineReplica` built in this process, the loop beside the routes)."""

    async def __init__(self, settings: ServerSettings, engine_handle=None, bandit_hub=None,
                       replica_kwargs: dict | None = None, metrics_hub=None):
        self.engine = engine_handle
        self.replica = None
        if replica_kwargs is not None:
            # the weights load on a thread: the replica's event loop keeps answering Serve's health checks
            self.replica = await asyncio.to_thread(EngineReplica, **replica_kwargs, bandit_hub=bandit_hub)
            info, client, lost = self.replica.info(), LocalEngine(self.replica), _never
            max_waiting = self.replica.loop.scheduler.config.max_waiting
        else:
            info, client, lost = await engine_handle.info.remote(), ServeEngine(engine_handle), replica_lost
            max_waiting = 0  # router mode spreads a request's sequences over the replicas and leaves this to Serve
        super().__init__(settings, client, info, lost, max_waiting)
        self.bandit_hub = bandit_hub
        self.metrics_hub = metrics_hub
        self.replica_name = replica_name("router" if self.replica is None else "engine")
        self.metrics_push = None
        if metrics_hub is not None:
            self.metrics_push = MetricsPush(metrics_hub, self.replica_name, self._metrics_snapshot)
        self.app_name = serve.get_replica_context().app_name
        logger.info("ray_specdec is ready. Try:\n%s", await self._curl_example())
        if direct_ingress_on():
            self._announcing = asyncio.get_running_loop().create_task(self._announce_direct())

    @app.get("/health")
    async def health(self):
        """Readiness (module docstring): 200 exactly when the app can serve a request now, else 503 with
        Retry-After."""
        return await self._probe()

    @app.get("/ready")
    async def ready(self):
        """/health under the name Kubernetes' readiness probes use."""
        return await self._probe()

    @app.get("/live")
    async def live(self):
        """Liveness: 200 while this replica runs (engine mode: its loop too, and its target is up or being
        restarted: what Serve's own health check asks); 503 when it should be replaced."""
        try:
            await self.check_health()
        except RuntimeError as exc:
            return self._unavailable({"status": "dead", "reason": str(exc)})
        return {"status": "alive"}

    async def _probe(self):
        """Engine mode: this replica's target is up (the proxy routes a probe only to a running replica, and one
        with no replica running gets 503 from the proxy: serving/proxy_guard.py). Router mode: an engine replica
        asked says its target is up; Serve routes around a dead one, and one with its target down is asked again."""
        replicas = asyncio.create_task(self._running_engines())
        if self.replica is not None:
            target = await self.replica.health()
        else:
            target = await self._engine_health()
        body = {"status": "ok" if target["healthy"] else "unavailable", "in_flight": self.core.in_flight,
                "engine_replicas": await replicas, "target_recovering": target["recovering"]}  # fmt: skip
        return body if target["healthy"] else self._unavailable(body)

    async def _engine_health(self) -> dict:
        """Router mode: an engine replica's health(), asked up to HEALTH_ASKS times within HEALTH_TIMEOUT_S until
        one says healthy (Serve picks the replica: two of them, one recovering its target, answer differently)."""
        target = {"healthy": False, "recovering": False}
        deadline = time.monotonic() + HEALTH_TIMEOUT_S
        for _ in range(HEALTH_ASKS):
            with contextlib.suppress(Exception):  # no answer in time is not healthy either
                target = await asyncio.wait_for(_result(self.engine.health.remote()),
                                                max(0.0, deadline - time.monotonic()))  # fmt: skip
            if target["healthy"] or time.monotonic() >= deadline:
                break
        return target

    async def _running_engines(self) -> int | None:
        """Running engine replicas as the Serve controller counts them (information: a replica's death reaches it
        seconds later), None when it does not answer within HEALTH_TIMEOUT_S."""
        try:
            status = await asyncio.wait_for(asyncio.to_thread(serve.status), HEALTH_TIMEOUT_S)
        except Exception:  # a busy controller: /health does not wait for it
            return None
        return status.applications[self.app_name].deployments["engine"].replica_states.get("RUNNING", 0)

    @staticmethod
    def _unavailable(body: dict) -> JSONResponse:
        return JSONResponse(body, status_code=503, headers={"Retry-After": str(RETRY_AFTER_S)})

    @app.get("/v1/bandit")
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

    @app.get("/metrics")
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

    @app.get("/v1/stats")
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
RouterDeployment = serve.deployment(name="router", ray_actor_options={"num_cpus": 0})(ServeServer)
# Engine mode: the routes and an engine replica in one process; the HTTP proxy hands each request to one of them.
# No access log: each request is one long streaming call.
ServerDeployment = serve.deployment(name="engine", logging_config={"enable_access_log": False},
                                    health_check_period_s=HEALTH_CHECK_PERIOD_S)(ServeServer)  # fmt: skip
