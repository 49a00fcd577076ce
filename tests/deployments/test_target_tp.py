"""The target side of serving: TargetWorker without Ray, and TargetReplica over real Ray rank actors.

TP=2 runs two rank actors in one STRICT_PACK placement group on a local Ray (gloo, DeepSpeed AutoTP) and must give
exactly the greedy tokens of TP=1 and of HF generate, with concurrent requests interleaved on the ranks. Release and
the idle reaper must free the caches on every rank.
"""

from __future__ import annotations

import asyncio
import gc
import weakref

import pytest
import ray
import torch
from ray.util.placement_group import placement_group_table

from deployments.target import TargetReplica
from ray_specdec.config import SamplingParams, TreeConfig
from ray_specdec.drafting import Draft
from ray_specdec.engine import TargetSession, empty_draft, judge, make_generators
from ray_specdec.models.target import TargetModel
from ray_specdec.serving.target_worker import TargetWorker, UnknownRequest, check_tp_dtype
from tests.tiny_models import tiny_gpt_neox, tiny_llama

# 4 query heads each (the Llama has 2 KV heads): both split evenly over 2 ranks.
FAMILIES = {"gpt_neox": tiny_gpt_neox, "llama_gqa": tiny_llama}
PROMPTS = [[5, 17, 33, 12, 9, 40], [71, 4], [100, 101, 102, 103, 104, 105, 106, 107, 108, 109]]
NEW_TOKENS = 12
VOCAB = 128
GREEDY = SamplingParams()
# DeepSpeed refuses float64 on CPU, so TP runs in float32, where splitting the matmuls reorders sums (logits move by
# ~1e-6). Greedy ids are compared only where the reference's top-2 logits are further apart than this.
MARGIN = 1e-3
# Two branches at depth 1, a chain below each: rows 1 -> 3 -> 5 and 2 -> 4 -> 6 (BFS order).
ORACLE_TREE = TreeConfig((2, 1, 1))
IDLE_TIMEOUT_S = 1.0


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


@pytest.fixture(scope="module")
def loop():
    """One event loop for every replica call: a replica's lock and reaper belong to the loop that first used them."""
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


@pytest.fixture(scope="module")
def tp1_replica(ray_cluster, loop, tiny_dirs):
    # Half a CPU per rank: this replica and a TP=2 one (2 x 0.5) fit the 2-CPU test cluster side by side.
    replica = TargetReplica(
        tiny_dirs["llama_gqa", torch.float64], dtype="float64", num_cpus_per_rank=0.5, idle_timeout_s=IDLE_TIMEOUT_S
    )
    yield replica
    replica.shutdown()


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    """HF generate, EOS ignored (the drivers below do not stop at EOS either)."""
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None,
                         pad_token_id=0, attention_mask=torch.ones(1, len(prompt), dtype=torch.long))  # fmt: skip
    return out[0, len(prompt) :].tolist()


def min_margin(model, prompt: list[int], continuation: list[int]) -> float:
    """Smallest top-1 minus top-2 logit over the positions that predict `continuation`."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + continuation])).logits[0, len(prompt) - 1 : -1]
    top2 = logits.topk(2, dim=-1).values
    return float((top2[:, 0] - top2[:, 1]).min())


def oracle_draft(reference: list[int], done: int) -> Draft:
    """A (2, 1, 1) tree whose second branch holds the next two reference tokens, then a wrong one.

    Greedy acceptance must take rows 2 and 4 (not a prefix of the rows: the commit compacts the cache) and emit
    reference[done + 2] as the bonus token. The first branch repeats the right tokens under a wrong parent.
    """
    r0, r1, r2 = reference[done : done + 3]
    tokens = [(r0 + 1) % VOCAB, r0, r1, r1, r2, (r2 + 1) % VOCAB]
    return Draft(ORACLE_TREE, torch.tensor(tokens), None)


async def drive_greedy(verify, reference: list[int], oracle: bool) -> list[int]:
    """Greedy decoding of NEW_TOKENS through `verify(draft) -> Verdict`, with oracle trees or empty drafts."""
    out: list[int] = []
    while len(out) < NEW_TOKENS:
        draft = oracle_draft(reference, len(out)) if oracle else empty_draft()
        verdict = await verify(draft)
        if oracle:
            assert verdict.accepted_rows == (2, 4)
        out += verdict.new_tokens
    return out[:NEW_TOKENS]


def worker_verify(worker: TargetWorker, request_id: str):
    """The replica's round (forward, judge rank 0's logits, commit) on an in-process worker."""

    async def verify(draft: Draft):
        verdict = judge(worker.forward(request_id, draft), draft, GREEDY, None)
        worker.commit(request_id, verdict)
        return verdict

    return verify


@pytest.mark.parametrize("family", FAMILIES)
def test_worker_gives_the_logits_of_a_target_session(tiny_dirs, family):
    """tp_size 1, no Ray: the worker loaded from disk runs exactly the in-process engine's TargetSession."""
    model = FAMILIES[family](torch.float64)
    prompt = PROMPTS[0]
    reference = hf_greedy(model, prompt, NEW_TOKENS + 3)
    worker = TargetWorker(tiny_dirs[family, torch.float64], dtype="float64")
    session = TargetSession(TargetModel(model), prompt)
    worker.start("r", prompt)
    produced: list[int] = []
    for round_ in range(6):
        draft = oracle_draft(reference, len(produced)) if round_ % 2 else empty_draft()
        logits = worker.forward("r", draft)
        assert torch.equal(logits, session.forward(draft))
        verdict = judge(logits, draft, GREEDY, None)
        worker.commit("r", verdict)
        session.commit(verdict)
        produced += verdict.new_tokens
    assert produced == reference[: len(produced)] and len(produced) == 3 * 1 + 3 * 3
    info = worker.info()
    assert (info["tp_size"], info["vocab_size"], info["dtype"]) == (1, VOCAB, "float64")


