"""The round loop: a step scheduler over every in-flight request (continuous batching of speculative rounds).

One `step()`:
1. admission: waiting requests join while their first KV grant fits the budget (`SchedulerConfig`), and this step's
   prefill chunks are picked within the rows the rounds leave; a request whose prompt's last chunk is among them
   also runs its first round in this step, verified after the chunk in the same forward, so that its first tokens
   come with the chunk's step (as a plain server samples its first token from the prefill), not a step later;
2. trees: the speculation controller picks every round's tree, none included, for the batch's expected tokens per
   second of step time (speculation/controller.py);
3. one batched draft for every request that drafts (speculation/drafters.py: `draft_many` in this process, or one
   call per drafter worker with `drafters=remote`; a round whose worker failed runs undrafted);
4. one target call (`TargetBackend.run`): last step's commits, then one forward over this step's prefill chunks
   and every round's verify rows;
5. per request: acceptance, commit (sent with the next step's target call), stop checks, one output chunk.

`step()` is `update(plan, execute(plan))` of `plan = schedule()`: `schedule` does 1 and 2 (a `StepPlan`: the target
call's work, the prompts' chunks, one `Round` per request with its tree), `execute` does 3 and 4 (a `StepResult`), and
`update` does 5 and teaches the bandit and the controller.

Everything that drives generation uses this loop: `llm.SpeculativeEngine` (CLI, benchmark, offline batches) and
the Serve app's engine replica. It runs without Ray and without threads; callers step it.

Batch invariance. A prompt is prefilled in chunks cut at fixed positions (multiples of `prefill_chunk` from its
start), never by what else runs in the step, and the target's batched forward computes each segment's rows the same
whatever shares the forward (`TargetModel.batch_invariant`). So a greedy request's tokens do not depend on the other
requests in flight, nor on the trees the controller picks for it.

KV budget (engine/kv_manager.py: grants, the prefix cache's room, each step's prefill chunks). Each request has a
reservation, the KV rows it can ever need (prompt + max_new_tokens + its largest verify), and a grant, the rows its
cache holds: twice what its prompt and first round need at admission (or just that), more as it decodes
(`SchedulerConfig.kv_grow`; off: the whole reservation at admission). A grant is made only where every request can
still finish (the banker's check), so a request whose growth does not fit skips a round instead of anyone being
preempted: nothing grows past the budget, a request admitted always finishes with the tokens it would have had
alone, and one that can never fit is refused at once (`RequestTooLarge`). Beyond `max_waiting` queued requests,
`add` raises `QueueFull`.

Prefix caching (engine/prefix_cache.py, `SchedulerConfig.prefix_cache`). Prefill chunks are kept after their forward
where the budget has room, and an admitted request whose prompt starts with cached chunks has them copied into its cache
and prefills only the rest: the same bits, since chunks are cut at the same fixed positions.
"""

from __future__ import annotations

import contextlib
import secrets
import time
from collections import deque
from dataclasses import dataclass, replace
from typing import Sequence

import torch

from ray_specdec.config import NO_TREE, SamplingParams, TreeConfig
from ray_specdec.engine.kv_manager import PrefillPlan
from ray_specdec.engine.outputs import StreamChunk
from ray_specdec.engine.prefix_cache import PrefixIndex
from ray_specdec.engine.request import QueueFull, Request, RequestTooLarge, StepOutput
from ray_specdec.engine.scheduler_config import SchedulerConfig
from ray_specdec.engine.target_backend import SegmentSpec, StepWork, TargetBackend, on_host
from ray_specdec.models.drafter.mamba import MambaDrafter
from ray_specdec.models.drafter.mamba_state import StateSlots
from ray_specdec.speculation.acceptance import Verdict
from ray_specdec.speculation.controller import (RoundFacts, SpeculationConfig, SpeculationController, StepShape,
                                                drafter_rows)
from ray_specdec.speculation.counterfactuals import what_if
from ray_specdec.speculation.coupled import KeyedGumbel
from ray_specdec.speculation.drafter_cache import DrafterStates
from ray_specdec.speculation.drafters import Drafters, LocalDrafters
from ray_specdec.speculation.drafting import Draft, empty_draft, lookup_draft
from ray_specdec.speculation.logits_processing import TokenHistory
from ray_specdec.speculation.lookup_value import LookupCounts
from ray_specdec.speculation.prompt_lookup import LookupIndex
from ray_specdec.speculation.sampling import make_generators
from ray_specdec.speculation.stopping import StopChecker
from ray_specdec.speculation.tree_policy import FixedTree
from ray_specdec.speculation.verify import (judge, judge_plain_coupled, judge_plain_sampled, plain_sampled,
                                            prefetch_rounds, round_logprobs)

