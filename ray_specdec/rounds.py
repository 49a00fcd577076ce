"""What every driver of the round loop shares: the judge of a round, random streams, output records, a fixed policy.

The loop itself is `scheduler.Scheduler`; the in-process engine, the CLI, the benchmark and the Serve app drive it
and import these types from here, not from each other.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Sequence

import torch

from ray_specdec.speculation.acceptance import Verdict, accept_greedy, accept_sampled
from ray_specdec.config import SamplingParams, TreeConfig
from ray_specdec.speculation.drafting import Draft
from ray_specdec.speculation.logits_processing import TokenHistory, TokenLogprob, process_logits, token_logprobs
from ray_specdec.speculation.sampling import logits_to_probs, sample_rows
from ray_specdec.engine.stats import GenerationStats

NO_TREE = TreeConfig(())


def judge(
    target_logits: torch.Tensor,  # [1 + n, V] raw, or [1 + n] their row argmaxes (see below)
    draft: Draft,
    params: SamplingParams,
    generator: torch.Generator | None,
    history: TokenHistory | None = None,
) -> Verdict:
    """Acceptance for one round: greedy walk, or multi-draft rejection sampling on processed distributions.

    target_logits may be the rows' argmaxes alone (`SegmentSpec.argmax_only`) for a greedy request without logit
    processing. history: the request's tokens so far, needed when params process the target's logits
    (speculation/logits_processing.py)."""
    tokens = draft.tokens.to(target_logits.device)
    if target_logits.dim() == 1:
        if not params.greedy or params.processes_logits:
            raise ValueError("only a greedy request without logit processing is judged on its rows' argmaxes")
        return accept_greedy(target_logits, draft.tree, tokens)
    if params.processes_logits:
        if history is None:
            raise ValueError("penalties, logit_bias and min_tokens need the request's token history")
        target_logits = process_logits(target_logits, draft.tree, tokens, history, params)
    if params.greedy:
        return accept_greedy(target_logits, draft.tree, tokens)
    p = logits_to_probs(target_logits, params)
    q = draft.probs.to(p.device) if draft.probs is not None else p[:0]
    return accept_sampled(p, q, draft.tree, tokens, params.draft_sampling == "without_replacement", generator,
                          draft.deterministic, draft.q_rows)


def plain_sampled(draft: Draft, params: SamplingParams) -> bool:
    """Whether `judge` of this round only draws the bonus token from the target's distribution at the root: a sampled
    request without logit processing, in a round without draft tokens (`judge_plain_sampled` draws those
    together)."""
    return not params.greedy and not params.processes_logits and draft.tokens.numel() == 0


def judge_plain_sampled(
    rows: Sequence[torch.Tensor],  # each [1, V] (or [V]): the root's raw logits of a `plain_sampled` round
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator],  # each round's target stream (on one device)
) -> list[Verdict]:
    """`judge` of many plain sampled rounds (a step's undrafted sampled requests): the same verdicts, each bonus
    token drawn from its own stream with the same bits as alone, but the distributions of the rounds that share a
    sampling setting (temperature, top-k, top-p) computed and searched together: a handful of tensor calls per
    setting instead of a dozen per round."""
    groups: dict[tuple, list[int]] = {}
    for i, p in enumerate(params):
        groups.setdefault((p.temperature, p.top_k, p.top_p), []).append(i)
    bonus = [0] * len(rows)
    for members in groups.values():
        logits = torch.cat([rows[i].reshape(1, -1) for i in members])
        tokens = sample_rows(logits_to_probs(logits, params[members[0]]), [generators[i] for i in members])
        for i, token in zip(members, tokens.tolist()):
            bonus[i] = token
    return [Verdict((), (), token) for token in bonus]


def round_logprobs(
    target_logits: torch.Tensor,  # [1 + n, V] raw
    verdict: Verdict,
    params: SamplingParams,
    kept: int,
) -> list[TokenLogprob] | None:
    """The logprobs of a round's first `kept` new tokens (those the stop checks kept), when the request asks."""
    return None if params.logprobs is None else token_logprobs(target_logits, verdict, params.logprobs, kept)


def empty_draft() -> Draft:
    return Draft(NO_TREE, torch.empty(0, dtype=torch.long), None)


def make_generators(seed: int | None) -> tuple[torch.Generator, torch.Generator]:
    """Independent (draft, target) random streams; the same seed gives the same output."""
    seed = secrets.randbits(62) if seed is None else seed
    draft_gen = torch.Generator(device="cpu").manual_seed(seed)
    target_gen = torch.Generator(device="cpu").manual_seed(seed ^ 0x5DEECE66D)
    return draft_gen, target_gen


class FixedTree:
    """A tree policy that always picks one config (the bandit is the adaptive one)."""

    def __init__(self, tree: TreeConfig):
        self.tree = tree

    @property
    def arms(self) -> tuple[TreeConfig, ...]:
        return (self.tree,)

    def select(self, context_len: int, sampled: bool = False, max_nodes: int | None = None, *,
               load: int = 1) -> TreeConfig:  # fmt: skip
        return self.tree

    def throughput(self, context_len: int, sampled: bool = False, draw: bool = False, *,
                   load: int = 1) -> dict[TreeConfig, float]:  # fmt: skip
        return {}  # no estimates: the start rule drafts

    def record(self, tree: TreeConfig, context_len: int, accepted_tokens: int, round_time_s: float,
               sampled: bool = False, what_if=None, *, load: int = 1) -> None:
        pass


@dataclass
class StreamChunk:
    token_ids: list[int]  # tokens kept this round
    text: str  # text delta
    finish_reason: str | None
    stats: GenerationStats
    logprobs: list[TokenLogprob] | None = None  # one per kept token, when the request asks (params.logprobs)


@dataclass
class Generation:
    token_ids: list[int]
    text: str
    finish_reason: str
    stats: GenerationStats
    prompt_tokens: int
    logprobs: list[TokenLogprob] | None = None  # one per token, when the request asks (params.logprobs)


def fit_tree(arm: TreeConfig, lookup: int, room: int) -> tuple[TreeConfig, int]:
    """The tree (and engine lookup tokens) cut until its verify rows fit the `room` left in the request's KV
    reservation (a pick larger than the reservation foresaw, e.g. of a policy whose picks are not its arms)."""
    while arm.depth and 1 + arm.num_nodes + max(arm.lookup, lookup) > room:
        if lookup:
            lookup = max(0, room - 1 - arm.num_nodes)
        else:
            arm = arm.truncated(arm.depth - 1)
    return arm, lookup
