"""The round loop: a step scheduler over every in-flight request (continuous batching of speculative rounds).

One `step()`:
1. admission: waiting requests join while their first KV grant fits the budget (`SchedulerConfig`), and this step's
   prefill chunks are picked within the rows the rounds leave; a request whose prompt's last chunk is among them
   also runs its first round in this step, verified after the chunk in the same forward, so that its first tokens
   come with the chunk's step (as a plain server samples its first token from the prefill), not a step later;
2. tree sizes: each round's policy pick, shrunk by goodput for the whole batch (speculation/goodput.py), or none at
   a load level where steps that draft measure slower than steps that do not (speculation/guard.py);
3. one batched draft for every request that drafts (`drafting.draft_many`);
4. one target call (`TargetBackend.run`): last step's commits, then one forward over this step's prefill chunks
   and every round's verify rows;
5. per request: acceptance, commit (sent with the next step's target call), stop checks, one output chunk.

Everything that drives generation uses this loop: `engine.SpeculativeEngine` (CLI, benchmark, offline batches) and
the Serve app's engine replica. It runs without Ray and without threads; callers step it.

Batch invariance. A prompt is prefilled in chunks cut at fixed positions (multiples of `prefill_chunk` from its
start), never by what else runs in the step, and the target's batched forward computes each segment's rows the same
whatever shares the forward (`TargetModel.batch_invariant`). So a greedy request's tokens do not depend on the other
requests in flight, nor on the tree sizes goodput picks for it.

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
import time
from collections import deque
from dataclasses import replace
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
from ray_specdec.speculation.bandit import DEFAULT_LOAD_EDGES, Bandit
from ray_specdec.speculation.counterfactuals import what_if
from ray_specdec.speculation.drafter_cache import DrafterStates
from ray_specdec.speculation.drafter_sessions import LazyDrafter, ready_many
from ray_specdec.speculation.drafting import Draft, DraftRequest, draft_many, empty_draft, lookup_draft, prefill_key
from ray_specdec.speculation.goodput import (AcceptanceModel, Candidate, StepCostModel, StepShape, drafter_rows,
                                             measure_prior, size_trees)
from ray_specdec.speculation.guard import SpeculationGuard
from ray_specdec.speculation.logits_processing import TokenHistory
from ray_specdec.speculation.prompt_lookup import LookupIndex
from ray_specdec.speculation.sampling import make_generators
from ray_specdec.speculation.start_rule import EXPLORE, PLAIN, StartRule, drafting_arm, prefill_tokens
from ray_specdec.speculation.stopping import StopChecker
from ray_specdec.speculation.tree_policy import FixedTree
from ray_specdec.speculation.verify import judge, judge_plain_sampled, plain_sampled, round_logprobs

# The shortest context suffix an undrafted round's lookup matches (plain_lookup): a single token matches often and
# guesses badly, and every proposed token is a verify row (measured on held-out code, 4 tokens: 1.66 tokens a round
# over 2.34 rows with pairs, 1.84 over 3.42 with single tokens).
PLAIN_LOOKUP_MIN_NGRAM = 2
# Weight of a round in the running mean of the rows a lookup branch adds (goodput costs trees with it).
LOOKUP_ROWS_WEIGHT = 0.05


def _start_rule_field(name: str) -> property:
    """A field of the scheduler's start rule, read and set on the scheduler (engine, bench and tests do)."""
    return property(lambda self: getattr(self.start_rule, name), lambda self, v: setattr(self.start_rule, name, v))


