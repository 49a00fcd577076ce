"""The target's piecewise forward (models/target/step_graphs.py) on CPU: the pieces run eagerly through the graphs'
buffers (capture=False), so padding, the buffers' reuse across forwards and the attention between pieces are checked
here; tests/engine/test_cuda_batching.py replays them as CUDA graphs."""

from __future__ import annotations

import pytest
import torch

from ray_specdec.config import SamplingParams, TreeConfig
from ray_specdec.engine.llm import SpeculativeEngine
from ray_specdec.models.target.model import Segment, TargetModel
from ray_specdec.models.target.step_graphs import PiecewiseGraphs
from ray_specdec.speculation.tree import build_tree
from tests.helpers.inputs import random_prompt
from tests.helpers.models import tiny_gpt_neox, tiny_llama, tiny_mamba

TREES = [(), (1,), (2, 2, 1), (3, 2, 1)]


def targets(make, buckets, kv_pool=True, fused=False):
    """The same float64 model with the pieces (eager, through the buffers; fused: pooled forwards with the pooled
    attention's reference between them) and without: each its own caches."""
    model = make(torch.float64, max_positions=1024, seed=4)
    pieces = TargetModel(model, lean=True, batch_invariant=False, kv_pool=kv_pool)
    plain = TargetModel(model, lean=True, batch_invariant=False, kv_pool=kv_pool)
    graphs = PiecewiseGraphs(pieces._lean, buckets=buckets, capture=False, fused=fused)
    pieces._lean.graphs = graphs
    for t in (pieces, plain):
        t.one_forward = True  # the CUDA path: prefill chunks in the verify rows' forward
    return pieces, plain, graphs


def count_runs(graphs: PiecewiseGraphs, monkeypatch, fused: bool = False) -> list[int]:
    """Rows of every forward through the pieces (fused: through the fused forward only)."""
    rows = []
    name = "run_fused" if fused else "run"
    original = getattr(graphs, name)

    def counted(input_ids, *args):
        rows.append(input_ids.shape[1])
        return original(input_ids, *args)

    monkeypatch.setattr(graphs, name, counted)
    return rows


@pytest.mark.parametrize("make", [tiny_gpt_neox, tiny_llama], ids=["neox", "llama_gqa"])
@pytest.mark.parametrize("kv_pool, fused", [(True, False), (False, False), (True, True)],
                         ids=["pooled", "own_caches", "fused"])  # fmt: skip
def test_the_pieces_compute_the_eager_forward(make, kv_pool, fused, monkeypatch):
    """Steps of four verifies and a prefill chunk, in buckets that pad them or fit them exactly, after a bigger
    forward has left its rows in the buffers: the logits and the caches are the eager forward's. Fused: every forward
    over pooled caches attends through the pooled attention (its reference here) and writes its K/V there."""
    trees = [build_tree(TreeConfig(b).index_paths()) for b in TREES]
    rows = sum(1 + t.num_nodes for t in trees)  # the verify rows of a step (30); a 40-token chunk beside them
    pieces, plain, graphs = targets(make, buckets=(8, rows + 40, 512), kv_pool=kv_pool, fused=fused)
    runs = count_runs(graphs, monkeypatch, fused)
    contexts = [1, 17, 150, 300]
    caches = [pieces.new_cache(500) for _ in contexts]
    mine = [plain.new_cache(500) for _ in contexts]
    for i, (context, cache, other) in enumerate(zip(contexts, caches, mine)):
        prompt = torch.tensor(random_prompt(context, seed=i))
        pieces.prefill(cache, prompt)  # 300 rows: a padded forward through the pieces, filling the buffers
        plain.prefill(other, prompt)
    late, late_own = pieces.new_cache(500), plain.new_cache(500)  # a prompt that prefills during the verifies
    for step in range(4):
        g = torch.Generator().manual_seed(step)
        segments = [torch.randint(4, 128, (1 + t.num_nodes,), generator=g) for t in trees]
        chunk = [Segment(late, torch.randint(4, 128, (40,), generator=g))] if step % 2 == 0 else []
        chunk_own = [Segment(late_own, s.tokens) for s in chunk]
        got = pieces.forward_batch([Segment(c, s, t) for c, s, t in zip(caches, segments, trees)] + chunk)
        want = plain.forward_batch([Segment(c, s, t) for c, s, t in zip(mine, segments, trees)] + chunk_own)
        assert runs[-1] == rows + len(chunk) * 40
        for cache, other, tree, a, b in zip(caches, mine, trees, got, want):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
            assert torch.equal(a.argmax(-1), b.argmax(-1))
            keep = [0] + ([1 + step % tree.num_nodes] if tree.num_nodes else [])
            pieces.commit(cache, keep)
            plain.commit(other, keep)
            for x, y in zip(cache.kv.layers, other.kv.layers):
                torch.testing.assert_close(x.keys, y.keys, rtol=1e-12, atol=1e-12)
                torch.testing.assert_close(x.values, y.values, rtol=1e-12, atol=1e-12)
    assert sorted({graphs.bucket(r) for r in runs}) == [8, rows + 40, 512]  # verifies padded (30) and not (70)


