"""`TargetModel.one_forward`: a step's prefill segments and verify rows in one lean forward (on by default where
nothing is batch-invariant anyway: CUDA). Forced on here on CPU in float64, where it must compute what HF's forward
computes segment by segment: the same logits to rounding, and K/V that later verifies read back the same."""

from __future__ import annotations

import pytest
import torch

from ray_specdec.config import TreeConfig
from ray_specdec.models.target.model import Segment, TargetModel
from ray_specdec.speculation.tree import build_tree
from tests.helpers.inputs import random_prompt
from tests.helpers.models import tiny_gpt_neox, tiny_llama

TREES = [(), (1,), (2, 2, 1), (3, 2, 1), (1, 1, 1, 1)]


def test_off_on_cpu_and_where_the_forward_is_batch_invariant():
    assert not TargetModel(tiny_gpt_neox(torch.float64)).one_forward  # CPU: each prefill chunk runs alone
    assert not TargetModel(tiny_gpt_neox(torch.float64), lean=False).one_forward


@pytest.mark.parametrize("make_target", [tiny_gpt_neox, tiny_llama], ids=["neox", "llama"])
def test_prefills_and_verifies_in_one_forward_compute_hfs_forward(make_target):
    target = TargetModel(make_target(torch.float64, max_positions=2048, seed=5))
    target.one_forward = True
    hf = TargetModel(target.model, lean=False)
    calls = []
    forward = target._lean.forward
    target._lean.forward = lambda *a, **k: calls.append(1) or forward(*a, **k)
    trees = [build_tree(TreeConfig(b).index_paths()) for b in TREES]
    # requests 0-4 decode from cached prompts; 5-8 prefill while they do: from empty caches (one token; 700 tokens,
    # past the CPU chunk) and after cached rows (one token; 300 tokens)
    caches, hf_caches = [target.new_cache(1500) for _ in range(9)], [hf.new_cache(1500) for _ in range(9)]
    for i, context in enumerate([1, 17, 64, 150, 300, 0, 0, 40, 90]):
        prompt = torch.tensor(random_prompt(context, seed=i))
        for model, store in ((target, caches), (hf, hf_caches)):
            model.prefill(store[i], prompt)
    prefills = [torch.tensor(random_prompt(n, seed=10 + n)) for n in (1, 700, 1, 300)]
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        drafts = [torch.randint(4, 128, (1 + t.num_nodes,), generator=g) for t in trees]
        segments = [Segment(c, d, t) for c, d, t in zip(caches, drafts, trees)]
        hf_segments = [Segment(c, d, t) for c, d, t in zip(hf_caches, drafts, trees)]
        if step == 0:  # the prefills share the first step with the verifies
            segments += [Segment(c, p) for c, p in zip(caches[5:], prefills)]
            hf_segments += [Segment(c, p) for c, p in zip(hf_caches[5:], prefills)]
        else:  # then they decode too: one-row trees after their prompts
            segments += [Segment(c, d[:1], trees[0]) for c, d in zip(caches[5:], drafts)]
            hf_segments += [Segment(c, d[:1], trees[0]) for c, d in zip(hf_caches[5:], drafts)]
        before = len(calls)
        got = target.forward_batch(segments)
        assert len(calls) == before + 1  # every request's rows in one forward
        for segment, hf_segment, logits in zip(segments, hf_segments, got):
            want = hf.forward_batch([hf_segment])[0]
            assert segment.cache.length == hf_segment.cache.length
            if want is None:
                assert logits is None
                continue
            torch.testing.assert_close(logits, want, rtol=1e-10, atol=1e-10)
            keep = [0] + ([1] if segment.tree.num_nodes else [])
            target.commit(segment.cache, keep)
            hf.commit(hf_segment.cache, keep)


