"""The step scheduler: a request's output is the same whatever shares its steps (greedy ids bit for bit; sampled
distribution), chunked prefills interleave with decoding, the KV budget admits, queues and refuses, a target that
loses its caches loses no request."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch
from scipy.stats import chisquare

from ray_specdec.config import NO_TREE, SamplingParams, TreeConfig
from ray_specdec.defaults import DEFAULT_DRAFTER, DEFAULT_TARGET
from ray_specdec.engine.config import EngineConfig
from ray_specdec.engine.llm import SpeculativeEngine
from ray_specdec.engine.request import QueueFull, RequestTooLarge
from ray_specdec.engine.scheduler import Scheduler
from ray_specdec.engine.scheduler_config import SchedulerConfig
from ray_specdec.engine.target_backend import LocalTarget, SegmentSpec, on_host, row_argmaxes
from ray_specdec.models.drafter.mamba import MambaDrafter
from ray_specdec.models.target.model import TargetModel
from ray_specdec.models.target.ssm import SSMTargetModel
from ray_specdec.speculation.bandit import Bandit, BanditConfig
from ray_specdec.speculation.drafting import empty_draft
from ray_specdec.speculation.tree_policy import FixedTree
from ray_specdec.speculation.verify import judge
from tests.helpers.bigram import agreeing_pair
from tests.helpers.configs import lookup_off
from tests.helpers.inputs import random_prompt
from tests.helpers.drafters import TargetEchoDrafter
from tests.helpers.models import tiny_gpt_neox, tiny_mamba, tiny_mamba2_lm
from tests.helpers.policies import LoadRecorder
from tests.helpers.reference import ENUMERATED_VOCAB, enumerate_target, hf_greedy_ignore_eos

# Trees a request may ask for (None: the engine's policy decides), cycled over a workload.
TREES = [None, NO_TREE, TreeConfig((1,)), TreeConfig((3, 2, 1)), None, TreeConfig((1, 1, 1, 1)),
         TreeConfig((2, 2, 1, 1)), TreeConfig((2,), lookup=3)]  # fmt: skip
# Prompt lengths across prefill-chunk boundaries (512 by default, 32 in the small config), up to ~2k tokens.
LONG_PROMPTS = [1, 2000, 7, 31, 32, 33, 64, 100, 511, 512, 513, 700, 1, 3, 1100, 250, 40, 1500, 9, 65, 1024, 128,
                17, 5]  # fmt: skip
SHIPPED_PROMPTS = [1, 600, 13, 64, 200, 5, 450, 33, 100, 2, 300, 77]
SMALL = SchedulerConfig(step_tokens=96, prefill_chunk=32)


def workload(lengths: list[int], vocab: int, seed: int = 0) -> list[tuple[str, list[int], SamplingParams, TreeConfig]]:
    """(id, prompt, greedy params, tree) per prompt length: max_new_tokens 1..~40, trees cycled from TREES."""
    return [
        (f"r{i}", random_prompt(n, seed=seed + i, vocab=vocab),
         SamplingParams(max_new_tokens=1 + (7 * i) % 41, ignore_eos=i % 3 > 0), TREES[i % len(TREES)])
        for i, n in enumerate(lengths)
    ]  # fmt: skip


def run_together(scheduler: Scheduler, requests) -> tuple[dict[str, list[int]], list[list[str]], dict]:
    """Add every request, step until all finish: -> token ids per request, per step the requests that got a chunk
    (in order), and {"peak": the most requests running at once, "trees": rounds per tree label}."""
    for request_id, prompt, params, tree in requests:
        scheduler.add(request_id, prompt, params, tree)
    tokens: dict[str, list[int]] = {r[0]: [] for r in requests}
    steps, finished, peak, trees = [], set(), 0, {}
    while scheduler.has_work:
        outputs = scheduler.step()
        ended = sum(out.chunk.finish_reason is not None for out in outputs)
        peak = max(peak, scheduler.num_running + ended)
        steps.append([out.request_id for out in outputs])
        for out in outputs:
            assert out.request_id not in finished
            tokens[out.request_id] += out.chunk.token_ids
            if out.chunk.finish_reason is not None:
                finished.add(out.request_id)
                for label, n in out.chunk.stats.trees.items():
                    trees[label] = trees.get(label, 0) + n
    assert finished == set(tokens)
    return tokens, steps, {"peak": peak, "trees": trees}


def check_batch_invariance(target: TargetModel, drafter: MambaDrafter, requests, config: SchedulerConfig,
                           hf: bool) -> None:  # fmt: skip
    engine = SpeculativeEngine(target, drafter, TreeConfig((2, 1, 1)), config=lookup_off(scheduler=config))
    together, _, seen = run_together(engine.scheduler, requests)
    assert seen["peak"] == len(requests)  # every request shared steps with all others
    assert {"none", "1", "3,2,1", "1,1,1,1"} <= set(seen["trees"]) and len(seen["trees"]) >= 6  # trees of many shapes
    assert sum(seen["trees"].values()) < sum(map(len, together.values()))  # rounds that took several tokens
    plain = SpeculativeEngine(target, None, config=lookup_off(scheduler=config))
    for request_id, prompt, params, tree in requests:
        alone = engine.generate(prompt, params, tree).token_ids
        expected = plain.generate(prompt, params).token_ids
        assert together[request_id] == alone == expected, (request_id, len(prompt), tree)
        if hf:
            assert expected == hf_greedy_ignore_eos(target, prompt, params.max_new_tokens)[: len(expected)]
        assert len(expected) == params.max_new_tokens or expected[-1] in target.eos_token_ids
    # the trees the speculation controller chooses, in one generate_many: the same tokens
    many = engine.generate_many([r[1] for r in requests], [r[2] for r in requests])
    assert [g.token_ids for g in many] == [together[r[0]] for r in requests]
    assert not engine.scheduler.target.caches and engine.scheduler.reserved == 0


@pytest.mark.parametrize("config", [SchedulerConfig(), SMALL], ids=["default", "small_chunks"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
def test_greedy_tokens_do_not_depend_on_the_batch(dtype, config):
    """24 requests of 1 to 2000 prompt tokens, mixed max_new_tokens and trees: each gets exactly its tokens alone,
    target-only decoding's and (float64) HF generate's."""
    target, drafter = agreeing_pair(dtype, max_positions=2300)
    if dtype == torch.float32:
        assert target.batch_invariant, target.batch_invariant_why
    check_batch_invariance(target, drafter, workload(LONG_PROMPTS, target.vocab_size), config,
                           hf=dtype == torch.float64)  # fmt: skip


@pytest.fixture(scope="module")
def shipped() -> tuple[TargetModel, MambaDrafter]:
    return TargetModel.from_pretrained(str(DEFAULT_TARGET)), MambaDrafter.from_pretrained(str(DEFAULT_DRAFTER))


def test_greedy_tokens_do_not_depend_on_the_batch_on_the_shipped_models(shipped):
    target, drafter = shipped
    check_batch_invariance(target, drafter, workload(SHIPPED_PROMPTS, target.vocab_size), SMALL, hf=False)


# ---- sampled requests in a batch: the emitted distribution is the target's -----------------------------------------


@pytest.mark.parametrize(
    "tree, draft_sampling, coupling",
    [(TreeConfig((2, 1)), "iid", "rejection"), (TreeConfig((3, 2)), "without_replacement", "rejection"),
     (None, "without_replacement", "rejection"), (NO_TREE, "iid", "rejection"),
     (None, "without_replacement", "coupled"), (NO_TREE, "iid", "coupled")],
    # plain: every round undrafted, its bonus drawn with the step's others (coupled: each its keyed argmax)
    ids=["iid", "rsd", "policy", "plain", "coupled-policy", "coupled-plain"],
)
def test_sampled_requests_in_a_batch_have_the_target_distribution(tree, draft_sampling, coupling):
    """2000 copies of one prompt with different seeds, continuously batched (64 at a time) with their trees: the
    3-token sequences they emit follow the target's enumerated distribution."""
    target = TargetModel(tiny_gpt_neox(torch.float64, vocab=ENUMERATED_VOCAB, seed=5))
    target.eos_token_ids = frozenset()
    prompt, n_tokens, n_samples = [1, 4, 2], 3, 2000
    base = SamplingParams(temperature=0.9, max_new_tokens=n_tokens, draft_sampling=draft_sampling)
    exact = enumerate_target(target, prompt, base, n_tokens)
    engine = SpeculativeEngine(target, tiny_mamba(vocab=ENUMERATED_VOCAB, seed=6), TreeConfig((2, 2, 1)),
                               config=EngineConfig().with_fields(sampling_coupling=coupling))
    params = [SamplingParams(**{**base.__dict__, "seed": seed}) for seed in range(n_samples)]
    results = engine.generate_many([prompt] * n_samples, params, tree)
    counts = dict.fromkeys(exact, 0)
    for result in results:
        counts[tuple(result.token_ids)] += 1
    if tree != NO_TREE:
        assert sum(r.stats.rounds < n_tokens for r in results) > 0  # rounds that accepted drafted tokens
    assert all(counts[k] == 0 for k in exact if exact[k] == 0), "emitted a sequence the target cannot produce"
    keys = [k for k in exact if exact[k] * n_samples >= 5]  # chi-square needs enough expected counts: pool the rest
    observed = [counts[k] for k in keys] + [n_samples - sum(counts[k] for k in keys)]
    expected = [exact[k] * n_samples for k in keys] + [n_samples * (1 - sum(exact[k] for k in keys))]
    assert chisquare(observed, expected).pvalue > 1e-3
    tv = 0.0  # on the first two tokens (36 outcomes: sampling noise alone stays well below the bound)
    for prefix in itertools.product(range(ENUMERATED_VOCAB), repeat=2):
        emitted = sum(counts[k] for k in exact if k[:2] == prefix) / n_samples
        tv += 0.5 * abs(emitted - sum(exact[k] for k in exact if k[:2] == prefix))
    assert tv < 0.08


