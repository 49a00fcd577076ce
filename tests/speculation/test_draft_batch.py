"""One batched draft for many requests (`drafting.draft_many`) against drafting them one by one, and the row invariance
of the drafter's step that makes batching exact.

Every comparison is exact (torch.equal): a batched draft must give each request the tokens, distributions, random
draws and commit state of its own single draft. The shipped drafter, a tiny float32 one and a tiny float32 Mamba2 one
run native steps (row-invariant: their requests step together); a float64 one runs the torch step (not row-invariant:
its requests draft one after the other, and the results must still be the same).
"""

from __future__ import annotations

import functools
import gc

import pytest
import torch
from transformers import MambaConfig

from ray_specdec.config import SamplingParams, TreeConfig
from ray_specdec.defaults import DEFAULT_DRAFTER
from ray_specdec.models.drafter.mamba import MambaDrafter, MambaState
from ray_specdec.models.drafter.mamba_state import StateSlots
from ray_specdec.models.native import library
from ray_specdec.speculation.acceptance import Verdict, accept_greedy
from ray_specdec.speculation.drafting import Draft, DraftRequest, DrafterSession, commit_many, draft_many
from tests.helpers.models import perturbed_mamba, tiny_mamba2

TINY = dict(vocab_size=77, hidden_size=40, state_size=6, num_hidden_layers=3, expand=2, conv_kernel=4,
            time_step_rank=5)  # fmt: skip
GREEDY = SamplingParams()
IID = SamplingParams(temperature=0.9, draft_sampling="iid")
WITHOUT_REPLACEMENT = SamplingParams(temperature=0.7, top_k=30, draft_sampling="without_replacement")
# (tree, sampling): every tree shape of the batch, greedy and both sampled kinds, lookup merged and appended
MIX = [
    ("1,1,1", GREEDY),
    ("3,2,2,1,1", IID),
    ("2,2,1,1+L4", GREEDY),
    ("none", IID),
    ("4", WITHOUT_REPLACEMENT),
    ("3,2,2,1,1", WITHOUT_REPLACEMENT),
    ("2,2,1,1+L4", WITHOUT_REPLACEMENT),
    ("1,1,1", IID),
    ("3,2,2,1,1", GREEDY),
]


@functools.cache
def drafter(name: str) -> MambaDrafter:
    if name == "shipped":
        return MambaDrafter.from_pretrained(str(DEFAULT_DRAFTER))
    if name == "tiny-mamba2":
        return tiny_mamba2(torch.float32, vocab=TINY["vocab_size"], seed=3)
    model = perturbed_mamba(MambaConfig(**TINY), seed=3)
    return MambaDrafter(model.float()) if name == "tiny" else MambaDrafter(model.double(), native=False)


@pytest.fixture(params=["shipped", "tiny", "tiny-torch", "tiny-mamba2"])
def named_drafter(request) -> MambaDrafter:
    return drafter(request.param)


def prompt(index: int, vocab: int) -> list[int]:
    """A prompt with repeats, so that lookup branches find proposals."""
    g = torch.Generator().manual_seed(index)
    phrase = torch.randint(0, vocab, (5 + index % 4,), generator=g).tolist()
    return (phrase * 4 + torch.randint(0, vocab, (3,), generator=g).tolist() + phrase[:2])[: 20 + index]


def sessions(d: MambaDrafter, n: int) -> list[DrafterSession]:
    # the target's vocabulary is the drafter's, wider (padded draft distributions) or narrower (cut ones)
    return [DrafterSession(d, prompt(i, d.vocab_size), d.vocab_size + (0, 3, -2)[i % 3]) for i in range(n)]


def requests(group: list[DrafterSession], seed: int) -> list[DraftRequest]:
    return [DraftRequest(s, TreeConfig.parse(tree), params, torch.Generator().manual_seed(seed + i))
            for i, (s, (tree, params)) in enumerate(zip(group, MIX))]  # fmt: skip


def assert_same_draft(a: Draft, b: Draft) -> None:
    assert (a.config, a.requested, a.paths, a.deterministic, a.q_rows, a.lookup_tokens) == (
        b.config, b.requested, b.paths, b.deterministic, b.q_rows, b.lookup_tokens)  # fmt: skip
    assert a.tokens.dtype == b.tokens.dtype and torch.equal(a.tokens, b.tokens)
    assert (a.probs is None) == (b.probs is None)
    if a.probs is not None:
        assert a.probs.dtype == b.probs.dtype and torch.equal(a.probs, b.probs)


