"""The target as a Ray Serve deployment: one replica owns tp_size rank actors in one placement group (STRICT_PACK).

`TargetReplica` is the replica's logic as a plain async class on Ray core (testable without Serve); `TargetDeployment`
is the same class as a Serve deployment. Each rank actor wraps a `TargetWorker` (ray_specdec/serving/target_worker.py)
holding its shard of the target and of every request's KV cache; rank 0's logits are judged here, with the request's
target random stream.

Ordering: rank actors are sync with max_concurrency=1, so each runs calls in the order this replica submitted them.
Every fan-out (the same call to every rank) is submitted under one asyncio.Lock with no await in between, so all ranks
see the same sequence of collective calls (prefill and forward all-reduce inside) however concurrent requests
interleave. Results are awaited outside the lock: ranks pipeline many requests' calls.

A request's caches are freed on release (done or cancelled: the router calls it) and by a background task when the
request has been idle longer than `idle_timeout_s` (a router that vanished), so abandoned requests cannot leak memory.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import Sequence

import ray
import torch
from ray import serve
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from ray_specdec.acceptance import Verdict
from ray_specdec.config import SamplingParams
from ray_specdec.drafting import Draft
from ray_specdec.engine import judge, make_generators
from ray_specdec.serving.target_worker import TargetWorker, UnknownRequest, free_port

logger = logging.getLogger(__name__)

# Waiting for the ranks' resources: a GPU node of an autoscaling cluster may take minutes to come up.
PLACEMENT_TIMEOUT_S = 600.0


class RankActor:
    """Body of one rank's Ray actor: a TargetWorker, built once rank 0's rendezvous address is known."""

    def __init__(self) -> None:
        self.worker: TargetWorker | None = None

    def rendezvous_address(self) -> tuple[str, int]:
        return ray.util.get_node_ip_address(), free_port()

    def load(self, model: str, **kwargs) -> dict:
        self.worker = TargetWorker(model, **kwargs)
        return self.worker.info()

    def start(self, request_id: str, prompt_ids: list[int]) -> None:
        self.worker.start(request_id, prompt_ids)

    def forward(self, request_id: str, draft: Draft) -> torch.Tensor | None:
        return self.worker.forward(request_id, draft)

    def commit(self, request_id: str, verdict: Verdict) -> None:
        self.worker.commit(request_id, verdict)

    def release(self, request_id: str) -> bool:
        return self.worker.release(request_id)

    def request_ids(self) -> list[str]:
        return self.worker.request_ids()


@dataclass
class _Request:
    target_gen: torch.Generator  # the request's target random stream (judging happens here, not on the ranks)
    last_used: float
    busy: int = 0  # calls in flight; a busy request is never reaped
    commits: list = field(default_factory=list)  # refs of the last commit fan-out, awaited by the next verify


class TargetReplica:
    """start / verify / release over tp_size rank actors; see the module docstring for ordering and freeing."""

    def __init__(
        self,
        model: str,
        *,
        tp_size: int = 1,
        dtype: str | None = None,
        device: str = "cpu",
        num_cpus_per_rank: float = 1.0,
        idle_timeout_s: float = 300.0,
    ):
        if tp_size < 1 or idle_timeout_s <= 0 or num_cpus_per_rank < 0:
            raise ValueError("tp_size must be >= 1, idle_timeout_s > 0 and num_cpus_per_rank >= 0")
        gpus = 1 if torch.device(device).type == "cuda" else 0
        if num_cpus_per_rank == 0 and gpus == 0:
            raise ValueError("a CPU rank needs num_cpus_per_rank > 0")
        self.tp_size = tp_size
        self.idle_timeout_s = idle_timeout_s
        self.timed_out = 0  # requests freed by the idle reaper
        self._ranks: list = []
        self._pg = placement_group([{"CPU": num_cpus_per_rank, "GPU": gpus}] * tp_size, strategy="STRICT_PACK")
        self._requests: dict[str, _Request] = {}
        self._lock = asyncio.Lock()
        self._reaper: asyncio.Task | None = None
        self._broken: BaseException | None = None
        try:
            self._info = self._start_ranks(model, dtype, device, num_cpus_per_rank, gpus)
        except BaseException:
            self.shutdown()
            raise

    def _start_ranks(self, model: str, dtype: str | None, device: str, num_cpus: float, gpus: int) -> dict:
        ready, _ = ray.wait([self._pg.ready()], timeout=PLACEMENT_TIMEOUT_S)
        if not ready:
            raise RuntimeError(
                f"no node could host {self.tp_size} target ranks of {num_cpus} CPU and {gpus} GPU together "
                f"within {PLACEMENT_TIMEOUT_S:.0f} s (placement group strategy STRICT_PACK)"
            )
        actor = ray.remote(RankActor)
        for rank in range(self.tp_size):
            strategy = PlacementGroupSchedulingStrategy(self._pg, placement_group_bundle_index=rank)
            options = {"num_cpus": num_cpus, "num_gpus": gpus, "max_concurrency": 1, "scheduling_strategy": strategy}
            self._ranks.append(actor.options(**options).remote())
        addr, port = ray.get(self._ranks[0].rendezvous_address.remote())
        infos = ray.get([
            rank.load.remote(model, dtype=dtype, device=device, rank=i, world_size=self.tp_size,
                             master_addr=addr, master_port=port)
            for i, rank in enumerate(self._ranks)
        ])  # fmt: skip
        return infos[0]

    async def info(self) -> dict:
        """{"model", "vocab_size", "max_context", "eos_token_ids", "tp_size", "dtype"}."""
        return dict(self._info)

    async def start(self, request_id: str, prompt_ids: Sequence[int], seed: int | None) -> None:
        """Prefill the prompt on every rank and create the request's target random stream from `seed`."""
        prompt = self._check_prompt(prompt_ids)
        self._ensure_reaper()
        _, target_gen = make_generators(seed)
        async with self._lock:
            if request_id in self._requests:
                raise ValueError(f"request {request_id!r} is already started")
            request = self._requests[request_id] = _Request(target_gen, time.monotonic(), busy=1)
            refs = self._fan_out("start", request_id, prompt)
        try:
            await self._gather(refs)
        except BaseException:
            await self.release(request_id)
            raise
        finally:
            self._done(request)

    async def verify(self, request_id: str, draft: Draft, params: SamplingParams) -> Verdict:
        """Forward on every rank, judge rank 0's logits, then send the commit to every rank without waiting."""
        payload = ray.put(draft) if self.tp_size > 1 else draft  # one copy in the object store for all ranks
        async with self._lock:
            request = self._get(request_id)
            request.busy += 1
            refs = self._fan_out("forward", request_id, payload)
        try:
            await self._gather(request.commits)  # they ran before this forward: only their errors are news
            logits = (await self._gather(refs))[0]
            verdict = judge(logits, draft, params, request.target_gen)
            async with self._lock:
                if self._requests.get(request_id) is not request:
                    raise UnknownRequest(f"request {request_id!r} was released during its verify")
                request.commits = self._fan_out("commit", request_id, verdict)
            return verdict
        finally:
            self._done(request)

    async def release(self, request_id: str) -> None:
        """Free the request's caches on every rank; unknown or already released ids are ignored."""
        async with self._lock:
            refs = self._drop(request_id)
        await self._gather(refs)

    async def release_idle(self) -> list[str]:
        """Free every request idle (no call in flight) for longer than idle_timeout_s. -> their ids."""
        now = time.monotonic()
        async with self._lock:
            idle = [rid for rid, r in self._requests.items() if not r.busy and now - r.last_used > self.idle_timeout_s]
            refs = [ref for rid in idle for ref in self._drop(rid)]
        await self._gather(refs)
        if idle:
            self.timed_out += len(idle)
            logger.warning("freed %d target requests idle for over %.0f s", len(idle), self.idle_timeout_s)
        return idle

    async def rank_request_ids(self) -> list[list[str]]:
        """The request ids each rank holds a cache for (what release and the reaper free)."""
        async with self._lock:
            refs = self._fan_out("request_ids")
        return await self._gather(refs)

    @property
    def num_requests(self) -> int:
        return len(self._requests)

    async def check_health(self) -> None:
        """Serve's health check: a dead rank leaves the others unable to run collectives, so restart the replica."""
        if self._broken is not None:
            raise RuntimeError(f"a target rank died: {self._broken}")

    def shutdown(self) -> None:
        """Kill the rank actors and free their placement group (the caches go with them)."""
        if self._reaper is not None:
            with contextlib.suppress(RuntimeError):  # its event loop may be closed already
                self._reaper.cancel()
        if not ray.is_initialized():
            return
        for rank in self._ranks:
            ray.kill(rank)
        self._ranks = []
        if self._pg is not None:
            remove_placement_group(self._pg)
            self._pg = None

    def _fan_out(self, method: str, *args) -> list:
        """The same call to every rank; the caller holds the lock (this is what orders collectives)."""
        assert self._lock.locked()
        return [getattr(rank, method).remote(*args) for rank in self._ranks]

    async def _gather(self, refs: list) -> list:
        try:
            return await asyncio.gather(*refs)
        except ray.exceptions.RayActorError as exc:
            self._broken = exc
            raise

    def _get(self, request_id: str) -> _Request:
        request = self._requests.get(request_id)
        if request is None:
            raise UnknownRequest(f"the target has no request {request_id!r} (never started, released or timed out)")
        return request

    def _drop(self, request_id: str) -> list:
        """Forget the request and fan out its release (caller holds the lock); no calls if it is unknown."""
        if self._requests.pop(request_id, None) is None:
            return []
        return self._fan_out("release", request_id)

    @staticmethod
    def _done(request: _Request) -> None:
        request.busy -= 1
        request.last_used = time.monotonic()

    def _check_prompt(self, prompt_ids: Sequence[int]) -> list[int]:
        ids = [int(t) for t in prompt_ids]
        vocab = self._info["vocab_size"]
        if not ids:
            raise ValueError("prompt_ids must hold at least one token")
        if not all(0 <= t < vocab for t in ids):
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        return ids

    def _ensure_reaper(self) -> None:
        """Started from the first call, not __init__: the replica's event loop runs only then."""
        if self._reaper is None or self._reaper.done():
            self._reaper = asyncio.get_running_loop().create_task(self._reap_forever())

    async def _reap_forever(self) -> None:
        interval = min(self.idle_timeout_s / 2, 30.0)
        while True:
            await asyncio.sleep(interval)
            try:
                await self.release_idle()
            except Exception:  # a failed release is retried on the next pass
                logger.exception("freeing idle target requests failed")


# Every active request has at most one call in flight here, and calls mostly wait on the ranks: allow many.
# No access log: routers call verify once per round of every request (a log line per round costs real time).
@serve.deployment(name="target", ray_actor_options={"num_cpus": 0}, max_ongoing_requests=256,
                  logging_config={"enable_access_log": False})  # fmt: skip
class TargetDeployment(TargetReplica):
    """The Serve deployment; the ranks hold the CPUs and GPUs, the replica itself only judges."""

    def __del__(self) -> None:  # Serve calls it when the replica shuts down
        self.shutdown()
