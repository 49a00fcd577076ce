"""The engine replica: the round loop (scheduler) beside the target, with the drafter in the same process.

One replica serves a request from start to end (data parallel: more replicas serve more requests, and a request
stays on its replica). Inside it, `EngineLoop` steps the `Scheduler` on a thread of its own:
- tp_size 1: the target is loaded in this process (`LocalTarget`): a step makes no remote call at all;
- tp_size > 1: the target's ranks are Ray actors in one placement group (STRICT_PACK), each a `TargetWorker` with
  DeepSpeed AutoTP over gloo / nccl (on CPU their sums go through shared memory); a step is one call to every rank
  (`RankGroup.run`; a Ray compiled graph with RAY_SPECDEC_COMPILED_STEPS=1), and rank 0's logits come back (for a
  greedy request without logit processing or logprobs, only its rows' argmaxes: `SegmentSpec.argmax_only`).
The drafter (a Mamba model of a few million parameters on CPU, ~100M on GPU) runs in this process too by default
(`drafters=local`): on one small machine a remote call per step costs more than its step. With `drafters=remote`
the replica holds no drafter: each step makes one call per replica of the `drafter` deployment
(deployments/drafter.py, speculation/drafters.py `RemoteDrafters`), and a failed call leaves its rounds undrafted.

Faults: a rank that dies fails the step at once (the first failed rank's error, not its peers' collective timeout);
a rank that hangs fails it after RANK_STEP_TIMEOUT_S. The loop restarts the ranks and prefills every running request
again from its token ids (`EngineLoop`). While the target is down the replica is not healthy (`health()`, read by the
router's /health; new requests get 503), but Serve's health check (`check_health`) passes while a recovery can still
succeed, so that Serve does not kill the replica, and the requests it is recovering, mid-recovery. A request that
outlives its replica (the process itself died) is continued by the router on another replica from the tokens it
already streamed.

Errors reach the router as items of the stream, not exceptions: `{"error": status, "message": ...}`.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from dataclasses import replace

import psutil
import ray
import torch
from ray import serve
from transformers import AutoConfig
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from deployments.bandit import BanditSaver, BanditSync
from deployments.drafter import ServeDrafterTransport
from deployments.metrics import MetricsPush, replica_name
from ray_specdec import env
from ray_specdec.config import SamplingParams, TreeConfig, default_tree
from ray_specdec.engine.config import EngineConfig
from ray_specdec.engine.kv_sizing import device_room, fitted_kv_budget
from ray_specdec.engine.request import QueueFull, RequestTooLarge
from ray_specdec.engine.scheduler import Scheduler
from ray_specdec.engine.target_backend import LocalTarget, StepWork
from ray_specdec.models.drafter.kinds import load_drafter_model
from ray_specdec.models.loading import failure, load_tokenizer, resolve_model_path, resolve_prefill_window
from ray_specdec.models.target.kinds import load_target_model
from ray_specdec.serving.engine_loop import EngineLoop, TargetUnavailable
from ray_specdec.serving.target_worker import TargetWorker, free_port, widened
from ray_specdec.speculation.bandit import Bandit, BanditConfig
from ray_specdec.speculation.drafters import RemoteDrafters

logger = logging.getLogger("ray.serve")

# Waiting for the ranks' resources: a GPU node of an autoscaling cluster may take minutes to come up.
PLACEMENT_TIMEOUT_S = 600.0
# A step the ranks have not finished by then is a hung rank (a step is at most step_tokens rows: well under this).
RANK_STEP_TIMEOUT_S = 300.0
# How often Serve's controller calls an engine replica's check_health: a replica whose process died is found at the
# next call and replaced (its routers drop it at once, at their first call that fails). The call answers from memory.
HEALTH_CHECK_PERIOD_S = 2.0
# Token rows up to which a StepWork travels inline with each rank's call (8 bytes a row: well under Ray's 100 KiB
# inline bound with the rest of the work), beyond which it is put in the object store once.
INLINE_STEP_ROWS = 4096


class RankActor:
    """Body of one rank's Ray actor: a TargetWorker, built once rank 0's rendezvous address is known."""

    def __init__(self) -> None:
        self.worker: TargetWorker | None = None

    def rendezvous_address(self) -> tuple[str, int]:
        return ray.util.get_node_ip_address(), free_port()

    def load(self, model: str, **kwargs) -> dict:
        self.worker = TargetWorker(model, **kwargs)
        return self.worker.info()

    def run(self, work: StepWork):
        return self.worker.run(work)

    def reset(self) -> None:
        self.worker.caches.reset()

    def request_ids(self) -> list[str]:
        return self.worker.request_ids()


class RankGroup:
    """The scheduler's target side over tp_size rank actors: one call to every rank per step."""

    def __init__(self, model: str, *, tp_size: int, dtype: str | None, device: str, num_cpus_per_rank: float):
        self.model, self.tp_size, self.dtype, self.device = model, tp_size, dtype, device
        self.num_cpus = num_cpus_per_rank
        self.gpus = 0 if device == "cpu" else 1
        self._ranks: list = []
        self._pg = None
        self._steps = None  # the compiled graph of a step (None: one task per rank)
        self.compiled_why: str | None = None  # why steps are not a compiled graph (None: they are)
        self.info = self.start()
        self.vocab_size = self.info["vocab_size"]
        self.max_context = self.info["max_context"]
        self.eos_token_ids = frozenset(self.info["eos_token_ids"])

    def start(self) -> dict:
        """(Re)start every rank: a fresh placement group, actors and process group. -> rank 0's info."""
        self.shutdown()
        self._pg = placement_group([{"CPU": self.num_cpus, "GPU": self.gpus}] * self.tp_size, strategy="STRICT_PACK")
        ready, _ = ray.wait([self._pg.ready()], timeout=PLACEMENT_TIMEOUT_S)
        if not ready:
            raise RuntimeError(
                f"no node could host {self.tp_size} target ranks of {self.num_cpus} CPU and {self.gpus} GPU "
                f"together within {PLACEMENT_TIMEOUT_S:.0f} s (placement group strategy STRICT_PACK)"
            )
        actor = ray.remote(RankActor)
        for rank in range(self.tp_size):
            strategy = PlacementGroupSchedulingStrategy(self._pg, placement_group_bundle_index=rank)
            self._ranks.append(actor.options(num_cpus=self.num_cpus, num_gpus=self.gpus, max_concurrency=1,
                                             scheduling_strategy=strategy).remote())  # fmt: skip
        addr, port = ray.get(self._ranks[0].rendezvous_address.remote())
        infos = ray.get([
            rank.load.remote(self.model, dtype=self.dtype, device=self.device, rank=i, world_size=self.tp_size,
                             master_addr=addr, master_port=port)
            for i, rank in enumerate(self._ranks)
        ])  # fmt: skip
        self._steps, self.compiled_why = self._compile()
        rooms = [info.get("kv_room_bytes") for info in infos]  # each rank's device: the budget's share must fit all
        return infos[0] | {"kv_room_bytes": None if None in rooms else min(rooms)}

    def _compile(self):
        """A step as a compiled graph over the ranks' `run` -> (the graph, None), or (None, why not)."""
        if not env.COMPILED_STEPS.on():
            return None, f"{env.COMPILED_STEPS.name} is not set to 1"
        try:
            from ray.dag import InputNode, MultiOutputNode

            with InputNode() as work:
                graph = MultiOutputNode([rank.run.bind(work) for rank in self._ranks])
            return graph.experimental_compile(), None
        except Exception as exc:  # an older Ray, or a setting it refuses: one task per rank still works
            logger.warning("target ranks: steps stay one task per rank (no compiled graph: %s)", failure(exc))
            return None, failure(exc)

    def run(self, work: StepWork):
        """One step on every rank -> rank 0's logits. A failed step shuts every rank down: a surviving peer would
        otherwise wait in the collective of the dead one (gloo: for half an hour) and hold the group's resources."""
        if not self._ranks:
            raise RuntimeError("the target's ranks are down")
        if self._steps is not None:
            return self._run_compiled(work)
        # a small step goes inline with each rank's call (~1 ms a step less on the 2-core machine than through the
        # object store); a large one is put there once for every rank
        rows = sum(segment.tokens.numel() for segment in work.segments)
        ref = work if rows <= INLINE_STEP_ROWS else ray.put(work)
        refs = [rank.run.remote(ref) for rank in self._ranks]
        pending, deadline = refs, time.monotonic() + RANK_STEP_TIMEOUT_S
        try:
            while pending:  # a dead rank's error at once, not after its peers' collective times out
                done, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
                if not done:
                    raise TimeoutError(f"{len(pending)} of {self.tp_size} target ranks did not finish a step "
                                       f"within {RANK_STEP_TIMEOUT_S:.0f} s")  # fmt: skip
                ray.get(done)
        except BaseException:
            self.shutdown()
            raise
        return [widened(x) for x in ray.get(refs[0])]  # (half-precision models' logits ship narrowed)

    def _run_compiled(self, work: StepWork):
        """run() through the compiled graph: a dead rank closes its channels (the step fails at once), a hung one
        fails it after RANK_STEP_TIMEOUT_S."""
        try:
            outputs = ray.get(self._steps.execute(work), timeout=RANK_STEP_TIMEOUT_S)
        except (ray.exceptions.GetTimeoutError, ray.exceptions.RayChannelTimeoutError) as exc:
            self.shutdown(failed=True)
            raise TimeoutError(f"the {self.tp_size} target ranks did not finish a step within "
                               f"{RANK_STEP_TIMEOUT_S:.0f} s") from exc  # fmt: skip
        except BaseException:
            self.shutdown(failed=True)
            raise
        return [widened(x) for x in outputs[0]]

    def _teardown(self) -> None:
        if self._steps is not None:
            try:
                self._steps.teardown()
            except Exception as exc:  # a rank is gone already; nothing else holds the graph
                logger.debug("compiled step graph teardown: %s", failure(exc))
            self._steps = None

    def reset(self) -> None:
        """Fresh caches on every rank (none to reset once a failed step shut them down: start() makes new ones)."""
        ray.get([rank.reset.remote() for rank in self._ranks])

    def request_ids(self) -> list[list[str]]:
        return ray.get([rank.request_ids.remote() for rank in self._ranks])

    def shutdown(self, failed: bool = False) -> None:
        """Stop every rank (failed: after a failed step, when a rank may hang: killed before the graph's teardown,
        which would wait for it)."""
        if not failed:
            self._teardown()
        for rank in self._ranks:
            ray.kill(rank)
        self._teardown()
        self._ranks = []
        if self._pg is not None:
            remove_placement_group(self._pg)
            self._pg = None


