"""Requests decoded through a scheduler with a KV budget, the budget checked against the target's own caches every
step, on a plain or a pooled target."""

from __future__ import annotations

import torch

from ray_specdec.config import SamplingParams, TreeConfig
from ray_specdec.engine.llm import SpeculativeEngine
from ray_specdec.engine.scheduler import Scheduler
from ray_specdec.engine.scheduler_config import SchedulerConfig
from ray_specdec.engine.target_backend import LocalTarget
from ray_specdec.models.target.model import TargetModel
from tests.helpers.configs import NO_LOOKUP
from tests.helpers.inputs import random_prompt
from tests.helpers.models import tiny_gpt_neox


def requests(n: int, max_new: int) -> list[tuple[str, list[int], SamplingParams]]:
    return [(f"g{i}", random_prompt(12 + 5 * i, seed=90 + i), SamplingParams(max_new_tokens=max_new, ignore_eos=True))
            for i in range(n)]  # fmt: skip


def run_within_budget(scheduler: Scheduler, reqs) -> tuple[dict[str, list[int]], dict[str, int]]:
    """Every request added, stepped to the end, checking the budget against the target's own caches each step."""
    for request_id, prompt, params in reqs:
        scheduler.add(request_id, prompt, params)
    tokens = {r[0]: [] for r in reqs}
    seen = {"running": 0, "waits": 0, "waiting": 0}
    budget = scheduler.config.kv_budget_tokens
    while scheduler.has_work:
        for out in scheduler.step():
            tokens[out.request_id] += out.chunk.token_ids
        caches = scheduler.target.caches.values()
        assert scheduler.reserved <= budget
        assert sum(c.kv.fixed_capacity for c in caches) <= budget  # what the target holds, not just the books
        seen["running"] = max(seen["running"], scheduler.num_running)
        seen["waits"] += scheduler.kv_waits
        seen["waiting"] = max(seen["waiting"], scheduler.num_waiting)
    assert not scheduler.target.caches and scheduler.reserved == 0
    assert scheduler.kv_waited == seen["waits"]  # the total the app's ray_specdec:kv_cache_waits counter shows
    return tokens, seen


def decode_pooled(reqs, budget: int, pool=None) -> tuple[TargetModel, dict, dict, dict]:
    """The requests through a scheduler of `budget` rows over a pooled float64 target (its pool `pool(target)` where
    given) -> (the target, their tokens, their tokens alone, what `run_within_budget` saw)."""
    model = tiny_gpt_neox(torch.float64, max_positions=600)
    pooled = TargetModel(model, lean=True, batch_invariant=False, kv_pool=True)
    assert pooled.kv_pool_why is None
    if pool is not None:
        pooled._pool = pool(pooled)
    alone = SpeculativeEngine(TargetModel(model), None)
    expected = {request_id: alone.generate(prompt, params).token_ids for request_id, prompt, params in reqs}
    config = SchedulerConfig(kv_budget_tokens=budget, prefill_chunk=32)
    scheduler = Scheduler(LocalTarget(pooled), None, None, TreeConfig(()), config, speculation=NO_LOOKUP)
    tokens, seen = run_within_budget(scheduler, reqs)
    return pooled, tokens, expected, seen
