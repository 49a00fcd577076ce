"""The speculation guard on made-up timings: a load level where drafted steps decode slower than plain ones goes
undrafted, others keep drafting; exploration keeps the losing side measured so a reversed trend flips the verdict back,
and grows rarer while the verdict holds; prefill steps and the first step after a switch are not measured as either
side, the latter's excess counting in what exploring costs; steps of different sizes are normalised."""

from __future__ import annotations

import math

import numpy as np
import pytest

from ray_specdec.speculation.guard import (EARLY_SAMPLES, EXPLORE_COST, EXPLORE_PERIOD, EXPLORE_RUN, MAX_EXPLORE_PERIOD,
                                           MIN_SAMPLES, POLICY_ROUNDS, WINDOW, SpeculationGuard, plain_line)

TOKENS_PER_ROUND = 2.5  # tokens a drafted round commits, on average


def plain_seconds(n: int) -> float:
    return 0.010 + 0.002 * n


def drive(guard: SpeculationGuard, loads, speedups: dict[int, float], noise: float = 0.0, seed: int = 0) -> list[bool]:
    """One step per load in `loads`: plain when the guard says so (each request 1 token, plain_seconds), else drafted
    (TOKENS_PER_ROUND each, in seconds that make its throughput `speedups[level]` times plain's). -> undrafted?"""
    rng = np.random.default_rng(seed)
    modes = []
    for n in loads:
        plain = guard.plain(n)
        tokens = n if plain else round(n * TOKENS_PER_ROUND)
        seconds = plain_seconds(n) * tokens / n / (1.0 if plain else speedups[guard.level(n)])
        guard.observe(n, tokens, seconds * (1 + noise * rng.standard_normal()))
        modes.append(plain)
    return modes


def mixed_loads(steps: int, seed: int = 1) -> list[int]:
    """Loads of 2-4 (level 1) and 5-16 (level 2), interleaved at random."""
    rng = np.random.default_rng(seed)
    return [int(rng.choice([2, 3, 4, 5, 8, 12, 16])) for _ in range(steps)]


def test_a_level_where_drafting_is_slower_goes_plain_and_the_others_keep_drafting():
    guard = SpeculationGuard()
    loads = mixed_loads(4000)
    modes = drive(guard, loads, {1: 1.3, 2: 0.85}, noise=0.1)
    assert [lv.undrafted for lv in guard.levels] == [False, False, True, False]
    assert guard.speedup(1) == pytest.approx(1.3, rel=0.08) and guard.speedup(2) == pytest.approx(0.85, rel=0.08)
    late = [(n, plain) for n, plain in zip(loads[2000:], modes[2000:])]
    share = {level: np.mean([plain for n, plain in late if guard.level(n) == level]) for level in (1, 2)}
    explore = EXPLORE_RUN / MAX_EXPLORE_PERIOD  # settled verdicts explore at the longest period
    assert share[1] == pytest.approx(explore, abs=0.01)  # drafting wins: plain only in exploration runs
    assert share[2] == pytest.approx(1 - explore, abs=0.01)  # drafting loses: drafted only in exploration runs
    assert guard.plain_steps == sum(modes)
    summary = {row["load"]: row for row in guard.summary()}
    assert summary["5-16"]["undrafted"] and not summary["2-4"]["undrafted"] and summary["1"]["speedup"] is None


@pytest.mark.parametrize("speedup", [1.08, 2.0])
def test_drafting_that_is_faster_stays(speedup):
    guard = SpeculationGuard()
    modes = drive(guard, [8] * 2000, {2: speedup}, noise=0.05)
    assert not any(lv.undrafted for lv in guard.levels)
    assert np.mean(modes[1000:]) == pytest.approx(EXPLORE_RUN / MAX_EXPLORE_PERIOD, abs=0.005)


