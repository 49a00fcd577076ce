"""The tree bandit shared by all engine replicas: one `BanditHub` in a Serve deployment, and the replicas' sync loop
(`BanditSync`); or, where the app has one engine replica only, its own bandit saved by `BanditSaver` (no hub).

Every router holds a local `Bandit` (the engine's TreePolicy: `select` and `record` never leave the process). About
once a second `BanditSync` pushes the router's batched records (`drain_updates`) to the hub and adopts the hub's
snapshot, so no round waits on a remote call. A push that fails is kept and sent with the next one. The hub persists
its state to `path` (every `save_interval_s` and on shutdown), so a restarted app keeps what it learned. Its summary
is also in the app's GET /metrics (ray_specdec:bandit_* gauges, deployments/metrics.py).
"""

from __future__ import annotations

import asyncio
import logging

from ray import serve

from ray_specdec.speculation.bandit import Bandit, BanditConfig, BanditHub, BanditState

logger = logging.getLogger(__name__)


# No access log: every router calls push and snapshot about once a second.
@serve.deployment(name="bandit", num_replicas=1, ray_actor_options={"num_cpus": 0},
                  logging_config={"enable_access_log": False})  # fmt: skip
class BanditHubDeployment:
    def __init__(self, config: BanditConfig, path: str | None = None, save_interval_s: float = 10.0):
        self.hub = BanditHub(config, path, save_interval_s)

    async def push(self, update: dict) -> None:
        self.hub.push(update)

    async def snapshot(self) -> dict:
        return self.hub.snapshot()

    async def summary(self) -> dict:
        return self.hub.summary()

    def __del__(self) -> None:  # Serve calls it when the replica shuts down
        if self.hub.path is not None:
            try:
                self.hub.save()
            except Exception:  # best effort at shutdown: the periodic saves already hold almost everything
                logger.exception("saving the bandit state at shutdown failed")


class BanditSync:
    """A router's side of the sharing: push the local records, pull the hub's snapshot, every `interval_s`."""

    def __init__(self, bandit: Bandit, hub, interval_s: float = 1.0, timeout_s: float = 10.0):
        self.bandit = bandit
        self.hub = hub  # DeploymentHandle of BanditHubDeployment
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self._unsent: BanditState | None = None
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def sync_once(self) -> None:
        delta = self.bandit.drain_updates()
        self._unsent = delta if self._unsent is None else self._unsent.merge(delta)
        await asyncio.wait_for(self._push(self._unsent.to_dict()), self.timeout_s)
        self._unsent = None
        snapshot = await asyncio.wait_for(self._snapshot(), self.timeout_s)
        self.bandit.apply_snapshot(snapshot)

    async def _push(self, update: dict) -> None:
        await self.hub.push.remote(update)

    async def _snapshot(self) -> dict:
        return await self.hub.snapshot.remote()

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.sync_once()
            except Exception as exc:  # the hub may be restarting: keep the records and try again
                logger.warning("bandit sync failed (%s: %s); retrying", type(exc).__name__, exc)


class BanditSaver:
    """The bandit of an app's only engine replica, which holds the whole state itself (no hub): save it to `path`
    every `interval_s` from the event loop (the file is written on a thread) and at shutdown (`save`)."""

    def __init__(self, bandit: Bandit, path: str, interval_s: float = 10.0):
        self.bandit, self.path, self.interval_s = bandit, path, interval_s
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run())

    def save(self) -> None:
        self.bandit.save(self.path)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await asyncio.to_thread(self.save)
            except Exception as exc:  # a full disk, a folder gone: the state stays in memory; try again
                logger.warning("saving the bandit state failed (%s: %s); retrying", type(exc).__name__, exc)
