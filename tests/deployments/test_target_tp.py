"""The target side of serving: TargetWorker without Ray, and RankGroup over real Ray rank actors under the scheduler.

A worker gets a step's work in one call (`run(StepWork)`: commits, releases, allocations, one batched forward) and
must give exactly the logits of the in-process `TargetModel.forward_batch`. TP=2 runs two rank actors in one
STRICT_PACK placement group on a local Ray (gloo, DeepSpeed AutoTP) stepped by the same `Scheduler` the engine runs:
a batch of concurrent requests of mixed lengths and trees must give exactly the greedy tokens of TP=1, and so must
the same batch again with every prompt chunk copied from the prefix cache (each rank keeps its own shard of them).
"""

from __future__ import annotations

import numpy as np
import pytest
import ray
import torch
from ray.util.placement_group import placement_group_table

from deployments.engine import RankGroup
from ray_specdec import env
from ray_specdec.config import SamplingParams, TreeConfig
from ray_specdec.engine.scheduler import Scheduler
from ray_specdec.engine.scheduler_config import SchedulerConfig
from ray_specdec.engine.target_backend import LocalTarget, SegmentSpec, StepWork
from ray_specdec.models.drafter.mamba import MambaDrafter
from ray_specdec.models.target.model import Segment, TargetModel
from ray_specdec.serving.target_worker import TargetWorker, check_tp_dtype, narrowed, shipped, widened
from ray_specdec.speculation.tree import build_tree
from tests.helpers.bigram import word_tokenizer
from tests.helpers.models import tiny_gpt_neox, tiny_llama
from tests.helpers.reference import greedy_margin

# 4 query heads each (the Llama has 2 KV heads): both split evenly over 2 ranks.
FAMILIES = {"gpt_neox": tiny_gpt_neox, "llama_gqa": tiny_llama}
VOCAB = 128
# Two branches at depth 1, a chain below each: rows 1 -> 3 -> 5 and 2 -> 4 -> 6 (BFS order).
TREE_PATHS = ((0,), (1,), (0, 0), (1, 0), (0, 0, 0), (1, 0, 0))
# Mixed prompt lengths (two of them span several prefill chunks of PREFILL_CHUNK), max_new_tokens and trees
# (None: the scheduler's policy picks).
BATCH = [(3, 24, None), (40, 30, "3,2,1"), (1, 16, "none"), (90, 20, "1,1,1,1"), (17, 28, "2,2,1"), (8, 24, None)]
PREFILL_CHUNK = 32
# DeepSpeed refuses float64 on CPU, so TP runs in float32, where splitting the matmuls reorders sums (logits move by
# ~1e-6). Greedy ids are compared only where the TP=1 path's top-2 logits are further apart than this.
MARGIN = 1e-3


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory) -> dict[tuple[str, torch.dtype], str]:
    """Every family in float32 and float64, saved like a real checkpoint: workers load from a path."""
    dirs = {}
    for family, build in FAMILIES.items():
        for dtype in (torch.float32, torch.float64):
            path = tmp_path_factory.mktemp(f"{family}-{dtype}".replace("torch.", ""))
            build(dtype).save_pretrained(path)
            dirs[family, dtype] = str(path)
    return dirs


@pytest.fixture(scope="module")
def ray_cluster():
    ray.init(num_cpus=2, include_dashboard=False)
    yield
    ray.shutdown()


def step_works(prompts: list[list[int]]) -> list[StepWork]:
    """Three steps for two requests: allocate and prefill both; verify a tree and a bare root; commit a non-prefix
    path (the cache compacts), release one, verify again."""
    (a, b), tokens = prompts, torch.tensor([9, 11, 13, 15, 17, 19])
    return [
        StepWork(allocations=[("a", 64), ("b", 64)],
                 segments=[SegmentSpec("a", torch.tensor(a[:-1])), SegmentSpec("b", torch.tensor(b[:-1]))]),
        StepWork(segments=[SegmentSpec("a", torch.cat([torch.tensor(a[-1:]), tokens]), TREE_PATHS),
                           SegmentSpec("b", torch.tensor(b[-1:]), ())]),
        StepWork(commits=[("a", (0, 2, 4)), ("b", (0,))], releases=["b"],
                 segments=[SegmentSpec("a", torch.tensor([21, 23, 25, 27, 29, 31, 33]), TREE_PATHS)]),
    ]  # fmt: skip


