"""Remote drafting (`drafters=remote`, speculation/drafters.py `RemoteDrafters` over speculation/drafter_worker.py
`DrafterWorker`s, here in this process): the same greedy tokens and the same rounds as the drafter in the engine's
process, one call per worker per step, the target's distribution for sampled requests, no request lost or changed
when a worker loses its sessions, fails a call or is replaced, and shards moving to a worker added mid-run."""

from __future__ import annotations

import itertools
import pickle
import uuid

import pytest
import torch

from ray_specdec.config import SamplingParams, TreeConfig
from ray_specdec.engine.config import EngineConfig
from ray_specdec.engine.llm import SpeculativeEngine
from ray_specdec.engine.scheduler_config import SchedulerConfig
from ray_specdec.models.target.model import TargetModel
from ray_specdec.speculation.drafter_worker import DraftCall, DrafterWorker
from ray_specdec.speculation.drafters import RemoteDrafters
from tests.helpers.bigram import agreeing_pair
from tests.helpers.configs import lookup_off
from tests.helpers.drafter_workers import InProcessTransport
from tests.helpers.inputs import random_prompt
from tests.helpers.models import tiny_gpt_neox, tiny_mamba
from tests.helpers.reference import ENUMERATED_VOCAB, assert_emitted_distribution, enumerate_target

SMALL = SchedulerConfig(step_tokens=96, prefill_chunk=32, max_running=8)
TREE = TreeConfig((2, 1, 1))


@pytest.fixture
def fixed_ids(monkeypatch):
    """The engine's request ids 0, 1, 2, ... (uuid4's by default): the same shards, so the same faults, every run."""
    from ray_specdec.engine import llm

    counter = itertools.count()
    monkeypatch.setattr(llm.uuid, "uuid4", lambda: uuid.UUID(int=next(counter)))


def remote(drafter, vocab: int, workers: int = 2, shards: int = 4,
           overlap: bool = False) -> tuple[RemoteDrafters, InProcessTransport]:
    transport = InProcessTransport({f"w{i}": DrafterWorker(drafter, max_sessions=8) for i in range(workers)})
    return RemoteDrafters(transport, vocab, drafter.prefill_window, shards=shards, overlap=overlap), transport


def batch(vocab: int, n: int = 12) -> tuple[list[list[int]], list[SamplingParams]]:
    prompts = [random_prompt(5 + 23 * i % 90, seed=i, vocab=vocab) for i in range(n)]
    return prompts, [SamplingParams(max_new_tokens=12 + 5 * i % 17, ignore_eos=True) for i in range(n)]


@pytest.mark.parametrize("config", [lookup_off(scheduler=SMALL), EngineConfig(scheduler=SMALL)],
                         ids=["drafter", "drafter+lookup"])
def test_remote_greedy_is_local_greedy_round_for_round(config):
    """12 requests, 8 at a time over 2 workers: every request's tokens and accepted lengths, round by round, are
    the local drafter's (the same drafts), and once its shard is placed each worker gets one call a step."""
    target, drafter = agreeing_pair(torch.float32, max_positions=512)
    prompts, params = batch(target.vocab_size)
    local = SpeculativeEngine(target, drafter, TREE, config=config).generate_many(prompts, params)
    drafters, transport = remote(drafter, target.vocab_size)
    far = SpeculativeEngine(target, drafters, TREE, config=config).generate_many(prompts, params)
    assert [g.token_ids for g in far] == [g.token_ids for g in local]
    assert [g.stats.accepted_lengths for g in far] == [g.stats.accepted_lengths for g in local]
    assert sum(sum(g.stats.accepted_lengths) - g.stats.rounds for g in far) > 0  # drafts were accepted
    assert drafters.failed_calls == drafters.missing == 0
    for step in transport.steps:
        placed = [name for name, was_placed in step if was_placed]
        assert len(placed) == len(set(placed)), step
    assert max(len(step) for step in transport.steps) <= 2 + 2  # both workers, plus shards placed that step
    # sessions of ended requests go with the next call to their worker: the last ones wait for one
    assert sum(len(w.sessions) for w in transport.workers.values()) == sum(map(len, drafters.releases.values()))
    assert sum(map(len, drafters.releases.values())) < len(prompts)


@pytest.mark.parametrize("config", [lookup_off(scheduler=SMALL), EngineConfig(scheduler=SMALL)],
                         ids=["drafter", "drafter+lookup"])
