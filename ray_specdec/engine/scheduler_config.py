"""The scheduler's settings (`SchedulerConfig`): admission, batching and the KV budget; part of
`engine.config.EngineConfig`, which gives each field as a flag of `generate` and `bench` and an argument of the app."""

from __future__ import annotations

from dataclasses import dataclass

from ray_specdec.settings import bounded, check_bounds


@dataclass(frozen=True)
class SchedulerConfig:
    """How the scheduler admits and batches requests (engine/scheduler.py); the comment on each field is its
    documentation."""

    kv_budget_tokens: int = bounded(1 << 17, ge=1)  # KV rows all admitted requests may hold together
    max_running: int = bounded(64, ge=1)  # requests decoding or prefilling at once
    max_waiting: int = bounded(256, ge=0)  # queued requests beyond which add() raises QueueFull (the app: 503)
    # 1024, not 2048: a CPU prefill row costs ~0.17 ms, and steps of 2048 rows held the decoding requests for ~350 ms
    # at a time (docs/BENCHMARKS.md): time to first token halved at 8 and 32 requests, tokens/s kept
    step_tokens: int = bounded(1024, ge=1)  # target rows per step: verify rows first, prefill chunks in what is left
    # a prompt's chunks are cut at multiples of this: its KV never depends on the batch
    prefill_chunk: int = bounded(512, ge=1)
    prefix_cache: bool = True  # keep prompt chunks' KV in unreserved budget for later prompts (engine/prefix_cache.py)
    # on: admit against the KV requests hold and grow each one's as it decodes, a request waiting a step where its
    # growth would leave some request unable to finish (never preempted: exact); off: reserve each one's most
    kv_grow: bool = True  # grow each request's KV as it decodes instead of reserving its most at admission

    def __post_init__(self) -> None:
        check_bounds(self)
