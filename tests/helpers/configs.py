"""Engine settings for tests that measure rounds without prompt lookup (the defaults add it to greedy rounds)."""

from __future__ import annotations

from ray_specdec.engine.config import EngineConfig
from ray_specdec.engine.scheduler_config import SchedulerConfig
from ray_specdec.speculation.controller import SpeculationConfig

# the speculation part with prompt lookup off, for tests that build a Scheduler themselves
NO_LOOKUP = SpeculationConfig(lookup=0, plain_lookup=0)


def lookup_off(scheduler: SchedulerConfig | None = None, **fields) -> EngineConfig:
    """EngineConfig of `scheduler` (default: SchedulerConfig()) with `fields` set by their own names and prompt lookup
    off unless they set it."""
    config = EngineConfig() if scheduler is None else EngineConfig(scheduler=scheduler)
    return config.with_fields(**{"lookup": 0, "plain_lookup": 0} | fields)