def test_drafting_ahead_keeps_the_greedy_tokens_and_saves_calls(config):
    """overlap on: the next round is drafted from the likeliest path while the target verifies; where the verdict
    agrees that draft is used (no call in the step), else the round drafts as usual: the local drafter's tokens."""
    target, drafter = agreeing_pair(torch.float32, max_positions=512)
    prompts, params = batch(target.vocab_size)
    local = SpeculativeEngine(target, drafter, TREE, config=config).generate_many(prompts, params)
    drafters, transport = remote(drafter, target.vocab_size, overlap=True)
    far = SpeculativeEngine(target, drafters, TREE, config=config).generate_many(prompts, params)
    assert [g.token_ids for g in far] == [g.token_ids for g in local]
    assert drafters.ahead_hits > 0 and drafters.ahead_misses > 0, drafters.summary()
    assert drafters.failed_calls == drafters.missing == 0
    assert sum(sum(g.stats.accepted_lengths) - g.stats.rounds for g in far) > 0


@pytest.mark.parametrize("overlap", [False, True], ids=["", "ahead"])
def test_lost_sessions_failed_calls_and_a_replaced_worker_lose_nothing(overlap, fixed_ids):
    """Faults mid-run (a worker clears its sessions, a worker's calls fail for two steps, a call cannot be sent, a
    worker is replaced by an empty one, a shard moves): every request completes with the local drafter's greedy
    tokens, its state rebuilt from its token ids, and drafting goes on after the faults."""
    target, drafter = agreeing_pair(torch.float32, max_positions=512)
    prompts, params = batch(target.vocab_size)
    config = lookup_off(scheduler=SMALL)
    local = SpeculativeEngine(target, drafter, TREE, config=config).generate_many(prompts, params)
    drafters, transport = remote(drafter, target.vocab_size, overlap=overlap)
    rebuilt = []

    def fault(step: int) -> None:
        if step == 2:
            transport.workers["w0"].sessions.clear()
        elif step == 4:
            transport.fail.add("w1")
        elif step == 5:
            transport.refuse.add("w0")
        elif step == 6:
            transport.fail.discard("w1")
            transport.refuse.discard("w0")
        elif step == 8:  # the worker that holds the most sessions now
            name = max(transport.workers, key=lambda n: len(transport.workers[n].sessions))
            rebuilt.append(name)
            transport.workers[name] = DrafterWorker(drafter, max_sessions=8)
        elif step == 9 and transport.placed:
            shard = next(iter(transport.placed))
            transport.placed[shard] = "w1" if transport.placed[shard] == "w0" else "w0"

    transport.before_call = fault
    far = SpeculativeEngine(target, drafters, TREE, config=config).generate_many(prompts, params)
    assert [g.token_ids for g in far] == [g.token_ids for g in local]
    assert drafters.failed_calls > 0 and drafters.missing > 0
    assert len(transport.steps) > 10
    assert sum(transport.drafted[10:]) > 0, "no drafting after the faults"
    assert transport.served.get(id(transport.workers[rebuilt[0]]), 0) > 0  # the new worker drafted


class LateTransport(InProcessTransport):
    """Every call to a worker runs there a second time after the next one (its reply lost): the call an engine
    stopped waiting for, run late, after the call that followed it."""

    def __init__(self, workers):
        super().__init__(workers)
        self.last: dict[str, DraftCall] = {}
        self.stale_runs = 0

    def submit(self, shard: int, call: DraftCall):
        reply = super().submit(shard, call)
        name = self.placed[shard]
        earlier, self.last[name] = self.last.get(name), call
        if earlier is not None:
            self.workers[name].draft(pickle.loads(pickle.dumps(earlier)))
            self.stale_runs += 1
        return reply


@pytest.mark.parametrize("overlap", [False, True], ids=["", "ahead"])
def test_a_stale_call_run_late_leaves_the_sessions_as_the_later_call_left_them(overlap):
    """A stale call's verdicts (or tokens) would take a session back, or commit against a draft that is not the one
    they judge: the worker leaves such a session alone, and every later call finds it as the engine expects (no
    draft missing), with the local drafter's tokens."""
    target, drafter = agreeing_pair(torch.float32, max_positions=512)
    prompts, params = batch(target.vocab_size)
    config = lookup_off(scheduler=SMALL)
    local = SpeculativeEngine(target, drafter, TREE, config=config).generate_many(prompts, params)
    transport = LateTransport({f"w{i}": DrafterWorker(drafter, max_sessions=8) for i in range(2)})
    drafters = RemoteDrafters(transport, target.vocab_size, drafter.prefill_window, shards=4, overlap=overlap)
    far = SpeculativeEngine(target, drafters, TREE, config=config).generate_many(prompts, params)
    assert [g.token_ids for g in far] == [g.token_ids for g in local]
    assert transport.stale_runs > 10
    assert drafters.failed_calls == drafters.missing == 0, drafters.summary()