def forward_batch_reference(model, works: list[StepWork]) -> list[list[torch.Tensor | None]]:
    """The same steps on TargetModel's own API: new_cache, commit, forward_batch."""
    target, caches, out = TargetModel(model), {}, []
    for work in works:
        for request_id, keep in work.commits:
            target.commit(caches[request_id], keep)
        for request_id in work.releases:
            del caches[request_id]
        for request_id, capacity in work.allocations:
            caches[request_id] = target.new_cache(capacity)
        out.append(target.forward_batch([
            Segment(caches[s.request_id], s.tokens, None if s.paths is None else build_tree(s.paths))
            for s in work.segments
        ]))  # fmt: skip
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_worker_runs_the_steps_of_forward_batch(tiny_dirs, family):
    """tp_size 1, no Ray: the worker loaded from disk gives exactly the in-process forward_batch's logits."""
    works = step_works([[5, 17, 33, 12, 9, 40], [71, 4]])
    want = forward_batch_reference(FAMILIES[family](torch.float64), works)
    worker = TargetWorker(tiny_dirs[family, torch.float64], dtype="float64")
    for work, expected in zip(works, want, strict=True):
        got = [widened(x) for x in worker.run(work)]
        assert [g is None for g in got] == [e is None for e in expected]
        assert all(g is None or torch.equal(g, e) for g, e in zip(got, expected))
    assert [x.shape for x in want[1]] == [(7, VOCAB), (1, VOCAB)] and worker.request_ids() == ["a"]
    info = worker.info()
    assert (info["tp_size"], info["vocab_size"], info["dtype"]) == (1, VOCAB, "float64")
    with pytest.raises(KeyError, match="no cache for request 'b'"):
        worker.run(StepWork(segments=[SegmentSpec("b", torch.tensor([1]), ())]))


@pytest.mark.parametrize("family", FAMILIES)
def test_a_bfloat16_worker_ships_its_logits_in_half_the_bytes_exactly(tiny_dirs, family):
    """Rank 0 of a bfloat16 target ships its verify logits as bfloat16 (what the model computed); widened again they
    are the in-process forward_batch's float32 logits, bit for bit. Values a half dtype cannot hold stay float32."""
    works = step_works([[5, 17, 33, 12, 9, 40], [71, 4]])
    worker = TargetWorker(tiny_dirs[family, torch.float32], dtype="bfloat16")
    twin = TargetWorker(tiny_dirs[family, torch.float32], dtype="bfloat16")  # its target's own float32 logits
    compared = 0
    for work in works:
        for got, e in zip(worker.run(work), twin.caches.run(work), strict=True):
            if e is None:
                continue
            assert got.dtype == np.int16 and e.dtype == torch.float32  # bfloat16's bits (NumPy has no bfloat16)
            assert got.nbytes == e.numel() * 2 and torch.equal(widened(got), e)
            compared += 1
    assert compared == 3
    wide = torch.tensor([1.0, 1.0 + 2**-12])  # the second is no bfloat16
    assert narrowed(wide, torch.bfloat16) is wide and narrowed(wide, torch.float32) is wide
    assert narrowed(wide[:1], torch.float16).dtype == torch.float16 and widened(None) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.long])