def test_worker_release_frees_the_cache(tiny_dirs):
    worker = TargetWorker(tiny_dirs["llama_gqa", torch.float64], dtype="float64")
    worker.start("a", PROMPTS[0])
    worker.forward("a", empty_draft())
    cache = weakref.ref(worker.sessions["a"].cache)
    assert worker.release("a") is True
    gc.collect()
    assert cache() is None
    assert worker.release("a") is False  # twice is harmless
    with pytest.raises(UnknownRequest, match="no request 'a'"):
        worker.forward("a", empty_draft())
    with pytest.raises(KeyError):
        worker.commit("never-started", judge(torch.zeros(1, VOCAB), empty_draft(), GREEDY, None))
    worker.start("b", PROMPTS[1])
    with pytest.raises(ValueError, match="already started"):
        worker.start("b", PROMPTS[1])
    with pytest.raises(ValueError, match="at least one token"):
        worker.start("c", [])
    assert worker.request_ids() == ["b"]


def test_tensor_parallel_refuses_float64_on_cpu():
    """DeepSpeed's CPU accelerator cannot shard float64; the worker says so before any rendezvous."""
    check_tp_dtype(torch.float32)
    with pytest.raises(ValueError, match="use tp_size=1 for torch.float64"):
        check_tp_dtype(torch.float64)


CASES = [(i, oracle) for i in range(len(PROMPTS)) for oracle in (False, True)]  # (prompt index, oracle drafts?)


def greedy_references(model) -> list[list[int]]:
    """HF generate for every prompt (3 tokens more: oracle drafts look ahead), checked to hold no near-tie."""
    references = [hf_greedy(model, p, NEW_TOKENS + 3) for p in PROMPTS]
    for prompt, reference in zip(PROMPTS, references):
        assert min_margin(model, prompt, reference) > MARGIN, "pick prompts whose greedy argmax is not a near-tie"
    assert len({t for r in references for t in r}) > 10  # not one token over and over
    return references


def worker_greedy(path: str, references: list[list[int]], loop) -> list[list[int]]:
    """Every case through one in-process TargetWorker (tp_size 1)."""
    worker = TargetWorker(path)
    outs = []
    for i, oracle in CASES:
        request_id = f"{i}-{oracle}"
        worker.start(request_id, PROMPTS[i])
        outs.append(loop.run_until_complete(drive_greedy(worker_verify(worker, request_id), references[i], oracle)))
    return outs


async def replica_greedy(replica: TargetReplica, references: list[list[int]]) -> list[list[int]]:
    """Every case at once: the ranks see the requests' collectives interleaved (and must see them in one order)."""

    async def generate(i: int, oracle: bool) -> list[int]:
        request_id = f"{i}-{oracle}"
        await replica.start(request_id, PROMPTS[i], None)
        out = await drive_greedy(lambda d: replica.verify(request_id, d, GREEDY), references[i], oracle)
        await replica.release(request_id)
        return out

    return await asyncio.gather(*(generate(i, oracle) for i, oracle in CASES))


