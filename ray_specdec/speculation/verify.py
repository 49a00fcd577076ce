"""Judging a round: the target's logits for the verify rows against the draft, for one request's sampling settings.

Greedy rounds walk the tree on the target's argmaxes; coupled sampled rounds walk it on the target's keyed argmaxes
(speculation/coupled.py: each row's Gumbel-max draw under its position's noise); other sampled rounds run multi-draft
rejection sampling on processed distributions (acceptance.py holds the pure tensor functions and defines accepted,
bonus and residual). Undrafted rejection-sampled rounds of a step are judged together (`judge_plain_sampled`), each
with its own random stream.
"""

from __future__ import annotations

from typing import Sequence

import torch

from ray_specdec.config import SamplingParams
from ray_specdec.speculation.acceptance import Verdict, accept_greedy, accept_sampled
from ray_specdec.speculation.coupled import KeyedGumbel, keyed_argmax, prefetch
from ray_specdec.speculation.drafting import Draft
from ray_specdec.speculation.logits_processing import TokenHistory, TokenLogprob, process_logits, token_logprobs
from ray_specdec.speculation.sampling import logits_to_probs, sample_rows
from ray_specdec.speculation.tree import TreeTensors


def judge(
    target_logits: torch.Tensor,  # [1 + n, V] raw, or [1 + n] their row argmaxes (see below)
    draft: Draft,
    params: SamplingParams,
    generator: torch.Generator | None,
    history: TokenHistory | None = None,
    noise: KeyedGumbel | None = None,
) -> Verdict:
    """Acceptance for one round: greedy walk, greedy walk on keyed argmaxes (a sampled request with `noise`), or
    multi-draft rejection sampling on processed distributions.

    target_logits may be the rows' argmaxes alone (`SegmentSpec.argmax_only`) for a greedy request without logit
    processing. history: the request's tokens so far, needed when params process the target's logits
    (speculation/logits_processing.py) and in coupled rounds (the rows' positions)."""
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
    if noise is not None:
        if history is None:
            raise ValueError("coupled rounds need the request's token history (their positions)")
        return accept_greedy(coupled_tokens(p, draft.tree, len(history.tokens), noise), draft.tree, tokens)
    q = draft.probs.to(p.device) if draft.probs is not None else p[:0]
    return accept_sampled(p, q, draft.tree, tokens, params.draft_sampling == "without_replacement", generator,
                          draft.deterministic, draft.q_rows)


def coupled_tokens(
    probs: torch.Tensor,  # [1 + n, V] processed target distributions at [root, *tree nodes]
    tree: TreeTensors,
    root_position: int,  # the absolute position the root row predicts: the request's tokens so far
    noise: KeyedGumbel,
) -> torch.Tensor:
    """-> [1 + n]: each row's keyed argmax, the noise of a row at depth d being that of position root_position + d
    (rows of one depth share it: the token a position gets depends on its prefix and the key alone)."""
    depths = tree.depths.tolist()
    noise.forget_before(root_position)  # later rounds (and their drafts) start past this one's root
    rows_noise = noise.at(range(root_position, root_position + max(depths) + 1), probs.shape[-1], probs.device)
    return keyed_argmax(probs, rows_noise[tree.depths.to(rows_noise.device)])


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


def judge_plain_coupled(
    rows: Sequence[torch.Tensor],  # each [1, V] (or [V]): the root's raw logits of a `plain_sampled` round
    params: Sequence[SamplingParams],
    noises: Sequence[KeyedGumbel],  # each round's request's keyed noise
    positions: Sequence[int],  # the absolute position each root predicts (its request's tokens so far)
) -> list[Verdict]:
    """`judge` of many plain coupled rounds: the same verdicts (each bonus token its root's keyed argmax), the noise
    of all made in one pass and the distributions of the rounds that share a sampling setting computed together."""
    vocab, device = rows[0].shape[-1], rows[0].device
    for noise, position in zip(noises, positions):
        noise.forget_before(position)
    prefetch([(noise, [position]) for noise, position in zip(noises, positions)], vocab, device)
    groups: dict[tuple, list[int]] = {}
    for i, p in enumerate(params):
        groups.setdefault((p.temperature, p.top_k, p.top_p), []).append(i)
    bonus = [0] * len(rows)
    for members in groups.values():
        probs = logits_to_probs(torch.cat([rows[i].reshape(1, -1) for i in members]), params[members[0]])
        noise = torch.cat([noises[i].at([positions[i]], vocab, device) for i in members])
        for i, token in zip(members, keyed_argmax(probs, noise).tolist()):
            bonus[i] = token
    return [Verdict((), (), token) for token in bonus]


def prefetch_rounds(
    rows: Sequence[torch.Tensor],  # each [1 + n, V]: a drafted coupled round's raw target logits
    trees: Sequence[TreeTensors],
    noises: Sequence[KeyedGumbel],
    positions: Sequence[int],  # the absolute position each root predicts
) -> None:
    """The noise `judge` of these drafted coupled rounds asks for, made in one pass for all of them."""
    if rows:
        prefetch([(noise, range(position, position + tree.depth + 1))
                  for noise, position, tree in zip(noises, positions, trees)], rows[0].shape[-1], rows[0].device)


def round_logprobs(
    target_logits: torch.Tensor,  # [1 + n, V] raw
    verdict: Verdict,
    params: SamplingParams,
    kept: int,
) -> list[TokenLogprob] | None:
    """The logprobs of a round's first `kept` new tokens (those the stop checks kept), when the request asks."""
    return None if params.logprobs is None else token_logprobs(target_logits, verdict, params.logprobs, kept)