def test_rank_zero_rows_cross_ray_as_arrays_bit_for_bit(ray_cluster, dtype):
    """What rank 0 returns travels as NumPy arrays (out of band through the object store, not pickled tensors) and
    comes back as the same bits, in a writable tensor of the loop's own; half precision comes back as float32."""
    torch.manual_seed(0)
    small, large = torch.randn(3, VOCAB), torch.randn(64, 4096)  # inline in the reply, and through the object store
    sent = [(x * 1000).to(dtype) if dtype == torch.long else x.to(dtype) for x in (small, large)]

    @ray.remote
    def rank_zero():
        return [shipped(x) for x in sent] + [None]

    got = [widened(x) for x in ray.get(rank_zero.remote())]
    assert got[-1] is None
    for g, x in zip(got, sent):
        half = x.dtype in (torch.bfloat16, torch.float16)
        assert g.dtype == (torch.float32 if half else x.dtype) and torch.equal(g, x.to(g.dtype))
        g.add_(1)  # the loop's own memory: writable


def test_tensor_parallel_refuses_float64_on_cpu(tiny_dirs):
    """DeepSpeed's CPU accelerator cannot shard float64; the worker says so before any rendezvous."""
    check_tp_dtype(torch.float32)
    with pytest.raises(ValueError, match="use tp_size=1 for torch.float64"):
        check_tp_dtype(torch.float64)
    with pytest.raises(ValueError, match="use tp_size=1 for torch.float64"):  # no peer ever joins: it must not wait
        TargetWorker(tiny_dirs["gpt_neox", torch.float64], dtype="float64", rank=0, world_size=2)


def batch_prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(4)  # a seed whose greedy paths hold no near-tie (MARGIN) in either family
    return [torch.randint(4, VOCAB, (n,), generator=g).tolist() for n, _, _ in BATCH]


def run_batch(backend, drafter: MambaDrafter, alone: bool = False) -> tuple[list[dict[str, list[int]]], int]:
    """Every request of BATCH added at once, the scheduler stepped until all finish; then the same batch again, its
    prompts now in the prefix cache -> (tokens per request of each run, prompt rows the cache gave). alone: one run,
    each request on its own (a scheduler of its own, stepped until it finishes before the next is added)."""
    def new_scheduler() -> Scheduler:
        config = SchedulerConfig(prefill_chunk=PREFILL_CHUNK, step_tokens=64)
        return Scheduler(backend, drafter, word_tokenizer(), TreeConfig((2, 1, 1)), config)

    scheduler = new_scheduler()
    runs = []
    for run in range(1 if alone else 2):
        out: dict[str, list[int]] = {}
        for i, (prompt, (_, max_new, tree)) in enumerate(zip(batch_prompts(), BATCH)):
            params = SamplingParams(max_new_tokens=max_new, ignore_eos=True)
            scheduler.add(f"{run}-{i}", prompt, params, None if tree is None else TreeConfig.parse(tree))
            out[str(i)] = []
            while alone and scheduler.has_work:
                for step_out in scheduler.step():
                    out[str(i)] += step_out.chunk.token_ids
            if alone:
                scheduler = new_scheduler()
        while scheduler.has_work:
            for step_out in scheduler.step():
                out[step_out.request_id.split("-")[1]] += step_out.chunk.token_ids
        runs.append(out)
    return runs, scheduler.prefix.hit_rows


def rank_paths(group: RankGroup) -> list[tuple[str | None, str | None, str | None]]:
    """Each rank's (lean_why, batch_invariant_why, native_attention_why): None where the path runs."""

    def paths(rank) -> tuple:  # nested: pickled by value into the rank actor
        t = rank.worker.target
        return t.lean_why, t.batch_invariant_why, t.native_attention_why

    return ray.get([rank.__ray_call__.remote(paths) for rank in group._ranks])


