"""An app of one engine replica keeps the bandit's state and its metrics inside that replica (AppArgs.hubs): no hub
deployments, the replica's own bandit loaded from and saved to `bandit_path`. The served side is in
tests/deployments/test_openai_client.py (one replica: /v1/stats lists no hub, /v1/bandit and /metrics read the
replica's bandit); the builder's wiring in tests/deployments/test_cluster_yaml.py."""

from __future__ import annotations

import asyncio

import pytest

from deployments.bandit import BanditSaver
from deployments.engine import EngineReplica
from ray_specdec.config import SamplingParams, TreeConfig
from ray_specdec.speculation.bandit import Bandit, BanditConfig, BanditState


def record(bandit: Bandit, rounds: int) -> None:
    for _ in range(rounds):
        bandit.record(bandit.arms[0], 100, 2, 0.01)


def saved_rounds(path) -> int:
    return int(BanditState.load(path).steps.sum())


def saved_state(path, rounds: int):
    """A bandit state file of `rounds` rounds, as an earlier run of the app left it."""
    learned = Bandit(BanditConfig())
    record(learned, rounds)
    learned.save(path)
    return path


def test_the_saver_writes_the_state_every_interval_and_when_asked(tmp_path):
    path = tmp_path / "state" / "bandit.json"  # a folder that does not exist yet
    bandit = Bandit(BanditConfig())
    record(bandit, 3)

    async def run() -> None:
        saver = BanditSaver(bandit, str(path), interval_s=0.05)
        saver.start()
        saver.start()  # a second start (every request calls it) runs no second loop
        for _ in range(100):
            await asyncio.sleep(0.05)
            if path.exists():
                break
        assert saved_rounds(path) == 3
        record(bandit, 2)
        saver.save()
        assert saved_rounds(path) == 5
        saver._task.cancel()

    asyncio.run(run())


def test_a_replica_without_a_hub_starts_from_its_file_and_saves_it_at_shutdown(model_dirs, tmp_path):
    target, drafter = model_dirs
    path = saved_state(tmp_path / "bandit.json", 7)
    replica = EngineReplica(str(target), str(drafter), policy=BanditConfig(), bandit_path=str(path))
    try:
        assert isinstance(replica.bandit_sync, BanditSaver) and saved_rounds(path) == 7
        assert int(replica.bandit.state.steps.sum()) == 7  # what the last run learned

        async def one_request() -> list:  # sampled rounds of an arm's tree: each whole one is a record (a greedy
            # round the speculation controller runs undrafted, on the step times it measured, may not be)
            params = SamplingParams(max_new_tokens=12, temperature=0.8, seed=1)
            return [c async for c in replica.generate([3, 4, 5], params, TreeConfig((1, 1)))]

        chunks = asyncio.run(one_request())
        assert chunks[-1].finish_reason == "length" and sum(len(c.token_ids) for c in chunks) == 12
    finally:
        replica.shutdown()
    rounds = int(replica.bandit.state.steps.sum())
    assert rounds > 7 and saved_rounds(path) == rounds  # the shutdown wrote what the request's rounds added


def test_a_replica_with_a_hub_does_not_read_the_file_itself(model_dirs, tmp_path):
    """With a hub the hub owns the file (it loads and saves it); the replica's bandit starts empty and syncs."""
    target, _ = model_dirs
    path = saved_state(tmp_path / "bandit.json", 4)
    replica = EngineReplica(str(target), None, policy=BanditConfig(), bandit_hub=object(), bandit_path=str(path))
    try:
        assert int(replica.bandit.state.steps.sum()) == 0 and type(replica.bandit_sync).__name__ == "BanditSync"
    finally:
        replica.shutdown()
    assert saved_rounds(path) == 4


@pytest.mark.parametrize("more", [{"replicas": 2}, {"min_replicas": 1, "max_replicas": 2}, {"ingress": "router"}])
def test_hubs_in_the_replica_need_the_only_replica(more):
    from deployments import AppArgs
    from deployments.app import AppError, parse_app_args

    assert AppArgs(**more).hubs_in_replica is False  # auto: deployments of their own
    with pytest.raises(AppError, match="hubs=replica needs one engine replica"):
        parse_app_args({"hubs": "replica", **more})
    assert AppArgs().hubs_in_replica and AppArgs(hubs="replica").hubs_in_replica
    assert not AppArgs(hubs="deployments").hubs_in_replica