# The shortest context suffix an undrafted round's lookup matches (plain_lookup): a single token matches often and
# guesses badly, and every proposed token is a verify row (measured on held-out code, 4 tokens: 1.66 tokens a round
# over 2.34 rows with pairs, 1.84 over 3.42 with single tokens).
PLAIN_LOOKUP_MIN_NGRAM = 2

@dataclass
class Round:
    """One request's round in a step: the tree the controller chose, its draft and, after the forward, its verdict."""

    request: Request
    tree: TreeConfig = NO_TREE  # the drafter's tree (cut to what the request's KV holds)
    lookup: int = 0  # prompt-lookup tokens added to a drafted tree (greedy requests)
    plain_lookup: bool = False  # undrafted: whether it verifies a prompt-lookup proposal (`plain_lookup`)
    # the prompt-lookup proposal its undrafted option verifies (greedy rounds that may have one), made before the
    # choice: an undrafted round verifies it where `plain_lookup`; what the round emits teaches its acceptance either
    # way (`_teach`)
    plain_proposal: tuple[int, ...] = ()
    context_len: int = 0  # the request's tokens before the round
    draft: Draft | None = None
    verdict: Verdict | None = None


@dataclass
class StepPlan:
    """What `schedule` decided for a step."""

    work: StepWork  # the target call's work: last step's commits, allocations, releases, and this step's chunks
    prefilling: list[Request]  # requests whose prompt chunks run in the step
    rounds: list[Round]
    prefill_rows: int
    started: float  # perf_counter when the step began


@dataclass
class StepResult:
    """What `execute` gave back: each round's target logits (in `plan.rounds` order), what the step ran and when."""

    logits: list
    shape: StepShape
    times: tuple[float, float, float]  # start (drafter prefills left out), drafts done, forward done