# ---- chunked prefill, the KV budget, faults, aborts ----------------------------------------------------------------


def test_a_long_prefill_does_not_stall_running_streams(long_context_pair):
    """A 1000-token prompt arriving mid-run is prefilled in 64-token chunks over many steps; each of those steps
    also decodes a round of every short request."""
    target, drafter = long_context_pair
    config = SchedulerConfig(prefill_chunk=64, step_tokens=128)
    scheduler = Scheduler(LocalTarget(target), drafter, None, TreeConfig((1, 1)), config)
    short = SamplingParams(max_new_tokens=60, ignore_eos=True)
    prompts = {f"s{i}": random_prompt(5 + i, seed=i) for i in range(3)}
    long = random_prompt(1000, seed=9), SamplingParams(max_new_tokens=4, ignore_eos=True)
    for request_id, prompt in prompts.items():
        scheduler.add(request_id, prompt, short)
    tokens: dict[str, list[int]] = {request_id: [] for request_id in [*prompts, "long"]}
    outputs = []
    while scheduler.has_work:
        if len(outputs) == 3:
            assert outputs[-1] == ["s0", "s1", "s2"]
            scheduler.add("long", *long)
        out = scheduler.step()
        outputs.append([o.request_id for o in out])
        for o in out:
            tokens[o.request_id] += o.chunk.token_ids
    first_long = next(i for i, step in enumerate(outputs) if "long" in step)
    prefill_steps = outputs[3:first_long]
    assert len(prefill_steps) >= 1000 // 64  # its prefill took many steps...
    assert all(step == ["s0", "s1", "s2"] for step in prefill_steps)  # ...and every short stream went on in each
    plain = SpeculativeEngine(target, None, config=lookup_off(scheduler=config))
    for request_id, prompt in prompts.items():  # with its own tokens
        assert tokens[request_id] == plain.generate(prompt, short).token_ids
    assert tokens["long"] == plain.generate(*long).token_ids
    assert not scheduler.target.caches


