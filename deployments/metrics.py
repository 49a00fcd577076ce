"""The app's metrics over every replica: one `MetricsHubDeployment`, and each replica's `MetricsPush`.

Every engine and router replica records its own numbers (ray_specdec/serving/metrics.py) and pushes a snapshot of
them to the hub about once a second, from a thread of its own (the engine's event loop and step thread never wait on
it). Snapshots are cumulative since the replica started, so a failed push loses nothing: the next one carries it. The
router's `GET /metrics` renders the hub's snapshots (with its own, fresh) and the bandit hub's summary: one scrape of
any replica gives the whole app. The last second of a replica that stops may be missing.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable

from ray import serve

from ray_specdec.serving.metrics import MetricsStore, Snapshot

logger = logging.getLogger("ray.serve")


# No access log: every replica pushes about once a second.
@serve.deployment(name="metrics", num_replicas=1, ray_actor_options={"num_cpus": 0},
                  logging_config={"enable_access_log": False})  # fmt: skip
class MetricsHubDeployment:
    def __init__(self, stale_after_s: float = 10.0):
        self.store = MetricsStore(stale_after_s)

    async def push(self, replica: str, snapshot: Snapshot) -> None:
        self.store.push(replica, snapshot)

    async def snapshots(self) -> dict[str, Snapshot]:
        return self.store.snapshots()


class MetricsPush:
    """Push `snapshot()` to the hub as `replica` every `interval_s`, on a daemon thread, until `stop()`."""

    def __init__(self, hub, replica: str, snapshot: Callable[[], Snapshot], interval_s: float = 1.0,
                 timeout_s: float = 10.0):
        self.hub = hub  # DeploymentHandle of MetricsHubDeployment
        self.replica, self.snapshot = replica, snapshot
        self.interval_s, self.timeout_s = interval_s, timeout_s
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="metrics-push", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stopped.set()  # a push under way finishes on its own (a daemon thread: nothing waits for it)

    def _run(self) -> None:
        failing = False
        while not self._stopped.wait(self.interval_s):
            try:
                self.hub.push.remote(self.replica, self.snapshot()).result(timeout_s=self.timeout_s)
                failing = False
            except Exception as exc:  # the hub may be restarting: the next push carries everything
                if not failing:
                    logger.warning("pushing metrics failed (%s: %s); retrying", type(exc).__name__, exc)
                failing = True


def replica_name(role: str) -> str:
    """The id this replica's numbers carry (the `replica` label of its gauges): role/Serve's replica id."""
    return f"{role}/{serve.get_replica_context().replica_id.unique_id}"
