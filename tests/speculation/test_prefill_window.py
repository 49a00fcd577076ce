"""A drafter prefill window: a request's drafter state starts from its last N tokens. Drafts change, the output
never does; the lookup branch still searches the whole context, and the speculation controller prices the shorter
prefill."""

from __future__ import annotations

import pytest
import torch

from ray_specdec.config import SamplingParams, TreeConfig
from ray_specdec.engine.llm import SpeculativeEngine
from ray_specdec.models.drafter.mamba import MambaDrafter
from ray_specdec.speculation.drafting import DrafterSession
from tests.helpers.inputs import random_prompt
from tests.helpers.models import tiny_mamba
from tests.helpers.policies import PricedPolicy, fix_costs
from tests.helpers.reference import hf_greedy


def windowed(window: int | None, **kw) -> MambaDrafter:
    drafter = tiny_mamba(**kw)
    drafter.prefill_window = window
    return drafter


def test_the_session_state_starts_from_the_last_window_tokens():
    prompt = random_prompt(40, seed=3)
    session = DrafterSession(windowed(8), prompt, vocab_size=128)
    state, logits = tiny_mamba().prefill(prompt[-8:])
    assert torch.equal(session.root_state.ssm, state.ssm) and torch.equal(session.root_state.conv, state.conv)
    assert torch.equal(session.root_logits[0], logits)
    full = DrafterSession(windowed(None), prompt, vocab_size=128)
    assert not torch.equal(full.root_logits, session.root_logits)  # the window changed the drafter's view
    assert session.history == prompt  # the lookup branch still searches every token


def test_lookup_still_finds_matches_before_the_window():
    head = [7, 8, 9, 10, 11, 12]
    prompt = head + random_prompt(30, seed=4) + head[:3]  # the suffix 7 8 9 last occurred at the start
    session = DrafterSession(windowed(5), prompt, vocab_size=128)
    draft = session.draft(TreeConfig((1,), lookup=3), SamplingParams(), None)
    assert draft.lookup_tokens == (10, 11, 12)


@pytest.mark.parametrize("tree", ["1,1,1", "3,2,1", "2,2,1+L4"])
@pytest.mark.parametrize("window", [1, 6, 1000])
def test_greedy_output_is_the_target_alone_with_any_window(target, tree, window):
    prompt = random_prompt(37, seed=window)
    engine = SpeculativeEngine(target, windowed(window), TreeConfig.parse(tree))
    result = engine.generate(prompt, SamplingParams(max_new_tokens=20))
    assert result.token_ids == hf_greedy(target, prompt, 20)
    assert set(result.stats.trees) - {"none"}  # it drafted, from the windowed state


def test_the_controller_prices_the_windowed_prefill(target):
    """37 tokens x 5 ms of prefill do not pay for 6 tokens at 3 a round against 1; a 5-token window (25 ms) does."""
    prompt = random_prompt(37, seed=10)
    for window, drafts in ((None, False), (5, True)):
        engine = SpeculativeEngine(target, windowed(window), PricedPolicy({(): 1.0, (1, 1): 3.0}))
        fix_costs(engine.controller, 5e-3)
        result = engine.generate(prompt, SamplingParams(max_new_tokens=6))
        assert ("1,1" in result.stats.trees) == drafts
        assert result.token_ids == hf_greedy(target, prompt, 6)
    # the measured cost per token divides by the tokens the prefill ran, not by the context
    engine = SpeculativeEngine(target, windowed(5), PricedPolicy({(): 1.0, (1, 1): 3.0}))
    engine.controller.observe_prefill(0.05, engine.scheduler._prefilled(37))
    assert engine.controller.prefill_s_per_token == pytest.approx(0.01)


def test_bad_windows_are_refused(tmp_path):
    from ray_specdec.factory import LoadError, load_engine

    model = tiny_mamba().model
    for bad in (0, -3, "some", 2.5, True):
        with pytest.raises(ValueError, match="prefill_window must be >= 1"):
            MambaDrafter(model, prefill_window=bad)
        with pytest.raises(LoadError, match="drafter_prefill_window must be >= 1"):
            load_engine(drafter_prefill_window=bad)


def test_auto_window_is_the_one_the_drafter_config_names():
    """'auto' (the default) takes the config's ray_specdec_prefill_window, else all tokens; an explicit window or
    'all' overrides it. The shipped drafter names 512, the longest windows it was trained on."""
    from ray_specdec.defaults import DEFAULT_DRAFTER

    model = tiny_mamba().model
    assert MambaDrafter(model).prefill_window is None
    model.config.ray_specdec_prefill_window = 48
    assert MambaDrafter(model).prefill_window == 48
    assert MambaDrafter(model, prefill_window="auto").prefill_window == 48
    assert MambaDrafter(model, prefill_window="all").prefill_window is None
    assert MambaDrafter(model, prefill_window=None).prefill_window is None
    assert MambaDrafter(model, prefill_window=7).prefill_window == 7
    assert MambaDrafter.from_pretrained(str(DEFAULT_DRAFTER)).prefill_window == 512


def test_window_argument_on_the_command_line():
    import argparse

    from ray_specdec.models.loading import prefill_window_arg

    assert [prefill_window_arg(t) for t in ("auto", "ALL", "512")] == ["auto", "all", 512]
    for bad in ("0", "-1", "x", "1.5"):
        with pytest.raises(argparse.ArgumentTypeError, match="'auto', 'all' or a token count"):
            prefill_window_arg(bad)