@pytest.mark.parametrize("tree", [TreeConfig((2, 1)), TreeConfig.parse("none")], ids=str)
def test_a_request_decodes_its_first_round_in_the_step_of_its_prompts_last_chunk(long_context_pair, tree):
    """Chunks of 16 tokens: a prompt of 10 or 17 tokens (whose last token is the first round's root) is one chunk,
    and its first tokens come in the first step; one of 33 in the second, one of 40 in the third, every request
    with its own greedy tokens."""
    target, drafter = long_context_pair
    config = SchedulerConfig(prefill_chunk=16)
    scheduler = Scheduler(LocalTarget(target), drafter, None, tree, config)
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    prompts = {n: random_prompt(n, seed=70 + n) for n in (10, 17, 33, 40)}
    for n, prompt in prompts.items():
        scheduler.add(str(n), prompt, params)
    tokens, first = {str(n): [] for n in prompts}, {}
    while scheduler.has_work:
        step = scheduler.steps + 1
        for out in scheduler.step():
            tokens[out.request_id] += out.chunk.token_ids
            first.setdefault(out.request_id, (step, out.chunk.stats.rounds))
    assert first == {"10": (1, 1), "17": (1, 1), "33": (2, 1), "40": (3, 1)}
    plain = SpeculativeEngine(target, None, config=lookup_off(scheduler=config))
    for n, prompt in prompts.items():
        assert tokens[str(n)] == plain.generate(prompt, params).token_ids
    assert not scheduler.target.caches