def test_exploration_keeps_measuring_the_losing_side_and_a_reversed_trend_flips_back():
    guard = SpeculationGuard()
    drive(guard, [8] * 600, {2: 0.8}, noise=0.02)
    assert guard.levels[2].undrafted and guard.levels[2].period == MAX_EXPLORE_PERIOD
    before = list(guard.levels[2].policy)
    modes = drive(guard, [8] * 2 * MAX_EXPLORE_PERIOD, {2: 0.8}, noise=0.02, seed=1)
    assert guard.levels[2].undrafted and list(guard.levels[2].policy) != before  # drafted steps still measured
    assert modes.count(False) == 2 * EXPLORE_RUN  # in runs, one per period
    modes = drive(guard, [8] * 4000, {2: 1.4})  # drafting now pays
    assert not guard.levels[2].undrafted
    flipped = next(i for i in range(len(modes)) if sum(modes[i:i + EXPLORE_PERIOD]) <= EXPLORE_RUN)
    assert flipped < WINDOW * MAX_EXPLORE_PERIOD / (EXPLORE_RUN - 1)  # within a window of exploration steps
    assert 0 < np.mean(modes[-2 * MAX_EXPLORE_PERIOD:]) <= EXPLORE_RUN / MAX_EXPLORE_PERIOD


def test_exploration_grows_rarer_while_the_verdict_holds_and_a_changed_verdict_restarts_it():
    """The exploration period doubles after each run that leaves the verdict as it was (32, 64, 128, 256, 256...)
    and is back to EXPLORE_PERIOD as soon as the verdict changes (gaps narrow enough for EXPLORE_PERIOD to keep
    exploration within EXPLORE_COST)."""
    guard = SpeculationGuard()
    modes = drive(guard, [8] * 1200, {2: 0.88})
    assert guard.levels[2].undrafted
    runs = [i for i in range(1, len(modes)) if not modes[i] and modes[i - 1]]  # where drafted runs start
    gaps = [b - a for a, b in zip(runs, runs[1:])]
    settled = gaps[next(i for i, g in enumerate(gaps) if g == EXPLORE_PERIOD):]
    assert settled[:5] == [EXPLORE_PERIOD, 2 * EXPLORE_PERIOD, 4 * EXPLORE_PERIOD, MAX_EXPLORE_PERIOD,
                           MAX_EXPLORE_PERIOD]  # fmt: skip
    assert guard.summary()[2]["explore_period"] == MAX_EXPLORE_PERIOD
    drive(guard, [8] * 4000, {2: 1.12})
    level = guard.levels[2]
    assert not level.undrafted and level.period == MAX_EXPLORE_PERIOD  # flipped back, then settled again
    guard = SpeculationGuard()
    drive(guard, [8] * 300, {2: 0.88})
    level = guard.levels[2]
    for _ in range(3000):  # drafting now pays: at the flip, the period starts over
        period, undrafted = level.period, level.undrafted
        drive(guard, [8], {2: 1.12})
        if level.undrafted != undrafted:
            assert period > EXPLORE_PERIOD and level.period == EXPLORE_PERIOD
            break
    else:
        pytest.fail("the verdict never flipped back")
    modes = drive(guard, [8] * EXPLORE_PERIOD, {2: 1.12})  # drafting now; the next plain run is a whole run
    runs = "".join("P" if plain else "D" for plain in modes).replace("D", " ").split()
    assert runs and runs[0] == "P" * EXPLORE_RUN


def test_prefill_steps_and_the_first_step_after_a_switch_are_not_measured():
    guard = SpeculationGuard()
    for _ in range(100):
        guard.plain(8)
        guard.observe(8, 8, 100.0, prefill=True)  # absurd timings, ignored
    assert not guard.levels[2].plain and not guard.levels[2].policy
    assert not guard.levels[2].undrafted
    guard = SpeculationGuard()
    modes = drive(guard, [8] * 40, {2: 1.0})
    kept = [mode for before, mode in zip(modes, modes[1:]) if before == mode]  # the first step follows none
    assert len(guard.levels[2].plain) == sum(kept) and len(guard.levels[2].policy) == len(kept) - sum(kept)
    assert len(kept) < len(modes) - 4