class EngineReplica:
    """The loop, the target side and the drafter of one replica (a plain class: tests run it on Ray core)."""

    def __init__(
        self,
        target: str,
        drafter: str | None,
        *,
        tp_size: int = 1,
        dtype: str | None = None,
        device: str = "cpu",
        num_cpus_per_rank: float = 1.0,
        policy: BanditConfig | TreeConfig | None = None,
        config: EngineConfig = EngineConfig(),
        kv_budget_gib: float | str | None = None,
        max_context: int | None = None,
        drafter_prefill_window: int | str | None = "auto",
        recover_timeout_s: float = 120.0,
        bandit_hub=None,
        bandit_sync_s: float = 1.0,
        bandit_path: str | None = None,
        metrics_hub=None,
        compute_first: bool = False,
        drafter_pool=None,
        drafter_pool_shards: int = 16,
        drafter_pool_timeout_s: float = 5.0,
        drafter_pool_overlap: bool = False,
        drafter_pool_rebalance_s: float = 5.0,
    ):
        """policy: the bandit's arms, or one tree for every request (None: the device's default tree); config: the
        engine's settings, whose scheduler and speculation parts run here. bandit_hub: the shared bandit this
        replica's syncs with; without one, bandit_path: the JSON file its own bandit (the whole state: the app's only
        replica) is loaded from and saved to. metrics_hub: where this
        replica pushes its metrics (deployments/metrics.py); None: nowhere (an engine replica inside the HTTP server:
        the server pushes them with its own, or renders them alone). compute_first: on CPU at tp_size 1, the
        process's other threads below the loop's compute threads (ray_specdec/serving/thread_priority.py).
        drafter_pool: the `drafter` deployment's handle (drafters=remote): requests are drafted there, in
        drafter_pool_shards shards, a call not answered within drafter_pool_timeout_s leaving its rounds undrafted,
        the next rounds drafted ahead while the target verifies with drafter_pool_overlap, shards beyond an even
        share on a drafter replica moved every drafter_pool_rebalance_s; the drafter is then only
        read for its prefill window."""
        self.bandit: Bandit | None = None
        self.bandit_sync: BanditSync | BanditSaver | None = None
        if isinstance(policy, BanditConfig):
            if bandit_hub is None and bandit_path is not None and os.path.exists(bandit_path):
                self.bandit = Bandit.load(bandit_path, policy)
            else:
                self.bandit = Bandit(policy)
            if bandit_hub is not None:
                self.bandit_sync = BanditSync(self.bandit, bandit_hub, bandit_sync_s)
            elif bandit_path is not None:
                self.bandit_sync = BanditSaver(self.bandit, bandit_path)
            policy = self.bandit
        elif policy is None:
            policy = default_tree(device)
        self.tokenizer = load_tokenizer(target)
        self.backend = self.drafter = self.remote_drafters = None

        def build() -> Scheduler:
            """The models and the scheduler, on the loop's thread: the one thread of this process that runs torch's
            parallel work (EngineLoop says why)."""
            scheduler = config.scheduler
            if tp_size == 1:
                # the CPUs the replica reserved are its threads (Ray sets OMP_NUM_THREADS from them only when
                # unset, and a runtime environment may have set it to 1)
                torch.set_num_threads(max(1, round(num_cpus_per_rank)))
                self.backend = LocalTarget(load_target_model(target, dtype=dtype, device=device))
                kv_bytes = self.backend.target.kv_bytes_per_token
            else:
                self.backend = RankGroup(target, tp_size=tp_size, dtype=dtype, device=device,
                                         num_cpus_per_rank=num_cpus_per_rank)  # fmt: skip
                kv_bytes, room = self.backend.info["kv_bytes_per_token"], self.backend.info.get("kv_room_bytes")
            drafters = None
            if drafter is not None and drafter_pool is not None:
                window = resolve_prefill_window(drafter_prefill_window,
                                                AutoConfig.from_pretrained(resolve_model_path(drafter)))
                drafters = self.remote_drafters = RemoteDrafters(
                    ServeDrafterTransport(drafter_pool), self.backend.vocab_size, window, drafter_pool_shards,
                    drafter_pool_timeout_s, drafter_pool_overlap, drafter_pool_rebalance_s)
            elif drafter is not None:
                drafters = self.drafter = load_drafter_model(drafter, dtype=dtype, device=device,
                                                             prefill_window=drafter_prefill_window)
            if tp_size == 1:  # measured once the drafter (on the same device) holds its weights and graphs too
                room = device_room(self.backend.target.device)
            # a budget the device cannot hold fails here, with what would fit, not as an OOM mid-step under load
            shards = tp_size if device != "cpu" else 1  # GPU ranks hold their shares apiece; CPU ranks share a host
            scheduler = replace(scheduler, kv_budget_tokens=fitted_kv_budget(scheduler.kv_budget_tokens, kv_budget_gib,
                                                                             kv_bytes, room, shards))  # fmt: skip
            built = Scheduler(self.backend, drafters, self.tokenizer, policy, scheduler, max_context,
                              config.speculation)
            if drafter_pool is None:  # before the replica is ready: the first request does not pay the calibration
                built.prepare()  # (remote drafter workers may still be starting: their first step measures them)
            return built

        self.loop = EngineLoop(build, self._restart_ranks if tp_size > 1 else None, recover_timeout_s,
                               compute_first=compute_first and tp_size == 1 and device == "cpu")
        self.tp_size = tp_size
        self.recover_timeout_s = recover_timeout_s
        self._down_since: float | None = None  # first restart of the ranks since the target last ran
        self.metrics_push = None
        if metrics_hub is not None:
            self.metrics_push = MetricsPush(metrics_hub, replica_name("engine"), self.loop.metrics.snapshot)

    def _restart_ranks(self) -> None:
        """The loop's `recover` (on its thread): raises while the ranks cannot be started."""
        if self._down_since is None:
            self._down_since = time.monotonic()
        self.backend.start()
        self._down_since = None

    @property
    def recovering(self) -> bool:
        """Whether a restart of the ranks is under way and may still succeed (the loop gives up after
        recover_timeout_s)."""
        since = self._down_since
        return since is not None and time.monotonic() - since < self.recover_timeout_s

    def info(self) -> dict:
        s = self.loop.scheduler
        return {"max_context": s.max_context, "vocab_size": self.backend.vocab_size, "tp_size": self.tp_size,
                "eos_token_ids": sorted(self.backend.eos_token_ids), "kv_budget_tokens": s.config.kv_budget_tokens,
                "drafter": self.drafter is not None or self.remote_drafters is not None}  # fmt: skip

    async def generate(self, prompt_ids: list[int], params: SamplingParams, tree: TreeConfig | None = None,
                       request_id: str | None = None, interval_s: float = 0.0, resumed: int = 0):
        """Stream a request's chunks (`StreamChunk`, stats on the last one only), or one error item. resumed: the
        last this many prompt tokens are the request's own, generated on a replica since lost (Scheduler.add)."""
        if self.bandit_sync is not None:
            self.bandit_sync.start()
        request_id = request_id or uuid.uuid4().hex
        try:
            async for chunk in self.loop.generate(request_id, prompt_ids, params, tree, interval_s, resumed):
                yield chunk if chunk.finish_reason is not None else replace(chunk, stats=None)
        except RequestTooLarge as exc:
            yield {"error": 400, "message": str(exc)}
        except (QueueFull, TargetUnavailable) as exc:
            yield {"error": 503, "message": str(exc)}
        except ValueError as exc:
            yield {"error": 400, "message": str(exc)}

    async def stats(self) -> dict:
        """The loop's stats, this replica's id and its process's resident memory (rss_bytes; the soak reads it)."""
        remote = {} if self.remote_drafters is None else {"drafters": self.remote_drafters.summary()}
        return self.loop.stats() | remote | {"replica": serve.get_replica_context().replica_id.unique_id,
                                             "rss_bytes": psutil.Process().memory_info().rss}  # fmt: skip

    async def health(self) -> dict:
        """{"healthy": the loop runs and the target is up (False while it restarts), "recovering"}."""
        return {"healthy": self.loop.alive and self.loop.healthy, "recovering": self.recovering}

    async def check_health(self) -> None:
        """Serve restarts a replica whose loop died or whose target did not come back (not one still recovering)."""
        if not self.loop.alive:
            raise RuntimeError("the engine loop thread died")
        if not self.loop.healthy and not self.recovering:
            raise RuntimeError("the target is down")

    def shutdown(self) -> None:
        if self.metrics_push is not None:
            self.metrics_push.stop()
        if isinstance(self.bandit_sync, BanditSaver):
            try:
                self.bandit_sync.save()
            except Exception:  # best effort at shutdown: the periodic saves already hold almost everything
                logger.exception("saving the bandit state at shutdown failed")
        self.loop.stop()
        if isinstance(self.backend, RankGroup):
            self.backend.shutdown()


# No access log: each request is one long streaming call.
@serve.deployment(name="engine", logging_config={"enable_access_log": False},
                  health_check_period_s=HEALTH_CHECK_PERIOD_S)
class EngineDeployment(EngineReplica):
    def __del__(self) -> None:  # Serve calls it when the replica shuts down
        self.shutdown()
