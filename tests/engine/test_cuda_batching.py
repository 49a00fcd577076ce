"""Continuous batching on a CUDA device (skipped without one).

On CUDA the lean forward (models/target/lean_forward.py) carries the verify rows of every request of a step in one
forward: each weight is one cuBLAS product for all of them, and the requests' verify rows attend over their caches,
ranges of one pool per layer, in one sdpa call per layer (models/target/kv_pool.py; with caches of their own, one call
per request). There is no batch-invariant path on CUDA (cuBLAS picks its kernel by the row count, so a row's rounding
may depend on the rows beside it), so what holds there is:

- the batched forward computes what HF's forward computes request by request (float64: to rounding; same argmax);
- float64: a request's greedy tokens are the same alone and in a batch of mixed prompts, lengths, max_tokens and
  trees (and are the target's plain greedy decoding);
- float32: a batch leaves a request's plain greedy tokens only at near-ties (DESIGN.md, "Floating point").
"""

from __future__ import annotations

import itertools

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from ray_specdec.config import SamplingParams, TreeConfig  # noqa: E402
from ray_specdec.defaults import DEFAULT_DRAFTER, DEFAULT_TARGET  # noqa: E402
from ray_specdec.engine.llm import SpeculativeEngine  # noqa: E402
from ray_specdec.models.drafter.mamba import MambaDrafter  # noqa: E402
from ray_specdec.models.target.model import Segment, TargetModel  # noqa: E402
from ray_specdec.training.corpus import heldout_prompts  # noqa: E402
from ray_specdec.speculation.tree import build_tree  # noqa: E402
from tests.helpers.inputs import random_prompt  # noqa: E402
from tests.helpers.models import tiny_gpt_neox, tiny_llama  # noqa: E402

CUDA = torch.device("cuda")
# per request of a mixed batch, cycled: the tree (None: the engine's policy) and max_tokens
MIXED_TREES = [None, TreeConfig((2, 2, 1, 1)), TreeConfig.parse("none"), TreeConfig((1, 1, 1, 1)),
               TreeConfig((3, 2, 2, 1, 1)), TreeConfig((4,))]  # fmt: skip
MIXED_MAX_TOKENS = [16, 40, 64, 24, 33]


def count_calls(obj, name: str) -> list[int]:
    """Wrap obj.name so that every call appends to the returned list."""
    calls, original = [], getattr(obj, name)

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    setattr(obj, name, counted)
    return calls


@pytest.mark.parametrize("make_target", [tiny_gpt_neox, tiny_llama], ids=["neox", "llama"])
def test_one_lean_forward_carries_every_requests_verify_rows_on_cuda(make_target):
    target = TargetModel(make_target(torch.float64, max_positions=512, seed=4).to(CUDA))
    assert target.lean_why is None and not target.batch_invariant
    hf = TargetModel(target.model, lean=False)  # the same weights, HF's forward one request at a time
    trees = [build_tree(TreeConfig(b).index_paths()) for b in [(), (1,), (2, 2, 1), (3, 2, 1), (1, 1, 1, 1)]]
    contexts = [1, 17, 64, 150, 300]
    caches, hf_caches = [target.new_cache(400) for _ in contexts], [hf.new_cache(400) for _ in contexts]
    for i, (context, cache, hf_cache) in enumerate(zip(contexts, caches, hf_caches)):
        prompt = torch.tensor(random_prompt(context, seed=i))
        target.prefill(cache, prompt)
        hf.prefill(hf_cache, prompt)
    lean_calls = count_calls(target._lean, "forward")
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        segments = [torch.randint(4, 128, (1 + t.num_nodes,), generator=g) for t in trees]
        got = target.forward_batch([Segment(c, s, t) for c, s, t in zip(caches, segments, trees)])
        assert len(lean_calls) == step + 1  # one forward for all five requests
        for cache, hf_cache, tokens, tree, logits in zip(caches, hf_caches, segments, trees, got):
            want = hf.forward_batch([Segment(hf_cache, tokens, tree)])[0]
            assert logits.device.type == "cuda" and logits.shape == want.shape
            torch.testing.assert_close(logits, want, rtol=1e-9, atol=1e-9)
            assert torch.equal(logits.argmax(-1), want.argmax(-1))
            keep = [0] + ([1] if tree.num_nodes else [])  # the root and the first node: commits move rows
            target.commit(cache, keep)
            hf.commit(hf_cache, keep)