# overlap: 4 tokens drafted one at a time, so that a round whose draft and bonus the drafter guessed can use the
# next round's draft made ahead (3 tokens under a deeper tree leave no drafted round after a fully accepted one)
@pytest.mark.parametrize("coupling, overlap, tree, n_tokens", [("rejection", False, (2, 2, 1), 3),
                                                               ("coupled", True, (2,), 4)],
                         ids=["rejection", "coupled-ahead"])
def test_remote_sampled_requests_have_the_target_distribution(coupling, overlap, tree, n_tokens):
    """2000 seeded copies of one prompt, 256 at a time, drafted by 2 workers (one of them failing every fifth call):
    the n-token sequences follow the target's enumerated distribution."""
    target = TargetModel(tiny_gpt_neox(torch.float64, vocab=ENUMERATED_VOCAB, seed=5))
    target.eos_token_ids = frozenset()
    prompt, n_samples = [1, 4, 2], 2000
    base = SamplingParams(temperature=0.9, max_new_tokens=n_tokens)
    exact = enumerate_target(target, prompt, base, n_tokens)
    drafter = tiny_mamba(vocab=ENUMERATED_VOCAB, seed=6)
    drafters, transport = remote(drafter, ENUMERATED_VOCAB, shards=8, overlap=overlap)
    transport.workers = {name: DrafterWorker(drafter, max_sessions=256) for name in transport.workers}
    transport.before_call = lambda step: transport.fail.symmetric_difference_update({"w1"}) if step % 5 == 0 else None
    engine = SpeculativeEngine(target, drafters, TreeConfig(tree),
                               config=EngineConfig().with_fields(sampling_coupling=coupling, max_running=256))
    params = [SamplingParams(**{**base.__dict__, "seed": seed}) for seed in range(n_samples)]
    results = engine.generate_many([prompt] * n_samples, params, TreeConfig(tree))
    counts = dict.fromkeys(exact, 0)
    for result in results:
        counts[tuple(result.token_ids)] += 1
    assert sum(r.stats.rounds < n_tokens for r in results) > 0  # rounds that accepted drafted tokens
    assert drafters.failed_calls > 0 and (drafters.ahead_hits > 0) == overlap, drafters.summary()
    assert_emitted_distribution(counts, exact, n_samples, ENUMERATED_VOCAB)


class GrowingTransport(InProcessTransport):
    """Workers that count themselves (`replicas`), a route not placed yet going to the worker that holds the fewest
    routes, as Serve's multiplexed routing places a model id no replica holds."""

    def replicas(self) -> int:
        return len(self.workers)

    def submit(self, route: int, call):
        if route not in self.placed:
            held = {name: 0 for name in self.workers}
            for name in self.placed.values():
                held[name] = held.get(name, 0) + 1
            self.placed[route] = min(self.workers, key=held.__getitem__)
        return super().submit(route, call)


def test_shards_move_to_a_worker_added_mid_run(fixed_ids):
    """One worker drafts 8 requests; a second one starts at step 3: about half the shards move to it (their requests'
    states rebuilt there from their token ids, their old sessions released), with no undrafted round and the local
    drafter's greedy tokens."""
    target, drafter = agreeing_pair(torch.float32, max_positions=512)
    prompts, params = batch(target.vocab_size)
    config = lookup_off(scheduler=SMALL)
    local = SpeculativeEngine(target, drafter, TREE, config=config).generate_many(prompts, params)
    transport = GrowingTransport({"w0": DrafterWorker(drafter, max_sessions=16)})
    drafters = RemoteDrafters(transport, target.vocab_size, drafter.prefill_window, shards=8, rebalance_s=0.0)
    before: set[str] = set()  # requests with a session on w0 when w1 started
    on_w1: set[str] = set()

    def grow(step: int) -> None:
        if step == 3 and "w1" not in transport.workers:
            before.update(transport.workers["w0"].sessions)
            transport.workers["w1"] = DrafterWorker(drafter, max_sessions=16)
        if "w1" in transport.workers:
            on_w1.update(transport.workers["w1"].sessions)

    transport.before_call = grow
    far = SpeculativeEngine(target, drafters, TREE, config=config).generate_many(prompts, params)
    assert [g.token_ids for g in far] == [g.token_ids for g in local]
    assert drafters.moved_shards > 0 and before & on_w1, (drafters.summary(), before, on_w1)
    assert drafters.missing == drafters.failed_calls == 0
    assert transport.served[id(transport.workers["w1"])] > 0
    held = set(drafters.homes.values())
    assert held == {"w0", "w1"}
    # the moved requests' sessions left w0 with its next call: none is held by both workers
    assert not set(transport.workers["w0"].sessions) & set(transport.workers["w1"].sessions)