def assert_auto_tp_sharded(replica: TargetReplica, model) -> None:
    """Two ranks in one STRICT_PACK placement group, each holding a part of the model, not all of it."""
    table = placement_group_table(replica._pg)
    assert table["strategy"] == "STRICT_PACK" and len(table["bundles"]) == 2

    def shard_summary(rank) -> tuple[set[str], int]:  # nested: pickled by value into the rank actor
        module = rank.worker.target.model
        return {type(m).__name__ for m in module.modules()}, sum(p.numel() for p in module.parameters())

    full = sum(p.numel() for p in model.parameters())
    for layer_kinds, params in ray.get([rank.__ray_call__.remote(shard_summary) for rank in replica._ranks]):
        assert "LinearAllreduce" in layer_kinds and params < full


@pytest.mark.parametrize("family", FAMILIES)
def test_tp2_gives_the_greedy_tokens_of_tp1_and_hf_generate(tiny_dirs, family, ray_cluster, loop):
    model = FAMILIES[family](torch.float32)
    path = tiny_dirs[family, torch.float32]
    references = greedy_references(model)
    tp1_out = worker_greedy(path, references, loop)

    replica = TargetReplica(path, tp_size=2, num_cpus_per_rank=0.5)
    try:
        assert_auto_tp_sharded(replica, model)
        tp2_out = loop.run_until_complete(replica_greedy(replica, references))
        info = loop.run_until_complete(replica.info())
        assert loop.run_until_complete(replica.rank_request_ids()) == [[], []]  # released on both ranks
    finally:
        replica.shutdown()
    assert info["tp_size"] == 2 and info["vocab_size"] == VOCAB
    for (i, _), tp2, tp1 in zip(CASES, tp2_out, tp1_out, strict=True):
        assert tp2 == tp1 == references[i][:NEW_TOKENS]


def test_release_frees_every_rank_and_unknown_ids_raise(tp1_replica, loop):
    run = loop.run_until_complete
    run(tp1_replica.start("a", PROMPTS[0], None))
    run(tp1_replica.start("b", PROMPTS[1], None))
    run(tp1_replica.verify("a", empty_draft(), GREEDY))
    assert sorted(run(tp1_replica.rank_request_ids())[0]) == ["a", "b"]

    run(tp1_replica.release("a"))
    assert run(tp1_replica.rank_request_ids()) == [["b"]]
    with pytest.raises(UnknownRequest, match="no request 'a'"):
        run(tp1_replica.verify("a", empty_draft(), GREEDY))
    run(tp1_replica.release("a"))  # twice, and never started: no error
    run(tp1_replica.release("never-started"))
    with pytest.raises(ValueError, match="already started"):
        run(tp1_replica.start("b", PROMPTS[1], None))
    for bad in ([], [VOCAB]):
        with pytest.raises(ValueError, match="token"):
            run(tp1_replica.start("c", bad, None))
    run(tp1_replica.release("b"))
    assert run(tp1_replica.rank_request_ids()) == [[]] and tp1_replica.num_requests == 0


def test_idle_requests_are_freed(tp1_replica, loop):
    run = loop.run_until_complete
    before = tp1_replica.timed_out
    run(tp1_replica.start("idle", PROMPTS[0], None))
    run(tp1_replica.verify("idle", empty_draft(), GREEDY))
    run(asyncio.sleep(3 * IDLE_TIMEOUT_S))  # the reaper runs every IDLE_TIMEOUT_S / 2 while the loop does
    assert tp1_replica.timed_out == before + 1
    assert run(tp1_replica.rank_request_ids()) == [[]]
    with pytest.raises(UnknownRequest):
        run(tp1_replica.verify("idle", empty_draft(), GREEDY))


def test_sampled_verdicts_follow_the_request_seed(tp1_replica, loop, tiny_dirs):
    """The replica judges with the request's target stream from make_generators(seed), like the engine."""
    run = loop.run_until_complete
    params = SamplingParams(temperature=1.0, top_k=20)
    target = TargetModel(tiny_llama(torch.float64))

    def engine_tokens(seed: int) -> list[int]:
        session, (_, target_gen) = TargetSession(target, PROMPTS[0]), make_generators(seed)
        tokens = []
        for _ in range(10):
            verdict = judge(session.forward(empty_draft()), empty_draft(), params, target_gen)
            session.commit(verdict)
            tokens.append(verdict.bonus_token)
        return tokens

    def replica_tokens(seed: int) -> list[int]:
        request_id = f"seed-{seed}"
        run(tp1_replica.start(request_id, PROMPTS[0], seed))
        tokens = [run(tp1_replica.verify(request_id, empty_draft(), params)).bonus_token for _ in range(10)]
        run(tp1_replica.release(request_id))
        return tokens

    assert replica_tokens(7) == engine_tokens(7)
    assert replica_tokens(8) == engine_tokens(8) != engine_tokens(7)
