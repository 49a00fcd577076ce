"""Engine settings for tests that measure rounds without prompt lookup (the defaults add it to greedy rounds)."""

from __future__ import annotations

from ray_specdec.engine.config import EngineConfig


def lookup_off(**fields) -> EngineConfig:
    """EngineConfig with `fields` set (by their own names) and prompt lookup off unless they set it."""
    return EngineConfig().with_fields(**{"lookup": 0, "plain_lookup": 0} | fields)