def test_a_policy_steps_drafting_charge_counts_against_drafting_and_a_plain_steps_does_not():
    """Drafted steps that decode 1.3x faster (20 tokens in 1.9 plain steps' time): charged a drafter prefill share of
    one plain step's time a step, drafting loses; charged nothing, it wins. The same charge handed in with plain
    steps changes nothing (plain rounds run no drafter), and neither does one handed in with a step not measured (a
    target prefill in it)."""
    def run(charge: float, on_plain: bool = False, on_prefill: bool = False) -> bool:
        guard = SpeculationGuard()
        for i in range(600):
            plain = guard.plain(8)
            tokens = 8 if plain else 20
            seconds = plain_seconds(8) * tokens / 8 / (1.0 if plain else 1.3)
            drafting_s = charge * plain_seconds(8) if plain == on_plain else 0.0
            if on_prefill and i % 2:
                guard.observe(8, tokens, seconds, prefill=True, drafting_s=100.0)
                continue
            guard.observe(8, tokens, seconds, drafting_s=drafting_s)
        return guard.levels[2].undrafted
    assert run(charge=1.0) and not run(charge=0.0)
    assert not run(charge=1.0, on_plain=True) and not run(charge=0.0, on_prefill=True)


def test_a_narrow_gap_waits_for_enough_steps_of_both_sides_and_a_clear_one_does_not():
    guard = SpeculationGuard()
    modes = drive(guard, [8] * (2 * MIN_SAMPLES), {2: 0.9}, noise=0.1)  # few steps measured, within the noise
    assert not guard.levels[2].undrafted and not guard.levels[2].settled
    assert sum(modes) == MIN_SAMPLES  # warming up: half the steps plain, in runs of EXPLORE_RUN
    drive(guard, [8] * (4 * MIN_SAMPLES), {2: 0.9}, noise=0.1)
    assert guard.levels[2].undrafted
    for speedup in (0.4, 2.5):  # a gap of 2.5x, with 10% noise a step: clear after EARLY_SAMPLES measured a side
        guard = SpeculationGuard()
        drive(guard, [8] * (2 * EXPLORE_RUN + 1), {2: speedup}, noise=0.1)
        level = guard.levels[2]
        assert min(len(level.plain), len(level.policy)) == EARLY_SAMPLES < MIN_SAMPLES
        assert level.settled and level.undrafted == (speedup < 1)
    guard = SpeculationGuard()  # the same gap in noise of 60% a step is not clear that soon
    drive(guard, [8] * (2 * EXPLORE_RUN + 1), {2: 0.4}, noise=0.6, seed=2)
    assert not guard.levels[2].settled


@pytest.mark.parametrize("speedup", [0.45, 0.75, 1.6])
def test_exploration_costs_at_most_its_share_of_the_gap(speedup):
    """Once settled, the losing mode runs EXPLORE_RUN steps per period, the period long enough that they cost at most
    EXPLORE_COST of the level's time (up to MAX_EXPLORE_PERIOD): wide gaps get long periods from the start, not
    after doubling up from EXPLORE_PERIOD."""
    guard = SpeculationGuard()
    level = guard.levels[2]
    gap = abs(speedup - 1) / min(speedup, 1)
    expected = min(MAX_EXPLORE_PERIOD, max(EXPLORE_PERIOD, math.ceil(EXPLORE_RUN * gap / EXPLORE_COST)))
    modes, periods = [], []
    for step in range(3000):
        modes += drive(guard, [8], {2: speedup}, noise=0.1, seed=step)
        periods.append(level.period if level.settled else None)
    assert level.undrafted == (speedup < 1)
    settled = next(i for i, p in enumerate(periods) if p is not None and p != EXPLORE_PERIOD or p == expected)
    assert all(p >= 0.85 * expected for p in periods[settled:])  # measured gaps are within the noise of the true one
    assert settled < 4 * EXPLORE_PERIOD  # wide gaps settle early
    losing = [plain != level.undrafted for plain in modes[settled:]]
    assert np.mean(losing) * gap <= 1.2 * EXPLORE_COST
    assert 0 < np.mean(losing)  # still explored