@pytest.fixture(scope="module")
def shipped64():
    target = TargetModel.from_pretrained(str(DEFAULT_TARGET), dtype=torch.float64, device="cuda")
    drafter = MambaDrafter.from_pretrained(str(DEFAULT_DRAFTER), dtype=torch.float64, device="cuda")
    return target, drafter


def mixed_requests(tokenizer) -> tuple[list[list[int]], list[SamplingParams], list[TreeConfig | None]]:
    """14 requests: short prompts (20-300 tokens) and two long ones (1-2k), mixed max_tokens and trees."""
    short = heldout_prompts(12, 20, 300, seed=31, tokenizer=tokenizer)
    long = heldout_prompts(2, 1000, 2000, seed=32, tokenizer=tokenizer)
    prompts = [p.token_ids for p in short[:6] + long[:1] + short[6:] + long[1:]]
    params = [SamplingParams(max_new_tokens=n) for n, _ in zip(itertools.cycle(MIXED_MAX_TOKENS), prompts)]
    trees = [t for t, _ in zip(itertools.cycle(MIXED_TREES), prompts)]
    return prompts, params, trees


def test_float64_greedy_is_the_same_alone_and_in_a_mixed_batch_on_cuda(shipped64):
    target, drafter = shipped64
    assert target.lean_why is None
    prompts, params, trees = mixed_requests(target.tokenizer)
    engine = SpeculativeEngine(target, drafter, TreeConfig((2, 2, 1, 1)))
    together = engine.generate_many(prompts, params, trees)
    drafted = 0
    for prompt, p, tree, gen in zip(prompts, params, trees, together):
        alone = SpeculativeEngine(target, None).generate(prompt, p).token_ids  # plain decoding, one request
        assert gen.token_ids == alone, (len(prompt), p.max_new_tokens, tree)
        drafted += sum(gen.stats.accepted_lengths) - gen.stats.rounds
    assert drafted > sum(p.max_new_tokens for p in params) // 5, "the batch must have accepted drafts"


