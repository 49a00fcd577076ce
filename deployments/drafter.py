"""The `drafter` deployment (`drafters=remote`): replicated drafter workers, and the engines' transport to them.

Each replica is a `DrafterWorker` (ray_specdec/speculation/drafter_worker.py: a Mamba drafter, a slot pool and one
session per request). Engines hash requests into shards and send one call per replica per step (speculation/drafters.py
`RemoteDrafters`); a call is routed by its first shard as a Serve multiplexed model id, so a shard stays on the replica
that holds it while that replica lives. "Loading" a shard costs nothing: its sessions are built from the requests'
token ids as they come. Serve autoscales the replicas (`autoscaling_config`) and places them (`ray_actor_options`);
a replica lost or downscaled costs its requests one undrafted round each, then their states are rebuilt elsewhere.
"""

from __future__ import annotations

import asyncio
import threading
import time

import torch
from ray import serve

from ray_specdec.models.drafter.mamba import MambaDrafter
from ray_specdec.speculation.drafter_worker import DraftCall, DrafterWorker, DraftReply

# Shards a replica may hold at once (Serve's multiplexed models per replica): all of them, as loading one is free.
MAX_SHARDS = 256


@serve.deployment(name="drafter", logging_config={"enable_access_log": False}, max_ongoing_requests=16)
class DrafterDeployment:
    def __init__(self, drafter: str, *, dtype: str | None = None, device: str = "cpu",
                 prefill_window: int | str | None = "auto", max_sessions: int = 256, num_threads: int = 1):
        torch.set_num_threads(max(1, num_threads))
        model = MambaDrafter.from_pretrained(drafter, dtype=dtype, device=device, prefill_window=prefill_window)
        self.worker = DrafterWorker(model, max_sessions)
        self.name = serve.get_replica_context().replica_id.unique_id
        self.lock = threading.Lock()  # calls of several engines run one at a time: the sessions are shared

    @serve.multiplexed(max_num_models_per_replica=MAX_SHARDS)
    async def shard(self, shard: str) -> str:
        return shard

    async def draft(self, call: DraftCall) -> tuple[str, list[DraftReply]]:
        """One engine's step on this replica -> (this replica's id, a reply per request)."""
        shard = serve.get_multiplexed_model_id()
        if shard:
            await self.shard(shard)
        return self.name, await asyncio.to_thread(self._locked, self.worker.draft, call)

    async def timings(self) -> tuple[float, float, float, float]:
        return await asyncio.to_thread(self._locked, self.worker.timings)

    def _locked(self, method, *args):
        with self.lock:
            return method(*args)


class ServeDrafterTransport:
    """`RemoteDrafters`' transport over the `drafter` deployment's handle (called from the engine loop's thread)."""

    def __init__(self, handle):
        self.handle = handle
        self._by_shard: dict[int, object] = {}

    def submit(self, shard: int, call: DraftCall):
        handle = self._by_shard.get(shard)
        if handle is None:
            handle = self._by_shard[shard] = self.handle.options(multiplexed_model_id=str(shard))
        return handle.draft.remote(call)

    def collect(self, pending, timeout_s: float):
        deadline, out = time.monotonic() + timeout_s, []
        for response in pending:
            try:
                out.append(response.result(timeout_s=max(0.0, deadline - time.monotonic())))
            except Exception as exc:  # a dead or downscaled replica, a timeout: the caller's rounds go undrafted
                response.cancel()
                out.append(exc)
        return out

    def timings(self, timeout_s: float) -> tuple[float, float, float, float]:
        return self.handle.timings.remote().result(timeout_s=timeout_s)
