"""The engine replica checks its KV budget against the device once its models are loaded
(ray_specdec/engine/kv_sizing.py): "auto" sizes it from the room, and a budget the device cannot hold stops the replica
at start with the reason, instead of an out-of-memory error under load."""

from __future__ import annotations

import math

import pytest

from deployments import engine as engine_module
from deployments.engine import EngineReplica
from ray_specdec.config import TreeConfig
from ray_specdec.engine.kv_sizing import AUTO_SHARE, GIB
from ray_specdec.engine.config import EngineConfig
from ray_specdec.engine.scheduler_config import SchedulerConfig


def test_auto_is_sized_from_the_room_and_too_much_stops_the_replica(model_dirs, monkeypatch):
    target, _ = model_dirs
    monkeypatch.setattr(engine_module, "device_room", lambda device: GIB // 2)
    replica = EngineReplica(str(target), None, policy=TreeConfig(()), config=EngineConfig(), kv_budget_gib="auto")
    try:
        per_token = replica.backend.target.kv_bytes_per_token
        assert replica.loop.scheduler.config.kv_budget_tokens == math.floor(AUTO_SHARE * GIB / 2 / per_token)
    finally:
        replica.shutdown()
    with pytest.raises(ValueError, match="does not fit: 0.50 GiB free"):
        EngineReplica(str(target), None, policy=TreeConfig(()), config=EngineConfig(), kv_budget_gib=1.0)
    big = SchedulerConfig(kv_budget_tokens=GIB // per_token + 1)  # rows, too
    with pytest.raises(ValueError, match="does not fit"):
        EngineReplica(str(target), None, policy=TreeConfig(()), config=EngineConfig(scheduler=big))