class Scheduler:
    def __init__(
        self,
        target: TargetBackend,
        drafter: MambaDrafter | Drafters | None,
        tokenizer,
        policy,
        config: SchedulerConfig = SchedulerConfig(),
        max_context: int | None = None,
        speculation: SpeculationConfig = SpeculationConfig(),
    ):
        """drafter: a drafter in this process, or a drafting side (speculation/drafters.py: remote workers); policy:
        a TreeConfig (every request drafts it) or a tree policy (the bandit: its arms and the shared
        statistics the controller prices them with); config and speculation: the scheduler's and the speculation
        parts of the engine's settings (engine/config.py EngineConfig); max_context: a cap on prompt +
        max_new_tokens below the target's own context."""
        self.target = target
        self.drafters: Drafters | None = drafter if isinstance(drafter, Drafters) or drafter is None else (
            LocalDrafters(drafter, target.vocab_size, DrafterStates() if config.prefix_cache else None,
                          StateSlots(drafter, config.max_running)))  # fmt: skip
        self.tokenizer = tokenizer
        self.policy = FixedTree(policy) if isinstance(policy, TreeConfig) else policy
        self.config = config
        self.speculation = speculation
        self.max_context = min(target.max_context, max_context or target.max_context)
        # an SSM target's fixed per-request state, in KV rows: part of every request's reservation and grant
        self.state_rows: int = getattr(target, "state_rows", 0)
        self.waiting: deque[Request] = deque()
        self.running: dict[str, Request] = {}
        # KV reservations, the prefix cache (cached prompt chunks) and each step's prefill chunks
        self.kv = PrefillPlan(config.kv_budget_tokens, config.prefill_chunk, config.prefix_cache, config.kv_grow)
        # every round's tree, each step (speculation/controller.py)
        self.controller = SpeculationController(self.policy, speculation)
        self.rounds_unrecorded = 0  # rounds whose tree is none of the policy's arms (cut at the end of a request)
        self.steps = 0
        self._cuts_of: tuple | None = None
        self._cuts: dict[int, list[TreeConfig]] = {}
        self.kv_waits = 0  # decoding requests that skipped the last step's round: their KV could not grow
        self.kv_waited = 0  # such skipped rounds since the start
        self.load = 1  # requests decoding in the current step: the policy's load level for its rounds
        self._work = StepWork()

    # ----- the drafter in this process (drafters=local) -----

    @property
    def drafter(self) -> MambaDrafter | None:
        return self.drafters.drafter if isinstance(self.drafters, LocalDrafters) else None

    @drafter.setter
    def drafter(self, drafter: MambaDrafter | None) -> None:
        """Another drafter for the requests admitted from now on (its own slot pool: `drafter_slots`)."""
        if drafter is None:
            self.drafters = None
        elif isinstance(self.drafters, LocalDrafters):
            self.drafters.drafter = drafter
        else:
            self.drafters = LocalDrafters(drafter, self.target.vocab_size, None, None)

    @property
    def drafter_states(self) -> DrafterStates | None:
        """The drafter's states after prompts it prefilled (speculation/drafter_cache.py)."""
        return self.drafters.states if isinstance(self.drafters, LocalDrafters) else None

    @property
    def drafter_slots(self) -> StateSlots | None:
        """The drafting requests' root states, one slot each (mamba_state.StateSlots; allocated on the first draft)."""
        return self.drafters.slots if isinstance(self.drafters, LocalDrafters) else None

    @drafter_slots.setter
    def drafter_slots(self, slots: StateSlots | None) -> None:
        if isinstance(self.drafters, LocalDrafters):
            self.drafters.slots = slots

    # ----- requests in and out -----

    def check(self, prompt_len: int, params: SamplingParams, tree: TreeConfig | None = None) -> int:
        """-> the KV rows the request reserves; RequestTooLarge if it can never run."""
        if prompt_len < 1:
            raise RequestTooLarge("the prompt holds no tokens")
        if prompt_len + params.max_new_tokens > self.max_context:
            raise RequestTooLarge(
                f"prompt ({prompt_len} tokens) + max_new_tokens ({params.max_new_tokens}) exceeds the target's "
                f"context length of {self.max_context} tokens"
            )
        rows = prompt_len + params.max_new_tokens + self._max_verify_rows(params, tree) + self.state_rows
        if rows > self.config.kv_budget_tokens:
            state = f" + its state {self.state_rows}" if self.state_rows else ""
            raise RequestTooLarge(
                f"the request needs {rows} KV rows (prompt {prompt_len} + max_new_tokens {params.max_new_tokens} + "
                f"one verify{state}) but the KV budget is {self.config.kv_budget_tokens} rows"
            )
        return rows

    def add(self, request_id: str, prompt_ids: Sequence[int], params: SamplingParams,
            tree: TreeConfig | None = None, resumed: int = 0) -> None:
        """Queue a request; it runs from the next step that has room for it. resumed: the last this many of
        prompt_ids are tokens the request generated already (continued here after its replica was lost): its
        max_tokens, min_tokens, penalties and stop strings go on from them, as if it had never moved."""
        if request_id in self.running or any(r.request_id == request_id for r in self.waiting):
            raise ValueError(f"request {request_id!r} is already in the scheduler")
        tokens = [int(t) for t in prompt_ids]
        if any(not 0 <= t < self.target.vocab_size for t in tokens):
            raise ValueError(f"prompt token ids must be in [0, {self.target.vocab_size})")
        if not 0 <= resumed < len(tokens):
            raise ValueError(f"resumed must be in [0, {len(tokens)}) (the prompt's tokens), got {resumed}")
        params.check_vocab(self.target.vocab_size)
        prompt_len = len(tokens) - resumed
        reserved = self.check(prompt_len, params, tree)
        stop = StopChecker(self.tokenizer, params, self.target.eos_token_ids)
        stop.feed(tokens[prompt_len:])  # (the text the client has: the deltas of these tokens were streamed)
        if stop.finished:
            raise ValueError(f"the {resumed} resumed tokens already end the request ({stop.finish_reason})")
        draft_gen, target_gen = make_generators(params.seed, params.choice)
        r = Request(request_id, tokens, prompt_len, params, tree, stop, draft_gen, target_gen, reserved)
        if r.sampled and self.speculation.coupled(params.seed):
            r.noise = KeyedGumbel(secrets.randbits(62) if params.seed is None else params.seed, params.choice)
        self._admit()  # the queue's length is then what really waits
        r.granted = self.kv.first_grants(r)[-1]
        admissible = (not self.waiting and not self.kv_waits and len(self.running) < self.config.max_running
                      and self.kv.fits_now(r.granted) and self.kv.safe(self.running.values(), r))  # fmt: skip
        if len(self.waiting) >= self.config.max_waiting and not admissible:  # FIFO: nothing overtakes the queue
            raise QueueFull(f"{len(self.waiting)} requests are waiting (max_waiting); retry later")
        self.waiting.append(r)
        self._admit()

    def abort(self, request_id: str) -> bool:
        """Drop a request wherever it is (its KV is freed with the next step's target call). -> whether it was here."""
        for r in self.waiting:
            if r.request_id == request_id:
                self.waiting.remove(r)
                return True
        request = self.running.pop(request_id, None)
        if request is None:
            return False
        self._free(request)
        if not self.has_work:  # no step will carry the release soon: free the cache now
            self._send_pending()
        return True

    @property
    def reserved(self) -> int:
        """KV rows granted to running requests (their caches' capacities)."""
        return self.kv.reserved

    @property
    def prefix(self) -> PrefixIndex | None:
        """The cached prompt chunks (None without the prefix cache)."""
        return self.kv.prefix

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def reset_target(self) -> None:
        """The target lost every cache (a restarted rank): each running request is prefilled again from its token
        ids (prompt + what it generated) and goes on where it was."""
        self.target.reset()
        self._work = self.kv.reset(self.running.values())

    # ----- the step: schedule, execute, update -----

    def step(self) -> list[StepOutput]:
        """One step over every running request; -> one output chunk per request that decoded a round."""
        self.prepare()
        plan = self.schedule()
        result = self.execute(plan)
        return self.update(plan, result)

    def schedule(self) -> StepPlan:
        """Which requests run this step, which prompt chunks, and every round's tree."""
        started = time.perf_counter()
        self._admit()
        decoding = [r for r in self.running.values() if r.decoding]
        prefilling = [r for r in self.running.values() if not r.decoding]
        # a request whose KV cannot grow to hold its next round this step waits a round
        fitting = [r for r in decoding if self.kv.room(r, self.running.values(), self._work)]
        self.kv_waits, decoding = len(decoding) - len(fitting), fitting
        self.kv_waited += self.kv_waits
        work, self._work = self._work, StepWork()
        # prefill chunks first, within what the rounds leave of the step's rows (as many as their last rounds had)
        rounds_hint = sum(r.last_rows for r in decoding)
        prefill_rows = self.kv.plan(prefilling, work, self.config.step_tokens - rounds_hint)
        # a prompt whose last chunk runs in this step has its first round in it too, after the chunk (the verify of
        # its last token): its first tokens come a step sooner. Its cache must hold the round, as any round's: a
        # request prefilled again after a fault (reset_target) holds only what its tokens filled
        last_chunks = [r for r in prefilling if r.chunk_end == len(r.tokens) - 1]
        requests = decoding + [r for r in last_chunks if self.kv.room(r, self.running.values(), work)]
        self.load = max(len(requests), 1)
        proposals = [tuple(self._plain_proposal(r)) if self._lookup_allowed(r) else None for r in requests]
        picks = self.controller.choose([self._facts(r, p) for r, p in zip(requests, proposals)],
                                       [r.request_id for r in requests])  # fmt: skip
        rounds = []
        for r, pick, proposal in zip(requests, picks, proposals):
            lookup = min(self.speculation.lookup if r.params.greedy else 0, r.stop.remaining - 1)
            tree, lookup = fit_tree(pick.tree, lookup, room=r.granted - (len(r.tokens) - 1))
            rounds.append(Round(r, tree, lookup, pick.plain_lookup, proposal or (), context_len=len(r.tokens)))
        return StepPlan(work, prefilling, rounds, prefill_rows, started)

    def execute(self, plan: StepPlan) -> StepResult:
        """The step's drafts (one batched draft) and its one target call: last step's commits, the prompt chunks and
        every round's verify rows in one forward."""
        draft_rows, drafter_prefill_s = self._draft(plan.rounds)
        t0 = plan.started + drafter_prefill_s  # the rounds' time leaves the drafter's prefills out (request costs)
        t1 = time.perf_counter()
        work = plan.work
        first, verify_rows, kilotokens = len(work.segments), 0, 0.0
        for rd, drafted in zip(plan.rounds, on_host([rd.draft.tokens for rd in plan.rounds])):
            r = rd.request
            if r.params.argmax_only:  # judged on the host, on the target's argmaxes (target_backend.row_argmaxes)
                rd.draft = replace(rd.draft, tokens=drafted)
            root = torch.tensor([r.tokens[-1]])
            tokens = torch.cat([root, drafted.reshape(-1)]) if drafted.numel() else root
            work.segments.append(SegmentSpec(r.request_id, tokens, tuple(rd.draft.tree.paths), r.params.argmax_only))
            verify_rows += tokens.numel()
            kilotokens += tokens.numel() * rd.context_len / 1024
        if self.drafters is not None:  # the next rounds' drafts ahead, while the target verifies these (remote)
            ahead = [rd for rd in plan.rounds if rd.draft.config.depth and rd.request.drafter is not None]
            self.drafters.ahead([rd.request for rd in ahead], [rd.tree.with_lookup(rd.lookup) for rd in ahead])
        logits = self._run(work)
        drafting = sum(rd.draft.config.depth > 0 for rd in plan.rounds)  # lookup-only rounds run no drafter
        # last step's rounds that kept drafted rows, on a target whose commit replays them (an SSM's; a KV cache only
        # keeps its rows: the feature stays 0 there, and its weight at its prior, 0)
        replays = sum(1 for _, keep in work.commits if len(keep) > 1) if self.state_rows else 0
        shape = StepShape(verify_rows, kilotokens, drafting, draft_rows, plan.prefill_rows, replays)
        return StepResult(logits[first:first + len(plan.rounds)], shape, (t0, t1, time.perf_counter()))

    def update(self, plan: StepPlan, result: StepResult) -> list[StepOutput]:
        """Judge every round, commit it (sent with the next step's target call), check stops, emit one chunk per
        round, and learn from the step."""
        for r in plan.prefilling:
            r.prefilled = r.chunk_end
        rounds, logits = plan.rounds, result.logits
        # plain sampled rounds draw together (coupled ones: their keyed argmaxes); the others are judged one by one,
        # the noise of the coupled ones made together first
        plain = [i for i, rd in enumerate(rounds) if plain_sampled(rd.draft, rd.request.params)]
        drawn = [i for i in plain if rounds[i].request.noise is None]
        keyed = [i for i in plain if rounds[i].request.noise is not None]
        t = time.perf_counter()
        verdicts = dict(zip(drawn, judge_plain_sampled([logits[i] for i in drawn],
                                                       [rounds[i].request.params for i in drawn],
                                                       [rounds[i].request.target_gen for i in drawn])
                            if drawn else []))  # fmt: skip
        verdicts |= dict(zip(keyed, judge_plain_coupled([logits[i] for i in keyed],
                                                        [rounds[i].request.params for i in keyed],
                                                        [rounds[i].request.noise for i in keyed],
                                                        [len(rounds[i].request.tokens) for i in keyed])
                             if keyed else []))  # fmt: skip
        coupled = [i for i, rd in enumerate(rounds) if rd.request.noise is not None and i not in verdicts]
        prefetch_rounds([logits[i] for i in coupled], [rounds[i].draft.tree for i in coupled],
                        [rounds[i].request.noise for i in coupled], [len(rounds[i].request.tokens) for i in coupled])
        # each round's own host time after the forward (judging, committing, stops), for the controller's prices
        finish_s = [0.0] * len(rounds)
        together = plain + coupled
        for i in together:
            finish_s[i] = (time.perf_counter() - t) / len(together)
        outputs = []
        try:
            for i, rd in enumerate(rounds):
                t = time.perf_counter()
                outputs.append(self._finish_round(rd, logits[i], verdicts.get(i)))
                finish_s[i] += time.perf_counter() - t
        except Exception as exc:  # rounds taken are in their requests (a finished one has left): the caller hands
            with contextlib.suppress(AttributeError):  # their chunks out (EngineLoop), then recovers or fails the rest
                exc.step_outputs = outputs
            raise
        self._account(plan, result, time.perf_counter(), finish_s)
        self.steps += 1
        if not self.has_work:  # nothing will step again soon: free the caches of the requests that just ended
            self._send_pending()
        return outputs

    def _send_pending(self) -> None:
        self._run(self._work)
        self._work = StepWork()

    def _run(self, work: StepWork) -> list[torch.Tensor | None]:
        try:
            logits = self.target.run(work)
        except BaseException:
            if self.prefix is not None:
                self.prefix.unsent()
            raise
        if self.prefix is not None:
            self.prefix.sent()
        return logits

    def calibrate(self) -> None:
        """The controller's step cost prior and drafter prefill rate, measured on this target and drafter."""
        self.controller.calibrate(self.target, self.drafters)

    def prepare(self) -> None:
        """The one-time measurements the first step would otherwise make (about a second on a large target): the
        controller's calibration where it prices drafting. The app makes them before its replica takes requests, so
        no request waits for them; `step` makes them where nothing did."""
        if self.drafters is not None and self.controller.prices and not self.controller.cost.calibrated:
            self.calibrate()

    def _admit(self) -> None:
        """Waiting requests join, oldest first, while their first grant fits; none while a running one waits for KV
        (they would take the rows it waits for)."""
        while (self.waiting and not self.kv_waits and len(self.running) < self.config.max_running
               and self.kv.can_admit(self.waiting[0], self.running.values(), self._work)):
            r = self.waiting.popleft()
            self.running[r.request_id] = r
            r.admitted = True
            self.kv.admit(r, self._work)
            if self.drafters is not None:
                r.drafter = self.drafters.open(r)
                r.drafter_state_kept = self._drafter_prefill(r.tokens) == 0  # once: a key of up to 512 tokens

    # ----- trees and drafts -----

    def _facts(self, r: Request, proposal: tuple[int, ...] | None) -> RoundFacts:
        """What the controller weighs for r's round: its options (a tree its client asked for, or the pick of a policy
        that picks its own trees, as the only one; else every arm of the bandit, none among them by default), cut to the
        tokens it has
        left (the bonus token comes for free: never draft deeper than what is left), and what its drafted and
        undrafted rounds cost beyond their trees' nodes. proposal: its undrafted option's lookup proposal (None: it may
        not verify one)."""
        cut = r.stop.remaining - 1
        if self.drafters is None:
            options = [NO_TREE]
        elif r.tree is not None:
            options = [r.tree.truncated(cut)]
        elif not self.controller.prices:  # a fixed tree (or a test's script)
            options = [self.policy.select(len(r.tokens), r.sampled, load=self.load).truncated(cut)]
        else:
            arms = self.policy.arms
            if self._cuts_of is not arms:  # the arms' cuts by tokens left, computed once per arm set
                self._cuts_of, self._cuts = arms, {}
            cut = min(cut, 32)  # no tree is deeper, nor its lookup longer
            options = self._cuts.get(cut)
            if options is None:
                options = self._cuts[cut] = list(dict.fromkeys(t.truncated(cut) for t in arms))
        greedy = r.params.greedy
        starting = r.drafter is not None and not r.drafter.started and not r.drafter_state_kept
        prefill = self._prefilled(len(r.tokens)) if starting else 0
        return RoundFacts(len(r.tokens), r.sampled, r.stop.remaining, options,
                          lookup_rows=self.controller.lookup_rows if greedy and self.speculation.lookup else 0.0,
                          plain_lookup_rows=None if proposal is None else self.controller.plain_lookup_rows,
                          proposal_rows=len(proposal or ()), prefill_tokens=prefill,
                          proposal_tokens=self.controller.lookup.expected(len(proposal), r.lookup_counts)
                          if proposal else 0.0)  # fmt: skip

    def _draft(self, rounds: list[Round]) -> tuple[int, float]:
        """Drafts for this step's rounds (one batched draft); -> (drafter rows stepped, seconds of drafter prefills:
        a per-request cost, kept out of the rounds' time). A round whose draft did not come (a remote drafter worker
        failed or lacked its state) runs undrafted."""
        owners, configs, prefills = [], [], 0.0
        for rd in rounds:
            config = rd.tree.with_lookup(rd.lookup)
            if rd.request.drafter is None or not config.depth:
                rd.draft = self._plain_draft(rd)
                continue
            owners.append(rd)
            configs.append(config)
        drafted = self.drafters.draft([rd.request for rd in owners], configs, self.speculation.min_path_prob) \
            if owners else []
        for rd, (draft, prefill_s) in zip(owners, drafted):
            r = rd.request
            if prefill_s:
                r.stats.prefill_s += prefill_s
                prefills += prefill_s
                self.controller.observe_prefill(prefill_s, self._prefilled(len(r.tokens)))
            if draft is None:
                rd.tree, rd.lookup, rd.plain_lookup = NO_TREE, 0, bool(rd.plain_proposal)
                rd.draft = self._plain_draft(rd)
                continue
            rd.draft = draft
        return sum(drafter_rows(rd.draft.config) for rd in owners), prefills

    def _lookup_allowed(self, r: Request) -> bool:
        """Whether r's undrafted rounds may verify a prompt-lookup proposal: a greedy request whose tree the
        scheduler chooses, with `plain_lookup` on."""
        return bool(self.speculation.plain_lookup) and r.params.greedy and r.tree is None

    @staticmethod
    def _plain_draft(rd: Round) -> Draft:
        """An undrafted round's draft: its prompt-lookup proposal as a chain (no drafter runs) where the controller
        chose to verify it, else no draft."""
        return lookup_draft(list(rd.plain_proposal)) if rd.plain_lookup and rd.plain_proposal else empty_draft()

    def _plain_proposal(self, r: Request) -> list[int]:
        """The prompt-lookup tokens an undrafted round of r verifies (none for a request that may not have them)."""
        room = r.granted - len(r.tokens)  # verify rows past the root that its cache holds
        size = min(self.speculation.plain_lookup, r.stop.remaining - 1, room)
        if size <= 0 or r.tree is not None or not r.params.greedy:
            return []
        if r.lookup_index is None:
            r.lookup_index = LookupIndex(r.tokens, min_ngram=PLAIN_LOOKUP_MIN_NGRAM)
        return r.lookup_index.propose(size)

    # ----- after the forward -----

    def _finish_round(self, rd: Round, logits: torch.Tensor, verdict: Verdict | None = None) -> StepOutput:
        """verdict: the round's, judged already (plain sampled rounds, drawn together); None: judge it here."""
        r, draft = rd.request, rd.draft
        if verdict is None:
            history = TokenHistory(r.tokens, r.prompt_len, r.stop.stop_ids)
            verdict = judge(logits, draft, r.params, r.target_gen, history, r.noise)
        rd.verdict = verdict
        self._work.commits.append((r.request_id, verdict.keep_rows))
        if r.drafter is not None:
            r.drafter.commit(verdict)
        if r.lookup_index is not None:
            r.lookup_index.extend(verdict.new_tokens)
        r.tokens += verdict.new_tokens
        r.prefilled = len(r.tokens) - 1  # with the commit, the cache holds the root and the accepted path
        r.last_rows = 1 + len(draft.tokens)
        kept, delta = r.stop.feed(verdict.new_tokens)
        r.stats.new_tokens += len(kept)
        r.stats.record_round(draft.label, draft.tree.depth, len(verdict.accepted_rows), len(draft.tokens))
        if r.stop.finished:
            self.running.pop(r.request_id, None)
            self._free(r)
        logprobs = round_logprobs(logits, verdict, r.params, len(kept))
        return StepOutput(r.request_id, StreamChunk(kept, delta, r.stop.finish_reason, r.stats, logprobs))

    def _account(self, plan: StepPlan, result: StepResult, t3: float, finish_s: Sequence[float]) -> None:
        """Split the step's time among its requests (by rows), teach the policy and the controller (the rounds'
        finishing times apart: measured per round, not fitted)."""
        t0, t1, t2 = result.times
        shape = result.shape
        for rd, seconds in zip(plan.rounds, finish_s):
            self.controller.observe_finish(rd.request.sampled, rd.draft.config.depth > 0, seconds)
        self.controller.observe_step(shape, t3 - t0 - sum(finish_s), draft_seconds=t1 - t0)
        rows = shape.verify_rows + shape.prefill_rows
        for r in plan.prefilling:
            r.stats.prefill_s += (t3 - t0) * r.chunk_rows / max(rows, 1)
        for rd in plan.rounds:
            r, draft = rd.request, rd.draft
            share = (draft.tree.num_nodes + 1) / max(rows, 1)
            r.stats.draft_s += (t1 - t0) * (drafter_rows(draft.config) / max(shape.drafter_rows, 1))
            r.stats.verify_s += (t2 - t1) * share
            r.stats.other_s += (t3 - t2) / max(len(plan.rounds), 1)
            r.stats.last_round_s = (t3 - t0) * share
            if rd.lookup and draft.config.depth:  # rows beyond the drafter's own nodes
                extra = len(draft.tokens) - TreeConfig(draft.config.branching).num_nodes
                self.controller.observe_lookup(max(extra, 0), drafted=True)
            elif not draft.config.depth and self._lookup_allowed(r):  # (0 rows: none, or declined)
                self.controller.observe_lookup(len(draft.tokens), drafted=False)
            self._teach(rd)

    def _teach(self, rd: Round) -> None:
        r, verdict, draft = rd.request, rd.verdict, rd.draft
        accepted = len(verdict.accepted_rows)
        arms = self.policy.arms
        # what smaller drafted trees would have accepted (not for a lookup-only round: no drafter drafted it)
        what = (what_if(draft, verdict, arms, rd.lookup, r.rejection_sampled)
                if self.speculation.min_path_prob == 0 and draft.config.depth else None)  # fmt: skip
        arm = rd.tree if draft.arm == rd.tree.with_lookup(rd.lookup) else draft.arm
        confirmed = 0  # how far the target's tokens confirm its lookup proposal, verified or not
        if rd.plain_proposal:
            if r.lookup_counts is None:
                r.lookup_counts = LookupCounts()
            confirmed = self.controller.lookup.observe(r.lookup_counts, rd.plain_proposal, verdict.new_tokens)
        if self.speculation.plain_lookup and r.params.greedy:
            # a greedy round's undrafted arm is the undrafted round as it runs, verifying its lookup proposal where
            # that pays: taught by those rounds, and by the drafted rounds of requests that may verify one, by how
            # much of it the target's tokens confirm (a lower bound: past the round's own new tokens nothing is known)
            if not arm.depth and not self._lookup_allowed(r):
                return  # a client's own `none`
            if what is not None:
                what.pop(NO_TREE, None)
                if self._lookup_allowed(r):
                    what[NO_TREE] = confirmed
        if arm not in arms:
            self.rounds_unrecorded += 1
        self.policy.record(arm, rd.context_len, accepted, max(r.stats.last_round_s, 1e-9), r.sampled, what,
                           load=self.load)  # fmt: skip

    def _free(self, r: Request) -> None:
        if r.drafter is not None:
            r.drafter.close()
        if r.admitted:
            self.kv.release(r)
            # an allocation not sent yet (after reset_target) must not follow the release: the target runs releases
            # before allocations
            self._work.allocations = [a for a in self._work.allocations if a[0] != r.request_id]
            self._work.loads = [a for a in self._work.loads if a[0] != r.request_id]
            self._work.resizes = [a for a in self._work.resizes if a[0] != r.request_id]
            self._work.releases.append(r.request_id)
            r.admitted = False

    # ----- the drafter's prefill -----

    def _prefilled(self, context_len: int) -> int:
        window = self.drafters.prefill_window
        return min(context_len, window) if window else context_len

    def _drafter_prefill(self, tokens: list[int]) -> int:
        """Tokens the drafter's prefill over `tokens` would run: none where its state is kept
        (speculation/drafter_cache.py)."""
        return self.drafters.prefill_tokens(tokens)

    def _max_verify_rows(self, params: SamplingParams, tree: TreeConfig | None) -> int:
        trees = [tree] if tree is not None else list(self.policy.arms) if self.drafters is not None else []
        nodes = max((t.num_nodes for t in trees), default=0)
        lookup = max((t.lookup for t in trees), default=0)
        if params.greedy and self.drafters is not None:
            lookup = max(lookup, self.speculation.lookup)
        if params.greedy and tree is None:
            lookup = max(lookup, self.speculation.plain_lookup)
        return 1 + nodes + lookup


def fit_tree(arm: TreeConfig, lookup: int, room: int) -> tuple[TreeConfig, int]:
    """The tree (and engine lookup tokens) cut until its verify rows fit the `room` left in the request's KV
    reservation (a pick larger than the reservation foresaw, e.g. of a policy whose picks are not its arms)."""
    while arm.depth and 1 + arm.num_nodes + max(arm.lookup, lookup) > room:
        if lookup:
            lookup = max(0, room - 1 - arm.num_nodes)
        else:
            arm = arm.truncated(arm.depth - 1)
    return arm, lookup