def budget_requests(n: int) -> list[tuple[str, list[int], SamplingParams, None]]:
    return [(f"b{i}", random_prompt(20 + i % 3, seed=40 + i), SamplingParams(max_new_tokens=20, ignore_eos=True), None)
            for i in range(n)]  # fmt: skip


def test_the_kv_budget_queues_what_does_not_fit_and_refuses_what_never_will(long_context_pair):
    """Each request reserves prompt + 20 + 5 verify rows (~46), granted whole at admission (kv_grow off): a budget
    of 120 runs two at a time."""
    target, drafter = long_context_pair
    config = SchedulerConfig(kv_budget_tokens=120, max_waiting=4, kv_grow=False)
    scheduler = Scheduler(LocalTarget(target), drafter, None, TreeConfig((2, 1)), config)
    requests = budget_requests(8)
    with pytest.raises(RequestTooLarge, match="KV budget"):
        scheduler.add("huge", random_prompt(100, seed=1), SamplingParams(max_new_tokens=20))
    with pytest.raises(RequestTooLarge, match="context length"):
        scheduler.add("past context", random_prompt(2290, seed=1), SamplingParams(max_new_tokens=20))
    for request_id, prompt, params, tree in requests[:2]:
        scheduler.add(request_id, prompt, params, tree)
    tokens = {r[0]: [] for r in requests[:6]}
    for out in scheduler.step():  # the two prompts' prefill, and their first tokens
        tokens[out.request_id] += out.chunk.token_ids
    for request_id, prompt, params, tree in requests[2:6]:
        scheduler.add(request_id, prompt, params, tree)
    with pytest.raises(QueueFull):
        scheduler.add(*requests[6])
    waited = running = 0
    while scheduler.has_work:
        assert scheduler.reserved <= config.kv_budget_tokens
        waited = max(waited, scheduler.num_waiting)
        for out in scheduler.step():
            tokens[out.request_id] += out.chunk.token_ids
        running = max(running, scheduler.num_running)
        assert scheduler.reserved <= config.kv_budget_tokens and len(scheduler.target.caches) <= 2
    assert waited == 4 and running == 2
    engine = SpeculativeEngine(target, None)
    for request_id, prompt, params, _ in requests[:6]:
        assert tokens[request_id] == engine.generate(prompt, params).token_ids
    assert not scheduler.target.caches and scheduler.reserved == 0