def verify_logits(group: RankGroup, prompts: list[list[int]], together: bool) -> list[torch.Tensor]:
    """Each prompt prefilled into a request of its own, then one verify tree per request: all in one step
    (together) or one step each -> rank 0's logits per request."""
    tag = "t" if together else "a"
    ids = [f"{tag}{i}" for i in range(len(prompts))]
    group.run(StepWork(allocations=[(i, 128) for i in ids],
                       segments=[SegmentSpec(i, torch.tensor(p[:-1])) for i, p in zip(ids, prompts)]))  # fmt: skip
    verifies = [SegmentSpec(i, torch.tensor(p[-1:] + [9, 11, 13, 15, 17, 19]), TREE_PATHS)
                for i, p in zip(ids, prompts)]  # fmt: skip
    if together:
        logits = group.run(StepWork(segments=verifies))
    else:
        logits = [group.run(StepWork(segments=[v]))[0] for v in verifies]
    group.run(StepWork(releases=ids))
    return logits


def assert_auto_tp_sharded(group: RankGroup, model) -> None:
    """Two ranks in one STRICT_PACK placement group, each holding a part of the model, not all of it."""
    table = placement_group_table(group._pg)
    assert table["strategy"] == "STRICT_PACK" and len(table["bundles"]) == 2

    def shard_summary(rank) -> tuple[set[str], int]:  # nested: pickled by value into the rank actor
        module = rank.worker.target.model
        return {type(m).__name__ for m in module.modules()}, sum(p.numel() for p in module.parameters())

    full = sum(p.numel() for p in model.parameters())
    for layer_kinds, params in ray.get([rank.__ray_call__.remote(shard_summary) for rank in group._ranks]):
        assert "LinearAllreduce" in layer_kinds and params < full


@pytest.mark.parametrize("family", FAMILIES)
def test_tp2_batch_gives_the_greedy_tokens_of_tp1(tiny_dirs, model_dirs, family, ray_cluster, monkeypatch):
    model = FAMILIES[family](torch.float32)
    path = tiny_dirs[family, torch.float32]
    drafter = MambaDrafter.from_pretrained(str(model_dirs[1]))
    target = TargetModel(model)
    (tp1, tp1_cached), hits = run_batch(LocalTarget(target), drafter)
    assert tp1_cached == tp1 and hits == sum(n - 1 for n, _, _ in BATCH)  # every prompt row of the second run cached
    for prompt, (i, tokens) in zip(batch_prompts(), tp1.items()):
        assert len(tokens) == BATCH[int(i)][1]
        assert greedy_margin(model, prompt, tokens) > MARGIN, "pick prompts whose greedy argmax is not a near-tie"
    assert len({t for tokens in tp1.values() for t in tokens}) > 10  # not one token over and over

    monkeypatch.setenv(env.COMPILED_STEPS.name, "1")  # steps as a compiled graph (the fault tests: a task per rank)
    group = RankGroup(path, tp_size=2, dtype=None, device="cpu", num_cpus_per_rank=0.5)
    try:
        assert_auto_tp_sharded(group, model)
        # every rank runs the lean forward over the step's rows, batch-invariant, verify rows through the native
        # attention (models/target/tp_shards.py: its row-parallel products summed in rank order)
        assert rank_paths(group) == [(None, None, None)] * 2
        (tp2, tp2_cached), tp2_hits = run_batch(group, drafter)  # the second run copies each rank's own shard
        (tp2_alone,), _ = run_batch(group, drafter, alone=True)
        assert group.request_ids() == [[], []]  # every request's cache released on both ranks
        prompts = batch_prompts()[:4]
        together, alone = verify_logits(group, prompts, together=True), verify_logits(group, prompts, together=False)
    finally:
        group.shutdown()
    assert (group.info["tp_size"], group.vocab_size, group.info["dtype"]) == (2, VOCAB, "float32")
    # the ranks sum through shared memory (models/target/shm_collective.py)
    assert group.info["shm_allreduce_why"] is None
    assert group.compiled_why is None  # every step went through the compiled graph
    assert tp2 == tp2_cached == tp1 and tp2_hits == hits
    # batch invariance over the ranks: each request's tokens, and a verify's logits, do not depend on the batch
    assert tp2_alone == tp2
    assert all(a.shape == (7, VOCAB) and torch.equal(a, b) for a, b in zip(alone, together, strict=True))