@pytest.mark.parametrize("make", [tiny_gpt_neox, tiny_llama], ids=["neox", "llama_gqa"])
def test_an_unpadded_forward_is_the_eager_forward_bit_for_bit(make):
    """Where a forward fills its bucket, the pieces run the eager forward's operations on the same rows."""
    tree = build_tree(TreeConfig((3, 2, 1)).index_paths())  # 16 rows
    pieces, plain, graphs = targets(make, buckets=(16, 64, 128))
    caches = [pieces.new_cache(200), plain.new_cache(200)]
    prompt = torch.tensor(random_prompt(64, seed=3))
    for target, cache in zip((pieces, plain), caches):
        target.prefill(cache, prompt)
    for x, y in zip(caches[0].kv.layers, caches[1].kv.layers):
        assert torch.equal(x.keys, y.keys) and torch.equal(x.values, y.values)
    tokens = torch.randint(4, 128, (16,), generator=torch.Generator().manual_seed(1))
    got, want = (t.forward_batch([Segment(c, tokens, tree)])[0] for t, c in zip((pieces, plain), caches))
    assert torch.equal(got, want)


@pytest.mark.parametrize("fused", [False, True], ids=["pieces", "fused"])
def test_float64_greedy_through_the_pieces_is_each_requests_own(fused, monkeypatch):
    """A mixed batch through the scheduler (prompts of 3-700 tokens, trees of several shapes and none): forwards of
    every size, padded into small buckets or, past the largest, eager; every request gets its plain greedy tokens."""
    pieces, plain, graphs = targets(tiny_llama, buckets=(4, 16, 48), fused=fused)
    runs = count_runs(graphs, monkeypatch, fused)
    drafter = tiny_mamba(torch.float64, seed=5)
    prompts = [random_prompt(n, seed=60 + n) for n in (3, 40, 700, 120, 9, 31)]
    params = [SamplingParams(max_new_tokens=n) for n in (9, 40, 17, 33, 24, 20)]
    trees = [TreeConfig((2, 2, 1)), None, TreeConfig.parse("none"), TreeConfig((1, 1, 1, 1)), TreeConfig((3, 2, 1)),
             TreeConfig((4,))]  # fmt: skip
    together = SpeculativeEngine(pieces, drafter, TreeConfig((2, 2, 1))).generate_many(prompts, params, trees)
    assert {graphs.bucket(r) for r in runs} == {4, 16, 48}
    for prompt, p, gen in zip(prompts, params, together):
        assert gen.token_ids == SpeculativeEngine(plain, None).generate(prompt, p).token_ids


def test_buckets_and_where_graphs_are_off():
    model = tiny_gpt_neox(torch.float64, seed=1)
    target = TargetModel(model, lean=True, batch_invariant=False)
    graphs = PiecewiseGraphs(target._lean, buckets=(16, 8, 32), capture=False)
    assert [graphs.bucket(n) for n in (1, 8, 9, 16, 17, 32)] == [8, 8, 16, 16, 32, 32]
    assert graphs.covers(32) and not graphs.covers(33) and not graphs.covers(0)
    with pytest.raises(ValueError, match="no graph for 33 rows"):
        graphs.bucket(33)
    with pytest.raises(ValueError, match="need a CUDA device"):
        PiecewiseGraphs(target._lean)
    assert target.cuda_graphs_why == "CUDA graphs run on CUDA devices, not cpu"
    assert TargetModel(model, cuda_graphs=False).cuda_graphs_why == "cuda_graphs=False"
    assert TargetModel(model, lean=False).cuda_graphs_why.startswith("the lean forward is off")
    with pytest.raises(RuntimeError, match="cuda_graphs=True but CUDA graphs run on CUDA devices"):
        TargetModel(model, cuda_graphs=True)
    invariant = TargetModel(tiny_gpt_neox(torch.float32, seed=1))
    assert invariant.batch_invariant
    with pytest.raises(ValueError, match="batch-invariant"):
        PiecewiseGraphs(invariant._lean, capture=False)
