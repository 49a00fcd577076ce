"""Sharing the bandit's statistics: routers' batched updates merged by the hub, snapshots, and persistence across
restarts."""

from __future__ import annotations

import json

import numpy as np
import pytest

from ray_specdec.config import TreeConfig
from ray_specdec.speculation.bandit import DEFAULT_ARMS, UCB1, Bandit, BanditConfig, BanditHub
from tests.helpers.bandit_sim import MEANS, assert_same_state, gaussian_env, random_rounds, replay, simulate


def test_merging_batched_updates_from_two_routers_equals_direct_records():
    rounds = random_rounds(300, seed=3)
    config = BanditConfig(gamma=0.99)  # strong discount so an order or exponent mistake shows
    direct = Bandit(config)
    replay(direct, rounds)

    hub, routers = BanditHub(config), [Bandit(config), Bandit(config)]
    for i, start in enumerate(range(0, 300, 37)):  # uneven batches, alternating routers
        router = routers[i % 2]
        replay(router, rounds[start : start + 37])
        hub.push(router.drain_updates().to_dict())  # JSON transport, as through an actor
        router.apply_snapshot(hub.snapshot())
    assert_same_state(hub.state, direct.state)
    assert_same_state(router.state, direct.state)  # the last one to pull sees everything


def test_snapshot_keeps_records_not_yet_drained():
    rounds = random_rounds(40, seed=4)
    hub, router = BanditHub(), Bandit()
    replay(router, rounds[:30])
    hub.push(router.drain_updates())
    replay(router, rounds[30:])
    router.apply_snapshot(hub.snapshot())
    direct = Bandit()
    replay(direct, rounds)
    assert_same_state(router.state, direct.state)
    assert router.drain_updates().steps.sum() == 10


def test_the_hub_merges_routers_recording_at_different_load_levels():
    rounds = random_rounds(400, seed=8)
    alone, busy = [r for r in rounds if r[5] == 1], [r for r in rounds if r[5] > 16]
    config = BanditConfig(gamma=0.99)
    hub, quiet, loaded = BanditHub(config), Bandit(config), Bandit(config)
    replay(quiet, alone)
    replay(loaded, busy)
    hub.push(quiet.drain_updates().to_dict())
    hub.push(loaded.drain_updates().to_dict())
    quiet.apply_snapshot(hub.snapshot())
    direct = Bandit(config)
    replay(direct, alone + busy)
    assert_same_state(hub.state, direct.state)
    assert_same_state(quiet.state, direct.state)
    rounds_per_level = {}
    for cell in hub.summary()["buckets"]:
        rounds_per_level[cell["load"]] = rounds_per_level.get(cell["load"], 0) + cell["rounds"]
    assert rounds_per_level == {"1": len(alone), "2-4": 0, "5-16": 0, "17+": len(busy)}
    assert min(len(alone), len(busy)) > 20


def test_save_load_round_trip_and_continue_where_it_left_off(tmp_path):
    config = BanditConfig(policy=UCB1())  # deterministic selection: the continuation must match exactly
    env = gaussian_env(MEANS)
    straight = simulate(Bandit(config), env, 600, seed=5)

    first = Bandit(config)
    head = simulate(first, env, 300, seed=5)
    path = tmp_path / "state" / "bandit.json"
    first.save(path)
    assert sorted(p.name for p in path.parent.iterdir()) == ["bandit.json"]  # temporary file renamed away
    data = json.loads(path.read_text())
    assert (data["format"], data["version"], data["modes"]) == ("ray_specdec.bandit", 4, ["greedy", "sampled"])
    assert data["load_edges"] == [1, 4, 16]

    resumed = Bandit.load(path, config)
    assert_same_state(resumed.state, first.state)
    rng_after_head = np.random.default_rng(5)
    for _ in range(300):  # the environment's stream, advanced past the first 300 rounds
        rng_after_head.standard_normal()
    tail = []
    for i in range(300):
        tree = resumed.select(100)
        tail.append(config.arms.index(tree))
        resumed.record(tree, 100, *env(tail[-1], 300 + i, 100, rng_after_head))
    np.testing.assert_array_equal(np.concatenate([head, tail]), straight)


def test_hub_persists_and_survives_a_restart_with_a_changed_arm_set(tmp_path):
    path = tmp_path / "bandit.json"
    now = [0.0]
    hub = BanditHub(path=path, save_interval_s=5.0, clock=lambda: now[0])
    router = Bandit()
    replay(router, random_rounds(50, seed=6))
    hub.push(router.drain_updates())
    assert not path.exists()  # within the save interval
    now[0] = 6.0
    hub.push(router.drain_updates())
    assert path.exists()

    restarted = BanditHub(path=path)
    assert_same_state(restarted.state, hub.state)
    fewer = BanditConfig(arms=DEFAULT_ARMS[2:] + (TreeConfig((5, 1)),))
    remapped = BanditHub(fewer, path=path)
    np.testing.assert_array_equal(remapped.state.raw[:, :-1], hub.state.raw[:, 2:])
    np.testing.assert_array_equal(remapped.state.raw[:, -1], 0.0)
    with pytest.raises(ValueError, match="buckets"):
        BanditHub(BanditConfig(bucket_edges=(2048,)), path=path)