def verdict(draft: Draft, vocab: int, seed: int) -> Verdict:
    """Greedy acceptance on random target logits that agree with the draft for the first `seed % 4` nodes of its
    first path, so that commits accept stepped nodes, leaves and lookup nodes as well as nothing."""
    g = torch.Generator().manual_seed(seed)
    tree = draft.tree
    logits = torch.randn(tree.num_nodes + 1, vocab, generator=g, dtype=torch.float64)  # [1 + n, V]
    row = 0
    for _ in range(seed % 4):
        if not tree.children[row]:
            break
        child = tree.children[row][0]
        logits[row, draft.tokens[child - 1]] = 100.0
        row = child
    return accept_greedy(logits, tree, draft.tokens)


def count_steps(d: MambaDrafter, monkeypatch) -> list[int]:
    """Row counts of the drafter's steps from now on."""
    rows: list[int] = []
    step = d.step

    def counted(state, tokens):
        rows.append(state.rows)
        return step(state, tokens)

    monkeypatch.setattr(d, "step", counted)
    return rows


@pytest.mark.parametrize("min_path_prob", [0.0, 0.05])
def test_batch_equals_one_by_one_then_commits_keep_it(named_drafter, min_path_prob, monkeypatch):
    d = named_drafter
    batched, alone = sessions(d, len(MIX)), sessions(d, len(MIX))
    for round_ in range(3):
        batch, single = requests(batched, 10 * round_), requests(alone, 10 * round_)
        steps = count_steps(d, monkeypatch)
        drafts = draft_many(batch, min_path_prob)
        monkeypatch.undo()
        expected = [r.session.draft(r.config, r.params, r.generator, min_path_prob) for r in single]
        for a, b, ra, rb in zip(drafts, expected, batch, single):
            assert_same_draft(a, b)
            assert torch.equal(ra.generator.get_state(), rb.generator.get_state())
        deepest = max(r.config.depth for r in batch)
        if d.steps_row_invariant and min_path_prob == 0:  # one step per depth that has children, for all requests
            assert len(steps) == deepest - 1
        for i, (a, b, draft) in enumerate(zip(batched, alone, drafts)):
            v = verdict(draft, a.vocab_size, seed=round_ * 31 + i)
            a.commit(v)
            b.commit(v)
            assert torch.equal(a.root_logits, b.root_logits)
            assert torch.equal(a.root_state.conv, b.root_state.conv) and torch.equal(a.root_state.ssm, b.root_state.ssm)


def later_verdicts(seed: int, vocab: int) -> list[Verdict]:
    """0-2 verdicts of rounds run without a drafter draft (a bonus token, after accepted lookup tokens or not) that
    queue behind a drafted round's, as the lazy drafter queues them."""
    g = torch.Generator().manual_seed(seed)
    tokens = lambda n: tuple(torch.randint(0, vocab, (n,), generator=g).tolist())  # noqa: E731
    return [Verdict(tuple(range(1, k + 1)), tokens(k), tokens(1)[0]) for k in (3, 0)[: seed % 3]]


@pytest.mark.parametrize("pool", [None, len(MIX), len(MIX) - 3])
def test_commits_together_equal_commits_one_by_one(named_drafter, pool, monkeypatch):
    """`commit_many` over every session (roots in a slot pool, of their own, or both when the pool runs out; verdicts
    queued behind a drafted round's; accepted stepped nodes, leaves and lookup nodes) gives each session the root
    logits, state, history and next draft of its own commit, bit for bit. On the native step the catch-ups of all
    sessions run in one call."""
    d = named_drafter
    slots = StateSlots(d, pool) if pool else None
    together = [DrafterSession(d, prompt(i, d.vocab_size), d.vocab_size + (0, 3, -2)[i % 3], slots=slots)
                for i in range(len(MIX))]  # fmt: skip
    alone = sessions(d, len(MIX))
    for round_ in range(3):
        drafts = draft_many(requests(together, 10 * round_))
        expected = draft_many(requests(alone, 10 * round_))
        for a, b in zip(drafts, expected):
            assert_same_draft(a, b)
        verdicts = [[verdict(draft, s.vocab_size, seed=round_ * 31 + i), *later_verdicts(round_ * 7 + i, d.vocab_size)]
                    for i, (s, draft) in enumerate(zip(together, drafts))]  # fmt: skip
        calls = []
        if d.native is not None:
            forward_rows = d.native.forward_rows
            monkeypatch.setattr(d.native, "forward_rows", lambda states, ids: calls.append(len(states)) or
                                forward_rows(states, ids))  # fmt: skip
        commit_many(list(zip(together, verdicts)))
        monkeypatch.undo()
        for s, v in zip(alone, verdicts):
            s.commit_all(v)
        if d.native is not None:
            assert calls == [len(MIX)]
        for a, b in zip(together, alone):
            assert torch.equal(a.root_logits, b.root_logits) and a.history == b.history
            assert torch.equal(a.root_state.conv, b.root_state.conv) and torch.equal(a.root_state.ssm, b.root_state.ssm)
            if a.slot is not None:  # the root is still the slot, advanced in place
                assert a.root_state.ssm.data_ptr() == slots.state(a.slot).ssm.data_ptr()