def test_steps_of_different_sizes_are_compared_through_the_plain_line():
    rng = np.random.default_rng(3)
    samples = [(n, plain_seconds(n)) for n in rng.integers(5, 17, size=20)]
    line = plain_line(samples)
    assert [line(n) for n in (5, 10, 16, 20)] == pytest.approx([plain_seconds(n) for n in (5, 10, 16, 20)])
    assert plain_line([(8, 0.02), (8, 0.04)])(12) == pytest.approx(0.03)  # one size seen: its mean
    assert plain_line([(5, 0.05), (16, 0.01)])(16) == pytest.approx(0.03)  # never cheaper with more requests
    # drafted steps exactly as fast as plain ones, at sizes other than the plain steps': speedup 1
    guard = SpeculationGuard()
    drive(guard, mixed_loads(600, seed=4), {1: 1.0, 2: 1.0})
    assert guard.speedup(2) == pytest.approx(1.0, rel=1e-6) and guard.speedup(1) == pytest.approx(1.0, rel=1e-6)


def test_requests_that_draft_in_both_modes_are_common_to_both_sides():
    """Plain-mode steps where one request of n drafts anyway (an asked-for tree: 3 tokens) are scored per token of
    each request: policy steps of the same throughput per request measure speedup 1, faster ones their factor."""
    for factor, undrafted in ((1.0, False), (0.8, True), (1.25, False)):
        guard = SpeculationGuard()
        for step in range(400):
            n = (6, 9, 12)[step % 3]
            plain = guard.plain(n)
            tokens = n + 2 if plain else 2 * n
            guard.observe(n, tokens, plain_seconds(n) * tokens / n / (1.0 if plain else factor))
        assert guard.speedup(2) == pytest.approx(factor, rel=1e-6) and guard.levels[2].undrafted == undrafted


def test_a_level_is_the_admitted_requests_and_steps_are_scored_per_decoding_request():
    """8 requests admitted, of which 3 or 8 decode (the others prefilling): every step lands in the level of 8 and
    is normalised by the requests that decoded, so the measured speedup is the drafted steps' factor."""
    for factor in (0.8, 1.25):
        guard = SpeculationGuard()
        for step in range(600):
            n = (3, 8)[step % 2]
            plain = guard.plain(8)
            tokens = n if plain else 2 * n
            guard.observe(8, tokens, plain_seconds(n) * tokens / n / (1.0 if plain else factor), decoding=n)
        level = guard.levels[guard.level(8)]
        assert not guard.levels[guard.level(3)].plain and {sample[0] for sample in level.plain} == {3, 8}
        assert guard.speedup(guard.level(8)) == pytest.approx(factor, rel=1e-6) and level.undrafted == (factor < 1)


def test_one_stalled_step_does_not_decide_a_verdict():
    """Drafting 1.2x faster, and one policy step stalled 100x (served at concurrency 1, a burst of other processes'
    work): the level keeps drafting. Counted raw, that step alone makes the window's speedup (POLICY_ROUNDS steps at
    one request) 0.87 and runs the level undrafted. A policy step's drafter prefill charge is added after the cap:
    drafting that pays a prefill's worth every few steps loses."""
    for stall, prefill, drafted in ((100.0, 0.0, True), (1.0, 1.0, False)):
        guard = SpeculationGuard()
        level = guard.levels[guard.level(1)]
        for step in range(400):
            plain = guard.plain(1)
            seconds = 0.01 if plain else 0.01 * 3 / 1.2  # a drafted step: 3 tokens in 2.5x the time
            extra = 0.0
            if not plain and step == 200:
                seconds *= stall
            if not plain and prefill and step % 3 == 0:
                extra = 0.01 * prefill * 3
            guard.observe(1, 1 if plain else 3, seconds, drafting_s=extra)
        assert level.undrafted != drafted, (stall, prefill, guard.speedup(guard.level(1)))


def test_one_hard_text_at_one_request_does_not_undraft_a_level_where_drafting_wins():
    """At one request 32 policy steps are one or two requests' texts, and what a drafted round commits depends on the
    text. Drafting wins ~1.5x here on average (rounds of 1-4 tokens in 1.6x a plain step's time), but one request of
    40 rounds that the drafter reads badly (one token a round) measures 0.6 alone. The policy side keeps
    POLICY_ROUNDS request-rounds, so the level keeps drafting through it."""
    rng = np.random.default_rng(3)
    guard = SpeculationGuard()
    level = guard.levels[guard.level(1)]
    undrafted = []
    for step in range(1500):
        plain = guard.plain(1)
        hard = 600 <= step < 640
        tokens = 1 if plain or hard else int(rng.integers(1, 5))
        guard.observe(1, tokens, 0.004 * (1.0 if plain else 1.6) * (1 + 0.1 * rng.standard_normal()))
        undrafted.append(level.undrafted)
    assert not any(undrafted) and len(level.policy) == POLICY_ROUNDS