class Scheduler:
    def __init__(
        self,
        target: TargetBackend,
        drafter: MambaDrafter | None,
        tokenizer,
        policy=TreeConfig((3, 2, 2, 1, 1)),
        config: SchedulerConfig = SchedulerConfig(),
        max_context: int | None = None,
    ):
        """policy: a TreeConfig (every request drafts it) or a tree policy (the bandit); max_context: a cap on prompt
        + max_new_tokens below the target's own context."""
        self.target = target
        self.drafter = drafter
        self.tokenizer = tokenizer
        self.policy = FixedTree(policy) if isinstance(policy, TreeConfig) else policy
        self.config = config
        self.max_context = min(target.max_context, max_context or target.max_context)
        self.waiting: deque[Request] = deque()
        self.running: dict[str, Request] = {}
        # KV reservations, the prefix cache (cached prompt chunks) and each step's prefill chunks
        self.kv = PrefillPlan(config.kv_budget_tokens, config.prefill_chunk, config.prefix_cache, config.kv_grow)
        # the drafter's states after prompts it prefilled (speculation/drafter_cache.py)
        self.drafter_states = DrafterStates() if config.prefix_cache and drafter is not None else None
        # the drafting requests' root states, one slot each (mamba_state.StateSlots; allocated on the first draft)
        self.drafter_slots = StateSlots(drafter, config.max_running)
        self.cost = StepCostModel()
        self.acceptance = AcceptanceModel()
        self.start_rule = StartRule()  # whether a request starts its drafter (speculation/start_rule.py)
        # drafted against plain steps per load level (speculation/guard.py), where the policy may pick no tree
        edges = self.policy.config.load_edges if isinstance(self.policy, Bandit) else DEFAULT_LOAD_EDGES
        guarded = config.guard and NO_TREE in self.policy.arms and len(self.policy.arms) > 1
        self.guard = SpeculationGuard(edges) if guarded else None
        self.guarded = False  # whether the guard runs this step's rounds undrafted
        self.rounds_unrecorded = 0  # rounds whose tree is none of the policy's arms (cut at the end of a request)
        self.lookup_rows = float(self.config.lookup)  # mean verify rows a drafted tree's lookup branch added (EW)
        self.steps = 0
        self.kv_waits = 0  # decoding requests that skipped the last step's round: their KV could not grow
        self.kv_waited = 0  # such skipped rounds since the start
        self.load = 1  # requests decoding in the current step: the policy's load level for its rounds
        self._work = StepWork()

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
        rows = prompt_len + params.max_new_tokens + self._max_verify_rows(params, tree)
        if rows > self.config.kv_budget_tokens:
            raise RequestTooLarge(
                f"the request needs {rows} KV rows (prompt {prompt_len} + max_new_tokens {params.max_new_tokens} + "
                f"one verify) but the KV budget is {self.config.kv_budget_tokens} rows"
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
        draft_gen, target_gen = make_generators(params.seed)
        r = Request(request_id, tokens, prompt_len, params, tree, stop, draft_gen, target_gen, reserved)
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

    # ----- the step -----

    def step(self) -> list[StepOutput]:
        """One step over every running request; -> one output chunk per request that decoded a round."""
        if self.config.goodput and self.drafter is not None and len(self.policy.arms) > 1 and not self.cost.calibrated:
            self.calibrate()
        t0 = time.perf_counter()
        self._admit()
        decoding = [r for r in self.running.values() if r.decoding]
        prefilling = [r for r in self.running.values() if not r.decoding]
        # a request whose KV cannot grow to hold its next round this step waits a round
        fitting = [r for r in decoding if self.kv.room(r, self.running.values(), self._work)]
        self.kv_waits, decoding = len(decoding) - len(fitting), fitting
        self.kv_waited += self.kv_waits
        work, self._work = self._work, StepWork()
        # prefill chunks first, within what the rounds leave of the step's rows (as many as their last rounds had)
        rounds_hint = sum(1 + (0 if r.draft is None else r.draft.tokens.numel()) for r in decoding)
        prefill_rows = self.kv.plan(prefilling, work, self.config.step_tokens - rounds_hint)
        # a prompt whose last chunk runs in this step has its first round in it too, after the chunk (the verify of
        # its last token): its first tokens come a step sooner. Its cache must hold the round, as any round's: a
        # request prefilled again after a fault (reset_target) holds only what its tokens filled
        last_chunks = [r for r in prefilling if r.chunk_end == len(r.tokens) - 1]
        rounds = decoding + [r for r in last_chunks if self.kv.room(r, self.running.values(), work)]
        self.load = max(len(rounds), 1)
        admitted = len(self.running)  # the guard's load: decoding and prefilling (speculation/guard.py says why)
        # the guard measures its own choice: a step where no decoding request's rounds follow it (each runs a tree
        # its client asked for, or the start rule keeps it undrafted) would score two identical modes
        guard = self.guard if self.drafter is not None and any(_steered(r) for r in rounds) else None
        sampled = any(r.sampled for r in rounds if _steered(r))  # drafting pays less at T > 0: verdicts apart
        self.guarded = guard is not None and guard.plain(admitted, sampled)
        self._choose_trees(rounds)
        draft_rows, drafter_prefill_s = self._draft(rounds)
        t0 += drafter_prefill_s  # the rounds' time leaves the drafter's prefills out (request costs, in prefill_s)
        t1 = time.perf_counter()
        first, verify_rows = len(work.segments), 0
        for r, drafted in zip(rounds, on_host([r.draft.tokens for r in rounds])):
            if r.params.argmax_only:  # judged on the host, on the target's argmaxes (target_backend.row_argmaxes)
                r.draft = replace(r.draft, tokens=drafted)
            root = torch.tensor([r.tokens[-1]])
            tokens = torch.cat([root, drafted.reshape(-1)]) if drafted.numel() else root
            work.segments.append(SegmentSpec(r.request_id, tokens, tuple(r.draft.tree.paths),
                                              r.params.argmax_only))
            verify_rows += tokens.numel()
        logits = self._run(work)
        t2 = time.perf_counter()
        for r in prefilling:
            r.prefilled = r.chunk_end
        # plain sampled rounds draw together; the others are judged one by one
        plain = [i for i, r in enumerate(rounds) if plain_sampled(r.draft, r.params)]
        verdicts = dict(zip(plain, judge_plain_sampled([logits[first + i] for i in plain],
                                                       [rounds[i].params for i in plain],
                                                       [rounds[i].target_gen for i in plain]) if plain else []))
        outputs = []
        try:
            for i, r in enumerate(rounds):
                outputs.append(self._finish_round(r, logits[first + i], verdicts.get(i)))
        except Exception as exc:  # rounds taken are in their requests (a finished one has left): the caller hands
            with contextlib.suppress(AttributeError):  # their chunks out (EngineLoop), then recovers or fails the rest
                exc.step_outputs = outputs
            raise
        t3 = time.perf_counter()
        self._account(rounds, prefilling, draft_rows, verify_rows, prefill_rows, (t0, t1, t2, t3))
        if guard is not None:  # the realised result of its choice; drafting's prefills at their steady-state share
            tokens = sum(len(r.verdict.new_tokens) for r in rounds)
            steered = sum(len(r.verdict.new_tokens) for r in rounds if _steered(r))
            guard.observe(admitted, tokens, t3 - t0, prefill_rows > 0, decoding=len(rounds),
                          drafting_s=steered * self.start_rule.prefill_s_per_decoded_token(),
                          drafter_prefill_s=drafter_prefill_s)
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
        """The step cost model's prior, measured on this target and drafter (goodput.measure_prior)."""
        self.cost.set_prior(measure_prior(self.target, self.drafter))

    def _admit(self) -> None:
        """Waiting requests join, oldest first, while their first grant fits; none while a running one waits for KV
        (they would take the rows it waits for)."""
        while (self.waiting and not self.kv_waits and len(self.running) < self.config.max_running
               and self.kv.can_admit(self.waiting[0], self.running.values(), self._work)):
            r = self.waiting.popleft()
            self.running[r.request_id] = r
            r.admitted = True
            self.kv.admit(r, self._work)
            if self.drafter is not None:
                r.drafter = LazyDrafter(self.drafter, self.target.vocab_size, self.drafter_states, self.drafter_slots)
                if r.tree is None:  # the request will decode alongside every running one (itself included)
                    prefill = self._drafter_prefill(r.tokens)
                    r.start = self.start_rule.decide(self.policy, prefill, len(r.tokens), r.stop.remaining, r.sampled,
                                                     load=len(self.running))  # fmt: skip
                    if _steered(r):
                        self.start_rule.note_request(prefill, r.stop.remaining)

    # ----- trees and drafts -----

    def _choose_trees(self, decoding: list[Request]) -> None:
        candidates = [self._candidate(r) for r in decoding]
        if self.config.goodput and len(decoding):
            choice = size_trees(candidates, self.cost, prefill_rows=0)
        else:
            choice = [0] * len(decoding)
        for r, c, i in zip(decoding, candidates, choice):
            lookup = min(self.config.lookup if r.params.greedy else 0, r.stop.remaining - 1)
            r.arm, r.lookup = fit_tree(c.trees[i], lookup, room=r.granted - (len(r.tokens) - 1))

    def _candidate(self, r: Request) -> Candidate:
        """The request's trees for this step: its policy's pick, then the policy's smaller arms (goodput may take
        one of those instead; "none" only where it is an arm). A fixed tree or an exploring request keeps its pick;
        in a step the guard runs undrafted, every request but those with a tree of their own gets none (exploring
        ones too: their rounds draft in the guard's policy steps, so a plain step costs what plain decoding does)."""
        cut = r.stop.remaining - 1  # the bonus token comes for free: never draft deeper than what is left
        ctx = len(r.tokens)
        if self.drafter is None or r.start == PLAIN or (self.guarded and r.tree is None):
            return Candidate([NO_TREE], [1.0], fixed=True)
        if r.tree is not None:
            return Candidate([r.tree.truncated(cut)], [1.0], fixed=True)
        pick = self.policy.select(ctx, r.sampled, load=self.load)
        if r.start == EXPLORE and not pick.depth:
            pick = drafting_arm(self.policy, ctx, r.sampled, load=self.load)
        smaller = sorted((a for a in self.policy.arms if a.num_nodes < pick.num_nodes), key=lambda a: -a.num_nodes)
        trees = list(dict.fromkeys(t.truncated(cut) for t in (pick, *smaller)))
        tokens = [self.acceptance.expected_tokens(t, ctx, r.sampled) for t in trees]
        extra = self.lookup_rows if self.config.lookup and r.params.greedy else 0.0
        return Candidate(trees, tokens, fixed=r.start == EXPLORE, extra_rows=extra)

    def _draft(self, decoding: list[Request]) -> tuple[int, float]:
        """Drafts for this step's rounds (one batched draft); -> (drafter rows stepped, seconds of drafter prefills:
        a per-request cost, kept out of the rounds' time)."""
        owners, configs, prefills = [], [], 0.0
        for r in decoding:
            config = r.arm.with_lookup(r.lookup)
            if r.drafter is None or not config.depth:
                r.draft = self._plain_lookup(r)
                continue
            owners.append(r)
            configs.append(config)
        # every drafting request's waiting verdicts through the drafter together, first prefills one by one
        for r, prefill_s in zip(owners, ready_many([(r.drafter, r.tokens) for r in owners])):
            if prefill_s:
                r.stats.prefill_s += prefill_s
                prefills += prefill_s
                self._note_prefill(prefill_s, self._prefilled(len(r.tokens)))
        batch = [DraftRequest(r.drafter.session, c, r.params, r.draft_gen) for r, c in zip(owners, configs)]
        for r, draft in zip(owners, draft_many(batch, self.config.min_path_prob)):
            r.draft = draft
        return sum(drafter_rows(r.draft.config) for r in owners), prefills

    def _plain_lookup(self, r: Request) -> Draft:
        """An undrafted round's draft: a prompt-lookup proposal of up to `plain_lookup` tokens as a chain (no drafter
        runs), for a greedy request whose rounds the scheduler steers; else no draft."""
        room = r.granted - len(r.tokens)  # verify rows past the root that its cache holds
        size = min(self.config.plain_lookup, r.stop.remaining - 1, room)
        if size <= 0 or r.tree is not None or not r.params.greedy:
            return empty_draft()
        if r.lookup_index is None:
            r.lookup_index = LookupIndex(r.tokens, min_ngram=PLAIN_LOOKUP_MIN_NGRAM)
        proposal = r.lookup_index.propose(size)
        return lookup_draft(proposal) if proposal else empty_draft()

    # ----- after the forward -----

    def _finish_round(self, r: Request, logits: torch.Tensor, verdict: Verdict | None = None) -> StepOutput:
        """verdict: the round's, judged already (plain sampled rounds, drawn together); None: judge it here."""
        if verdict is None:
            history = TokenHistory(r.tokens, r.prompt_len, r.stop.stop_ids)
            verdict = judge(logits, r.draft, r.params, r.target_gen, history)
        self._work.commits.append((r.request_id, verdict.keep_rows))
        if r.drafter is not None:
            r.drafter.commit(verdict)
        if r.lookup_index is not None:
            r.lookup_index.extend(verdict.new_tokens)
        context_len = len(r.tokens)
        r.tokens += verdict.new_tokens
        r.prefilled = len(r.tokens) - 1  # with the commit, the cache holds the root and the accepted path
        kept, delta = r.stop.feed(verdict.new_tokens)
        r.stats.new_tokens += len(kept)
        r.stats.record_round(r.draft.label, r.draft.tree.depth, len(verdict.accepted_rows), len(r.draft.tokens))
        r.verdict, r.context_len = verdict, context_len
        if r.stop.finished:
            self.running.pop(r.request_id, None)
            self._free(r)
            if r.drafter is not None and _steered(r):
                self.start_rule.note_finished(r.stats.new_tokens)
        logprobs = round_logprobs(logits, verdict, r.params, len(kept))
        return StepOutput(r.request_id, StreamChunk(kept, delta, r.stop.finish_reason, r.stats, logprobs))

    def _account(self, decoding, prefilling, draft_rows, verify_rows, prefill_rows, times) -> None:
        """Split the step's time among its requests (by rows), teach the policy, the acceptance and cost models."""
        t0, t1, t2, t3 = times
        drafting = sum(r.draft.config.depth > 0 for r in decoding)  # lookup-only rounds run no drafter
        self.cost.observe(StepShape(verify_rows, draft_rows, prefill_rows, drafting), t3 - t0)
        rows = verify_rows + prefill_rows
        for r in prefilling:
            r.stats.prefill_s += (t3 - t0) * r.chunk_rows / max(rows, 1)
        for r in decoding:
            own = r.draft.tree.num_nodes + 1
            share = own / max(rows, 1)
            r.stats.draft_s += (t1 - t0) * (drafter_rows(r.draft.config) / max(draft_rows, 1))
            r.stats.verify_s += (t2 - t1) * share
            r.stats.other_s += (t3 - t2) / max(len(decoding), 1)
            r.stats.last_round_s = (t3 - t0) * share
            if r.lookup and r.draft.config.depth:  # rows beyond the drafter's own nodes
                extra = len(r.draft.tokens) - TreeConfig(r.draft.config.branching).num_nodes
                self.lookup_rows += LOOKUP_ROWS_WEIGHT * (max(extra, 0) - self.lookup_rows)
            self._teach(r)

    def _teach(self, r: Request) -> None:
        verdict, draft = r.verdict, r.draft
        accepted = len(verdict.accepted_rows)
        arms = self.policy.arms
        # what smaller drafted trees would have accepted (not for a lookup-only round: no drafter drafted it)
        what = (what_if(draft, verdict, arms, r.lookup, r.sampled)
                if self.config.min_path_prob == 0 and draft.config.depth else None)  # fmt: skip
        arm = r.arm if draft.arm == r.arm.with_lookup(r.lookup) else draft.arm
        if arm not in arms:
            self.rounds_unrecorded += 1
        self.acceptance.record(arm, r.context_len, r.sampled, accepted, what)
        self.policy.record(arm, r.context_len, accepted, max(r.stats.last_round_s, 1e-9), r.sampled, what,
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

    # ----- the start rule's state (speculation/start_rule.py) -----

    kept_plain = _start_rule_field("kept_plain")  # requests the start rule kept undrafted
    prefill_s_per_token = _start_rule_field("prefill_s_per_token")  # the drafter's, measured (running estimate)

    def _prefilled(self, context_len: int) -> int:
        return prefill_tokens(self.drafter, context_len)

    def _drafter_prefill(self, tokens: list[int]) -> int:
        """Tokens the drafter's prefill over `tokens` would run: none where its state is kept
        (speculation/drafter_cache.py)."""
        states = self.drafter_states
        if states is not None and states.holds(self.drafter, prefill_key(self.drafter, tokens)):
            return 0
        return self._prefilled(len(tokens))

    def _note_prefill(self, seconds: float, tokens: int) -> None:
        self.start_rule.note_prefill(seconds, tokens)

    def _max_verify_rows(self, params: SamplingParams, tree: TreeConfig | None) -> int:
        trees = [tree] if tree is not None else list(self.policy.arms) if self.drafter is not None else []
        nodes = max((t.num_nodes for t in trees), default=0)
        lookup = max((t.lookup for t in trees), default=0)
        if params.greedy and self.drafter is not None:
            lookup = max(lookup, self.config.lookup)
        if params.greedy and tree is None:
            lookup = max(lookup, self.config.plain_lookup)
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


def _steered(r: Request) -> bool:
    """Whether r's rounds follow the speculation guard's mode (the policy's trees, or none in its plain steps)."""
    return r.tree is None and r.start != PLAIN