@pytest.mark.parametrize("at_step", [1, 4, 9])
def test_a_target_that_loses_every_cache_loses_no_request(long_context_pair, at_step):
    """reset_target() mid-run (a restarted rank): every request is prefilled again and ends with its own tokens."""
    target, drafter = long_context_pair
    engine = SpeculativeEngine(target, drafter, TreeConfig((2, 1, 1)), config=lookup_off(prefill_chunk=32))
    requests = workload([3, 150, 40, 1, 90, 12], target.vocab_size, seed=60)
    scheduler = engine.scheduler
    for request_id, prompt, params, tree in requests:
        scheduler.add(request_id, prompt, params, tree)
    tokens = {r[0]: [] for r in requests}
    for step in itertools.count():
        if step == at_step:
            scheduler.reset_target()
            assert not scheduler.target.caches or set(scheduler.target.caches) <= set(tokens)
        for out in scheduler.step():
            tokens[out.request_id] += out.chunk.token_ids
        if not scheduler.has_work:
            break
    for request_id, prompt, params, tree in requests:
        assert tokens[request_id] == engine.generate(prompt, params, tree).token_ids, request_id
    assert not scheduler.target.caches


@pytest.mark.parametrize("after_reset", [False, True])
def test_aborts_of_waiting_and_running_requests(long_context_pair, after_reset):
    target, drafter = long_context_pair
    scheduler = Scheduler(LocalTarget(target), drafter, None, TreeConfig((2, 1)),
                          SchedulerConfig(kv_budget_tokens=120, kv_grow=False))  # fmt: skip
    requests = budget_requests(4)
    for request in requests:
        scheduler.add(*request)
    tokens = {"b1": [], "b2": []}
    for out in scheduler.step():  # the two prompts' prefill, and their first rounds
        tokens.get(out.request_id, []).extend(out.chunk.token_ids)  # (b0's are not checked: it is aborted)
    assert scheduler.num_running == 2 and scheduler.num_waiting == 2
    if after_reset:
        scheduler.reset_target()
    assert scheduler.abort("b3") and scheduler.abort("b0")  # waiting, running
    assert not scheduler.abort("b0") and not scheduler.abort("nobody")
    assert scheduler.num_running == 1 and scheduler.num_waiting == 1
    while scheduler.has_work:
        for out in scheduler.step():
            tokens[out.request_id] += out.chunk.token_ids
    engine = SpeculativeEngine(target, None)
    for request_id, prompt, params, _ in requests[1:3]:
        assert tokens[request_id] == engine.generate(prompt, params).token_ids
    assert not scheduler.target.caches and scheduler.reserved == 0
    scheduler.add(*requests[0])  # an aborted request's id may be used again
    scheduler.step()
    assert scheduler.abort("b0") and not scheduler.has_work
    assert not scheduler.target.caches  # an abort that leaves nothing to step frees its cache at once


# ---- the policy's load level ---------------------------------------------------------------------------------------


def load_requests() -> list[tuple[str, list[int], SamplingParams, None]]:
    """Three requests that start together and end one after another: 3, then 2, then 1 decoding."""
    return [(f"l{i}", random_prompt(20 + i, seed=60 + i), SamplingParams(max_new_tokens=n, ignore_eos=True), None)
            for i, n in enumerate((4, 12, 24))]  # fmt: skip


def test_the_policy_picks_and_learns_at_the_load_of_the_step(long_context_pair):
    target, drafter = long_context_pair
    policy = LoadRecorder()
    scheduler = Scheduler(LocalTarget(target), drafter, None, policy)
    for request in load_requests():
        scheduler.add(*request)
    loads = []
    while scheduler.has_work:
        asked, taught = len(policy.asked), len(policy.taught)
        decoded = len(scheduler.step())
        assert policy.asked[asked:] == policy.taught[taught:] == [decoded] * decoded  # every round, at its step's load
        loads.append(decoded)
    assert {1, 2, 3} <= set(loads)

    bandit = Bandit(BanditConfig(arms=LoadRecorder.arms))
    scheduler = Scheduler(LocalTarget(target), drafter, None, bandit)
    run_together(scheduler, load_requests())
    rounds = {}
    for cell in bandit.summary()["buckets"]:
        rounds[cell["load"]] = rounds.get(cell["load"], 0) + cell["rounds"]
    assert rounds["1"] > 0 and rounds["2-4"] > 0 and rounds["5-16"] == rounds["17+"] == 0