def test_the_policy_window_holds_policy_rounds_of_requests_and_at_least_window_steps():
    guard = SpeculationGuard()
    for load, steps in ((1, POLICY_ROUNDS), (4, POLICY_ROUNDS // 4), (16, WINDOW), (40, WINDOW)):
        level = guard.levels[guard.level(load)]
        for _ in range(2000):
            plain = guard.plain(load)
            guard.observe(load, load if plain else 2 * load, 0.01 * load)
        assert len(level.policy) == steps, load


def test_what_a_switch_costs_lengthens_the_exploration_period():
    """Drafting loses narrowly (0.88: EXPLORE_RUN steps in EXPLORE_PERIOD cost ~2%), but the first drafted step of
    each exploration run pays drafter prefills worth three plain steps (the requests that came since the last run),
    handed in apart from the step's seconds. Counted with the run, the period the verdict starts from keeps
    exploration within EXPLORE_COST of the level's time, prefills included; left out (as the guard once did), it
    started at EXPLORE_PERIOD and the first runs cost ~3.5%. Prefills handed in with a plain step after a switch (a
    client tree's: common to both modes) are not a switch's cost."""
    guard = SpeculationGuard()
    level = guard.levels[2]
    speedup, switch_s = 0.88, 3 * plain_seconds(8)
    spent, as_plain, previous, settled = [], [], None, None
    for step in range(1000):
        plain = guard.plain(8)
        tokens = 8 if plain else 20
        seconds = plain_seconds(8) * tokens / 8 / (1.0 if plain else speedup)
        prefills = switch_s if plain != previous else 0.0  # into plain: a client tree's session, into drafting: ours
        guard.observe(8, tokens, seconds, drafter_prefill_s=prefills)
        spent.append(seconds + (0.0 if plain else prefills))
        as_plain.append(plain_seconds(8) * tokens / 8)
        previous = plain
        if settled is None and level.settled:
            settled, period = step + 1, level.period
    run = EXPLORE_RUN * (1 / speedup - 1) + 3  # in plain steps: the losing steps' gap and the switch into drafting
    assert level.undrafted and period == math.ceil(run / EXPLORE_COST) > EXPLORE_PERIOD
    assert guard.summary()[2]["switch_s"] == pytest.approx(switch_s)
    cost = sum(spent[settled:settled + 600]) / sum(as_plain[settled:settled + 600]) - 1
    assert 0 < cost <= 1.1 * EXPLORE_COST


def test_greedy_and_sampled_steps_keep_verdicts_of_their_own():
    """At one load, greedy steps draft 1.3x faster and sampled ones (lower acceptance at T=1) 0.7x as fast,
    interleaved: the greedy level keeps drafting and the sampled one goes undrafted (one verdict for both measured
    their mix and drafted both, or neither). summary() has both, the greedy set's at the row's top."""
    guard = SpeculationGuard()
    for step in range(2000):
        sampled = step % 3 == 0
        plain = guard.plain(8, sampled)
        tokens = 8 if plain else 20
        speedup = 0.7 if sampled else 1.3
        guard.observe(8, tokens, plain_seconds(8) * tokens / 8 / (1.0 if plain else speedup))
    assert not guard.levels[2].undrafted and guard.sampled_levels[2].undrafted
    assert guard.speedup(2) == pytest.approx(1.3) and guard.speedup(2, sampled=True) == pytest.approx(0.7)
    row = guard.summary()[2]
    assert row["load"] == "5-16" and not row["undrafted"] and row["speedup"] == pytest.approx(1.3)
    assert row["sampled"]["undrafted"] and row["sampled"]["speedup"] == pytest.approx(0.7)
    assert row["sampled"]["settled"] and row["sampled"]["policy"] > 0 and row["sampled"]["plain"] > 0


def test_a_level_not_yet_settled_starts_from_the_verdict_of_a_settled_one_below():
    """Load 5-16 is settled undrafted (drafting 0.5x). The first steps at 17+, never visited, run undrafted too,
    drafting only in exploration runs at the period 5-16's gap calls for (warming up from scratch drafted half of
    them: served at 32 requests, a whole 15 s cell at 0.79x of undrafted throughput). The runs still measure it: where
    drafting wins there (a wrong prior), the level settles and drafts after its first run. Sampled steps at 5-16 start
    from the greedy level's undrafted verdict (drafting gains less when sampling); a drafted verdict carries over
    neither to sampled steps nor to a level at higher load, which warm up as with nothing settled below."""
    period = math.ceil(EXPLORE_RUN * (1 / 0.5 - 1) / EXPLORE_COST)
    for speedup in (0.5, 1.5):
        guard = SpeculationGuard()
        drive(guard, [8] * 600, {2: 0.5})
        assert guard.levels[2].settled and guard.levels[2].undrafted and not guard.levels[3].settled
        modes = drive(guard, [32] * 259, {3: speedup})  # as many steps as the served cell ran
        level = guard.levels[3]
        first_run = modes.index(False)
        assert first_run == period - EXPLORE_RUN and all(modes[:first_run])
        if speedup < 1:
            assert modes.count(False) == EXPLORE_RUN and level.undrafted
        else:
            assert level.settled and not level.undrafted and not any(modes[first_run:first_run + EXPLORE_PERIOD])
        assert sum(drive_sampled(guard, [8] * 40, 0.5)) == 40 and guard.sampled_levels[2].undrafted
    guard = SpeculationGuard()
    drive(guard, [1] * 600, {0: 1.5})
    assert guard.levels[0].settled and not guard.levels[0].undrafted
    assert sum(drive_sampled(guard, [1] * (2 * EXPLORE_RUN), 1.5)) == EXPLORE_RUN  # warming up: half plain
    # nor to a level at higher load: 5-16 warms up (half its first steps plain), and settles undrafted where drafting
    # loses there, soon
    modes = drive(guard, [8] * (2 * EXPLORE_RUN), {2: 0.85})
    assert sum(modes) == EXPLORE_RUN and not guard.levels[2].settled
    drive(guard, [8] * 200, {2: 0.85})
    assert guard.levels[2].settled and guard.levels[2].undrafted


def drive_sampled(guard: SpeculationGuard, loads, speedup: float) -> list[bool]:
    """As `drive`, of steps with a sampled request: drafting at `speedup`."""
    modes = []
    for n in loads:
        plain = guard.plain(n, sampled=True)
        tokens = n if plain else round(n * TOKENS_PER_ROUND)
        guard.observe(n, tokens, plain_seconds(n) * tokens / n / (1.0 if plain else speedup))
        modes.append(plain)
    return modes


def test_a_settled_level_weighs_its_verdict_at_every_exploring_step_and_every_recheck_th_other(monkeypatch):
    """The ratio over both windows is recomputed at each step on the side a settled level explores and at every
    RECHECK-th step on its verdict's side (not at every step: ~0.17 ms of NumPy each); verdicts still flip."""
    import ray_specdec.speculation.guard as sg

    guard = SpeculationGuard()
    drive(guard, [8] * 600, {2: 0.8})
    level = guard.levels[2]
    assert level.settled and level.undrafted
    weighed = []
    real = sg._speedup
    monkeypatch.setattr(sg, "_speedup", lambda lv: weighed.append(lv) or real(lv))
    modes = drive(guard, [8] * 4 * MAX_EXPLORE_PERIOD, {2: 0.8})
    exploring = modes.count(False) - modes.count(False) // EXPLORE_RUN  # measured drafted steps (not the switches)
    plain = modes.count(True) - modes.count(False) // EXPLORE_RUN
    assert exploring > 0 and len(weighed) <= exploring + plain // sg.RECHECK + 1
    assert len(weighed) >= plain // sg.RECHECK
    modes = drive(guard, [8] * 4000, {2: 1.4})  # drafting now pays: the verdict still flips back
    assert not level.undrafted
