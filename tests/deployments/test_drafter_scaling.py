"""The drafter pool's autoscaling (deployments/drafter_scaling.py), without Ray running: `DrafterBusyPolicy` on
hand-built contexts of Serve's (up under busy replicas, down when idle, within the bounds, a dead band between the
two), as AppArgs hands it to Serve, behind Serve's own delays; and `BusyMeter` on a hand-driven clock."""

from __future__ import annotations

import pytest
from ray.serve._private.common import DeploymentID, ReplicaID
from ray.serve.autoscaling_policy import _apply_autoscaling_config
from ray.serve.config import AutoscalingConfig, AutoscalingContext

from deployments.app import AppArgs
from deployments.drafter_scaling import BUSY, REQUESTS_PER_S, ROWS_PER_S, BusyMeter, DrafterBusyPolicy, pool_size

DEPLOYMENT = DeploymentID(name="drafter", app_name="specdec")


def context(busy: list[float] | None, replicas: int, low: int = 1, high: int = 8, now: float = 0.0,
            config: AutoscalingConfig | None = None, state: dict | None = None) -> AutoscalingContext:
    """Serve's context for a pool of `replicas` whose replicas report `busy` (None: no metric reported yet)."""
    ids = [ReplicaID(unique_id=f"r{i}", deployment_id=DEPLOYMENT) for i in range(replicas)]
    metrics = {} if busy is None else {BUSY: dict(zip(ids, busy))}
    return AutoscalingContext(
        deployment_id=DEPLOYMENT, deployment_name="drafter", app_name="specdec", current_num_replicas=replicas,
        target_num_replicas=replicas, running_replicas=ids, total_num_requests=float(replicas),
        total_queued_requests=0.0, aggregated_metrics=metrics, raw_metrics={}, capacity_adjusted_min_replicas=low,
        capacity_adjusted_max_replicas=high, policy_state=state or {}, last_scale_up_time=None,
        last_scale_down_time=None, current_time=now,
        config=config or AutoscalingConfig(min_replicas=low, max_replicas=high))  # fmt: skip


def test_busy_replicas_grow_the_pool_to_the_target_share():
    policy = DrafterBusyPolicy(target=0.6)
    assert policy(context([0.9], 1))[0] == 2  # ceil(0.9 / 0.6)
    assert policy(context([0.95, 0.85], 2))[0] == 3  # ceil(1.8 / 0.6)
    assert policy(context([1.0, 1.0, 1.0], 3))[0] == 5
    assert policy(context([0.6], 1))[0] == 1  # at the target: no more
    replicas, state = policy(context([0.95, 0.85], 2))
    assert state[BUSY] == pytest.approx(1.8)


def test_an_idle_pool_shrinks():
    policy = DrafterBusyPolicy(target=0.6)
    assert policy(context([0.05, 0.05, 0.0], 3))[0] == 1
    assert policy(context([0.0] * 4, 4))[0] == 1
    assert policy(context([0.3, 0.3, 0.2, 0.1], 4))[0] == 2  # 0.9 replicas' worth, ceil(0.9 / 0.45)


def test_the_pool_stays_within_its_bounds():
    policy = DrafterBusyPolicy(target=0.6)
    assert policy(context([1.0] * 3, 3, low=1, high=4))[0] == 4
    assert policy(context([0.0] * 3, 3, low=2, high=4))[0] == 2
    assert policy(context([0.0], 1, low=0, high=4))[0] == 0  # to zero where min_replicas allows
    assert policy(context([1.5, -0.2], 2, high=8))[0] == 2  # reports outside [0, 1] count as 1 and 0