@pytest.mark.parametrize("kind", ["kv", "ssm"])
def test_a_step_counts_the_commits_that_keep_rows_past_their_verifys_root(kind):
    """The step cost model's `replays`: the rounds of the last step whose commit (sent with this step's forward) keeps
    drafted rows, which an SSM target runs its scan along again. A KV cache only keeps its rows: 0 there."""
    if kind == "kv":
        target, drafter = agreeing_pair(torch.float32, max_positions=512)
    else:
        target = SSMTargetModel(tiny_mamba2_lm(torch.float32))
        drafter = TargetEchoDrafter(target.model, noise=0.3)
    engine = SpeculativeEngine(target, drafter, TreeConfig((1, 1, 1)), config=lookup_off())
    scheduler = engine.scheduler
    shapes = []
    observe = scheduler.controller.observe_step
    scheduler.controller.observe_step = lambda shape, *args, **kw: (shapes.append(shape), observe(shape, *args, **kw))
    for i in range(2):
        scheduler.add(f"r{i}", random_prompt(20 + i, seed=i, vocab=target.vocab_size),
                      SamplingParams(max_new_tokens=16, ignore_eos=True), None)  # fmt: skip
    sent = []  # per step, the commits its forward ran that kept rows past the root
    while scheduler.has_work:
        sent.append(sum(len(keep) > 1 for _, keep in scheduler._work.commits))
        scheduler.step()
    assert max(sent) >= 2  # rounds that accepted drafts, several in one step
    assert [shape.replays for shape in shapes] == (sent if kind == "ssm" else [0] * len(sent))


# ---- what the target returns per verify segment ----------------------------------------------------------------------


class Recording(LocalTarget):
    """The target in this process, keeping every step's verify segments and what the step returned for them."""

    def __init__(self, target):
        super().__init__(target)
        self.seen: list[tuple[SegmentSpec, torch.Tensor]] = []

    def run(self, work):
        out = super().run(work)
        self.seen += [(s, x) for s, x in zip(work.segments, out) if x is not None]
        return out


def test_greedy_requests_without_processing_get_argmaxes_and_the_others_logits(long_context_pair):
    """Greedy rounds need only the target's row argmaxes (what crosses from rank 0 to the loop with tensor-parallel
    ranks): their segments are marked argmax_only and get [rows] ids, which equal the argmaxes of the logits an
    unmarked run of the same work returns; sampled requests, logprobs and penalties still get [rows, V] logits. Each
    request's tokens are the same as with the logits (greedy: target-alone decoding)."""
    target, drafter = long_context_pair
    backend = Recording(target)
    scheduler = Scheduler(backend, drafter, None, FixedTree(TreeConfig((2, 1))), SchedulerConfig())
    kinds = {"greedy": SamplingParams(max_new_tokens=12, ignore_eos=True),
             "sampled": SamplingParams(max_new_tokens=12, temperature=1.0, seed=3, ignore_eos=True),
             "logprobs": SamplingParams(max_new_tokens=12, logprobs=2, ignore_eos=True),
             "penalty": SamplingParams(max_new_tokens=12, repetition_penalty=1.3, ignore_eos=True)}  # fmt: skip
    for i, (name, params) in enumerate(kinds.items()):
        scheduler.add(name, random_prompt(9 + i, seed=200 + i), params)
    tokens = {name: [] for name in kinds}
    while scheduler.has_work:
        for out in scheduler.step():
            tokens[out.request_id] += out.chunk.token_ids
    by_kind = {name: [(s, x) for s, x in backend.seen if s.request_id == name] for name in kinds}
    assert all(len(seen) >= 4 for seen in by_kind.values())
    for spec, out in by_kind["greedy"]:
        assert spec.argmax_only and out.dtype == torch.long and out.shape == (spec.tokens.numel(),)
    for name in ("sampled", "logprobs", "penalty"):
        assert all(not s.argmax_only and x.shape == (s.tokens.numel(), target.vocab_size) for s, x in by_kind[name])
    # the same segments unmarked, on a fresh copy of the caches: the ids are the logits' argmaxes
    fresh = Recording(target)
    again = Scheduler(fresh, drafter, None, FixedTree(TreeConfig((2, 1))), SchedulerConfig())
    again.add("greedy", random_prompt(9, seed=200), dataclasses.replace(kinds["greedy"], logprobs=0))
    while again.has_work:
        again.step()
    logits = [x for s, x in fresh.seen if s.request_id == "greedy"]
    assert len(logits) == len(by_kind["greedy"])
    for (_, ids), full in zip(by_kind["greedy"], logits):
        assert torch.equal(ids, full.argmax(dim=-1))
    plain = SpeculativeEngine(target, None)
    assert tokens["greedy"] == plain.generate(random_prompt(9, seed=200), kinds["greedy"]).token_ids
    with pytest.raises(ValueError, match="argmaxes"):
        judge(torch.zeros(3, dtype=torch.long), empty_draft(), kinds["sampled"], None)