def test_commit_many_takes_each_session_once_and_skips_those_without_verdicts():
    d = drafter("tiny")
    a, b = sessions(d, 2)
    logits = b.root_logits.clone()
    with pytest.raises(ValueError, match="only once"):
        commit_many([(a, [Verdict((), (), 1)]), (a, [Verdict((), (), 2)])])
    commit_many([(a, [Verdict((), (), 1)]), (b, [])])
    assert a.history[-1] == 1 and torch.equal(b.root_logits, logits)


def test_requests_sharing_a_generator_draw_in_one_by_one_order(named_drafter):
    d = named_drafter
    shared = torch.Generator().manual_seed(5)
    copy = torch.Generator().manual_seed(5)
    configs = [("2,2", IID), ("1,1,1", GREEDY), ("3,1", WITHOUT_REPLACEMENT), ("2", IID)]
    batched, alone = sessions(d, len(configs)), sessions(d, len(configs))
    gens = [shared, None, shared, None]  # None: torch's global generator, shared as well
    torch.manual_seed(9)
    drafts = draft_many([DraftRequest(s, TreeConfig.parse(t), p, g)
                         for s, (t, p), g in zip(batched, configs, gens)])  # fmt: skip
    torch.manual_seed(9)
    for s, (t, p), g, draft in zip(alone, configs, [copy, None, copy, None], drafts):
        assert_same_draft(draft, s.draft(TreeConfig.parse(t), p, g))
    assert torch.equal(shared.get_state(), copy.get_state())


def test_requests_on_two_drafters_in_one_call():
    mixed = [("tiny", 0), ("shipped", 1), ("tiny", 2), ("tiny", 3), ("shipped", 4)]
    batched, alone = ([sessions(drafter(name), 5)[i] for name, i in mixed] for _ in range(2))
    drafts = draft_many(requests(batched, 0))
    for draft, r in zip(drafts, requests(alone, 0)):
        assert_same_draft(draft, r.session.draft(r.config, r.params, r.generator))


def test_batches_stop_at_the_row_cap(monkeypatch):
    d = drafter("tiny")
    group = sessions(d, 8)  # (3,2,2,1,1) steps 12 rows at its widest: 5 requests fill a batch of 64 rows
    steps = count_steps(d, monkeypatch)
    draft_many([DraftRequest(s, TreeConfig((3, 2, 2, 1, 1)), GREEDY, None) for s in group])
    assert steps == [15, 30, 60, 60, 9, 18, 36, 36]


def test_depth_zero_requests_never_touch_the_drafter(monkeypatch):
    d = drafter("tiny")
    group = sessions(d, 2)
    steps = count_steps(d, monkeypatch)
    monkeypatch.setattr(d, "copy_rows", lambda *a, **k: pytest.fail("no row copies for depth-0 trees"))
    drafts = draft_many([DraftRequest(s, TreeConfig(()), p, None) for s, p in zip(group, (GREEDY, IID))])
    assert steps == [] and [x.tokens.numel() for x in drafts] == [0, 0] and drafts[1].probs is None


def test_a_session_drafts_once_per_batch():
    s = sessions(drafter("tiny"), 1)[0]
    with pytest.raises(ValueError, match="once per batch"):
        draft_many([DraftRequest(s, TreeConfig((1,)), GREEDY, None)] * 2)


def test_state_rows_cat_and_slice_copy_only_what_they_must():
    d = drafter("tiny")
    a, b = d.copy_rows(d.prefill([1, 2, 3])[0], [0, 0]), d.prefill([4, 5])[0]
    assert MambaState.cat([a]) is a
    both = MambaState.cat([a, b])
    assert both.rows == 3 and torch.equal(both.ssm[:, 2], b.ssm[:, 0]) and torch.equal(both.conv[:, :2], a.conv)
    tail = both.row_slice(2, 3)
    assert tail.rows == 1 and tail.conv.data_ptr() == both.conv[:, 2].data_ptr()  # a view
    assert torch.equal(d.copy_rows(tail, [0]).ssm, b.ssm)