def test_a_dead_band_keeps_the_pool_from_flapping():
    """Between the target and 3/4 of it (band 0.25) the count stands: a step down never calls for a step up."""
    policy = DrafterBusyPolicy(target=0.6, band=0.25)
    assert policy(context([0.7], 1))[0] == 2
    for busy in (0.25, 0.3, 0.5, 0.6):  # 0.5 to 1.2 replicas' worth on 2: each under the target; 1 would be over 0.45
        assert policy(context([busy, busy], 2))[0] == 2, busy
    assert policy(context([0.2, 0.2], 2))[0] == 1  # 0.4 on one replica: under 0.45
    assert policy(context([0.4], 1))[0] == 1
    for busy in range(0, 300):  # over a sweep: whatever it moves to, it would stay there at the same load
        total = busy / 100
        for n in range(1, 6):
            m = pool_size(total, n, 0.6, 0.25)
            assert pool_size(total, m, 0.6, 0.25) == m, (total, n, m)
    with pytest.raises(ValueError):
        DrafterBusyPolicy(target=0.0)


def test_no_report_keeps_the_count():
    assert DrafterBusyPolicy()(context(None, 3))[0] == 3


def test_the_app_hands_the_policy_to_serve_whose_delays_still_hold():
    """AppArgs' drafter pool under autoscaling scales on busy by default: its policy, unpickled as Serve's controller
    does, with the target asked for; Serve's upscale and downscale delays wrap it; "ongoing" leaves Serve's own."""
    args = AppArgs(drafters="remote", drafter_pool_busy_target=0.5,
                   drafter_pool_autoscaling={"min_replicas": 1, "max_replicas": 4, "upscale_delay_s": 10,
                                             "downscale_delay_s": 30})  # fmt: skip
    config = AutoscalingConfig(**args.drafter_pool_options()["autoscaling_config"])
    assert config.policy.policy_kwargs == {"target": 0.5}
    held = _apply_autoscaling_config(config.policy.get_policy()(**config.policy.policy_kwargs))
    assert held(context([0.9, 0.9], 2, high=4, config=config))[0] == 2  # 1.8 / 0.5 asks for 4: not before 10 s
    config = config.model_copy(update={"upscale_delay_s": 0.0})
    now = _apply_autoscaling_config(config.policy.get_policy()(**config.policy.policy_kwargs))
    assert now(context([0.9, 0.9], 2, high=4, config=config))[0] == 4
    ongoing = AppArgs(drafters="remote", drafter_pool_scale_on="ongoing", drafter_pool_autoscaling={"max_replicas": 4})
    assert AutoscalingConfig(**ongoing.drafter_pool_options()["autoscaling_config"]).policy.is_default_policy_function()
    own = {"max_replicas": 4, "policy": {"policy_function": "ray.serve.autoscaling_policy:default_autoscaling_policy"}}
    mine = AppArgs(drafters="remote", drafter_pool_autoscaling=own).drafter_pool_options()["autoscaling_config"]
    assert mine["policy"] == own["policy"]


def test_the_meter_reads_busy_time_and_rates_over_its_window():
    now = [100.0]
    meter = BusyMeter(window_s=4.0, clock=lambda: now[0])
    now[0] = 101.0
    assert meter.stats()[BUSY] == 0.0
    meter.start()
    now[0] = 101.5
    meter.stop(requests=3, rows=12)
    now[0] = 102.0
    stats = meter.stats()  # 0.5 s drafting over the replica's 2 s
    assert stats[BUSY] == pytest.approx(0.25) and stats[REQUESTS_PER_S] == pytest.approx(1.5)
    assert stats[ROWS_PER_S] == pytest.approx(6.0)
    meter.start()
    now[0] = 104.0  # a span under way counts: 0.5 + 2.0 over the 4 s window
    assert meter.stats()[BUSY] == pytest.approx(2.5 / 4)
    meter.stop(requests=1, rows=4)
    now[0] = 107.5  # the window is 103.5..107.5: 0.5 s of the second span, the first gone
    stats = meter.stats()
    assert stats[BUSY] == pytest.approx(0.5 / 4) and stats[REQUESTS_PER_S] == pytest.approx(1 / 4)
    now[0] = 120.0
    assert meter.stats() == {BUSY: 0.0, REQUESTS_PER_S: 0.0, ROWS_PER_S: 0.0}