DEVICES = ["cpu", *(["cuda"] if torch.cuda.is_available() else [])]


@pytest.mark.parametrize("device", DEVICES)
def test_a_steps_argmaxes_and_draft_tokens_reach_the_host_per_segment(device):
    """row_argmaxes replaces each argmax_only segment's logits with its rows' argmaxes (the first of equal maxima)
    and leaves the others' logits and the prefills' None as they are; off the CPU its argmaxes come back on the host
    (one argmax and one copy for the step). on_host gives every tensor's values on the CPU, in its shape."""
    g = torch.Generator().manual_seed(5)
    logits = [torch.randn(3, 50, generator=g), None, torch.randn(1, 50, generator=g), torch.randn(4, 50, generator=g)]
    logits[0][1, 7] = logits[0][1, 30] = logits[0][1].max() + 1  # a tie: the first index wins
    specs = [SegmentSpec(str(i), torch.zeros(1 if x is None else x.shape[0], dtype=torch.long), None, i != 3)
             for i, x in enumerate(logits)]
    on_device = [None if x is None else x.to(device) for x in logits]
    got = row_argmaxes(specs, on_device)
    for i in (0, 2):
        assert got[i].device.type == "cpu" and torch.equal(got[i], logits[i].argmax(dim=-1))
    assert got[0][1] == 7 and got[1] is None and got[3] is on_device[3]
    tokens = [torch.arange(6).reshape(2, 3).to(device), torch.zeros(0, dtype=torch.long), torch.tensor([9]).to(device)]
    host = on_host(tokens)
    assert [t.device.type for t in host] == ["cpu"] * 3
    assert all(torch.equal(h, t.cpu()) and h.shape == t.shape for h, t in zip(host, tokens))


def test_drafting_requests_keep_their_roots_in_slots_and_give_them_back():
    """The scheduler's drafting requests keep their drafter roots in its slot pool (mamba_state.StateSlots): a batch
    drafts and commits exactly as with states of their own (the same tokens and the same accepted lengths, round by
    round), and every slot is free once the requests end."""
    target, drafter = agreeing_pair(torch.float32, max_positions=2300)
    requests = workload(SHIPPED_PROMPTS, target.vocab_size)
    trees = [t if t is not None else TreeConfig((2, 1, 1)) for *_, t in requests]  # fixed: no timing decides them
    prompts, params = [r[1] for r in requests], [r[2] for r in requests]
    slotted = SpeculativeEngine(target, drafter, TreeConfig((2, 1, 1)), config=lookup_off(scheduler=SMALL))
    own = SpeculativeEngine(target, drafter, TreeConfig((2, 1, 1)), config=lookup_off(scheduler=SMALL))
    own.scheduler.drafter_slots = None
    slots = slotted.scheduler.drafter_slots
    taken = []
    acquire = slots.acquire
    slots.acquire = lambda: taken.append(acquire()) or taken[-1]
    a = slotted.generate_many(prompts, params, trees)
    b = own.generate_many(prompts, params, trees)
    assert [g.token_ids for g in a] == [g.token_ids for g in b]
    assert [g.stats.accepted_lengths for g in a] == [g.stats.accepted_lengths for g in b]
    assert sum(sum(g.stats.accepted_lengths) - g.stats.rounds for g in a) > 0  # drafts were accepted
    # a slot per request that drafted (at most those with a tree: one with max_tokens 1 never drafts), reused
    assert 0 < len(taken) <= sum(t.depth > 0 for t in trees) and None not in taken and len(set(taken)) < len(taken)
    assert slots.free_slots == slots.slots == SMALL.max_running