@pytest.mark.parametrize("make_target", [tiny_gpt_neox, tiny_llama], ids=["neox", "llama"])
def test_a_chunk_and_the_verify_after_it_on_one_cache_in_one_forward(make_target):
    """A prompt's last chunk and its first round (the scheduler's), beside other requests' verifies and chunks: one
    forward, and the verify's logits and the cache are HF's chunk forward, then its verify forward."""
    target = TargetModel(make_target(torch.float64, seed=8))
    target.one_forward = True
    hf = TargetModel(target.model, lean=False)
    calls = []
    forward = target._lean.forward
    target._lean.forward = lambda *a, **k: calls.append(1) or forward(*a, **k)
    tree = build_tree(TreeConfig((2, 1)).index_paths())
    history, chunk = torch.tensor(random_prompt(20, seed=1)), torch.tensor(random_prompt(11, seed=2))
    rows = torch.tensor(random_prompt(1 + tree.num_nodes, seed=3))
    other = torch.tensor(random_prompt(2, seed=4))
    mine, theirs, fresh = target.new_cache(64), target.new_cache(64), target.new_cache(64)
    target.prefill(mine, history)
    target.prefill(theirs, history)
    got = target.forward_batch([Segment(theirs, other, build_tree(TreeConfig((1,)).index_paths())),
                                Segment(mine, chunk), Segment(fresh, chunk), Segment(mine, rows, tree)])
    assert len(calls) == 3 and got[1] is None and got[2] is None  # two prefills above, then one forward
    alone = hf.new_cache(64)
    hf.prefill(alone, torch.cat([history, chunk]))
    want = hf.forward_batch([Segment(alone, rows, tree)])[0]
    torch.testing.assert_close(got[3], want, rtol=1e-10, atol=1e-10)
    target.commit(mine, [0, 2])
    hf.commit(alone, [0, 2])
    assert mine.length == alone.length == 20 + 11 + 2


def test_a_step_of_prefills_alone_returns_no_logits():
    target = TargetModel(tiny_llama(torch.float64, seed=6))
    target.one_forward = True
    caches = [target.new_cache(64) for _ in range(2)]
    assert target.forward_batch([Segment(c, torch.tensor(random_prompt(9, seed=i))) for i, c in enumerate(caches)]) \
        == [None, None]  # fmt: skip
    assert [c.length for c in caches] == [9, 9] and all(c.pending_rows == 0 for c in caches)


def test_engine_batches_in_one_forward_give_each_requests_own_greedy_tokens():
    """Mixed prompt lengths (one past 512 tokens), max_tokens and trees through the scheduler, every step one forward:
    float64 greedy tokens are each request's plain decoding alone."""
    from ray_specdec.config import SamplingParams
    from ray_specdec.engine.llm import SpeculativeEngine
    from tests.helpers.models import tiny_mamba

    target = TargetModel(tiny_gpt_neox(torch.float64, max_positions=1024, seed=7))
    target.one_forward = True
    calls = []
    forward = target._lean.forward
    target._lean.forward = lambda *a, **k: calls.append(1) or forward(*a, **k)
    prompts = [random_prompt(n, seed=20 + n) for n in (1, 30, 700, 5, 120, 64, 300, 9)]
    params = [SamplingParams(max_new_tokens=n) for n in (20, 7, 33, 16, 25, 12, 30, 18)]
    trees = [TreeConfig(b) if b != "none" else TreeConfig.parse("none")
             for b in [(2, 2, 1), (1, 1, 1, 1), "none", (3, 2), (4,), (1,), (2, 2, 1, 1), (3, 2, 1)]]  # fmt: skip
    engine = SpeculativeEngine(target, tiny_mamba(), TreeConfig((2, 1)))
    together = engine.generate_many(prompts, params, trees)
    assert len(calls) == engine.scheduler.steps  # one forward per step
    plain = TargetModel(target.model, lean=False)
    for prompt, p, gen in zip(prompts, params, together):
        assert gen.token_ids == SpeculativeEngine(plain, None).generate(prompt, p).token_ids
