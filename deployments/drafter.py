"""The `drafter` deployment (`drafters=remote`): replicated drafter workers, and the engines' transport to them.

Each replica is a `DrafterWorker` (ray_specdec/speculation/drafter_worker.py: a Mamba drafter, a slot pool and one
session per request). Engines hash requests into shards and send one call per replica per step (speculation/drafters.py
`RemoteDrafters`); a call is routed by its first shard as a Serve multiplexed model id, so a shard stays on the replica
that holds it while that replica lives. "Loading" a shard costs nothing: its sessions are built from the requests'
token ids as they come. Serve autoscales the replicas (`autoscaling_config`) and places them (`ray_actor_options`);
a replica lost or downscaled costs its requests one undrafted round each, then their states are rebuilt elsewhere.

Each replica measures the share of its time it spends drafting, and the requests and rows it drafts per second
(deployments/drafter_scaling.py `BusyMeter`), and reports them as Serve's custom autoscaling metrics
(`record_autoscaling_stats`): the pool's default policy (`DrafterBusyPolicy`) scales on them. The transport counts
the pool's running replicas (`replicas`, from Serve's status every REPLICAS_POLL_S in a thread of its own), so that
the engine moves shards to a replica that holds none of them (speculation/drafters.py).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time

import torch
from ray import serve

from deployments.drafter_scaling import BusyMeter
from ray_specdec.models.drafter.kinds import load_drafter_model
from ray_specdec.speculation.drafter_worker import DraftCall, DrafterWorker, DraftReply

# Shards a replica may hold at once (Serve's multiplexed models per replica): all of them, as loading one is free.
MAX_SHARDS = 256
# How often Serve's controller checks a drafter replica (default 10 s): a replica whose process died is found then,
# counted out of the pool (REPLICAS_POLL_S, DrafterBusyPolicy) and replaced.
HEALTH_CHECK_PERIOD_S = 2.0
REPLICAS_POLL_S = 2.0  # how often an engine's transport asks Serve how many drafter replicas run, seconds

logger = logging.getLogger(__name__)


@serve.deployment(name="drafter", logging_config={"enable_access_log": False}, max_ongoing_requests=16,
                  health_check_period_s=HEALTH_CHECK_PERIOD_S)
class DrafterDeployment:
    def __init__(self, drafter: str, *, dtype: str | None = None, device: str = "cpu",
                 prefill_window: int | str | None = "auto", max_sessions: int = 256, num_threads: int = 1):
        torch.set_num_threads(max(1, num_threads))
        model = load_drafter_model(drafter, dtype=dtype, device=device, prefill_window=prefill_window)
        self.worker = DrafterWorker(model, max_sessions)
        self.name = serve.get_replica_context().replica_id.unique_id
        self.lock = threading.Lock()  # calls of several engines run one at a time: the sessions are shared
        self.meter = BusyMeter()

    @serve.multiplexed(max_num_models_per_replica=MAX_SHARDS)
    async def shard(self, shard: str) -> str:
        return shard

    async def draft(self, call: DraftCall) -> tuple[str, list[DraftReply], dict[str, float]]:
        """One engine's step on this replica -> (this replica's id, a reply per request, its load: the meter's)."""
        shard = serve.get_multiplexed_model_id()
        if shard:
            await self.shard(shard)
        replies = await asyncio.to_thread(self._locked, self._draft, call)
        return self.name, replies, self.meter.stats()

    def _draft(self, call: DraftCall) -> list[DraftReply]:
        """The worker's draft, metered (the lock held)."""
        self.meter.start()
        replies: list[DraftReply] = []
        try:
            replies = self.worker.draft(call)
            return replies
        finally:
            drafted = [reply.draft for reply in replies if reply.draft is not None]
            self.meter.stop(len(drafted), sum(len(draft.tokens) for draft in drafted))

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """Serve's custom autoscaling metrics of this replica: its busy fraction, requests and rows drafted per
        second over the meter's window (deployments/drafter_scaling.py)."""
        return self.meter.stats()

    async def timings(self) -> tuple[float, float, float, float]:
        return await asyncio.to_thread(self._locked, self.worker.timings)

    def _locked(self, method, *args):
        with self.lock:
            return method(*args)


class ServeDrafterTransport:
    """`RemoteDrafters`' transport over the `drafter` deployment's handle (called from the engine loop's thread)."""

    def __init__(self, handle):
        self.handle = handle
        self._by_route: dict[int, object] = {}
        self._replicas: int | None = None
        self._poller: threading.Thread | None = None
        self._loads: dict[str, tuple[float, dict[str, float]]] = {}  # replica -> (when, its load with a reply)

    def submit(self, route: int, call: DraftCall):
        handle = self._by_route.get(route)
        if handle is None:
            handle = self._by_route[route] = self.handle.options(multiplexed_model_id=str(route))
        return handle.draft.remote(call)

    def loads(self, max_age_s: float = 5.0) -> dict[str, dict[str, float]]:
        """Each replica's load (busy fraction, requests and rows drafted per second) as its last reply within
        `max_age_s` said, by replica id."""
        now = time.monotonic()
        return {name: load for name, (when, load) in dict(self._loads).items() if now - when <= max_age_s}

    def replicas(self) -> int | None:
        """The pool's running replicas as Serve's controller last counted them (None until it first answers)."""
        if self._poller is None:
            self._poller = threading.Thread(target=self._poll, name="drafter-replicas", daemon=True)
            self._poller.start()
        return self._replicas

    def _poll(self) -> None:
        while True:
            try:
                deployments = serve.status().applications[self.handle.app_name].deployments
                self._replicas = deployments[self.handle.deployment_name].replica_states.get("RUNNING", 0)
            except Exception as exc:  # a busy controller: the last count stands
                logger.debug("drafter replicas not counted: %s", exc)
            time.sleep(REPLICAS_POLL_S)

    def collect(self, pending, timeout_s: float):
        deadline, out = time.monotonic() + timeout_s, []
        for response in pending:
            try:
                name, replies, load = response.result(timeout_s=max(0.0, deadline - time.monotonic()))
                self._loads[name] = (time.monotonic(), load)
                out.append((name, replies))
            except Exception as exc:  # a dead or downscaled replica, a timeout: the caller's rounds go undrafted
                response.cancel()
                out.append(exc)
        return out

    def timings(self, timeout_s: float) -> tuple[float, float, float, float]:
        return self.handle.timings.remote().result(timeout_s=timeout_s)
