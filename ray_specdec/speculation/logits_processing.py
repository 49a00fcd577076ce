"""The target-side request options (penalties, logit_bias, min_tokens) on a verify's logits, and logprobs.

Lossless under speculation. Verify row i (rows are ``[root, *tree nodes]`` in BFS order, speculation/tree.py) predicts
the token after the root-to-i path, so target-only decoding at that position would have generated the request's tokens
so far plus the draft tokens on that path (row i's ancestors and itself, root excluded). `process_logits` gives every
row exactly the logits target-only decoding would use there: counts per row = the request's counts + counts along the
row's path; min_tokens holds back at rows whose position is still short of it. Greedy argmax and `logits_to_probs`
then see the processed target distribution, so the accepted tokens, the bonus token and every rejection follow it
exactly (speculation/acceptance.py).

The drafter's q needs no such processing for exactness: acceptance only needs q to be the distribution the drafts
were drawn from. `drafting.pick_children` adds logit_bias (path-independent: it helps acceptance when a bias bans or
forces tokens) and keeps q the distribution it drew from; penalties and min_tokens stay off the drafter.

Order, as vLLM's sampler: logit_bias, then repetition (prompt + generated), frequency and presence (generated)
penalties, then min_tokens' -inf; temperature / top-k / top-p follow (speculation/sampling.py).

logprobs are the target's own: log_softmax of the raw logits at the row each emitted token came from (an accepted
token at its parent's row, the bonus at the stop row), before any processing or temperature, as vLLM returns them by
default (logprobs_mode "raw_logprobs"). They do not depend on drafting wherever the target's verify rows do not
depend on the tree (`TargetModel.batch_invariant`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Sequence

import torch

from ray_specdec.config import SamplingParams
from ray_specdec.speculation.acceptance import Verdict
from ray_specdec.speculation.tree import TreeTensors


@dataclass(frozen=True)
class TokenHistory:
    """What the processing at a verify's root depends on: the request's tokens so far."""

    tokens: Sequence[int]  # prompt + generated; the root row predicts the token after these
    prompt_len: int
    stop_ids: frozenset[int] = frozenset()  # ids min_tokens holds back: the EOS ids that end the request, stop ids


class TokenLogprob(NamedTuple):
    logprob: float  # of the emitted token
    top: list[tuple[int, float]]  # the k most likely (token id, logprob) there, most likely first


def apply_logit_bias(
    logits: torch.Tensor,  # [rows, V]
    params: SamplingParams,
) -> torch.Tensor:
    """-> [rows, V] with params.logit_bias added (the path-independent part; the drafter's too)."""
    if not params.logit_bias:
        return logits
    ids = torch.tensor([t for t, _ in params.logit_bias], device=logits.device)
    bias = torch.tensor([b for _, b in params.logit_bias], dtype=logits.dtype, device=logits.device)
    out = logits.clone()
    out[:, ids] += bias
    return out


def path_counts(
    tree: TreeTensors,
    draft_tokens: torch.Tensor,  # [n]
    base: torch.Tensor,  # [V] long, counts of the tokens generated before the root's prediction
) -> torch.Tensor:
    """-> [1 + n, V] long: row i's counts, base plus the draft tokens on the root-to-i path (i included)."""
    rows, nodes = tree.attn_mask[:, 1:].to(base.device).nonzero(as_tuple=True)  # node j+1 is on row i's path
    counts = base.expand(tree.num_nodes + 1, -1).clone()
    counts.index_put_((rows, draft_tokens.to(base.device)[nodes]), torch.ones_like(rows), accumulate=True)
    return counts


def process_logits(
    logits: torch.Tensor,  # [1 + n, V] raw target logits at [root, *tree nodes]
    tree: TreeTensors,
    draft_tokens: torch.Tensor,  # [n]
    history: TokenHistory,
    params: SamplingParams,
) -> torch.Tensor:
    """-> [1 + n, V]: at every row, the logits target-only decoding would use at that position."""
    if not params.processes_logits:
        return logits
    vocab, device = logits.shape[-1], logits.device
    out = apply_logit_bias(logits, params)
    if params.penalized:
        all_ids = torch.tensor(list(history.tokens), dtype=torch.long, device=device)
        generated = torch.bincount(all_ids[history.prompt_len:], minlength=vocab)  # [V]
        counts = path_counts(tree, draft_tokens, generated)  # [1 + n, V]
        if params.repetition_penalty != 1.0:
            in_prompt = torch.zeros(vocab, dtype=torch.bool, device=device)
            in_prompt[all_ids[: history.prompt_len]] = True
            seen = (counts > 0) | in_prompt  # [1 + n, V]
            r = params.repetition_penalty
            out = torch.where(seen, torch.where(out > 0, out / r, out * r), out)
        if params.frequency_penalty:
            out = out - params.frequency_penalty * counts.to(out.dtype)
        if params.presence_penalty:
            out = out - params.presence_penalty * (counts > 0).to(out.dtype)
    if params.min_tokens and history.stop_ids:
        generated_before = len(history.tokens) - history.prompt_len + tree.depths.to(device)  # [1 + n]
        held = generated_before < params.min_tokens
        stop = torch.zeros(vocab, dtype=torch.bool, device=device)
        stop[torch.tensor([t for t in history.stop_ids if t < vocab], dtype=torch.long, device=device)] = True
        out = out.masked_fill(held[:, None] & stop, float("-inf"))
    return out


def token_logprobs(
    logits: torch.Tensor,  # [1 + n, V] raw target logits
    verdict: Verdict,
    k: int,
    count: int | None = None,
) -> list[TokenLogprob]:
    """The raw target log-probability of each of the verdict's first `count` new tokens (all by default) at the row
    it was emitted from, with the top-k there. One row at a time, so that a row's values never depend on how many
    rows the verify had."""
    out = []
    for row, token in list(zip(verdict.keep_rows, verdict.new_tokens))[:count]:
        raw = logits[row]
        logprobs = torch.log_softmax(raw.to(torch.promote_types(raw.dtype, torch.float32)), dim=-1)  # [V]
        top = torch.topk(logprobs, min(k, logprobs.numel())) if k else None
        pairs = list(zip(top.indices.tolist(), top.values.tolist())) if top is not None else []
        out.append(TokenLogprob(float(logprobs[token]), pairs))
    return out