def test_float32_batches_leave_plain_decoding_only_at_near_ties_on_cuda():
    """Where a request's greedy tokens in the batch first differ from its plain decoding alone, the target's logits
    there (computed alone, float64 of float32) hold both tokens within 1e-3 of each other."""
    target = TargetModel.from_pretrained(str(DEFAULT_TARGET), dtype=torch.float32, device="cuda")
    drafter = MambaDrafter.from_pretrained(str(DEFAULT_DRAFTER), dtype=torch.float32, device="cuda")
    prompts, params, trees = mixed_requests(target.tokenizer)
    together = SpeculativeEngine(target, drafter, TreeConfig((2, 2, 1, 1))).generate_many(prompts, params, trees)
    same = 0
    for prompt, p, gen in zip(prompts, params, together):
        plain = SpeculativeEngine(target, None).generate(prompt, p).token_ids
        if gen.token_ids == plain:
            same += 1
            continue
        at = next(i for i, (a, b) in enumerate(zip(gen.token_ids, plain)) if a != b)
        with torch.inference_mode():
            logits = target.model(torch.tensor([prompt + plain[:at]], device=CUDA)).logits[0, -1].double()
        gap = abs(float(logits[plain[at]] - logits[gen.token_ids[at]]))
        assert gap <= 1e-3, (len(prompt), at, gap)
    assert same >= len(prompts) // 2, "near-ties should be rare: most requests must match plain decoding exactly"


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "pieces"])
@pytest.mark.parametrize("make_target", [tiny_gpt_neox, tiny_llama], ids=["neox", "llama"])
def test_graphed_forwards_compute_the_eager_forwards_on_cuda(make_target, fused):
    """The target's CUDA graphs (models/target/step_graphs.py), captured at load for every bucket, replay what the eager
    lean forward computes (float64: to rounding, same argmax; caches too), over steps of five verifies, with and without
    a prefill chunk beside them, and past the largest bucket (eager). Fused (the default over pooled caches): each
    forward is one graph, its attention the Triton kernel of kernels/pooled_attention.py."""
    model = make_target(torch.float64, max_positions=1024, seed=4).to(CUDA)
    graphed, eager = TargetModel(model), TargetModel(model, cuda_graphs=False)
    assert graphed.cuda_graphs_why is None and eager.cuda_graphs_why == "cuda_graphs=False"
    graphs = graphed._lean.graphs
    assert sorted(graphs._graphs) == list(graphs.buckets)  # every bucket captured at load
    graphs.fused = fused
    runs = count_calls(graphs, "run_fused" if fused else "run")
    trees = [build_tree(TreeConfig(b).index_paths()) for b in [(), (1,), (2, 2, 1), (3, 2, 1), (1, 1, 1, 1)]]
    contexts = [1, 17, 64, 150, 700]  # 700: a prefill past the largest bucket, eager
    caches = [graphed.new_cache(900) for _ in contexts]
    mine = [eager.new_cache(900) for _ in contexts]
    for i, (context, cache, other) in enumerate(zip(contexts, caches, mine)):
        prompt = torch.tensor(random_prompt(context, seed=i))
        graphed.prefill(cache, prompt)
        eager.prefill(other, prompt)
    late, late_own = graphed.new_cache(900), eager.new_cache(900)
    for step in range(4):
        g = torch.Generator().manual_seed(step)
        segments = [torch.randint(4, 128, (1 + t.num_nodes,), generator=g) for t in trees]
        chunk = [torch.randint(4, 128, (40,), generator=g)] if step % 2 == 0 else []
        got = graphed.forward_batch([Segment(c, s, t) for c, s, t in zip(caches, segments, trees)]
                                    + [Segment(late, x) for x in chunk])  # fmt: skip
        want = eager.forward_batch([Segment(c, s, t) for c, s, t in zip(mine, segments, trees)]
                                   + [Segment(late_own, x) for x in chunk])  # fmt: skip
        for cache, other, tree, a, b in zip(caches, mine, trees, got, want):
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)
            assert torch.equal(a.argmax(-1), b.argmax(-1))
            keep = [0] + ([1 + step % tree.num_nodes] if tree.num_nodes else [])
            graphed.commit(cache, keep)
            eager.commit(other, keep)
            for x, y in zip(cache.kv.layers, other.kv.layers):
                torch.testing.assert_close(x.keys, y.keys, rtol=1e-9, atol=1e-9)
    assert len(runs) >= 4 + len(contexts) - 1  # every step and every prefill but the 700-token one replayed graphs


@pytest.mark.parametrize("pool", [None, False], ids=["pooled", "own_caches"])
def test_masks_reach_sdpa_without_being_padded_again_at_every_layer(pool):
    """The masks of verify rows and prefill spans are handed to sdpa aligned (TreeMasks, aligned_mask, and the pooled
    batch's mask): torch pads and copies a misaligned mask at every call, i.e. per layer and request. Pooled caches
    (the default on CUDA) attend in one sdpa call per layer for all verify rows; caches of their own, one per request.
    (Written after the third GPU session's time ran out, from its profile.)"""
    target = TargetModel(tiny_llama(torch.bfloat16, max_positions=512, seed=8).to(CUDA), kv_pool=pool,
                         cuda_graphs=False)  # (graphs over pooled caches attend in their own kernel: no sdpa)
    assert target.one_forward and (target.kv_pool_why is None) == (pool is None)
    caches = [target.new_cache(400) for _ in range(3)]
    for i, cache in enumerate(caches):
        target.prefill(cache, torch.tensor(random_prompt(37 + 50 * i, seed=i)))
    tree = build_tree(TreeConfig((2, 1)).index_paths())
    segments = [Segment(c, torch.tensor([5, 6, 7, 8, 9]), tree) for c in caches[:2]]
    segments.append(Segment(caches[2], torch.tensor(random_prompt(23, seed=9))))  # a prefill after cached rows
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        target.forward_batch(segments)
        torch.cuda.synchronize()
    names = [event.name for event in prof.events()]
    calls = names.count("aten::scaled_dot_product_attention")
    assert calls == 2 * (2 if pool is None else 3)  # per layer: the pooled verify rows and the prefill, or each alone
    assert not [name for name in names if "constant_pad_nd" in name]