@pytest.mark.parametrize("rows", [2, 7, 13, 64])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("name", ["shipped", "tiny"])
def test_native_step_is_row_invariant(name, rows, threads):
    """Each row of a step over `rows` rows equals that row stepped alone, bit for bit: logits and both states."""
    d = drafter(name)
    if d.native is None:
        pytest.skip(f"native kernels unavailable here: {library.why_unavailable()}")
    assert d.steps_row_invariant
    g = torch.Generator().manual_seed(rows)
    state = d.copy_rows(d.prefill(torch.randint(0, d.vocab_size, (9,), generator=g))[0], [0] * rows)
    d.step(state, torch.randint(0, d.vocab_size, (rows,), generator=g))  # rows now differ
    tokens = torch.randint(0, d.vocab_size, (rows,), generator=g)
    alone = [d.copy_rows(state, [r]) for r in range(rows)]
    before = torch.get_num_threads()
    torch.set_num_threads(threads)  # the native products split their outputs over torch's thread count
    try:
        logits = d.step(state, tokens)
        for r, single in enumerate(alone):
            assert torch.equal(d.step(single, tokens[r : r + 1])[0], logits[r])
            assert torch.equal(single.conv[:, 0], state.conv[:, r]) and torch.equal(single.ssm[:, 0], state.ssm[:, r])
    finally:
        torch.set_num_threads(before)


def test_torch_step_is_not_declared_row_invariant():
    assert not drafter("tiny-torch").steps_row_invariant
    assert not MambaDrafter(perturbed_mamba(MambaConfig(**TINY)).float(), native=False).steps_row_invariant


# ----- the slot pool of root states (mamba_state.StateSlots) -----


def test_slots_are_handed_out_released_and_viewed_in_place():
    d = drafter("tiny")
    slots = StateSlots(d, 3)
    assert [slots.acquire() for _ in range(3)] == [0, 1, 2] and slots.acquire() is None
    slots.release(1)
    slots.release(1)  # twice: no-op
    assert slots.free_slots == 1 and slots.acquire() == 1
    one = slots.state(2)
    assert one.rows == 1 and one.conv.is_contiguous() and one.ssm.is_contiguous()
    one.ssm.fill_(3.0)  # a view: the pool holds what the state holds
    rows = slots.rows()
    assert rows.rows == 3 and torch.equal(rows.ssm[:, 2], one.ssm[:, 0]) and float(rows.ssm[:, 1].abs().sum()) == 0
    with pytest.raises(ValueError, match="at least one slot"):
        StateSlots(d, 0)


def slotted_sessions(d: MambaDrafter, n: int, slots: StateSlots) -> list[DrafterSession]:
    return [DrafterSession(d, prompt(i, d.vocab_size), d.vocab_size + (0, 3, -2)[i % 3], slots=slots)
            for i in range(n)]  # fmt: skip


def test_root_states_in_slots_draft_and_commit_as_states_of_their_own(named_drafter, monkeypatch):
    """Sessions whose roots live in a slot pool (all of them, or all but two when the pool runs out: those take the
    batch's other path) give every draft, random draw and commit of sessions with states of their own; at depth 1 the
    roots' rows come from the pool in one gather."""
    d = named_drafter
    for size in (len(MIX), len(MIX) - 2):
        slots = StateSlots(d, size)
        slotted, own = slotted_sessions(d, len(MIX), slots), sessions(d, len(MIX))
        assert [s.slot for s in slotted] == [*range(size), *[None] * (len(MIX) - size)]
        for round_ in range(3):
            batch, single = requests(slotted, 10 * round_), requests(own, 10 * round_)
            sources = []
            copy_rows = d.copy_rows
            monkeypatch.setattr(d, "copy_rows", lambda src, *a, **k: sources.append(src) or copy_rows(src, *a, **k))
            drafts = draft_many(batch)
            monkeypatch.undo()
            if d.steps_row_invariant:  # one batch: its first copy reads the pool itself, or the roots' cat
                assert (sources[0].ssm.data_ptr() == slots.ssm.data_ptr()) == (size == len(MIX))
            for a, b, ra, rb in zip(drafts, draft_many(single), batch, single):
                assert_same_draft(a, b)
                assert torch.equal(ra.generator.get_state(), rb.generator.get_state())
            for i, (a, b, draft) in enumerate(zip(slotted, own, drafts)):
                v = verdict(draft, a.vocab_size, seed=round_ * 31 + i)
                a.commit(v)
                b.commit(v)
                assert torch.equal(a.root_logits, b.root_logits)
                assert torch.equal(a.root_state.ssm, b.root_state.ssm) and torch.equal(a.root_state.conv,
                                                                                       b.root_state.conv)
                if a.slot is not None:  # the root is still the slot, advanced in place
                    assert a.root_state.ssm.data_ptr() == slots.state(a.slot).ssm.data_ptr()


def test_a_closed_or_collected_session_gives_its_slot_back():
    d = drafter("tiny")
    slots = StateSlots(d, 2)
    a, b = slotted_sessions(d, 2, slots)
    assert slots.free_slots == 0 and DrafterSession(d, [1, 2], d.vocab_size, slots=slots).slot is None
    a.close()
    a.close()
    assert slots.free_slots == 1
    del b
    gc.collect()
    assert slots.free_slots == 2
