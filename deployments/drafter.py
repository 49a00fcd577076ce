"""The drafters as a replicated, autoscaled Ray Serve deployment around `DrafterWorker`.

Sticky routing. A request's drafter state should stay on one replica, so the router calls this deployment through
`handle.options(session_id=key)` and the deployment uses Ray Serve's `ConsistentHashRouter` (ray 2.60,
`ray.serve.experimental.consistent_hash_router`): calls with the same session id go to the same replica while the
replica set is unchanged, and to the next replica on the hash ring when that one is full. Model multiplexing
(`multiplexed_model_id` + `@serve.multiplexed`) was the other candidate, but routers learn which replica holds an id
only after the replica reports it to the controller, and each replica caps its number of "models": built for a few
long-lived models, not for thousands of short-lived requests. Correctness never depends on stickiness: a replica that
lacks the state (new after a scale-up, restarted, or reached on a fallback) answers None and the router rebuilds the
state from the token ids (see ray_specdec/serving/router.py).

Drafting is CPU/GPU work: it runs on one worker thread per replica, so calls are served one at a time while the
replica's event loop stays free for Serve's queue-length probes and health checks.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

from ray import serve
from ray.serve.config import RequestRouterConfig

from ray_specdec.acceptance import Verdict
from ray_specdec.config import SamplingParams, TreeConfig
from ray_specdec.drafting import Draft
from ray_specdec.models.mamba_drafter import MambaDrafter
from ray_specdec.serving.drafter_worker import DrafterWorker

STICKY_ROUTER = RequestRouterConfig(
    request_router_class="ray.serve.experimental.consistent_hash_router.ConsistentHashRouter",
    request_router_kwargs={"num_fallback_replicas": 1},
)


# No access log: one draft call per round of every request.
@serve.deployment(name="drafter", request_router_config=STICKY_ROUTER, logging_config={"enable_access_log": False})
class DrafterDeployment:
    """draft / release per docs/INTERFACES.md ("Serving"), plus stats for /v1/stats."""

    def __init__(
        self,
        drafter: str,
        vocab_size: int,
        *,
        dtype: str | None = None,
        device: str = "cpu",
        max_sessions: int = 1024,
        idle_timeout_s: float = 600.0,
        min_path_prob: float = 0.0,
        prefill_window: int | str | None = "auto",
    ):
        model = MambaDrafter.from_pretrained(drafter, dtype=dtype, device=device, prefill_window=prefill_window)
        self.worker = DrafterWorker(model, vocab_size, max_sessions=max_sessions, idle_timeout_s=idle_timeout_s,
                                    min_path_prob=min_path_prob)  # fmt: skip
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="drafter")

    async def draft(
        self,
        request_id: str,
        commits: list[Verdict],
        config: TreeConfig,
        params: SamplingParams,
        seed: int | None,
        token_ids: list[int] | None = None,
    ) -> Draft | None:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(
            self._thread, self.worker.draft, request_id, commits, config, params, seed, token_ids
        )

    async def release(self, request_id: str) -> None:
        self.worker.release(request_id)

    async def stats(self) -> dict:
        w = self.worker
        replica = serve.get_replica_context().replica_id.unique_id
        return {"replica": replica, "sessions": w.num_sessions, "rebuilds": w.rebuilds, "evictions": w.evictions}
