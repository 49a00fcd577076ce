"""The drafter's prefix cache (ray_specdec/speculation/drafter_cache.py): a hit is the prefill's state, copied, bit for
bit; the session advancing its state never changes what is kept; the byte budget holds; another drafter starts
afresh."""

from __future__ import annotations

import torch

from ray_specdec.config import SamplingParams, TreeConfig
from ray_specdec.engine.scheduler import Scheduler
from ray_specdec.engine.scheduler_config import SchedulerConfig
from ray_specdec.engine.target_backend import LocalTarget
from ray_specdec.models.target.model import TargetModel
from ray_specdec.speculation.drafter_cache import DrafterStates, _bytes
from ray_specdec.speculation.drafter_sessions import LazyDrafter
from ray_specdec.speculation.drafting import DrafterSession
from tests.helpers.inputs import random_prompt
from tests.helpers.models import tiny_gpt_neox, tiny_mamba

VOCAB = 128


def test_a_hit_is_the_prefills_state_and_survives_the_session_advancing():
    drafter = tiny_mamba(torch.float32)
    states = DrafterStates()
    prompt = random_prompt(40, seed=1)
    fresh_state, fresh_logits = drafter.prefill(torch.tensor(prompt))
    first = DrafterSession(drafter, prompt, VOCAB, states)
    first.draft(TreeConfig((2, 1)), SamplingParams(), None)
    second = DrafterSession(drafter, prompt, VOCAB, states)
    assert (states.hits, states.misses) == (1, 1)
    assert torch.equal(second.root_state.conv, fresh_state.conv) and torch.equal(second.root_state.ssm, fresh_state.ssm)
    assert torch.equal(second.root_logits, first.root_logits)
    drafter.extend(second.root_state, torch.tensor([5, 6, 7]))  # the session's state moves on in place...
    third = DrafterSession(drafter, prompt, VOCAB, states)
    assert torch.equal(third.root_state.ssm, fresh_state.ssm)  # ...the kept one does not
    assert not torch.equal(second.root_state.ssm, fresh_state.ssm)
    other = DrafterSession(drafter, prompt[:-1], VOCAB, states)  # other ids: a miss
    assert (states.hits, states.misses) == (2, 2) and not torch.equal(other.root_state.ssm, fresh_state.ssm)


def test_the_byte_budget_drops_the_least_recently_used():
    drafter = tiny_mamba(torch.float32)
    size = _bytes(*drafter.prefill(torch.tensor([5])))
    states = DrafterStates(max_bytes=2 * size)
    prompts = [random_prompt(10, seed=s) for s in range(3)]
    for p in prompts[:2]:
        states.prefill(drafter, torch.tensor(p))
    states.prefill(drafter, torch.tensor(prompts[0]))  # touch the first
    states.prefill(drafter, torch.tensor(prompts[2]))  # evicts the second
    assert list(states.entries) == [tuple(prompts[0]), tuple(prompts[2])] and states.bytes == 2 * size
    another = tiny_mamba(torch.float32)
    states.prefill(another, torch.tensor(prompts[0]))  # another drafter: its own states only
    assert list(states.entries) == [tuple(prompts[0])] and states.misses == 4


def test_a_kept_state_costs_the_controller_and_the_prefill_estimate_nothing():
    """The speculation controller charges no drafter prefill for a prompt whose state is kept, and a copied state is
    not timed as a prefill (it would drag the measured cost per token towards zero)."""
    drafter = tiny_mamba(torch.float32)
    scheduler = Scheduler(LocalTarget(TargetModel(tiny_gpt_neox(torch.float32))), drafter, None, TreeConfig((2, 1)))
    prompt = random_prompt(40, seed=3)
    assert scheduler._drafter_prefill(prompt) == 40
    assert LazyDrafter(drafter, VOCAB, scheduler.drafter_states).ready(prompt) > 0
    assert scheduler._drafter_prefill(prompt) == 0 and scheduler._drafter_prefill(prompt[1:]) == 39
    assert LazyDrafter(drafter, VOCAB, scheduler.drafter_states).ready(prompt) == 0.0
    off = Scheduler(LocalTarget(TargetModel(tiny_gpt_neox(torch.float32))), drafter, None, TreeConfig((2, 1)),
                    SchedulerConfig(prefix_cache=False))  # fmt: skip
    assert off.drafter_states is None and off._drafter_prefill(prompt) == 40


def test_the_admission_check_keys_a_prompt_on_the_host_as_its_prefill_does():
    """prefill_key (the scheduler's check at admission, made on the host) is the ids prefill_input runs, as a tuple:
    out-of-vocabulary ids as 0, only the last prefill_window tokens where the drafter has a window; holds() finds a
    prompt a session prefilled, and not another one or another drafter's."""
    from ray_specdec.speculation.drafting import prefill_input, prefill_key

    drafter = tiny_mamba(torch.float32)
    prompt = random_prompt(40, seed=3)
    odd = prompt[:10] + [drafter.vocab_size + 5, drafter.vocab_size] + prompt[10:]
    for ids in (prompt, odd, prompt[:1]):
        assert prefill_key(drafter, ids) == tuple(prefill_input(drafter, ids).tolist())
    assert prefill_key(drafter, odd)[10:12] == (0, 0)
    drafter.prefill_window = 16
    try:
        assert prefill_key(drafter, odd) == tuple(prefill_input(drafter, odd).tolist()) == tuple(odd[-16:])
    finally:
        drafter.prefill_window = None
    states = DrafterStates()
    DrafterSession(drafter, odd, VOCAB, states)
    assert states.holds(drafter, prefill_key(drafter, odd))
    assert not states.holds(drafter, prefill_key(drafter, prompt))
    assert not states.holds(tiny_mamba(torch.float32), prefill_key(drafter, odd))
